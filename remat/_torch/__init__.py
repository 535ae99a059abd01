"""The one door to torch's internals: every private torch name remat uses, and what differs between releases.

remat stands on parts of torch that are not public API: `make_fx` and its
proxy mode, functionalization, fake tensors, functorch's interpreters, Dynamo,
autograd's tracing switches, the schemas of ops, and the text of some of
torch's errors. They change between releases without notice. Every other
module reaches them through the names here, so that a new torch release is
one package to read and fix; `tests/test_torch.py` imports each on the running
torch. Supported releases: `SUPPORTED` (see docs/torch-versions.md).

The package holds one module per job, and other modules of remat import
from the package only (`from ._torch import make_fx`), never from one of
its modules:

- `_releases`: the running release, the supported range (checked first,
  before any private import), and the text of torch's errors;
- `_ops`: ops, their schemas and decompositions, dispatch modes and keys,
  higher-order ops;
- `_tracing`: make_fx, its proxy mode and functionalization;
- `_fake`: fake tensors, real values beside them, sizes that depend on
  data, torch's stride rules;
- `_func`: torch.func's transforms, wrappers and levels, forward-mode AD;
- `_autograd`: autograd's graph nodes, saved tensors, derivatives, selective
  checkpointing;
- `_frames`: where a traced call comes from (the user's line, the custom
  Functions being applied).

Of remat, the package imports `_quirks` only (the registry of what differs
per op and release, beside it in layer 0 of docs/architecture.md); its
modules import one another relatively, without a loop.
"""

from __future__ import annotations

# First: an unsupported torch is refused before the modules below import its private names.
from ._releases import (
    DATA_NOT_ALLOCATED,
    LEAF_UPDATED_IN_PLACE,
    RELEASE,
    SUPPORTED,
    UNTRACEABLE_COLLECTIVE,
    check_supported,
    is_saved_value_modified,
)
from ._releases import minor_release as minor_release  # not in `__all__`: the tests read it

# isort: split
from ._autograd import (
    SAC_BYPASSES_HOOKS,
    accumulated_leaf,
    apply_without_binding,
    autograd_node_inputs,
    autograd_node_order,
    grad_dtype_override,
    has_no_derivative,
    is_custom_function_node,
    is_custom_op_autograd,
    release_saved_tensors,
    saved_tensors_hooks_tracing,
    selective_checkpoint_context,
    version_counter,
)
from ._fake import (
    FAKE_DTYPE_ERRATA,
    STRICT_FAKE_KERNELS,
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeRankMismatch,
    FakeTensor,
    FakeTensorMode,
    GuardOnDataDependentSymNode,
    ShapeEnv,
    UncheckedRealValuesFakeMode,
    UnsupportedOperatorException,
    carry_real_values,
    dense_without_overlap,
    elementwise_output_strides,
    forget_pending_sizes,
    guard_scalar,
    insert_value_checks,
    real_values_traced,
    run_real_kernel_on_zeros,
    size_bound,
    unset_fake_temporarily,
)
from ._fake import fake_kernel_errors_unlogged as fake_kernel_errors_unlogged  # not in `__all__`: `_joint` reads it
from ._frames import (
    FunctionApplications,
    function_applications_noted,
    is_user_code,
    source_and_scope,
)
from ._func import (
    CtxCustomSave,
    CtxWithSavedTensors,
    TransformType,
    batched_at,
    batched_level,
    drawn_per_example_but_unbatched,
    empty_in_memory_layout,
    forward_ad_level,
    forward_grad_enabled,
    functorch_active,
    functorch_interpreters,
    functorch_level,
    grad_transform_active,
    import_jvp_decompositions,
    innermost,
    inplace_requires_grad_allowed,
    is_functorch_wrapped,
    make_dual,
    memory_layout,
    runs_per_example_under_vmap,
    tangent_of,
    temporarily_clear_interpreter_stack,
    unbatched_at,
    under_torch_func,
    unwrap_batched,
    unwrap_dead_wrappers,
    unwrap_level,
    vmap_levels,
)
from ._ops import (
    COLLECTIVE_NAMESPACES,
    HigherOrderOperator,
    OpOverload,
    OpOverloadPacket,
    TorchDispatchMode,
    TorchFunctionMode,
    any_autocast_enabled,
    decomposition_of,
    disable_current_modes,
    flex_attention_as_one_call,
    inherit_higher_order_rules,
    is_custom_op,
    op_schema,
    overload_name,
    preserved_dispatch_keys,
    sdp_priority_order,
    tree_leaves,
    tree_map_only,
)
from ._tracing import (
    BoxedCodeGen,
    FunctionalTensor,
    FunctionalTensorMode,
    LazyGraphModule,
    default_generator,
    from_functional,
    get_proxy_mode,
    has_data_mutation,
    lazy_graph_modules,
    make_fx,
    node_behind,
    outside_compilers_tracing,
    random_calls_traced,
    sync,
    trace_call,
)

