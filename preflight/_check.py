"""The decision layer behind the trainer callbacks: predict, compare with the budget, report, stop or warn, verify.

Trainer-agnostic: the adapters in ``preflight.integrations`` translate a trainer's objects (model, optimizer,
precision, accumulation, dataloaders) into the arguments of `predict`, hand its `Report` to `decide`, and call
`VerifySession` around the first optimizer steps; `check` does both for a loop without a trainer. Everything
here runs on every rank; only rank zero prints and writes files.

Policies:

- **Verdict**: the larger of the training and evaluation peaks is compared with ``budget * (1 - headroom)``
  (`preflight._budget.usable_bytes`). Under ``torch.distributed`` the maximum over ranks decides, on every rank
  alike, so all ranks raise (or continue) together and none is left waiting in a collective. A rank whose
  prediction failed takes part with a labelled lower bound (`predict_or_lower_bound`): the ranks that predicted
  decide, and its lower bound stops the run if it alone is over the budget. After the measured steps, each rank
  compares its own measurement with its own prediction.
- **Overflow**: ``on_overflow="raise"`` raises `preflight.PreflightError` before any optimizer step, with the
  numbers and what to change (top suggestions of `preflight._advise.advise` when it can run); ``"warn"`` warns.
- **Dry run** (`preflight._dryrun`'s protocol, used by ``preflight check -- python train.py``): with
  ``PREFLIGHT_DRY_RUN=1`` the process ends after the report with exit status 0 when the run fits (or there is no
  budget to compare with), 3 (`EXIT_DOES_NOT_FIT`) when it does not, 4 (`EXIT_NO_VERDICT`) when the model could
  not be traced and its lower bound is under the budget, 5 (`EXIT_STEP_FAILS`) when the step would raise at step
  one (`preflight.StepWouldFailError`), and 1 when the prediction itself failed, so a job script
  can run the real training script once and stop before step one. ``PREFLIGHT_REPORT``,
  ``PREFLIGHT_BUDGET``, ``PREFLIGHT_GPU``, ``PREFLIGHT_HEADROOM``, ``PREFLIGHT_WORLD_SIZE`` and
  ``PREFLIGHT_SHARDING`` override the callback's options.
- **Internal failures**: any exception inside preflight that is not a `PreflightError` (a model the trace
  cannot run, a profiler already in use, a bug of ours) becomes a ``RuntimeWarning`` with the reason, and
  training proceeds without the prediction or the verification. A `StepWouldFailError` is not ours: the real step
  would raise it at step one, so it is raised before it.
- **The user's errors**: an exception the user's own code raised inside the traced step (``ValueError`` in a
  forward, a batch of the wrong type; `preflight.trace._blame` gives the rule) is re-raised as it is, with a note
  saying it happened in preflight's trace and where: the real first step would raise it too, so swallowing it into
  a warning would only delay it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from preflight._batches import BatchInfo, failures_text
from preflight._budget import DEFAULT_HEADROOM, check_headroom, usable_bytes
from preflight._console import progress
from preflight._device import iter_tensors, live_storage_bytes, map_tensors, resolve_device
from preflight._dryrun import EXIT_DOES_NOT_FIT, EXIT_NO_VERDICT, finish_failed_step, settings_from_env
from preflight._errors import PreflightError, StepWouldFailError
from preflight._analytic import optimizer_state_bytes
from preflight._estimate import deepspeed_precision, estimate, read_plan_off_ddp
from preflight._sharding import hf_hidden_size, read_deepspeed_config
from preflight._guard import untouched
from preflight._eval import EvalStepFn, estimate_eval
from preflight._result import Category, Estimate
from preflight._run import Run, check_run, pinned, run_budget
from preflight._steps import LossNotFoundError, Loop, StepFn, check_step
from preflight._units import format_bytes
from preflight._verify import StepPeakMeter, compare, summary
from preflight.cuda import WORKSPACE_UIDS
from preflight.parallel import ParallelPlan, already_sharded, read_ddp, read_fsdp1, read_fsdp2, read_zero, zero_plan
from preflight.parallel import held_tensors, stand_in
from preflight.trace import blamed_on_user, float_dtype_for

__all__ = [
    "EXIT_DOES_NOT_FIT", "ON_OVERFLOW_CHOICES", "Options", "Report", "VerifySession", "ddp_bucket_bytes",
    "options_plan",
    "check", "decide", "eval_resident", "internal_failures", "is_rank_zero", "lower_bound_report", "predict",
    "predict_or_lower_bound",
]

ON_OVERFLOW_CHOICES = ("raise", "warn")
_EXIT_PREDICTION_FAILED = 1  # what a crashed script exits with: a failed prediction must not read as "fits"
_TOP_SUGGESTIONS = 3  # shown in the table and the error; the JSON keeps all


@dataclasses.dataclass(frozen=True)
class Options:
    """The callbacks' common options, checked at construction (see ``preflight.integrations``).

    How the run trains (precision, loop, target and its budget, parallel plan) is the `preflight.Run`; these say
    what preflight does with its prediction.

    Attributes:
        headroom: fraction of the budget kept free (see `preflight._budget.DEFAULT_HEADROOM` for why 0.10).
        on_overflow: ``"raise"`` or ``"warn"`` when the prediction exceeds the usable budget. ``"raise"`` (fail
            fast) also stops the run before step one when a dataset sample raises as the scan reads it; ``"warn"``
            leaves that sample out and names it (`scan_on_error`).
        verify_steps: optimizer steps measured at the start of training to check the prediction; 0 disables.
        report_path: where to write the JSON report (rank zero), or None.
        plot_path: where to write a PNG of the predicted timeline and breakdown (needs matplotlib), or None.
        check_eval: also predict the evaluation step when there is an eval dataloader.
        suggest: when the run does not fit, rank what to change with `preflight._advise.advise` (rank zero; it
            traces each option, about ten more traces).
    """

    headroom: float = DEFAULT_HEADROOM
    on_overflow: str = "raise"
    verify_steps: int = 3
    report_path: str | os.PathLike | None = None
    plot_path: str | os.PathLike | None = None
    check_eval: bool = True
    suggest: bool = True

    def __post_init__(self) -> None:
        check_headroom(self.headroom)
        if self.on_overflow not in ON_OVERFLOW_CHOICES:
            raise ValueError(f"`on_overflow` should be either of {ON_OVERFLOW_CHOICES}, got {self.on_overflow!r}.")
        if isinstance(self.verify_steps, bool) or not isinstance(self.verify_steps, int) or self.verify_steps < 0:
            raise ValueError(f"`verify_steps` should be a non-negative integer (0 disables), "
                             f"got {self.verify_steps!r}.")
        for name in ("report_path", "plot_path"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"`{name}` should be a file path or None, got {value!r}.")
        for name in ("check_eval", "suggest"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` should be True or False, got {getattr(self, name)!r}.")

    @property
    def scan_on_error(self) -> str:
        """What the dataset scan does with a sample that raises when read: stop the run before step one (the user
        asked to fail fast: ``on_overflow="raise"``), or leave it out and say so."""
        return "raise" if self.on_overflow == "raise" else "skip"


@dataclasses.dataclass
class Report:
    """What preflight predicted (and, after verification, measured) for a training run; ``to_dict()`` is the JSON.

    Byte counts are per device (per rank under data parallelism). ``predicted_peak_bytes`` is the training
    step's peak of tensor bytes (``torch.cuda.max_memory_allocated``; the maximum over ranks when distributed).
    ``fits`` compares the larger of it and ``eval_predicted_peak_bytes`` (``predicted_required_bytes`` in the
    JSON) with ``usable_bytes``; it is None when there is no budget, or when a lower bound is under the budget.
    For a CUDA target, ``predicted_reserved_bytes`` and ``predicted_device_total_bytes`` add the caching
    allocator's reserve and the CUDA context: what the headroom is there to cover.
    """

    version: str
    device: str
    budget_bytes: int | None
    headroom: float
    usable_bytes: int | None
    predicted_peak_bytes: int
    predicted_breakdown: dict[str, int]
    peak_phase: str
    eval_predicted_peak_bytes: int | None
    eval_peak_phase: str | None
    worst_case_batch_shape: Any
    worst_case_batch: dict[str, Any] | None
    eval_batch_shape: Any
    fits: bool | None
    coverage: dict[str, Any]
    precision: str | None
    schedule: dict[str, Any]
    # The run's description as predicted (`preflight.Run.to_dict`): precision, loop, target, parallel plan.
    run: dict[str, Any] | None = None
    predicted_reserved_bytes: int | None = None
    predicted_device_total_bytes: int | None = None
    eval_predicted_device_total_bytes: int | None = None
    world_size: int = 1
    rank_predicted_peak_bytes: list[int | None] | None = None
    # Per rank under torch.distributed: whose figure is only a lower bound (its prediction failed), and each rank's
    # own measurement and its error against that rank's own prediction.
    rank_lower_bound: list[bool | None] | None = None
    rank_measured_peak_bytes: list[int | None] | None = None
    rank_relative_errors: list[float | None] | None = None
    suggestions: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    autotune: dict[str, Any] | None = None
    measured_peak_bytes: int | None = None
    measured_reserved_bytes: int | None = None
    relative_error: float | None = None
    steps_measured: int = 0
    measured_step_peaks: list[int] = dataclasses.field(default_factory=list)
    predicted_step_peaks: list[int | None] = dataclasses.field(default_factory=list)
    worst_case_headroom: float | None = None
    retained_step_bytes: list[int] = dataclasses.field(default_factory=list)
    eval_measured_peak_bytes: int | None = None
    eval_predicted_measured_bytes: int | None = None
    eval_relative_error: float | None = None
    verify_method: str | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    estimate: Estimate | None = dataclasses.field(default=None, repr=False)
    eval_estimate: Estimate | None = dataclasses.field(default=None, repr=False)
    # step_predictor(batch) -> {step: peak bytes}: the same prediction for another batch (`VerifySession`).
    step_predictor: Callable[[Any], dict[int, int]] | None = dataclasses.field(default=None, repr=False)
    # eval_predictor(batch) -> bytes: the eval prediction for another eval batch.
    eval_predictor: Callable[[Any], int] | None = dataclasses.field(default=None, repr=False)

    @property
    def verdict_bytes(self) -> int:
        """What the verdict compares with the usable budget: the larger of the training need (the device total
        when a GPU target was simulated: reserved memory + CUDA context + cuBLAS workspace; else the peak of
        tensor storages) and the evaluation need (likewise)."""
        train = self.predicted_device_total_bytes
        if train is None:
            train = self.predicted_peak_bytes
        evaluation = self.eval_predicted_device_total_bytes or self.eval_predicted_peak_bytes or 0
        return max(train, evaluation)

    def to_dict(self) -> dict[str, Any]:
        """The JSON report (without the timelines)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("estimate", "eval_estimate", "step_predictor", "eval_predictor")}
        out["relative_error"] = None if self.relative_error is None else round(self.relative_error, 6)
        if self.worst_case_headroom is not None:
            out["worst_case_headroom"] = round(self.worst_case_headroom, 6)
        out["predicted_required_bytes"] = self.verdict_bytes  # what the verdict compared with usable_bytes
        return out

    def write(self, path: str | os.PathLike) -> None:
        """Write ``to_dict()`` as JSON to ``path`` (parent directories are created)."""
        path = os.fspath(path)
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, default=str)
            f.write("\n")


