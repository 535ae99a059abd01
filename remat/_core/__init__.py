"""The data everything else speaks, with no pipeline of its own: op calls and traces (`_calls`), the
trace cache's keys, pytrees of arguments, objects handed to `fn`, KV caches, the contexts a trace runs
under (autocast, dispatch keys), generator states, and old public names kept for one release.

May import: `_memory`, `_torch`, `_quirks`. Nothing here imports `remat.testing` or `remat/__init__.py`.
See docs/architecture.md.
"""
