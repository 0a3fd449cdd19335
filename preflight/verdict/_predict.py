"""`predict`: one rank's training (and evaluation) peak under the run's description, compared with the budget, as a
`preflight.report.Report`; no collectives. Also the training state alive during evaluation (`eval_resident`), DDP's
buckets, and the labelled lower bound of a rank whose prediction failed (`lower_bound_report`)."""

from __future__ import annotations

import collections
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from preflight._warnings import warn
from preflight._batches import BatchInfo, failures_text
from preflight._budget import usable_bytes
from preflight.report._console import progress
from preflight._device import live_storage_bytes, live_storages, resolve_device
from preflight._dryrun import settings_from_env
from preflight._analytic import optimizer_state_bytes
from preflight._estimate import _allocator_config, estimate, estimate_evaluating, read_plan_off_ddp
from preflight.parallel._deepspeed import deepspeed_precision, deepspeed_terms
from preflight._sharding import hf_hidden_size, read_deepspeed_config
from preflight._eval import EvalStepFn, estimate_eval
from preflight._eval_loop import EvalLoop
from preflight._optimizer_group import STANDS_FOR, OptimizerGroup, stands_for
from preflight._result import Category, Estimate, PhaseEstimate
from preflight._run import Run, check_run, pinned, run_budget
from preflight._steps import Evaluation, Loop, StepFn
from preflight._units import format_bytes
from preflight._version import __version__
from preflight.cuda import WORKSPACE_UIDS
from preflight.cuda._nccl import rank_nccl_buffers
from preflight.parallel import ParallelPlan, already_sharded, read_ddp, read_fsdp1, read_fsdp2, read_zero, zero_plan
from preflight.parallel import held_tensors, read_ep, read_tp, stand_in
from preflight.parallel._pipeline import read_pp
from preflight.trace import float_dtype_for, gradients_held_by