@untouched()
def check(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    run: Run | None = None,
    *,
    step: StepFn | None = None,
    eval_batch: Any = None,
    eval_step: EvalStepFn | None = None,
    headroom: float = DEFAULT_HEADROOM,
    on_overflow: str = "raise",
    report_path: str | os.PathLike | None = None,
    plot_path: str | os.PathLike | None = None,
    suggest: bool = True,
) -> Report | None:
    """Check before training that a run fits: predict, report, and raise (or warn, or end a dry run).

    For loops without a trainer (the callbacks in ``preflight.integrations`` do this for Lightning, the HF Trainer
    and accelerate). Pass the worst-case batch: the longest samples your loader can yield, collated
    (`preflight.worst_case_batch` finds it from a DataLoader).

    Args:
        model, optimizer, batch, step: as for `preflight.estimate`. A model ``DistributedDataParallel`` wraps (or
            FSDP, or DeepSpeed) is read as its wrapping runs it: its plan is the run's parallel section.
        run: how the run trains (`preflight.Run`): precision, loop, target (its ``budget``, or a catalog ``gpu``'s
            memory, is what the verdict compares with) and parallel plan.
        eval_batch, eval_step: an evaluation batch and step, to predict the no-grad eval peak too.
        headroom, on_overflow, report_path, plot_path, suggest: see `Options`.

    Returns:
        The `Report`, or None when the prediction failed (a warning says why).

    Raises:
        preflight.PreflightError: it does not fit and ``on_overflow="raise"``.
        ValueError: a bad option (raised before anything is traced), or a step that yields no loss.
        TypeError: a ``step`` or ``eval_step`` that cannot be called as ``step(model, batch)``.
        Exception: an exception of the user's own code in the traced step, re-raised with a note (see
            `preflight.estimate`); any other failure of the prediction is a warning and None.

    Example:
        >>> report = preflight.check(model, opt, batch, Run(target=Target(budget="24GiB")))  # doctest: +SKIP
    """
    options = Options(headroom=headroom, on_overflow=on_overflow, verify_steps=0, report_path=report_path,
                      plot_path=plot_path, suggest=suggest)
    run = check_run(run)
    check_step(step)
    check_step(eval_step, "eval_step")
    report = None
    # No trainer to protect here: a step that yields no loss is the caller's mistake, and says how to fix it.
    with internal_failures("the prediction", reraise=(LossNotFoundError,)):
        report = predict(model, optimizer, batch, run, options=options, step=step, eval_batch=eval_batch,
                         eval_step=eval_step)
    return decide(report, options)


