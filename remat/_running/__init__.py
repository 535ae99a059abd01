"""Running: what one traced signature runs (`Executable`), the `autograd.Function` that runs the
programs (its forward-mode rule, its gradients by reverse mode over the pure forward), which torch.func
transforms run and what cannot run under them, compiled programs, and checkpoints inside
`torch.compile`.

May import: `_partitioning`, `_tracing`, `_eager`, `_storing`, `_core`, `_memory`, `_torch`, `_quirks`. Nothing here imports `remat.testing` or `remat/__init__.py`.
See docs/architecture.md.
"""