from preflight.advice import Suggestion, batch_size_of, fewer_kept_batches, ranking, resize_batch
from preflight.advice import moving_every_batch, smaller_eval_batch, with_evaluation
from preflight.report._report import Report
from preflight.verdict._options import Options
from preflight.verdict._ranks import _rank, _world_size, internal_failures, is_rank_zero
__all__ = ["ddp_bucket_bytes", "eval_resident", "held_module_bytes", "lower_bound_report", "options_plan", "predict",
           "predict_or_lower_bound"]


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
    eval_keeps_batch: bool = False,
    sample_batches: Callable[[int], list[Any]] | None = None,
    held: tuple[int, str] | None = None,
) -> Report:
    """Predict this rank's training (and evaluation) peak and compare it with the budget. No collectives, except
    for a pipeline schedule of a running job, whose estimate exchanges its stages' shapes and figures with every
    rank (`preflight.parallel._pipeline.read_pp`).

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
        eval_keeps_batch: the trainer evaluates while the last optimizer step's micro-batches are still alive (the
            HF Trainer evaluates and saves inside its loop over them): ``batch`` x accumulation is resident then.
        sample_batches: ``sample_batches(n)`` draws ``n`` training batches from the dataset, for the run's
            ``loop.sampled_steps`` (`preflight.sample_batches`).
        held: ``(bytes, what)``: device memory the trainer keeps for the whole run outside the model, the
            optimizer and the batch (`held_module_bytes`: the averaged copy a weight-averaging callback keeps),
            counted, not traced: added to training, evaluation and saving as parameters.

    Returns:
        A `Report`. When the run does not fit and this is rank zero, its ``suggestions`` hold the ranked output
        of `preflight.advice.advise` (left empty, with a warning in the report, when advice fails).
    """
    options, settings = _with_environment(options)
    asked = settings.run()  # `preflight check --gpu/--budget/--world-size/--sharding/--full`: laid over the run
    from_env = asked.parallel is not None
    run = asked.over(check_run(run))
    ddp_note = None
    wrapper = read_ddp(model)
    if from_env and wrapper is not None:  # a dry run plans the ranks asked for, whatever wraps it here
        model = wrapper[0]
    elif wrapper is not None:  # a DDP model is its own plan: buckets counted per rank by the estimate
        model, run, ddp_note = read_plan_off_ddp(model, run)
    # A pipeline schedule built inside the job: `estimate` traces this rank's own stages, exchanging their shapes with
    # the other ranks, so every estimate of it must run on every rank at once: the training step alone is predicted
    # (no evaluation, suggestions or re-prediction on one rank).
    job = read_pp(model)
    if job is not None:
        if from_env:
            raise ValueError("`preflight check` plans the ranks it is asked for, but the model is a pipeline schedule "
                             "already cut in this job: run the dry run on the script before it cuts the model.")
        schedule_object, model = model, job.modules
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
    wrapped = already_sharded(model) if job is None else None  # a job's pipeline: `estimate` reads its stages
    # A model FSDP already wrapped (fully_shard, or FullyShardedDataParallel: Lightning's FSDPStrategy, accelerate)
    # has its own plan: `estimate` reads it and traces each rank on a copy. A ValueError says what is not followed.
    # A model DTensor's tensor parallelism laid out (alone, or then wrapped by fully_shard): `estimate` reads its layout
    # and traces each rank, its evaluation after the steps, and each suggestion on the model as laid out.
    # A model transformers laid out with expert parallelism: `estimate` reads its plan from its config, the same.
    spread = read_ep(model) if wrapped is not None else None
    laid_out = read_tp(model) if wrapped is not None and spread is None else None
    fsdp2 = read_fsdp2(model) if wrapped is not None and laid_out is None and spread is None else None
    fsdp1 = read_fsdp1(model) if wrapped is not None and fsdp2 is None and laid_out is None and spread is None \
        else None
    engine = "fully_shard" if fsdp2 is not None else "FullyShardedDataParallel"
    own = fsdp2 or fsdp1
    if fsdp2 is not None:
        sharded = ParallelPlan(fsdp2.world_size, "fsdp2", source="the model's fully_shard", fsdp=fsdp2.plan)
        estimate_run = run.replace(parallel=None)
    elif fsdp1 is not None:
        sharded = ParallelPlan(fsdp1.world_size, fsdp1.sharding, source="the model's FullyShardedDataParallel",
                               fsdp=fsdp1.plan)
        estimate_run = run.replace(parallel=None)
    elif laid_out is not None or spread is not None:
        sharded, estimate_run = None, run.replace(parallel=None)
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
    estimate_run = pinned(estimate_run, target)
    # A model laid out by tensor or expert parallelism evaluates on its own shards: its evaluation is traced per
    # rank after the training steps, on the same fake ranks.
    evaluation = None
    if (laid_out is not None or spread is not None) and options.check_eval and eval_batch is not None:
        evaluation = Evaluation(eval_batch, eval_step, frees_gradients=eval_frees_gradients,
                                keeps_batch=eval_keeps_batch)

    # The gradients held now, when the run begins: a step traced again after the real steps starts with these, not
    # with those the real steps left.
    held_at_start = [p for p in model.parameters() if p.grad is not None]

    def run_estimate(b: Any, opt: torch.optim.Optimizer = optimizer, evaluated: Evaluation | None = None,
                     held: list[torch.Tensor] | None = None) -> Estimate:
        with gradients_held_by(held_at_start if held is None else held):
            if job is not None:
                return estimate(schedule_object, opt, b, estimate_run, step=step)
            if evaluated is not None:
                return estimate_evaluating(model, opt, b, estimate_run, step=step, evaluation=evaluated)
            return estimate(model, opt, b, estimate_run, step=step)

    def step_predictor(b: Any, resumed: bool = False) -> dict[int, int]:
        # After the measured steps the optimizer has state; the measured run's first step had none. ``resumed``: a
        # step that begins with the optimizer's state and no gradients (a trainer freed them to evaluate): the
        # traced step 1 of the optimizer as the measured steps left it, without gradients.
        # Under a per-rank trace inside a job, this rank's own steps (its shards may differ from the peak rank's).
        one = run_estimate(b, optimizer, held=[]) if resumed else run_estimate(b, _without_state(optimizer))
        rank = _traced_rank(one.per_rank_peak_bytes)
        # On a CUDA target, what max_memory_allocated will read: the allocator's blocks, not the tensors' bytes.
        peaks = one.step_allocated_peaks(rank, _allocator_config(estimate_run.target.allocator))
        return {k: v + buckets + kept for k, v in (one.step_peaks(rank) if peaks is None else peaks).items()}

    talk = is_rank_zero()  # a trace takes seconds (11 s on a 7B model): say so, as the CLI does
    with progress("tracing the training step on fake tensors" + (" and the evaluation after it" if evaluation
                                                                  else ""), enabled=talk):
        est = run_estimate(batch, evaluated=evaluation)
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
    if schedule.sampled_steps and sample_batches is not None and total is not None and job is None:
        total = _over_sampled_steps(model, optimizer, step, estimate_run, est, total, sample_batches(
            schedule.sampled_steps), notes, talk)
    if buckets:
        peak += buckets
        total = None if total is None else total + buckets
        breakdown["gradients"] += buckets
        notes.append(f"DDP gradient buckets ({format_bytes(buckets)}, a copy of every gradient) added as gradients")
    kept = held[0] if held else 0
    if kept:
        peak += kept
        total = None if total is None else total + kept
        breakdown["parameters"] = breakdown.get("parameters", 0) + kept
        notes.append(f"{held[1]}: {format_bytes(kept)} on the device for the whole run, counted as parameters (not "
                     "traced: its updates are assumed to allocate nothing, as an in-place average does)")
    # The replicas' communicator: its NCCL buffers in the device total, as `estimate` counts them for a DDP plan.
    replicas_nccl = _replicas_nccl(run) if buckets and total is not None else None
    if replicas_nccl is not None:
        total += replicas_nccl[0]
        notes.append(f"{replicas_nccl[1]} (the trainer's DDP replicas' process group)")

    # A model FSDP already wrapped: its evaluation step and the suggestions' options run on its unwrapped meta copy
    # (`preflight.parallel.stand_in`), rescaled to the rank or traced per rank under its own plan.
    base_model, base_optimizer, unwrapped = model, optimizer, job is None
    if job is not None:
        notes.append("a pipeline read off the job: its training step predicted on every rank at once; "
                     + ("no evaluation peak, " if options.check_eval and eval_batch is not None else "")
                     + "no suggestions and no re-prediction after the measured steps (each would have to run on "
                     "every rank at the same time); plan the pipeline on the whole model (`PPPlan`) for those")
    traced_eval = _rank_evaluation(est, evaluation, schedule, batch, target, notes)
    if laid_out is not None:
        unwrapped = False
        notes.append(f"{laid_out.note()}; " + ("evaluation traced on each rank after the training steps"
                                               if traced_eval is not None else "no evaluation peak"))
    if spread is not None:
        unwrapped = False
        notes.append(f"the model was laid out by transformers' expert parallelism ({spread.describe()}); "
                     + ("evaluation traced on each rank after the training steps; " if traced_eval is not None
                        else "no evaluation peak; ")
                     + "suggestions traced on the model as it is laid out")
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
        if eval_keeps_batch:
            resident["inputs"] = resident.get("inputs", 0) + schedule.accumulate * live_storage_bytes(batch, target)
        if kept:
            resident["parameters"] = resident.get("parameters", 0) + kept
        # The plan the training estimate counted NCCL's communicators for (a strategy's DDP replicas, traced as one
        # device, have theirs added above): evaluation keeps the same buffers.
        eval_run = pinned(run.replace(parallel=estimate_run.parallel or sharded or (
            run.parallel if replicas_nccl is not None else None)), target)
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

        if eval_run.evaluation is not None and eval_run.evaluation.kept_batches > 1:
            eval_predictor = None  # noqa: F811
            notes.append("evaluation batches measured while verifying are not compared with a prediction: each "
                         "batch's measurement starts at its forward and does not see the outputs the evaluation loop "
                         "kept from earlier batches, which the evaluation peak counts")

    eval_peak = eval_total = None
    if traced_eval is not None:
        eval_peak, eval_total = traced_eval.peak_bytes, traced_eval.device_total_bytes

        def eval_predictor(b: Any) -> int:  # noqa: F811 - this rank's evaluation of another batch, traced again
            again = _rank_evaluation(run_estimate(batch, _without_state(optimizer), dataclasses.replace(
                evaluation, batch=b)), evaluation, schedule, batch, target, [])
            if again is None:
                raise RuntimeError("the evaluation could not be traced again")
            mine = _traced_rank(again.per_rank_peak_bytes)
            return again.peak_bytes if mine is None else again.per_rank_peak_bytes[mine]
    if eval_est is not None:
        eval_peak, eval_total = eval_figures(eval_est)
        notes.extend(f"evaluation: {n}" for n in eval_est.coverage.notes
                     if n.startswith(("generation:", "kept outputs:")))
        if sharded is not None:
            notes.append("evaluation peak: this rank's share of the single-device evaluation trace, rescaled by "
                         "category (optimizer state, gradients and parameters as the plan shards them)")
    coverage = est.coverage.to_dict()
    coverage["notes"] = list(coverage["notes"]) + notes
    if eval_est is not None and eval_est.coverage.lower_bound:
        coverage["eval_lower_bound"] = True
    report = Report(
        version=__version__,
        device=str(target),
        budget_bytes=budget_bytes,
        headroom=options.headroom,
        usable_bytes=usable,
        predicted_peak_bytes=peak,
        predicted_breakdown=breakdown,
        peak_phase=est.peak_phase,
        eval_predicted_peak_bytes=eval_peak,
        eval_predicted_device_total_bytes=None if total is None else eval_total,
        eval_peak_phase=eval_est.peak_phase if eval_est is not None else (
            traced_eval.where if traced_eval is not None else None),
        worst_case_batch_shape=batch_info.shape if batch_info is not None else _shape(batch),
        worst_case_batch=batch_info.to_dict() if batch_info is not None else None,
        eval_batch_shape=(eval_batch_info.shape if eval_batch_info is not None else _shape(eval_batch))
        if eval_est is not None or traced_eval is not None else None,
        fits=None,
        coverage=coverage,
        precision=precision,
        schedule=schedule.to_dict(),
        run=run.to_dict(),
        predicted_reserved_bytes=est.peak_reserved_bytes,
        predicted_allocated_bytes=est.peak_allocated_bytes,
        predicted_device_total_bytes=total,
        estimate=est,
        eval_estimate=eval_est,
        step_predictor=step_predictor if job is None else None,
        eval_predictor=eval_predictor,
    )
    report.phases = _phases(est, peak, total, eval_est, eval_peak, eval_total, buckets,
                            0 if replicas_nccl is None else replicas_nccl[0], traced_eval, kept)
    for what, info in (("training", batch_info), ("evaluation", eval_batch_info)):
        if info is not None and info.failed_samples:
            text = (f"the {what} dataset scan: {failures_text(info.failed_samples, info.failures)}; they were left "
                    "out of the worst-case batch, and training will hit them")
            report.warnings.append(text)
            if talk:
                warn(f"preflight: {text}", RuntimeWarning)
    if est.coverage.lower_bound:
        report.warnings.append("the training step could not be traced: the prediction is a lower bound "
                               f"(operator {est.coverage.failed_op}: {est.coverage.reason})")
    if usable is not None:
        report.fits = report.verdict_bytes <= usable
        if report.fits and (est.coverage.lower_bound or (eval_est is not None and eval_est.coverage.lower_bound)):
            report.fits = None  # a lower bound under the budget says nothing about the real peak
            report.warnings.append("no verdict: the prediction is a lower bound and it is under the budget")
    # A laid-out model's options are traced on the model as it is laid out (`estimate` reads the layout each time).
    if report.fits is False and options.suggest and talk and (unwrapped or laid_out is not None or
                                                              spread is not None):
        needs = report.phase_needs()
        evaluation_need, rest = needs.pop("evaluation"), max(needs.values())
        fixes: list[tuple[Suggestion, int]] = []
        size = batch_size_of(eval_batch) if eval_est is not None else None

        def evaluate(loop: EvalLoop | None, b: int | None = None, precision: str | None = run.precision) -> int:
            # The evaluation's need as the verdict compares it, traced again: with ``loop``, on ``b`` samples, under
            # ``precision``.
            one = estimate_eval(base_model, eval_batch if b in (None, size) else resize_batch(eval_batch, b),
                                eval_run.replace(precision=precision, evaluation=loop), step=eval_step,
                                resident=resident)
            figure, device_total = eval_figures(one)
            return (device_total if total is not None else None) or figure

        def retraced(s: Suggestion, fix: Suggestion | None) -> int | None:
            # Autocast with its cache (the HF Trainer's) keeps a low-precision copy of each weight an evaluation
            # uses: a change to mixed precision can raise the evaluation, which is traced again with it (and with
            # the evaluation change made with it).
            if s.run.precision == run.precision or not str(s.run.precision).endswith("-mixed"):
                return None
            if fix is None:
                return evaluate(eval_run.evaluation, precision=s.run.precision)
            return evaluate(fix.run.evaluation, fix.change.get("eval_batch_size"), s.run.precision)

        if eval_est is not None and usable is not None and evaluation_need > usable:
            with progress("the evaluation does not fit: predicting what to change in it"):
                fixes = _evaluation_fixes(evaluate, run, size, usable, rest, report)
        # The cheapest evaluation change that fits, else the one that lowers it most, is made with training changes.
        fix = next((f for f in fixes if f[1] <= usable), min(fixes, key=lambda f: f[1], default=None))
        found = [f[0] for f in fixes]
        if rest > usable or not any(s.fits for s in found):
            with progress("it does not fit: predicting what to change (about ten traces)"):
                advised = run.replace(parallel=sharded if own is not None else options_plan(model, run.parallel))
                found += with_evaluation(_suggestions(base_model, base_optimizer, batch, step,
                                                      pinned(advised, target), options, make_batch, report),
                                         evaluation=evaluation_need, fix=fix, limit=usable,
                                         retraced=retraced if eval_est is not None else None)
        report.suggestions = [s.to_dict() for s in sorted(found, key=ranking)]
    return report


