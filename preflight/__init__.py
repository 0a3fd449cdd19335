"""preflight: predict the peak memory of PyTorch training before step one, say what to change when it does not
fit, and check the prediction against the measured peak. The user's model, optimizer and batch are traced on fake
tensors under one description of how the run trains (`Run`: precision, `Loop`, `Target`, `ParallelPlan`); the doors
are `estimate`, `estimate_eval`, `check`, `advise`, `max_batch_size` and `measure` here, the trainer callbacks in
`preflight.integrations`, and the ``preflight`` command. docs/architecture.md describes the layers.
"""

from preflight._advise import Suggestion, advise, resize_batch
from preflight._autotune import BatchSizeResult, GlobalBatchPlan, max_batch_size, split_global_batch
from preflight._batches import worst_case_batch
from preflight.report import Report
from preflight.verdict import check
from preflight._errors import PreflightError, StepWouldFailError
from preflight._eval import estimate_eval
from preflight._estimate import estimate
from preflight._gpus import GPU, get_gpu, known_gpus
from preflight._measure import measure
from preflight._result import Category, Coverage, Estimate, Event, Measurement, TimelinePoint
from preflight._run import Loop, Run, Target
from preflight.parallel import ParallelPlan, deepspeed_plan, fsdp_plan
from preflight._steps import PRECISIONS
from preflight._units import format_bytes, parse_bytes
from preflight._version import __version__


__all__ = [
    "__version__",
    "PRECISIONS",
    "Loop",
    "ParallelPlan",
    "Run",
    "Target",
    "deepspeed_plan",
    "fsdp_plan",
    "BatchSizeResult",
    "GlobalBatchPlan",
    "Suggestion",
    "Report",
    "advise",
    "check",
    "estimate_eval",
    "worst_case_batch",
    "max_batch_size",
    "resize_batch",
    "split_global_batch",
    "Category",
    "Coverage",
    "Estimate",
    "Event",
    "GPU",
    "Measurement",
    "PreflightError",
    "StepWouldFailError",
    "TimelinePoint",
    "estimate",
    "format_bytes",
    "get_gpu",
    "known_gpus",
    "measure",
    "parse_bytes",
]