def predict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    run: Run,
    *,
    options: Options,
    step: StepFn | None = None,
    batch_info: BatchInfo | None = None,
    eval_batch: Any = None,
    eval_step: EvalStepFn | None = None,
    eval_batch_info: BatchInfo | None = None,
    ddp_gradient_buckets: bool = False,
    make_batch: Callable[[int], Any] | None = None,
    eval_frees_gradients: bool = False,
) -> Report:
    """Predict this rank's training (and evaluation) peak and compare it with the budget. No collectives.

    Args:
        model, optimizer, batch, step: as for `preflight.estimate` (``batch`` should be the worst-case batch, see
            `preflight._batches.worst_case_batch`). A ``DistributedDataParallel`` model is read as its plan.
        run: how the run trains (`preflight.Run`), as the adapter read it off the trainer: both peaks are this
            rank's share under a sharded ``run.parallel`` (the evaluation peak rescaled by category). What
            ``preflight check`` asked for through the environment is laid over it (`Run.over`).
        options: the callback's `Options`.
        batch_info, eval_batch_info: how the batches were found, for the report.
        eval_batch: an evaluation batch; with ``options.check_eval`` the no-grad step is predicted too.
        eval_step: ``eval_step(model, batch)``; default ``model(**batch)`` / ``model(batch)``.
        ddp_gradient_buckets: the adapter unwrapped a DDP model: its buckets hold a flat copy of every gradient for
            the whole run (`preflight._sharding.shard_breakdown` docs), added to both peaks as gradients.
        make_batch: ``make_batch(b)`` builds the worst-case batch at size ``b``, for the suggestions.
        eval_frees_gradients: the trainer releases the gradients before evaluating (Lightning's default
            ``on_validation_model_zero_grad``), so a ``"before_backward"`` loop's gradients are not alive during
            evaluation.

    Returns:
        A `Report`. When the run does not fit and this is rank zero, its ``suggestions`` hold the ranked output
        of `preflight._advise.advise` (left empty, with a warning in the report, when advice fails).
    """
    import preflight

    options, settings = _with_environment(options)
    asked = settings.run()  # `preflight check --gpu/--budget/--world-size/--sharding/--full`: laid over the run
    from_env = asked.parallel is not None
    run = asked.over(check_run(run))
    ddp_note = None
    if from_env and read_ddp(model) is not None:  # a dry run plans the ranks asked for, whatever wraps it here
        model = read_ddp(model)[0]
    else:  # a DDP model is its own plan: buckets counted per rank by the estimate
        model, run, ddp_note = read_plan_off_ddp(model, run)
    target = resolve_device(run.target.device, model)
    budget_bytes = run_budget(run, model, required=False)
    usable = usable_bytes(budget_bytes, options.headroom) if budget_bytes is not None else None
    # A model and optimizer DeepSpeed has taken over are read back as the unpartitioned model and a torch optimizer
    # (`preflight.parallel.read_zero`), predicted under the run's ZeRO plan; a ValueError says what does not map.
    zero = read_zero(model, optimizer)
    if zero is not None:
        model, optimizer = zero.model, zero.optimizer
        run = run.replace(parallel=zero_plan(zero, run.parallel))
    parallel = run.parallel
    if parallel is not None and parallel.deepspeed is not None and parallel.sharded:
        # DeepSpeed's 16-bit modes: the model as DeepSpeed casts it, for training, evaluation and the resident state
        run = run.replace(precision=deepspeed_precision(
            model, read_deepspeed_config(dict(parallel.deepspeed), hidden_size=hf_hidden_size(model)), run.precision))
    precision, schedule = run.precision, run.loop
    sharded = parallel if parallel is not None and parallel.sharded else None
    # The trainer's replicas (DDP from a strategy) are traced as one device, their buckets added below; a plan asked
    # for through `preflight check` or read off a DDP model is predicted per rank by the estimate.
    estimate_run = run if from_env or ddp_note is not None else run.replace(parallel=None)
    wrapped = already_sharded(model)
    # A model FSDP already wrapped (fully_shard, or FullyShardedDataParallel: Lightning's FSDPStrategy, accelerate)
    # has its own plan: `estimate` reads it and traces each rank on a copy. A ValueError says what is not followed.
    fsdp2 = read_fsdp2(model) if wrapped is not None else None
    fsdp1 = read_fsdp1(model) if wrapped is not None and fsdp2 is None else None
    engine = "fully_shard" if fsdp2 is not None else "FullyShardedDataParallel"
    own = fsdp2 or fsdp1
    if fsdp2 is not None:
        sharded = ParallelPlan(fsdp2.world_size, "fsdp2", source="the model's fully_shard", fsdp=fsdp2.plan)
        estimate_run = run.replace(parallel=None)
    elif fsdp1 is not None:
        sharded = ParallelPlan(fsdp1.world_size, fsdp1.sharding, source="the model's FullyShardedDataParallel",
                               fsdp=fsdp1.plan)
        estimate_run = run.replace(parallel=None)
    elif sharded is not None:
        estimate_run = run
        if wrapped is not None:  # its tensors are this rank's shards: the plan would divide them again
            report = lower_bound_report(model, optimizer, options, run, device=target,
                                        reason=f"the model is already sharded ({wrapped})")
            report.fits = None
            report.warnings.append(f"no verdict: the strategy sharded the model before preflight saw it ({wrapped}); "
                                   "a per-rank prediction of a model wrapped other than by fully_shard or "
                                   f"FullyShardedDataParallel is not supported yet ({sharded.note()})")
            return report
    if estimate_run.target.planned_device is None:
        estimate_run = pinned(estimate_run, target)

    def run_estimate(b: Any, opt: torch.optim.Optimizer = optimizer) -> Estimate:
        return estimate(model, opt, b, estimate_run, step=step)

    def step_predictor(b: Any) -> dict[int, int]:
        # After the measured steps the optimizer has state; the measured run's first step had none.
        # Under a per-rank trace inside a job, this rank's own steps (its shards may differ from the peak rank's).
        one = run_estimate(b, _without_state(optimizer))
        rank = _rank() if one.per_rank_peak_bytes is not None and _world_size() == one.world_size else None
        return {k: v + buckets for k, v in one.step_peaks(rank).items()}

    talk = is_rank_zero()  # a trace takes seconds (11 s on a 7B model): say so, as the CLI does
    with progress("tracing the training step on fake tensors", enabled=talk):
        est = run_estimate(batch)
    if est.device != str(target):
        target = torch.device(est.device)
    breakdown = dict(est.breakdown)
    peak = est.peak_bytes
    notes: list[str] = []
    if sharded is not None:
        notes.append(sharded.note())
    if zero is not None:
        notes.append(zero.note())
    # A plan predicted per rank (asked for through `preflight check`, or read off a DDP model) already has DDP's
    # buckets in the per-rank breakdown; sharded strategies have none.
    ddp_gradient_buckets = ddp_gradient_buckets and estimate_run.parallel is None and sharded is None
    buckets = _gradient_bytes(model, precision) if ddp_gradient_buckets else 0
    total = est.device_total_bytes
    if buckets:
        peak += buckets
        total = None if total is None else total + buckets
        breakdown["gradients"] += buckets
        notes.append(f"DDP gradient buckets ({format_bytes(buckets)}, a copy of every gradient) added as gradients")

    # A model FSDP already wrapped: its evaluation step and the suggestions' options run on its unwrapped meta copy
    # (`preflight.parallel.stand_in`), rescaled to the rank or traced per rank under its own plan.
    base_model, base_optimizer, unwrapped = model, optimizer, True
    if own is not None and ((options.check_eval and eval_batch is not None) or options.suggest):
        try:
            base_model, base_optimizer = stand_in(own.root if fsdp1 is not None else model, optimizer, engine)
        except (ValueError, TypeError) as err:  # the optimizer does not map to the copy: the verdict stands alone
            unwrapped = False
            notes.append(f"no evaluation peak or suggestions for the model {engine} wrapped: {err}")
    eval_est = eval_predictor = None
    if options.check_eval and eval_batch is not None and unwrapped:
        resident = eval_resident(base_model, base_optimizer, precision=precision, schedule=schedule,
                                 ddp_gradient_buckets=ddp_gradient_buckets, estimate=est,
                                 frees_gradients=eval_frees_gradients)
        # The autograd thread's cuBLAS workspace stays allocated from the first backward on.
        autograd_workspace = next((e.nbytes for e in est.events if e.uid == WORKSPACE_UIDS[1] and e.nbytes > 0), 0)
        if autograd_workspace:
            resident["temporaries"] = resident.get("temporaries", 0) + autograd_workspace
        eval_run = pinned(run, target)
        with progress("tracing the evaluation step on fake tensors", enabled=talk):
            eval_est = estimate_eval(base_model, eval_batch, eval_run, step=eval_step, resident=resident)

        # Under a sharded plan, this rank's share. The resident optimizer state is the per-rank training trace's
        # where ranks were traced (kept as it is: each rank's own slices and scalars), else closed-form (a
        # replica's, to shard), else the trace's at its peak.
        traced_state = None
        if sharded is not None and est.per_rank_peak_bytes is not None:
            traced_state = est.resident_bytes(Category.OPTIMIZER_STATE)
        if traced_state is None and sharded is not None and (own is not None or optimizer_state_bytes(
                optimizer, param_dtype=float_dtype_for(precision)) is None):
            traced_state = est.breakdown.get("optimizer_state", 0)

        def eval_figures(one: Estimate) -> tuple[int, int | None]:
            if sharded is None:
                return one.peak_bytes, one.device_total_bytes
            return _rank_share(one, base_model, sharded, precision, traced_state)

        def eval_predictor(b: Any, resident: dict[str, int] = resident) -> int:  # noqa: F811
            return eval_figures(estimate_eval(base_model, b, eval_run, step=eval_step, resident=resident))[0]

    eval_peak = eval_total = None
    if eval_est is not None:
        eval_peak, eval_total = eval_figures(eval_est)
        if sharded is not None:
            notes.append("evaluation peak: this rank's share of the single-device evaluation trace, rescaled by "
                         "category (optimizer state, gradients and parameters as the plan shards them)")
    coverage = est.coverage.to_dict()
    coverage["notes"] = list(coverage["notes"]) + notes
    if eval_est is not None and eval_est.coverage.lower_bound:
        coverage["eval_lower_bound"] = True
    report = Report(
        version=preflight.__version__,
        device=str(target),
        budget_bytes=budget_bytes,
        headroom=options.headroom,
        usable_bytes=usable,
        predicted_peak_bytes=peak,
        predicted_breakdown=breakdown,
        peak_phase=est.peak_phase,
        eval_predicted_peak_bytes=eval_peak,
        eval_predicted_device_total_bytes=None if total is None else eval_total,
        eval_peak_phase=eval_est.peak_phase if eval_est is not None else None,
        worst_case_batch_shape=batch_info.shape if batch_info is not None else _shape(batch),
        worst_case_batch=batch_info.to_dict() if batch_info is not None else None,
        eval_batch_shape=(eval_batch_info.shape if eval_batch_info is not None else _shape(eval_batch))
        if eval_est is not None else None,
        fits=None,
        coverage=coverage,
        precision=precision,
        schedule=schedule.to_dict(),
        run=run.to_dict(),
        predicted_reserved_bytes=est.peak_reserved_bytes,
        predicted_device_total_bytes=total,
        estimate=est,
        eval_estimate=eval_est,
        step_predictor=step_predictor,
        eval_predictor=eval_predictor,
    )
    for what, info in (("training", batch_info), ("evaluation", eval_batch_info)):
        if info is not None and info.failed_samples:
            text = (f"the {what} dataset scan: {failures_text(info.failed_samples, info.failures)}; they were left "
                    "out of the worst-case batch, and training will hit them")
            report.warnings.append(text)
            if talk:
                warnings.warn(f"preflight: {text}", RuntimeWarning, stacklevel=2)
    if est.coverage.lower_bound:
        report.warnings.append("the training step could not be traced: the prediction is a lower bound "
                               f"(operator {est.coverage.failed_op}: {est.coverage.reason})")
    if usable is not None:
        report.fits = report.verdict_bytes <= usable
        if report.fits and (est.coverage.lower_bound or (eval_est is not None and eval_est.coverage.lower_bound)):
            report.fits = None  # a lower bound under the budget says nothing about the real peak
            report.warnings.append("no verdict: the prediction is a lower bound and it is under the budget")
    if report.fits is False and options.suggest and talk and unwrapped:
        with progress("it does not fit: predicting what to change (about ten traces)"):
            advised = run.replace(parallel=sharded if own is not None else options_plan(model, run.parallel))
            report.suggestions = _suggestions(base_model, base_optimizer, batch, step, pinned(advised, target),
                                              options, make_batch, report)
    return report


