"""preflight: predict the peak memory of PyTorch training before step one."""

from preflight._advise import Suggestion, advise, resize_batch
from preflight._autotune import BatchSizeResult, GlobalBatchPlan, max_batch_size, split_global_batch
from preflight._batches import worst_case_batch
from preflight._check import Report, check
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

__version__ = "0.1.0"

__all__ = [
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