def _evaluation_fixes(evaluate: Callable[..., int], run: Run, size: int | None, usable: int, rest: int,
                      report: Report) -> list[tuple[Suggestion, int]]:
    """For a run whose evaluation is over: fewer kept batches where the loop keeps predictions
    (`preflight.advice.fewer_kept_batches`), then, where one kept batch is still over or nothing is kept, a smaller
    evaluation batch (`smaller_eval_batch`; with the predictions moved off after every batch where the loop keeps
    them), each with its evaluation's need. An evaluation trace that fails leaves a
    warning in the report; the other suggestions stand."""
    fixes: list[tuple[Suggestion, int]] = []
    try:
        kept = fewer_kept_batches(evaluate, run, limit=usable, others=rest)
        if kept is not None:
            fixes.append(kept)
        if size is not None and (kept is None or kept[1] > usable):
            # Where the loop keeps every batch's predictions, smaller batches keep the same samples' outputs: they
            # are made with the predictions moved off after every batch.
            stub = kept[0] if kept is not None else moving_every_batch(run)
            smaller = smaller_eval_batch(evaluate, run, size, kept=stub, limit=usable, others=rest)
            if smaller is not None:
                fixes.append(smaller)
    except Exception as err:  # noqa: BLE001 - advice is optional: the verdict stands without it
        report.warnings.append(f"no evaluation suggestion: {type(err).__name__}: {err}".splitlines()[0][:300])
    return fixes