def options_plan(model: nn.Module, parallel: ParallelPlan | None) -> ParallelPlan | None:
    """The plan the suggestions and the micro-batch search predict each option under: the run's, when it spans
    several ranks (DDP included), unless the strategy has already wrapped the model (then `preflight.estimate`
    reads the plan off the model itself, or there is none to follow). A plan ``preflight check --world-size`` asked
    for takes precedence (the dry run plans for N ranks from one process)."""
    parallel = settings_from_env().run().parallel or parallel
    if parallel is None or parallel.world_size < 2 or already_sharded(model) is not None:
        return None
    return parallel


def _rank_share(eval_est: Estimate, model: nn.Module, plan: ParallelPlan, precision: str | None,
                traced_state: int | None = None) -> tuple[int, int | None]:
    """One rank's evaluation peak (and device total, keeping the single-device figure's allocator and context
    overhead) under a sharded ``plan``: the evaluation breakdown rescaled by category (`per_rank_breakdown`).
    ``traced_state``: the resident optimizer state when it came from the per-rank training trace (already this
    rank's, so not divided again)."""
    from preflight._estimate import deepspeed_terms
    from preflight._target import per_rank_breakdown

    ds = None if plan.deepspeed is None else read_deepspeed_config(dict(plan.deepspeed),
                                                                   hidden_size=hf_hidden_size(model))
    offload = {"offload_optimizer": plan.offload_optimizer, "offload_params": plan.offload_params}
    # DeepSpeed's own terms as training leaves them: ZeRO-3's fp32 partition copy, gradient partitions and
    # persistent / gathered parameters stay through evaluation (without them a ZeRO-3 evaluation was 9% under).
    terms, _ = deepspeed_terms(model, plan.sharding, ds, precision, plan.world_size, offload)
    buffers = terms["zero_buffers"]
    if buffers is not None and buffers.during_backward:  # stages 1 and 2 release them after each backward
        buffers = None
    share, _ = per_rank_breakdown(eval_est.breakdown, model, world_size=plan.world_size, sharding=plan.sharding,
                                  dtype=float_dtype_for(precision), zero_buffers=buffers, zero3=terms["zero3"],
                                  state_scale=terms["state_scale"], **offload)
    if traced_state is not None:
        share["optimizer_state"] = traced_state
    peak = sum(share.values())
    total = eval_est.device_total_bytes
    return peak, None if total is None else total - eval_est.peak_bytes + peak


