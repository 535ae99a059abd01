"""Deciding: what a policy is and how its decisions are asked for per call (nested checkpoints
included), the SAC bridge, and the budget planner with its exact solver (HiGHS, imported on first use).
`remat.policies` is the public face of this package.

May import: `_partitioning` and everything it may, `costs`. Nothing here imports `remat.testing` or `remat/__init__.py`.
See docs/architecture.md.
"""