def _over_sampled_steps(model: nn.Module, optimizer: torch.optim.Optimizer, step: StepFn | None, run: Run,
                        est: Estimate, total: int, batches: list[Any], notes: list[str], talk: bool) -> int:
    """The training device total with the reserved memory of steps over ``batches`` (`preflight.estimate_steps`),
    where it is larger than the worst case's: an epoch of varying lengths fragments the allocator's cache. One
    device only; a failure here leaves the worst case's figure, with a note."""
    from preflight._epoch import estimate_steps

    if run.world_size > 1:
        notes.append("loop.sampled_steps: reserved memory over sampled steps is simulated for one device only; the "
                     "worst case's stands")
        return total
    try:
        with progress(f"tracing {len(batches)} steps over batches drawn from the dataset", enabled=talk):
            series = estimate_steps(model, optimizer, batches, run, step=step)
    except Exception as err:  # noqa: BLE001 - the worst case's figure stands without it
        notes.append(f"loop.sampled_steps: the sampled steps could not be traced ({type(err).__name__}: {err})"
                     .splitlines()[0][:300])
        return total
    grown = max(0, series.peak_reserved_bytes - (est.peak_reserved_bytes or 0))
    notes.append(f"reserved memory over {len(batches)} steps of batches drawn from the dataset: "
                 f"{format_bytes(series.peak_reserved_bytes)} (last grew in step {series.stopped_growing_at}), "
                 f"{format_bytes(grown)} over the worst case's two steps" + ("; added to the device total" if grown
                                                                             else ""))
    return total + grown