# How to have preflight choose the micro-batch, for a loop without a trainer (the adapters name their own way).
REMEDY_MAX_BATCH_SIZE = ("Or let preflight choose the micro-batch: preflight.max_batch_size(model, optimizer, "
                         "make_batch, budget=...) gives the largest that fits.")


def decide(report: Report | None, options: Options, *, emit: Callable[[Report], None] | None = None,
           remedy: str = REMEDY_MAX_BATCH_SIZE) -> Report | None:
    """Agree on the verdict across ranks, write and print the report, then end a dry run or raise/warn.

    ``report`` is None on a rank whose prediction failed; that rank still joins the collective, and raises
    with the others if another rank's prediction does not fit. ``emit(report)`` renders extra output (e.g. a
    trainer's logger) on rank zero. ``remedy``: a line of the overflow error saying how to have preflight choose
    the batch size in the caller's setting.
    """
    local_fits = report.fits if report is not None else None
    report, ranks = _agree(report)
    verdicts = [r[2] if r is not None else "failed" for r in ranks]
    if report is not None and is_rank_zero():
        with internal_failures("writing the report"):
            _emit(report, options)
            if emit is not None:
                emit(report)
    failed = any(v == "failed" for v in verdicts)
    # A rank with only a lower bound under the budget (None) is covered by a rank that predicted (True): `_agree`.
    fits = False if False in verdicts else (True if True in verdicts and not failed else None)
    lower_bound = fits is None and report is not None and report.budget_bytes is not None
    if settings_from_env().dry_run:
        code = EXIT_DOES_NOT_FIT if fits is False else (_EXIT_PREDICTION_FAILED if failed else
                                                        EXIT_NO_VERDICT if lower_bound else 0)
        if is_rank_zero():
            verdict = "does not fit" if fits is False else "prediction failed" if failed else \
                "no verdict: the prediction is a lower bound under the budget" if lower_bound else \
                "no budget to compare with" if fits is None else "fits"
            print(f"preflight: dry run (PREFLIGHT_DRY_RUN=1): {verdict}; exiting with status {code} before step "
                  "one.", file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.exit(code)
    if fits is False:
        message = _overflow_message(report, ranks, local_fits, remedy, stops=options.on_overflow == "raise")
        if options.on_overflow == "raise":
            raise PreflightError(message, report=report.to_dict() if report is not None else None)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return report


class VerifySession:
    """Measure the first ``verify_steps`` optimizer steps and fill in the report's measured fields.

    The adapter calls ``step_started(resident)`` before the first forward of an optimizer step,
    ``micro_batch(batch)`` for each further micro-batch of a step that accumulates gradients (where all of them
    are alive from the step's start, as in the HF Trainer), and ``step_ended()``
    after its ``zero_grad``; ``step_ended`` returns True once the last step was measured, after
    which `finish` has run: results are agreed across ranks (a collective: every rank measures the same number
    of steps), written, printed, and warnings emitted. If training ends early, the adapter calls `finish` itself.
    A measurement that fails on one rank is a warning there; the collective still runs.

    Args:
        report: the prediction to compare with (None when it failed: the measurement still runs, for the
            collective, but nothing is reported).
        options: the callback's `Options` (``verify_steps``, output paths).
        device: where training runs.
        extra_resident_bytes: bytes alive during every step that the CPU profiler cannot see because they were
            allocated before it started and no Python tensor points at them (DDP's gradient buckets).
    """

    def __init__(self, report: Report | None, options: Options, device: torch.device,
                 extra_resident_bytes: int = 0) -> None:
        self.report = report
        self.options = options
        self.steps = options.verify_steps
        self.extra = extra_resident_bytes
        self.meter: StepPeakMeter | None = None
        self.done = self._finished = self.steps == 0
        self.ended = 0
        # The shape of each measured step's batch, and a host copy of one batch per shape: after the measured
        # steps, each is predicted as the worst case was, so a step is compared with the prediction for its own
        # batch. Copies, not the batches: holding those would keep them alive into the next measured step.
        self._step_shapes: list[str | None] = []
        self._batches: dict[str, Any] = {}
        self._pending_shape: str | None = None
        # The step's largest micro-batch so far: its elements, and the batch itself when it came after the meter
        # started (copied once the meter has stopped: a copy made inside the window would be measured).
        self._pending_size = -1
        self._pending_batch: Any = None
        # Evaluation batches run inside the measured window, measured apart: (peak, shape key) each.
        self._eval_meter: StepPeakMeter | None = None
        self._eval_peaks: list[tuple[int, str | None]] = []
        self._eval_shape: str | None = None
        with internal_failures("starting verification"):
            self.meter = StepPeakMeter(device)
        self.method = self.meter.method if self.meter is not None else None

    @property
    def active(self) -> bool:
        """Still measuring (the adapter should call the step hooks)."""
        return not self.done

    def step_started(self, resident: Any, batch: Any = None) -> None:
        """A step begins; ``resident`` holds every tensor alive now that the step uses (see `StepPeakMeter`);
        ``batch``, when the adapter has it now, is the step's (first micro-)batch."""
        if self.done or self.meter is None:
            return
        self._pending_shape, self._pending_size, self._pending_batch = self._remember(batch), _elements(batch), None
        ok = False
        with internal_failures("measuring the peak"):
            self.meter.start(resident)
            ok = True
        if not ok:
            self._give_up()

    def micro_batch(self, batch: Any) -> None:
        """A micro-batch of the current step, for an adapter whose step's micro-batches are all alive from its start
        (the HF Trainer fetches them first; the reference kept here changes no lifetime). A step that accumulates
        over micro-batches of different shapes is compared with the prediction for its largest one, at every
        micro-step (an upper bound for that step): the first micro-batch alone under-predicts a step whose later
        micro-batch is longer."""
        if self.done or batch is None:
            return
        size = _elements(batch)
        if size > self._pending_size:
            self._pending_size, self._pending_batch = size, batch

    def step_ended(self, also_resident: Any = None, batch: Any = None) -> bool:
        """Record the step; return True when verification has just finished. ``also_resident``: see
        `StepPeakMeter.stop`; ``batch``: the step's batch, for an adapter that only knows it now."""
        if self.done:
            return False
        if self.meter is not None and self.meter.running:
            ok = False
            with internal_failures("measuring the peak"):
                self.meter.stop(also_resident)
                ok = True
            if not ok:
                self._give_up()
            else:
                self.micro_batch(batch)
                if self._pending_batch is not None:  # the meter has stopped: copying it now is not measured
                    self._pending_shape = self._remember(self._pending_batch)
                self._step_shapes.append(self._pending_shape)
        self._pending_shape, self._pending_size, self._pending_batch = None, -1, None
        self.ended += 1
        if self.ended >= self.steps:
            self.finish()
            return True
        return False

    @untouched()  # after the measured window: the guard's own snapshot must not be inside it
    def finish(self) -> Report | None:
        """Agree on the measured peaks across ranks and update, write and print the report (once)."""
        if self._finished:
            return self.report
        self.done = self._finished = True
        if self.meter is not None:
            self.meter.abort()
        local = None
        if self._eval_meter is not None:
            self._eval_meter.abort()
        if self.meter is not None and self.meter.step_peaks:
            own: list[int | None] = []
            with internal_failures("predicting the measured batches"):
                own = self._own_predictions()
            evals = None
            with internal_failures("predicting the measured evaluation batches"):
                evals = self._eval_comparison()
            local = ([p + self.extra for p in self.meter.step_peaks], list(self.meter.reserved_peaks), own,
                     list(self.meter.step_retained), evals)
        self._batches.clear()
        report = self.report
        # Each rank compares its own measurement with its own prediction (ranks can differ: a rank whose prediction
        # failed has a lower bound), then the comparisons are gathered.
        mine = None
        if report is not None and local is not None:
            with internal_failures("comparing with the measurement"):
                peaks, reserved, own, retained, evals = local
                predicted = self._own_prediction(report)
                result = compare(predicted, peaks, method=self.method, reserved_peaks=reserved,
                                 predicted_step_peaks=own, step_retained=retained)
                mine = (result, evals, bool(report.coverage.get("lower_bound")), predicted)
        everyone = _all_gather(mine)
        gathered = [g for g in everyone if g is not None]
        if report is None or not gathered:
            return report
        report.step_predictor = report.eval_predictor = None  # they hold the model; not needed past verification
        with internal_failures("comparing with the measurement"):
            # The headline: the rank with the largest measured peak among those that predicted (not a lower bound).
            result, evals, _, predicted = max(gathered, key=lambda g: (not g[2], g[0].measured_peak_bytes))
            if len(everyone) > 1:
                report.rank_measured_peak_bytes = [None if g is None else g[0].measured_peak_bytes for g in everyone]
                report.rank_relative_errors = [None if g is None else g[0].relative_error for g in everyone]
            report.measured_peak_bytes = result.measured_peak_bytes
            report.measured_reserved_bytes = result.measured_reserved_bytes
            report.relative_error = result.relative_error
            report.worst_case_headroom = result.worst_case_headroom
            report.steps_measured = result.steps_measured
            report.measured_step_peaks = list(result.step_peaks)
            report.predicted_step_peaks = list(result.predicted_step_peaks)
            report.retained_step_bytes = list(result.step_retained)
            if evals is not None:
                eval_measured, eval_predicted = evals
                report.eval_measured_peak_bytes = eval_measured + self.extra
                report.eval_predicted_measured_bytes = eval_predicted
                report.eval_relative_error = (None if not eval_predicted else
                                              (eval_predicted - report.eval_measured_peak_bytes) /
                                              report.eval_measured_peak_bytes)
            report.verify_method = result.method
            report.warnings.extend(result.warnings)
            if is_rank_zero():
                for message in result.warnings:
                    warnings.warn(f"preflight: {message}", RuntimeWarning, stacklevel=2)
                _emit(report, self.options, verified=True)
                print(summary(predicted, result), flush=True)
        return report

    @staticmethod
    def _own_prediction(report: Report) -> int:
        """This rank's own predicted peak (the report's headline is the maximum over ranks)."""
        peaks = report.rank_predicted_peak_bytes
        own = peaks[_rank()] if peaks and len(peaks) == _world_size() else None
        return report.predicted_peak_bytes if own is None else own

    def eval_started(self, resident: Any, batch: Any) -> None:
        """An evaluation batch begins inside the measured window (between measured training steps)."""
        if self.done or self.meter is None or self.meter.running or \
                (self._eval_meter is not None and self._eval_meter.running):
            return
        ok = False
        with internal_failures("measuring the evaluation peak"):
            self._eval_meter = self._eval_meter or StepPeakMeter(self.meter.device)
            self._eval_shape = self._remember(batch)
            self._eval_meter.start(resident)
            ok = True
        if not ok:
            self._eval_meter = None

    def eval_ended(self) -> None:
        """The evaluation batch started by `eval_started` is done."""
        meter = self._eval_meter
        if meter is None or not meter.running:
            return
        with internal_failures("measuring the evaluation peak"):
            self._eval_peaks.append((meter.stop(), self._eval_shape))

    def _remember(self, batch: Any) -> str | None:
        """The shape key of ``batch``; keep a host copy of the first batch of each shape."""
        if batch is None:
            return None
        key = json.dumps(_shape(batch), default=str)
        if key not in self._batches:
            self._batches[key] = map_tensors(lambda t: t.detach().to("cpu", copy=True), batch)
        return key

    def _eval_comparison(self) -> tuple[int, int | None] | None:
        """The largest measured evaluation batch and the eval prediction for that batch's own shape."""
        if not self._eval_peaks:
            return None
        peak, key = max(self._eval_peaks, key=lambda pair: pair[0])
        predictor = None if self.report is None else self.report.eval_predictor
        predicted = predictor(self._batches[key]) if predictor is not None and key is not None else None
        return peak, predicted

    def _own_predictions(self) -> list[int | None]:
        """For each measured step, the prediction for its own batch's shapes: the first step against the traced
        step 1 (it creates the optimizer state), later steps against the steady state. Traced once per shape."""
        predictor = None if self.report is None else self.report.step_predictor
        if predictor is None or not any(self._step_shapes):
            return []
        per_shape = {}
        for key in dict.fromkeys(k for k in self._step_shapes if k is not None):
            per_shape[key] = predictor(self._batches[key])
        own: list[int | None] = []
        for i, key in enumerate(self._step_shapes, start=1):
            peaks = per_shape.get(key) if key is not None else None
            own.append(peaks.get(min(i, max(peaks))) if peaks else None)
        return own

    def _give_up(self) -> None:
        if self.meter is not None:
            self.meter.abort()
            self.meter.step_peaks.clear()
        self.meter = None


def training_state(model: nn.Module, optimizers: Any) -> list[Any]:
    """Every tensor of the training state alive between steps, for `VerifySession`'s resident bytes: the model's
    parameters, buffers and gradients, the optimizers' state, and what DeepSpeed holds beside them
    (`preflight.parallel.held_tensors`: ZeRO-3's partitions, its ZeRO optimizer's flat buffers)."""
    optimizers = [o for o in optimizers if o is not None]
    return [list(model.parameters()), list(model.buffers()), [p.grad for p in model.parameters() if p.grad is not None],
            [list(s.values()) for o in optimizers for s in o.state.values()],
            [held_tensors(model, o) for o in optimizers]]


def _elements(batch: Any) -> int:
    """Elements in ``batch``'s tensors (-1 for no batch): which micro-batch of a step is the largest."""
    return -1 if batch is None else sum(t.numel() for t in iter_tensors(batch))


# ---- policies ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def internal_failures(what: str, reraise: tuple[type[BaseException], ...] = (),
                      reasons: list[str] | None = None) -> Iterator[None]:
    """Turn an exception inside preflight (not a `PreflightError`, nor one of ``reraise``) into a warning: training
    must not stop for us. ``reasons``, when given, gets the failure's one-line reason. An exception of the user's own
    code that a trace re-raised as such (`preflight.trace.blamed_on_user`) is re-raised: not ours to swallow, and the
    real first step raises it too."""
    try:
        yield
    except StepWouldFailError as err:  # the real step would raise too: say why, before it (a dry run exits 5)
        finish_failed_step(str(err))
        raise
    except (PreflightError, *reraise):
        raise
    except Exception as err:  # noqa: BLE001 - the policy: preflight never breaks a training run by its own failure
        if blamed_on_user(err):
            raise
        reason = f"{type(err).__name__}: {err}".splitlines()[0][:500]
        if reasons is not None:
            reasons.append(reason)
        warnings.warn(f"preflight: {what} failed and was skipped; training proceeds. Reason: {reason}",
                      RuntimeWarning, stacklevel=3)