__all__ = [
    "COLLECTIVE_NAMESPACES",
    "LEAF_UPDATED_IN_PLACE",
    "RELEASE",
    "SAC_BYPASSES_HOOKS",
    "SUPPORTED",
    "UNTRACEABLE_COLLECTIVE",
    "BoxedCodeGen",
    "any_autocast_enabled",
    "elementwise_output_strides",
    "empty_in_memory_layout",
    "apply_without_binding",
    "CtxCustomSave",
    "CtxWithSavedTensors",
    "DATA_NOT_ALLOCATED",
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "UnsupportedOperatorException",
    "FakeTensor",
    "FakeTensorMode",
    "guard_scalar",
    "grad_dtype_override",
    "FAKE_DTYPE_ERRATA",
    "FakeRankMismatch",
    "ShapeEnv",
    "UncheckedRealValuesFakeMode",
    "carry_real_values",
    "forget_pending_sizes",
    "insert_value_checks",
    "is_custom_op",
    "is_custom_op_autograd",
    "is_custom_function_node",
    "accumulated_leaf",
    "autograd_node_inputs",
    "autograd_node_order",
    "real_values_traced",
    "sdp_priority_order",
    "selective_checkpoint_context",
    "size_bound",
    "STRICT_FAKE_KERNELS",
    "FunctionalTensor",
    "FunctionalTensorMode",
    "GuardOnDataDependentSymNode",
    "HigherOrderOperator",
    "flex_attention_as_one_call",
    "inherit_higher_order_rules",
    "OpOverload",
    "OpOverloadPacket",
    "TorchDispatchMode",
    "TorchFunctionMode",
    "TransformType",
    "batched_level",
    "check_supported",
    "default_generator",
    "dense_without_overlap",
    "disable_current_modes",
    "forward_ad_level",
    "forward_grad_enabled",
    "from_functional",
    "functorch_active",
    "grad_transform_active",
    "is_saved_value_modified",
    "functorch_interpreters",
    "get_proxy_mode",
    "has_data_mutation",
    "import_jvp_decompositions",
    "FunctionApplications",
    "function_applications_noted",
    "drawn_per_example_but_unbatched",
    "batched_at",
    "functorch_level",
    "unbatched_at",
    "unwrap_dead_wrappers",
    "has_no_derivative",
    "decomposition_of",
    "inplace_requires_grad_allowed",
    "innermost",
    "is_user_code",
    "is_functorch_wrapped",
    "make_dual",
    "make_fx",
    "node_behind",
    "runs_per_example_under_vmap",
    "LazyGraphModule",
    "lazy_graph_modules",
    "outside_compilers_tracing",
    "memory_layout",
    "op_schema",
    "overload_name",
    "preserved_dispatch_keys",
    "release_saved_tensors",
    "run_real_kernel_on_zeros",
    "saved_tensors_hooks_tracing",
    "source_and_scope",
    "sync",
    "tangent_of",
    "temporarily_clear_interpreter_stack",
    "random_calls_traced",
    "trace_call",
    "tree_leaves",
    "tree_map_only",
    "under_torch_func",
    "unset_fake_temporarily",
    "unwrap_batched",
    "unwrap_level",
    "version_counter",
    "vmap_levels",
]