def _phases(est: Estimate, peak: int, total: int | None, eval_est: Estimate | None, eval_peak: int | None,
            eval_total: int | None, buckets: int, nccl: int = 0,
            traced_eval: PhaseEstimate | None = None, held: int = 0) -> list[dict[str, Any]]:
    """The report's phases: training, evaluation where predicted (``traced_eval``: traced per rank after the
    steps), the loading where the run describes it and the checkpoint save where the run saves (DDP's buckets,
    alive for the whole run from its wrapping, added to each as to training, and their communicator's ``nccl`` bytes
    to its device total; ``held``, what the trainer keeps beside the model from before the first step, to the
    save)."""
    how = "labelled lower bound" if est.coverage.lower_bound else "traced"
    phases = [{"name": "training", "peak_bytes": peak, "required_bytes": total if total is not None else peak,
               "where": est.peak_phase, "how": how, "per_rank_peak_bytes": _listed(est.per_rank_peak_bytes)}]
    if traced_eval is not None:
        phases.append({"name": "evaluation", "peak_bytes": traced_eval.peak_bytes,
                       "required_bytes": traced_eval.required_bytes, "where": traced_eval.where, "how": "traced",
                       "per_rank_peak_bytes": _listed(traced_eval.per_rank_peak_bytes)})
    if eval_est is not None and eval_peak is not None:
        phases.append({"name": "evaluation", "peak_bytes": eval_peak,
                       "required_bytes": eval_total if total is not None and eval_total is not None else eval_peak,
                       "where": eval_est.peak_phase,
                       "how": "labelled lower bound" if eval_est.coverage.lower_bound else "traced",
                       "per_rank_peak_bytes": None})
    for name in ("loading", "saving"):  # DDP allocates its buckets as it wraps the model, before the first step
        phase = est.phase(name)
        if phase is not None:
            extra = buckets + (held if name == "saving" else 0)
            device = None if phase.device_total_bytes is None else phase.device_total_bytes + extra + nccl
            phases.append({"name": name, "peak_bytes": phase.peak_bytes + extra,
                           "required_bytes": device if device is not None else phase.peak_bytes + extra,
                           "where": phase.where, "how": phase.how,
                           "per_rank_peak_bytes": _listed(phase.per_rank_peak_bytes),
                           **({"host_bytes": phase.host_bytes} if name == "loading" else {})})
    return phases