def predict_or_lower_bound(predict_run: Callable[[], Report], model: nn.Module, optimizer: torch.optim.Optimizer,
                           options: Options, run: Run, *, device: torch.device) -> Report | None:
    """``run()`` (an adapter's prediction); if it fails inside preflight, a warning and `lower_bound_report`
    instead, so that under ``torch.distributed`` this rank still takes part in the verdict (as a labelled lower
    bound) and measures its own steps. None only if the lower bound fails too."""
    reasons: list[str] = []
    with internal_failures("the prediction", reasons=reasons):
        return predict_run()
    with internal_failures("the lower bound after a failed prediction"):
        return lower_bound_report(model, optimizer, options, run, device=device, reason=reasons[0])
    return None


def lower_bound_report(model: nn.Module, optimizer: torch.optim.Optimizer, options: Options, run: Run, *,
                       device: torch.device, reason: str) -> Report:
    """The report of a rank whose prediction failed: parameters + buffers + gradients + optimizer state in closed
    form (`preflight._analytic.model_state`), or under DeepSpeed what it holds on the rank now (its partitions and
    its optimizer's flat buffers, measured), labelled a lower bound (``coverage.lower_bound``), with the reason."""
    import preflight
    from preflight._analytic import model_state

    options, settings = _with_environment(options)
    run = settings.run().over(run)
    precision = run.precision
    target = resolve_device(device, model)
    budget_bytes = run_budget(run, model, required=False)
    usable = usable_bytes(budget_bytes, options.headroom) if budget_bytes is not None else None
    held = held_tensors(model, optimizer)
    if held:  # DeepSpeed's: what it holds on this rank now, measured (its partitions; its optimizer's flat buffers)
        partitions = {id(getattr(p, "ds_tensor", None)) for p in model.parameters()}
        own = [t for t in held if id(t) in partitions]
        parameters = live_storage_bytes([list(model.parameters()), own], target)
        breakdown = {"parameters": parameters, "buffers": live_storage_bytes(list(model.buffers()), target),
                     "gradients": 0, "optimizer_state": live_storage_bytes([held, list(model.parameters())], target)
                     - parameters}
    else:
        state = model_state(model, optimizer, None, target, param_dtype=float_dtype_for(precision))
        breakdown = {"parameters": state.parameters, "buffers": state.buffers, "gradients": state.gradients,
                     "optimizer_state": state.optimizer_state or 0}
    peak = sum(breakdown.values())
    report = Report(
        version=preflight.__version__, device=str(target), budget_bytes=budget_bytes, headroom=options.headroom,
        usable_bytes=usable, predicted_peak_bytes=peak, predicted_breakdown=breakdown, peak_phase="unknown",
        eval_predicted_peak_bytes=None, eval_peak_phase=None, worst_case_batch_shape=None, worst_case_batch=None,
        eval_batch_shape=None, fits=None if usable is None or peak <= usable else False,
        coverage={"traced": False, "lower_bound": True, "failed_op": None, "reason": f"the prediction failed: {reason}",
                  "notes": []},
        precision=precision, schedule={}, run=run.to_dict())
    report.warnings.append(f"the prediction failed on this rank ({reason}): its figure is a lower bound (parameters, "
                           "buffers, gradients and optimizer state, without activations or the batch)")
    return report


