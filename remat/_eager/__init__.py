"""What eager does that a trace must keep, where fake tensors and functionalization would lose it: the
facts tracing notes about the graph's nodes (where a call came from, why a value stops the gradient, the
custom Functions applied, the values Python reads: `_facts`, `_capture`, `_applications`,
`_higher_order`, `_specialize`, `_nodes`), and the kernels and modes that run as eager does (layouts and
dtypes of fake kernels, random fills in eager's layout, rrelu, writes through views, linalg's error
checks, what vmap runs example by example: `_fake_kernels`, `_random_fills`, `_eager_kernels`,
`_in_place`, `_error_checks`, `_noting_modes`, `_strides`).

May import: `_core`, `_memory`, `_torch`, `_quirks`. Nothing here imports `remat.testing` or
`remat/__init__.py`. See docs/architecture.md.
"""