def _traced_rank(per_rank: tuple[int, ...] | None) -> int | None:
    """This process's rank where a per-rank estimate traced the job it runs in (the same world size), else None."""
    return _rank() if per_rank is not None and _world_size() == len(per_rank) else None


def _rank_evaluation(est: Estimate, evaluation: Evaluation | None, schedule: Loop, batch: Any,
                     target: torch.device, notes: list[str]) -> PhaseEstimate | None:
    """The evaluation traced on each rank after the training steps (``est``'s phase ``"evaluation"``), with the
    micro-batches beyond the one the trace kept where the trainer evaluates while they are alive; None where none
    was asked for or it could not be traced (a note says so)."""
    if evaluation is None:
        return None
    traced = est.phase("evaluation")
    if traced is None:
        notes.append("the evaluation after the training steps could not be traced on each rank: no evaluation peak")
        return None
    extra = (schedule.accumulate - 1) * live_storage_bytes(batch, target) if evaluation.keeps_batch else 0
    if not extra:
        return traced
    return dataclasses.replace(
        traced, peak_bytes=traced.peak_bytes + extra,
        device_total_bytes=None if traced.device_total_bytes is None else traced.device_total_bytes + extra,
        per_rank_peak_bytes=None if traced.per_rank_peak_bytes is None else tuple(
            p + extra for p in traced.per_rank_peak_bytes))


