"""Partitioning: a trace's value graph and the rules over it, written once (what is kept, replayed,
recomputed; resolved for decisions, or as the planners' 0-1 rows); decisions -> the `Programs` running
needs (forward, backward, pure forward, prologue, epilogue), built node by node as eager ran them; bytes
kept and replays of any decisions; predicted peaks.

May import: `_tracing`, `_eager`, `_storing`, `_core`, `_memory`, `_torch`, `_quirks`, `_report`, `costs`. Nothing here imports `remat.testing` or `remat/__init__.py`.
See docs/architecture.md.
"""
