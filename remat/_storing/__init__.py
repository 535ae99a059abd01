"""Where a kept value lives: the kinds of storage (on its device, in host memory, as bits, in a
narrower format), with the copies of offloaded values, the bits of packed ones and the narrowed forms of
compressed ones.

May import: `_core`, `_memory`, `_torch`, `costs`. Nothing here imports `remat.testing` or `remat/__init__.py`.
See docs/architecture.md.
"""