def _replicas_nccl(run: Run) -> tuple[int, str] | None:
    """NCCL's buffers on one of a trainer's DDP replicas (traced as one device): one communicator, the default
    group, as a DDP plan's are counted; None on one rank."""
    if run.parallel is None:
        return None
    return rank_nccl_buffers(run.parallel.world_size, "ddp", run.target.nccl_buffers)


def _listed(values: tuple[int, ...] | None) -> list[int] | None:
    return None if values is None else list(values)


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
        version=__version__, device=str(target), budget_bytes=budget_bytes, headroom=options.headroom,
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
    """``options`` with the headroom and suggestions ``preflight check`` asked for through the environment
    (`preflight._dryrun`), and those settings (`DryRunSettings.run` gives what they say of the run)."""
    settings = settings_from_env()
    if settings.headroom is not None:
        options = dataclasses.replace(options, headroom=settings.headroom)
    if not settings.suggest:
        options = dataclasses.replace(options, suggest=False)
    return options, settings


def _suggestions(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, step: StepFn | None, run: Run,
                 options: Options, make_batch: Callable[[int], Any] | None, report: Report) -> list[Suggestion]:
    run = run.replace(target=dataclasses.replace(run.target, budget=report.budget_bytes))
    try:
        from preflight.advice import advise  # looked up at the call: a test replaces it

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # options advise leaves out are not the user's concern here
            found = advise(model, optimizer, batch, run, step=step, make_batch=make_batch, headroom=options.headroom)
    except Exception as err:  # noqa: BLE001 - advice is optional: the verdict stands without it
        report.warnings.append(f"no suggestions: {type(err).__name__}: {err}".splitlines()[0][:300])
        return []
    return found


def _without_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A shallow copy of ``optimizer`` with an empty ``state``, for tracing a first step again. The original is
    never written: the copy gets its own ``state`` in its instance dict (a wrapper whose ``state`` is a property
    keeps reading its inner optimizer's). It stands for the original (`stands_for`): a step that calls the user's own
    optimizers (`Loop.manual`) is pointed at the trace's clone of the copy. An `OptimizerGroup`: a group of copies."""
    if isinstance(optimizer, OptimizerGroup):
        return OptimizerGroup([_without_state(opt) for opt in optimizer.optimizers])
    fresh = object.__new__(type(optimizer))
    fresh.__dict__.update(optimizer.__dict__)
    fresh.__dict__["state"] = collections.defaultdict(dict)
    fresh.__dict__[STANDS_FOR] = stands_for(optimizer)
    return fresh


def _gradient_bytes(model: nn.Module, precision: str | None) -> int:
    dtype = float_dtype_for(precision)
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    return sum(p.numel() * (dtype.itemsize if dtype is not None and p.is_floating_point() else p.element_size())
               for p in params)


def held_module_bytes(modules: list[nn.Module], model: nn.Module, device: torch.device) -> int:
    """Bytes on ``device`` of the parameters and buffers of ``modules`` that ``model`` does not share: copies of the
    model a trainer keeps beside it (an averaged model)."""
    own = set(live_storages([list(model.parameters()), list(model.buffers())], device))
    held = live_storages([[t for m in modules for t in (*m.parameters(), *m.buffers())]], device)
    return sum(nbytes for key, nbytes in held.items() if key not in own)


def ddp_bucket_bytes(wrapped: Any) -> int:
    """Bytes of DDP's gradient buckets, a flat copy of every trainable parameter's gradient allocated at
    construction and kept for the whole run, when ``wrapped`` is a ``DistributedDataParallel``; else 0.

    With ``gradient_as_bucket_view=True`` the buckets are there all the same (the gradients become views into them
    after DDP copies each one in): a 2-rank gloo run of `benchmarks/distributed.py`'s Llama peaked at 240,806,308 B
    with and without it, 33,563,648 B (the buckets) over the replica's trace, because its peak comes early in
    backward, before the gradients add up. The replica's trace plus the buckets is exact there and an upper bound
    where the peak holds the gradients (`preflight.estimate` under ``ParallelPlan(n, "ddp",
    gradient_as_bucket_view=True)`` times each gradient's life)."""
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