def _with_environment(options: Options) -> tuple[Options, Any]:
    """``options`` with the headroom ``preflight check`` asked for through the environment (`preflight._dryrun`),
    and those settings (`DryRunSettings.run` gives what they say of the run)."""
    settings = settings_from_env()
    if settings.headroom is not None:
        options = dataclasses.replace(options, headroom=settings.headroom)
    return options, settings


def _overflow_message(report: Report | None, ranks: list[tuple | None], local_fits: bool | None,
                      remedy: str = REMEDY_MAX_BATCH_SIZE, *, stops: bool = True) -> str:
    """The overflow verdict in words; ``stops``: the run is stopped (``on_overflow="raise"``), else it trains on."""
    if report is None or local_fits is not False:  # another rank does not fit: say which, with its numbers
        over = [(i, r) for i, r in enumerate(ranks) if r is not None and r[2] is False]
        outcome = "so no rank trains" if stops else "training goes on (on_overflow='warn')"
        lines = [f"preflight: {len(over)} of {len(ranks)} ranks are predicted not to fit, {outcome}:"]
        lines += [f"  rank {i}: {format_bytes(max(r[0], r[1] or 0))} over its usable {format_bytes(r[3])}"
                  for i, r in over]
        if report is not None:
            peaks = report.rank_predicted_peak_bytes
            own = peaks[_rank()] if peaks else report.predicted_peak_bytes
            lines.append(f"  this rank: {format_bytes(own)} (usable {format_bytes(report.usable_bytes)})")
        lines.append(f"  See rank {over[0][0]}'s error for what to change. Set on_overflow='warn' to train anyway.")
        return "\n".join(lines)
    training_need = report.predicted_device_total_bytes or report.predicted_peak_bytes
    lines = [
        f"preflight: the run is predicted to need {format_bytes(report.verdict_bytes)} per device "
        f"({'evaluation' if report.verdict_bytes > training_need else 'training'} peak), over the usable "
        f"{format_bytes(report.usable_bytes)} (budget {format_bytes(report.budget_bytes)} "
        f"minus {report.headroom:.0%} headroom) on {report.device}.",
        f"  training step: {format_bytes(report.predicted_peak_bytes)} at {report.peak_phase}; "
        + ", ".join(f"{k} {format_bytes(v)}" for k, v in report.predicted_breakdown.items() if v),
    ]
    if report.eval_predicted_peak_bytes is not None:
        lines.append(f"  evaluation step: {format_bytes(report.eval_predicted_peak_bytes)}")
    if report.worst_case_batch_shape is not None:  # None: the prediction failed before a batch was traced
        lines.append(f"  worst-case batch: {report.worst_case_batch_shape}")
    if report.suggestions:
        lines.append("  What to change (predicted peak with the change):")
        for s in report.suggestions[:_TOP_SUGGESTIONS]:
            lines.append(f"    - {'fits' if s['fits'] else 'still over'}: {s['description']}")
    else:
        lines.append("  What to change: a smaller micro-batch with gradient accumulation, activation checkpointing, "
                     "bf16 mixed precision, an 8-bit optimizer or LoRA; preflight.advise(...) predicts each.")
    lines.append(f"  {remedy}")
    if stops:
        lines.append("  Nothing was trained. Set on_overflow='warn' to train anyway, or a larger `budget`.")
    else:
        lines.append("  Training goes on, as on_overflow='warn' asks: expect an out-of-memory error on the device "
                     "unless one of these changes is made.")
    return "\n".join(lines)


