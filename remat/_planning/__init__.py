"""Planning a whole step: `remat.fit` (the probe step, the candidates per block, the solvers, the
results) and `remat.pareto`.

May import: `_api` and everything below it. Nothing here imports `remat.testing` or `remat/__init__.py`.
See docs/architecture.md.
"""
