"""remat: per-op-call activation checkpointing for PyTorch, as a composable transform."""

from . import _report
from . import policies as policies
from ._api._apply import checkpoint_modules as checkpoint_modules
from ._api._apply import uncheckpoint_modules as uncheckpoint_modules
from ._api._checkpoint import checkpoint as checkpoint
from ._api._checkpointed import Checkpointed as Checkpointed
from ._api._inspect import report as report
from ._api._inspect import trace as trace
from ._api._module import CheckpointedModule as CheckpointedModule
from ._core import _deprecated
from ._core._cache import CacheInfo as CacheInfo
from ._core._calls import Call as Call
from ._core._calls import Dataflow as Dataflow
from ._core._calls import Decision as Decision
from ._core._calls import TensorMeta as TensorMeta
from ._core._calls import Trace as Trace
from ._memory._gpu import Gpu as Gpu
from ._memory._gpu import assume_gpu as assume_gpu
from ._planning._fit import fit as fit
from ._planning._fit_results import BlockPlan as BlockPlan
from ._planning._fit_results import Fit as Fit
from ._planning._fit_results import StepReport as StepReport
from ._planning._pareto import Pareto as Pareto
from ._planning._pareto import pareto as pareto
from ._report import Peak as Peak
from ._report import Report as Report
from ._report import ReportRow as ReportRow
from ._storing._offload import limit_pinned_memory as limit_pinned_memory
from ._tracing._errors import TraceError as TraceError
from ._tracing._tag import tag as tag

# `remat.report` is the function; the module that defined its result types had the same name, so that
# `remat.report.ReportRow` failed. Their old import path keeps working for one release, with a warning.
_deprecated.moved_module("remat.report", "remat", _report, ("Peak", "Report", "ReportRow"))

SAVE = Decision.SAVE
RECOMPUTE = Decision.RECOMPUTE
OFFLOAD = Decision.OFFLOAD
PACK = Decision.PACK

__version__ = "0.1.0"

__all__ = [
    "OFFLOAD",
    "PACK",
    "RECOMPUTE",
    "SAVE",
    "BlockPlan",
    "CacheInfo",
    "Call",
    "Checkpointed",
    "CheckpointedModule",
    "Dataflow",
    "Decision",
    "Fit",
    "Gpu",
    "Report",
    "ReportRow",
    "TensorMeta",
    "Trace",
    "TraceError",
    "Pareto",
    "Peak",
    "StepReport",
    "assume_gpu",
    "checkpoint",
    "checkpoint_modules",
    "fit",
    "limit_pinned_memory",
    "pareto",
    "policies",
    "report",
    "tag",
    "trace",
    "uncheckpoint_modules",
]
