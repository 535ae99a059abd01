"""Every behaviour of a particular op or torch release that remat works around, in one place.

Each entry (a `Quirk`) names the ops, the releases it holds on, what differs from what remat would
otherwise assume, and the NOTE that says what remat does about it; it carries the table the modules
that work around it read, so that no other module names these ops for this reason.
`tests/test_quirks.py` probes each entry on the running torch: the behaviour is there exactly where
the entry says. The differences between releases of torch's private API are the torch door's
(`_torch`); this registry holds the behaviours of ops, public or not.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

__all__ = [
    "BATCH_NORM_TRAINING_IGNORES_RUNNING_STATS",
    "CONTIGUOUS",
    "CPU_KERNELS_CHOOSE_LAYOUTS",
    "DETACH_TRACES_AS_ALIAS",
    "IN_PLACE_META_KERNELS_FAIL_UNDER_FORWARD_AD",
    "IN_PLACE_OPS_FUNCTIONALIZATION_CANNOT_MAP",
    "ELEMENTWISE",
    "FAKE_BATCH_NORM_BACKWARD_IGNORES_MASK",
    "LINALG_CHECKS_ARE_EFFECTFUL",
    "QUANTILE_COMPARES_TENSORS",
    "QUIRKS",
    "REGIONS_ALLOCATE_FOR_IN_PLACE_OPS",
    "RRELU_FUNCTIONAL_DERIVATIVE",
    "GRADIENTS_READ_LU_FACTORS",
    "GRADIENTS_SWITCH_IN_GRAD_MODE",
    "SLICE_SCATTER_NEGATIVE_BOUNDS_UNDER_VMAP",
    "BATCH_NORM_FUNCTIONAL_UNBATCHED",
    "BATCH_NORM_UPDATES_UNDECLARED",
    "TANGENT_FORMULAS_READ_STATISTICS",
    "SAC_ASKS_AGAIN_WHILE_RECOMPUTING",
    "SAC_ERRORS_LEAVE_MODES_PUSHED",
    "SDPA_CHOOSES_BELOW_THE_DISPATCHER",
    "UNBACKED_SYMBOL_NAMES",
    "CpuLayout",
    "Quirk",
]

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Quirk:
    """One behaviour remat works around: of `ops` (none: of torch itself), on `releases` (None: on every
    release remat supports), what `differs`, and where `note` says what remat does. `table` is what the
    modules that work around it read (an op table, a pattern)."""

    ops: tuple[Any, ...]
    releases: tuple[str, ...] | None
    differs: str
    note: str
    table: Any = None

    def applies(self, release: str) -> bool:
        """Whether the behaviour is there on `release` ("2.13")."""
        return self.releases is None or release in self.releases


# --- tracing ------------------------------------------------------------------------------------

DETACH_TRACES_AS_ALIAS = Quirk(
    ops=(aten.detach.default, aten.alias.default),
    releases=("2.14", "2.15"),
    differs="make_fx records `x.detach()` as `aten.alias`, a view autograd differentiates, not as `aten.detach`",
    note="NOTE [a detach runs as a detach] (remat/_tracing/_gradient_stops.py)",
    table=frozenset({aten.detach.default, aten.alias.default}),  # what a detach traces as, on any release
)

IN_PLACE_META_KERNELS_FAIL_UNDER_FORWARD_AD = Quirk(
    ops=(aten.lerp_.Tensor,),
    releases=None,
    differs=(
        "the meta kernel of `lerp_` calls `lerp` by its overload packet, whose overload resolution prints the "
        "weight tensor as it tries it against `lerp.Scalar`; while a forward-mode AD level is active, printing "
        "a tensor inside a kernel raises torch's internal assert about `_fw_primal`. So `quantile` (which "
        "calls `lerp_`) could not be traced under `torch.func.jvp` or `forward_ad`, where eager runs"
    ),
    note="NOTE [in-place ops whose meta kernels fail under forward AD] (remat/_eager/_fake_kernels.py)",
    table={aten.lerp_.Tensor: aten.lerp.Tensor},
)

UNBACKED_SYMBOL_NAMES = Quirk(
    ops=(),
    releases=None,
    differs=(
        "torch names the symbols of data-dependent sizes `u0`, `u1`, ... and writes the runtime assertions "
        "about them as text, which is the only place that says which symbols a check is about"
    ),
    note="NOTE [values Python reads] (remat/_eager/_specialize.py)",
    table=re.compile(r"\bu\d+\b"),
)

LINALG_CHECKS_ARE_EFFECTFUL = Quirk(
    ops=(aten._linalg_check_errors.default,),
    releases=("2.13", "2.14", "2.15"),
    differs=(
        "functionalization marks the check effectful and wants an effect token threaded through the graph, "
        "which only AOTAutograd sets up"
    ),
    note="NOTE [error checks of linalg ops] (remat/_eager/_error_checks.py)",
    table=frozenset({aten._linalg_check_errors.default}),
)


class CpuLayout(NamedTuple):
    """The layout a CPU kernel gives its outputs: contiguous in the suggested memory format of the
    argument at `position`, plainly contiguous (`CONTIGUOUS`), or TensorIterator's over its tensor
    arguments (`ELEMENTWISE`; over the arguments at `operands`, in that order, where given)."""

    position: int
    outputs: tuple[int, ...] = (0,)  # which of its outputs
    operands: tuple[int, ...] | None = None


CONTIGUOUS, ELEMENTWISE = -1, -2

_CPU_LAYOUTS: Mapping[Any, CpuLayout] = {
    **{
        op: CpuLayout(0)
        for op in (
            aten.native_batch_norm.default,
            aten._native_batch_norm_legit.default,
            aten._native_batch_norm_legit.no_stats,
            aten._native_batch_norm_legit_functional.default,
            aten._native_batch_norm_legit_no_training.default,
            aten._batch_norm_with_update.default,
            aten._batch_norm_no_update.default,
            aten.channel_shuffle.default,
            aten.reflection_pad3d.default,
            aten.replication_pad3d.default,
        )
    },
    **{
        op: CpuLayout(1)  # the input's (or `self`'s), whatever the incoming gradient's layout
        for op in (
            aten.native_batch_norm_backward.default,
            aten.batch_norm_backward.default,
            aten.reflection_pad2d_backward.default,
            aten.reflection_pad3d_backward.default,
            aten.replication_pad2d_backward.default,
            aten.replication_pad3d_backward.default,
        )
    },
    **{
        op: CpuLayout(CONTIGUOUS)
        for op in (
            aten.native_layer_norm_backward.default,
            aten.mse_loss_backward.default,
            aten.huber_loss_backward.default,
            aten.smooth_l1_loss_backward.default,
            aten._log_softmax_backward_data.default,
            aten.glu_backward.default,
            aten.nll_loss2d_forward.default,
            aten.normal.Tensor_Tensor,
            aten.normal.float_Tensor,
            aten.rrelu_with_noise.default,
            aten.rrelu_with_noise_functional.default,  # as eager's in-place one: NOTE [rrelu runs as eager's]
            aten.pow.Scalar,
        )
    },
    aten.log_sigmoid_forward.default: CpuLayout(CONTIGUOUS, (0, 1)),
    # In training, the noise times the gradient (found by the 2.13 soak: not in OpInfo's database).
    aten.rrelu_with_noise_backward.default: CpuLayout(ELEMENTWISE, operands=(2, 0)),
    **{
        op: CpuLayout(ELEMENTWISE)
        for op in (
            aten.heaviside.default,
            aten.logaddexp.default,
            aten.logaddexp2.default,
            aten.logical_and.default,
            aten.logical_or.default,
            aten.logical_xor.default,
            aten.copysign.Tensor,
            aten.floor_divide.default,
            aten.div.Tensor_mode,
            aten.xlogy.Tensor,
            aten.special_xlog1py.default,
            aten.native_dropout_backward.default,
        )
    },
}

CPU_KERNELS_CHOOSE_LAYOUTS = Quirk(
    ops=tuple(_CPU_LAYOUTS),
    releases=None,
    differs=(
        "the CPU kernel gives its output another layout than the fake kernel predicts (PyTorch's OpInfo "
        "database swept on torch 2.13 and 2.15 for real CPU strides that differ from the fake ones)"
    ),
    note="NOTE [kernels that choose their output layout] (remat/_eager/_fake_kernels.py)",
    table=_CPU_LAYOUTS,
)

FAKE_BATCH_NORM_BACKWARD_IGNORES_MASK = Quirk(
    ops=(aten.native_batch_norm_backward.default,),
    releases=None,
    differs="the fake kernel gives the input's gradient even where `output_mask` does not ask for it",
    note="NOTE [backward kernels that skip outputs] (remat/_torch/_fake.py)",
    table={aten.native_batch_norm_backward.default: (9, (0,))},  # op -> (`output_mask`'s position, outputs given)
)

# --- partitioning -------------------------------------------------------------------------------

BATCH_NORM_TRAINING_IGNORES_RUNNING_STATS = Quirk(
    ops=(
        aten.native_batch_norm_backward.default,
        aten.cudnn_batch_norm_backward.default,
        aten.miopen_batch_norm_backward.default,
        aten._native_batch_norm_legit_functional.default,
        aten.cudnn_batch_norm.default,
        aten.miopen_batch_norm.default,
    ),
    releases=None,
    differs=(
        "in training mode, batch norm's backward takes the running statistics but reads the batch "
        "statistics instead; a replayed forward's outputs that backward reads do not depend on them. A GPU's "
        "backward kernels (cuDNN's, MIOpen's) run only for training"
    ),
    note="`_value_graph.reads_any_value` and `_graph_cleanup._drop_unread_batch_norm_arguments`: nothing keeps them",
    # For the backward ops and for the forward ops a replay runs: op -> (the position of its `training`
    # flag, None for an op that always trains; the positions of the running statistics)
    table={
        "backward": {
            aten.native_batch_norm_backward.default: (7, (3, 4)),
            aten.cudnn_batch_norm_backward.default: (None, (3, 4)),
            aten.miopen_batch_norm_backward.default: (None, (3, 4)),
        },
        "replay": {
            aten._native_batch_norm_legit_functional.default: (5, (3, 4)),
            aten.cudnn_batch_norm.default: (5, (3, 4)),
            aten.miopen_batch_norm.default: (5, (3, 4)),
        },
    },
)

BATCH_NORM_UPDATES_UNDECLARED = Quirk(
    ops=(aten.cudnn_batch_norm.default, aten.miopen_batch_norm.default),
    releases=None,
    differs=(
        "in training mode these kernels (what batch norm runs on a GPU) update the running statistics in "
        "place, which their schemas do not declare: a trace holds them as pure ops, and each run of one "
        "updates the statistics again (a checkpointed CUDA step that replays it updated them twice; found on "
        "a GPU, as running statistics off eager's by the momentum). The native kernel does the same, but a "
        "trace decomposes it into the functional op"
    ),
    note="NOTE [replays update no running statistics] (remat/_partitioning/_program_emitter.py)",
    table={  # op -> (the position of its `training` flag, the positions of the running statistics)
        aten.cudnn_batch_norm.default: (5, (3, 4)),
        aten.miopen_batch_norm.default: (5, (3, 4)),
    },
)

RRELU_FUNCTIONAL_DERIVATIVE = Quirk(
    ops=(aten.rrelu_with_noise_functional.default,),
    releases=None,
    differs=(
        "the derivative of the functional `rrelu_with_noise` (what `F.rrelu` traces to) reads its `noise` "
        "input (uninitialized in a trace) instead of the noise it returns, and on the CPU its output takes "
        "the input's layout where eager's in-place `rrelu_with_noise` gives a contiguous one"
    ),
    note="NOTE [rrelu runs as eager's] (remat/_eager/_eager_kernels.py): the programs compute it as the input times its noise",
    table=frozenset({aten.rrelu_with_noise_functional.default}),
)

_FACTORS_READ = (
    "its gradient formula reads the LU factors the forward computed, which autograd does not differentiate "
    "(eager's formula works from the matrix again where its gradient will itself be differentiated), so "
    "remat's backward cannot be differentiated again exactly. Take second derivatives of it outside "
    "remat.checkpoint"
)

GRADIENTS_READ_LU_FACTORS = Quirk(
    ops=(aten._linalg_solve_ex.default, aten._linalg_det.default, aten._linalg_slogdet.default),
    releases=None,
    differs=(
        "the gradient formulas of linalg.solve, det and slogdet read the LU factors their forward returned "
        "(outputs autograd does not differentiate) where grad mode is off as they run, and work from the "
        "matrix again where it is on; remat traces them with grad mode off, so a second derivative through "
        "its backward misses how the factors depend on the matrix"
    ),
    note="NOTE [second derivatives of gradients that read LU factors] (remat/_running/_execute.py)",
    table={
        aten._linalg_solve_ex.default: f"linalg.solve: {_FACTORS_READ}",
        aten._linalg_det.default: f"linalg.det: {_FACTORS_READ}",
        aten._linalg_slogdet.default: f"linalg.slogdet: {_FACTORS_READ}",
    },
)

GRADIENTS_SWITCH_IN_GRAD_MODE = Quirk(
    ops=(aten.cumprod.default, *GRADIENTS_READ_LU_FACTORS.ops),
    releases=None,
    differs=(
        "their gradient formulas take another form where grad mode is on as they run (the gradient will "
        "itself be differentiated) than where it is off, and the form remat traces (grad mode off) is not "
        "differentiated as eager's: cumprod's divides by its input where that has no zero, so its second "
        "derivative is NaN at an input with a zero; linalg.solve, det and slogdet's read LU factors "
        "(GRADIENTS_READ_LU_FACTORS). Found by sweeping OpInfo's samples, with and without zeros put in, "
        "for second derivatives through remat's backward against eager's"
    ),
    note="NOTE [a backward that will be differentiated] (remat/_partitioning/_differentiable_programs.py)",
    table=frozenset({aten.cumprod.default, *GRADIENTS_READ_LU_FACTORS.ops}),
)

TANGENT_FORMULAS_READ_STATISTICS = Quirk(
    ops=(
        aten.native_layer_norm.default,
        aten.native_batch_norm.default,
        aten._native_batch_norm_legit.default,
        aten._native_batch_norm_legit.no_stats,
        aten._native_batch_norm_legit_functional.default,
        aten.cudnn_batch_norm.default,
    ),
    releases=None,
    differs=(
        "their forward-mode formulas read the mean and inverse deviation the op returns without a derivative, "
        "so a reverse-mode derivative of their tangents (`grad` of `jvp`, `jacrev` of `jacfwd`) misses the "
        "terms through those statistics: eager's is off from float64 finite differences (by about 1 on unit "
        "inputs; layer norm, batch and instance norm in training, cuDNN's batch norm on a GPU). Found by "
        "comparing `grad` of `jvp` with the gradient of a finite-difference tangent, op by op"
    ),
    note="NOTE [tangents that will be differentiated] (remat/_partitioning/_differentiable_programs.py)",
    table=frozenset(
        {
            aten.native_layer_norm.default,
            aten.native_batch_norm.default,
            aten._native_batch_norm_legit.default,
            aten._native_batch_norm_legit.no_stats,
            aten._native_batch_norm_legit_functional.default,
            aten.cudnn_batch_norm.default,
        }
    ),
)

SLICE_SCATTER_NEGATIVE_BOUNDS_UNDER_VMAP = Quirk(
    ops=(aten.slice_scatter.default,),
    releases=None,
    differs=(
        "under vmap, the batching rule of `slice_scatter` raises on a negative bound (`upper bound and "
        "lower bound inconsistent with step sign`), where a write through `t[:, 1:-1]` in eager runs"
    ),
    note="NOTE [slice scatters count from the start] (remat/_partitioning/_eager_copies.py)",
    table=frozenset({aten.slice_scatter.default}),
)

BATCH_NORM_FUNCTIONAL_UNBATCHED = Quirk(
    ops=(aten._native_batch_norm_legit_functional.default,),
    releases=None,
    differs=(
        "under vmap, the functional batch norm (what training with running statistics traces to) has no "
        "batching rule, and the fallback stacks a contiguous output, where eager's in-place op has a rule "
        "that folds the batch into the channels and keeps that layout"
    ),
    note="NOTE [batch norm under vmap] (remat/_partitioning/_eager_copies.py)",
    table={aten._native_batch_norm_legit_functional.default: aten._native_batch_norm_legit.default},
)

QUANTILE_COMPARES_TENSORS = Quirk(
    ops=(aten.quantile.default, aten.nanquantile.default),
    releases=("2.10", "2.11"),
    differs=(
        "`quantile` and `nanquantile` check their `q` with `torch.equal`, a bool of two tensors' values that "
        "Python reads, which a trace of tensor ops cannot hold"
    ),
    note="docs/torch-versions.md: refused inside a checkpointed function there, saying why",
)

# --- torch.compile ------------------------------------------------------------------------------

SAC_ASKS_AGAIN_WHILE_RECOMPUTING = Quirk(
    ops=(),
    releases=("2.10", "2.11", "2.12"),
    differs=(
        "a selective-checkpoint region under torch.compile that Dynamo runs eagerly (a graph break inside) "
        "asks its policy again for each op it recomputes (`ctx.is_recompute`), from the first call on"
    ),
    note="`_dynamo._RecomputeTags` counts the forward's and the recomputation's positions apart",
)

SAC_ERRORS_LEAVE_MODES_PUSHED = Quirk(
    ops=(),
    releases=("2.10", "2.11", "2.12"),
    differs=(
        "an error raised inside a selective-checkpoint region (by its policy function, say) leaves the "
        "region's dispatch modes pushed until the error is garbage collected: every op run meanwhile, in any "
        "later code, reaches the policy"
    ),
    note="NOTE [a region's error raised where torch can unwind] (remat/_running/_dynamo.py)",
)

REGIONS_ALLOCATE_FOR_IN_PLACE_OPS = Quirk(
    ops=(aten.empty.memory_format, aten.empty_like.default, aten._local_scalar_dense.default),
    releases=None,
    differs=(
        "a region under torch.compile allocates for ops that then fill the memory in place (training-mode "
        "batch norm), and reads the Python numbers Dynamo passes in as tensors; remat's functionalized trace "
        "has neither"
    ),
    note="NOTE [regions that differ from the trace] (remat/_running/_dynamo.py): such calls are recomputed",
    table=frozenset({aten.empty.memory_format, aten.empty_like.default, aten._local_scalar_dense.default}),
)

# --- CUDA without a GPU --------------------------------------------------------------------------

SDPA_CHOOSES_BELOW_THE_DISPATCHER = Quirk(
    ops=(
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
    ),
    releases=None,
    differs=(
        "SDPA picks its CUDA kernel (flash, memory-efficient, cuDNN) from the device's compute capability, "
        "below the dispatcher; on fake CUDA tensors where this machine has no GPU it runs the math kernel, "
        "which keeps the T x T probabilities for backward where the GPU's kernel keeps a row of log-sum-exps"
    ),
    note="NOTE [kernels of a GPU this machine lacks] (remat/_memory/_gpu.py): remat chooses as the assumed GPU would",
    table={  # backend -> the op SDPA calls for it on CUDA
        "flash": aten._scaled_dot_product_flash_attention.default,
        "efficient": aten._scaled_dot_product_efficient_attention.default,
        "cudnn": aten._scaled_dot_product_cudnn_attention.default,
    },
)

IN_PLACE_OPS_FUNCTIONALIZATION_CANNOT_MAP = Quirk(
    ops=(aten.polygamma_.default,),
    releases=None,
    differs=(
        "functionalization finds no functional form of `polygamma_(self, n)` (the functional op takes its "
        "arguments the other way round, `polygamma(n, self)`), and raises torch's raw 'Found a custom "
        "(non-ATen) operator whose output has alias annotations'"
    ),
    note="NOTE [in-place ops functionalization cannot map] (remat/_eager/_in_place.py)",
    table={aten.polygamma_.default: lambda self, n: self.copy_(aten.polygamma.default(n, self))},
)

QUIRKS: tuple[Quirk, ...] = (
    DETACH_TRACES_AS_ALIAS,
    IN_PLACE_META_KERNELS_FAIL_UNDER_FORWARD_AD,
    UNBACKED_SYMBOL_NAMES,
    LINALG_CHECKS_ARE_EFFECTFUL,
    CPU_KERNELS_CHOOSE_LAYOUTS,
    FAKE_BATCH_NORM_BACKWARD_IGNORES_MASK,
    BATCH_NORM_TRAINING_IGNORES_RUNNING_STATS,
    RRELU_FUNCTIONAL_DERIVATIVE,
    GRADIENTS_READ_LU_FACTORS,
    GRADIENTS_SWITCH_IN_GRAD_MODE,
    SLICE_SCATTER_NEGATIVE_BOUNDS_UNDER_VMAP,
    BATCH_NORM_FUNCTIONAL_UNBATCHED,
    BATCH_NORM_UPDATES_UNDECLARED,
    TANGENT_FORMULAS_READ_STATISTICS,
    QUANTILE_COMPARES_TENSORS,
    SAC_ASKS_AGAIN_WHILE_RECOMPUTING,
    SAC_ERRORS_LEAVE_MODES_PUSHED,
    REGIONS_ALLOCATE_FOR_IN_PLACE_OPS,
    SDPA_CHOOSES_BELOW_THE_DISPATCHER,
    IN_PLACE_OPS_FUNCTIONALIZATION_CANNOT_MAP,
)
