"""Memory, measured: the bytes a tensor's storage holds and the ones CUDA's caching allocator counts
for it, the GPU assumed where none is present (and the attention kernel it would run), and the timeline
of a probe step that `remat.fit` plans on.

May import: `_torch`, `_quirks`. Nothing here imports `remat.testing` or `remat/__init__.py`.
See docs/architecture.md.
"""
