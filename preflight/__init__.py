"""preflight: predict the peak memory of PyTorch training before step one, say what to change when it does not
fit, and check the prediction against the measured peak. The user's model, optimizer and batch are traced on fake
tensors under one description of how the run trains (`Run`: precision, `Loop`, `Target`, `ParallelPlan`); the doors
are `estimate`, `estimate_eval`, `check`, `advise`, `max_batch_size` and `measure` here, the trainer callbacks in
`preflight.integrations`, and the ``preflight`` command. docs/architecture.md describes the layers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what each name is, for type checkers; at run time they load on first use (below)
    from preflight.advice import Suggestion, advise, resize_batch
    from preflight._autotune import BatchSizeResult, GlobalBatchPlan, max_batch_size, split_global_batch
    from preflight._batches import worst_case_batch
    from preflight.report import Report
    from preflight.verdict import check
    from preflight._errors import PreflightError, StepWouldFailError
    from preflight._epoch import StepsEstimate, estimate_steps, sample_batches
    from preflight._eval import estimate_eval, estimate_generation
    from preflight._estimate import estimate
    from preflight._gpus import GPU, get_gpu, known_gpus
    from preflight._measure import measure
    from preflight._result import Category, Coverage, Estimate, Event, Measurement, PhaseEstimate, TimelinePoint
    from preflight._checkpoint import Checkpoint
    from preflight._eval_loop import EvalLoop
    from preflight._loading import Loading
    from preflight._optimizer_group import OptimizerGroup
    from preflight._run import Loop, Run, Target
    from preflight.parallel import ParallelPlan, deepspeed_plan, fsdp_plan
    from preflight._steps import PRECISIONS
    from preflight._units import format_bytes, parse_bytes
    from preflight._version import __version__

# Public name -> the module defining it. Importing preflight loads none of them (nor torch): the ``preflight``
# command starts, and answers Ctrl-C, at once; the first use of a name imports its module.
_WHERE = {
    "Suggestion": "preflight.advice",
    "advise": "preflight.advice",
    "resize_batch": "preflight.advice",
    "BatchSizeResult": "preflight._autotune",
    "GlobalBatchPlan": "preflight._autotune",
    "max_batch_size": "preflight._autotune",
    "split_global_batch": "preflight._autotune",
    "worst_case_batch": "preflight._batches",
    "Report": "preflight.report",
    "check": "preflight.verdict",
    "PreflightError": "preflight._errors",
    "StepWouldFailError": "preflight._errors",
    "StepsEstimate": "preflight._epoch",
    "estimate_steps": "preflight._epoch",
    "sample_batches": "preflight._epoch",
    "estimate_eval": "preflight._eval",
    "estimate_generation": "preflight._eval",
    "estimate": "preflight._estimate",
    "GPU": "preflight._gpus",
    "get_gpu": "preflight._gpus",
    "known_gpus": "preflight._gpus",
    "measure": "preflight._measure",
    "Category": "preflight._result",
    "Coverage": "preflight._result",
    "Estimate": "preflight._result",
    "Event": "preflight._result",
    "Measurement": "preflight._result",
    "PhaseEstimate": "preflight._result",
    "TimelinePoint": "preflight._result",
    "Checkpoint": "preflight._checkpoint",
    "EvalLoop": "preflight._eval_loop",
    "Loading": "preflight._loading",
    "OptimizerGroup": "preflight._optimizer_group",
    "Loop": "preflight._run",
    "Run": "preflight._run",
    "Target": "preflight._run",
    "ParallelPlan": "preflight.parallel",
    "deepspeed_plan": "preflight.parallel",
    "fsdp_plan": "preflight.parallel",
    "PRECISIONS": "preflight._steps",
    "format_bytes": "preflight._units",
    "parse_bytes": "preflight._units",
    "__version__": "preflight._version",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'preflight' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))

__all__ = [
    "__version__",
    "PRECISIONS",
    "Checkpoint",
    "EvalLoop",
    "Loading",
    "Loop",
    "OptimizerGroup",
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
    "estimate_generation",
    "estimate_steps",
    "sample_batches",
    "StepsEstimate",
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
    "PhaseEstimate",
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
