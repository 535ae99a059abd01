"""Tracing: `fn` and example inputs -> the joint forward and backward graph (`JointGraph`) and its
`Trace`. `_joint.joint_graph_of` is the driver: a first run (`_discovery`), the function `make_fx` traces
(`_forward_then_backward`), checkpoints nested inside (`_nesting`), the graph cleaned up and its views
rewritten (`_graph_cleanup`, `_view_fixups`), where derivatives stop (`_gradient_stops`), the calls
described (`_describe`, `_tag`); tracing's errors explained (`_errors`); autograd's backward walked where
its engine cannot run (`_engine`).

May import: `_eager`, `_core`, `_memory`, `_torch`, `_quirks`. Nothing here imports `remat.testing` or
`remat/__init__.py`. See docs/architecture.md.
"""
