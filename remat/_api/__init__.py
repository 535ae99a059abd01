"""The entry points: a checkpointed function and its cache of traces (`_checkpointed`), its programs
built under a policy (`_build`), `remat.checkpoint`, `CheckpointedModule`, `checkpoint_modules`, and
`remat.trace` and `remat.report` (`_inspect`); the traces identical blocks share (`_sharing`).

May import: `_running`, `_deciding`, `policies` and everything they may. Nothing here imports `remat.testing` or `remat/__init__.py`.
See docs/architecture.md.
"""