def _suggestions(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, step: StepFn | None, run: Run,
                 options: Options, make_batch: Callable[[int], Any] | None, report: Report) -> list[dict[str, Any]]:
    try:
        from preflight._advise import advise
    except ImportError:
        return []
    run = run.replace(target=dataclasses.replace(run.target, budget=report.budget_bytes))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # options advise leaves out are not the user's concern here
            found = advise(model, optimizer, batch, run, step=step, make_batch=make_batch, headroom=options.headroom)
    except Exception as err:  # noqa: BLE001 - advice is optional: the verdict stands without it
        report.warnings.append(f"no suggestions: {type(err).__name__}: {err}".splitlines()[0][:300])
        return []
    return [s.to_dict() for s in found]


def _emit(report: Report, options: Options, *, verified: bool = False) -> None:
    from preflight._console import print_report

    if options.report_path is not None:
        report.write(options.report_path)
    requested = settings_from_env().report_path  # `preflight check` reads the report back from here
    if requested is not None and requested != options.report_path:
        report.write(requested)
    print_report(report, verified=verified)
    if options.plot_path is not None:
        from preflight._plot import plot_report

        plot_report(report, options.plot_path)


def _without_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A shallow copy of ``optimizer`` with an empty ``state``, for tracing a first step again. The original is
    never written: the copy gets its own ``state`` in its instance dict (a wrapper whose ``state`` is a property
    keeps reading its inner optimizer's)."""
    fresh = object.__new__(type(optimizer))
    fresh.__dict__.update(optimizer.__dict__)
    fresh.__dict__["state"] = collections.defaultdict(dict)
    return fresh


# ---- numbers -------------------------------------------------------------------------------------------------


def _gradient_bytes(model: nn.Module, precision: str | None) -> int:
    dtype = float_dtype_for(precision)
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    return sum(p.numel() * (dtype.itemsize if dtype is not None and p.is_floating_point() else p.element_size())
               for p in params)


def ddp_bucket_bytes(wrapped: Any) -> int:
    """Bytes of DDP's gradient buckets, a flat copy of every trainable parameter's gradient allocated at
    construction and kept for the whole run, when ``wrapped`` is a ``DistributedDataParallel``; else 0.

    With ``gradient_as_bucket_view=True`` the buckets are there all the same (the gradients become views into them
    after DDP copies each one in): a 2-rank gloo run of `benchmarks/distributed.py`'s Llama peaked at 240,806,308 B
    with and without it, 33,563,648 B (the buckets) over the replica's trace, because its peak comes early in
    backward, before the gradients add up. The replica's trace plus the buckets is exact there and an upper bound
    where the peak holds the gradients (`preflight.estimate(..., sharding="ddp", gradient_as_bucket_view=True)`
    times each gradient's life)."""
    if not isinstance(wrapped, nn.parallel.DistributedDataParallel):
        return 0
    return _gradient_bytes(wrapped.module, None)


def eval_resident(model: nn.Module, optimizer: torch.optim.Optimizer, *, precision: str | None, schedule: Loop,
                  ddp_gradient_buckets: bool = False, estimate: Estimate | None = None,
                  frees_gradients: bool = False) -> dict[str, int]:
    """Training state alive during evaluation inside training: the optimizer state (closed form when the optimizer
    is known, else the traced training breakdown's), the last step's gradients when the trainer frees them only at
    the next backward and not before evaluating (``frees_gradients``: Lightning's default
    ``on_validation_model_zero_grad`` releases them), and DDP's buckets."""
    state = optimizer_state_bytes(optimizer, param_dtype=float_dtype_for(precision))
    if state is None:
        state = estimate.breakdown.get("optimizer_state", 0) if estimate is not None else 0
    grads = _gradient_bytes(model, precision)
    kept = grads if schedule.zero_grad != "after_step" and not frees_gradients else 0
    return {"optimizer_state": state, "gradients": kept + (grads if ddp_gradient_buckets else 0)}


def _shape(batch: Any) -> Any:
    from preflight._batches import batch_shape

    return batch_shape(batch) if batch is not None else None


# ---- ranks ---------------------------------------------------------------------------------------------------


def _distributed() -> Any:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _world_size() -> int:
    dist = _distributed()
    return dist.get_world_size() if dist is not None else 1


def _rank() -> int:
    dist = _distributed()
    return dist.get_rank() if dist is not None else 0


def is_rank_zero() -> bool:
    """Rank zero of ``torch.distributed`` (True when not distributed)."""
    dist = _distributed()
    return dist is None or dist.get_rank() == 0


def _all_gather(value: Any) -> list[Any]:
    dist = _distributed()
    if dist is None:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _agree(report: Report | None) -> tuple[Report | None, list[tuple | None]]:
    """Every rank's ``(peak, eval peak, fits, usable, lower bound)`` (None where even the lower bound failed); the
    report updated with the maximum over ranks. ``fits``: False if any rank does not fit (a lower bound over the
    budget included), else True if a rank that predicted fits (a rank whose prediction failed, with a lower bound
    under the budget, runs the same model on the same worst-case batch), else None."""
    local = None if report is None else (report.predicted_peak_bytes, report.eval_predicted_peak_bytes, report.fits,
                                         report.usable_bytes, bool(report.coverage.get("lower_bound")))
    gathered = _all_gather(local)
    verdicts = [g[2] if g is not None else "failed" for g in gathered]
    if report is not None and len(gathered) > 1:
        peaks = [g[0] if g is not None else None for g in gathered]
        eval_peaks = [g[1] for g in gathered if g is not None and g[1] is not None]
        report.world_size = len(gathered)
        report.rank_predicted_peak_bytes = peaks
        report.rank_lower_bound = [g[4] if g is not None else None for g in gathered]
        report.predicted_peak_bytes = max(p for p in peaks if p is not None)
        if eval_peaks:
            report.eval_predicted_peak_bytes = max(eval_peaks)
        if report.usable_bytes is not None:
            over = report.verdict_bytes > report.usable_bytes or False in verdicts
            report.fits = False if over else (True if True in verdicts else None)
        bounded = [i for i, g in enumerate(gathered) if g is not None and g[4]]
        if bounded and len(bounded) < len(gathered):
            report.warnings.append(f"rank(s) {', '.join(map(str, bounded))}: the figure is a lower bound (the "
                                   "prediction failed there, or could not trace); the verdict uses the ranks that "
                                   "predicted")
    return report, gathered
