"""`decide` and `check`: the verdict on a prediction, agreed across ranks, reported, and acted on (raise, warn, end
a dry run). The policies of the whole decision layer:

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
  numbers and what to change (top suggestions of `preflight.advice.advise` when it can run); ``"warn"`` warns.
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

import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from preflight._warnings import warn
from preflight._budget import DEFAULT_HEADROOM
from preflight._dryrun import EXIT_DOES_NOT_FIT, EXIT_NO_VERDICT, settings_from_env
from preflight._errors import PreflightError
from preflight._guard import untouched
from preflight._eval import EvalStepFn
from preflight._run import Run, check_run
from preflight._steps import LossNotFoundError, StepFn, check_step
from preflight._units import format_bytes

from preflight.parallel._pipeline import is_job_pipeline
from preflight.report._report import Report
from preflight.verdict._options import Options
from preflight.verdict._predict import predict
from preflight.verdict._ranks import _agree, _rank, internal_failures, is_rank_zero, wait_for_every_rank
__all__ = ["REMEDY_MAX_BATCH_SIZE", "check", "decide"]


_EXIT_PREDICTION_FAILED = 1  # what a crashed script exits with: a failed prediction must not read as "fits"


_TOP_SUGGESTIONS = 3  # shown in the table and the error; the JSON keeps all


# How to have preflight choose the micro-batch, for a loop without a trainer (the adapters name their own way).
REMEDY_MAX_BATCH_SIZE = ("Or let preflight choose the micro-batch: preflight.max_batch_size(model, optimizer, "
                         "make_batch, budget=...) gives the largest that fits.")
REMEDY_PIPELINE_JOB = ("To have preflight predict each change, or choose the micro-batch, plan the pipeline on the "
                       "whole model before the job cuts it: Run(parallel=ParallelPlan(..., pp=PPPlan(...))) with "
                       "preflight.advise or preflight.max_batch_size.")


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
            FSDP, or DeepSpeed) is read as its wrapping runs it: its plan is the run's parallel section. A pipeline
            schedule built in the job is read on every rank (call it on every rank at once): the training step
            alone is predicted, the largest rank deciding.
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
    pipeline = is_job_pipeline(model)
    try:
        # No trainer to protect here: a step that yields no loss is the caller's mistake, and says how to fix it.
        with internal_failures("the prediction", reraise=(LossNotFoundError,)):
            report = predict(model, optimizer, batch, run, options=options, step=step, eval_batch=eval_batch,
                             eval_step=eval_step)
    except BaseException:
        if pipeline:  # the other ranks of a job's pipeline agree on the verdict next: this rank joins them, then raises
            with contextlib.suppress(Exception):
                _agree(None)
        raise
    return decide(report, options, remedy=REMEDY_PIPELINE_JOB if pipeline else REMEDY_MAX_BATCH_SIZE)


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
        wait_for_every_rank()  # rank zero's report is written before any rank exits
        sys.exit(code)
    if fits is False:
        message = _overflow_message(report, ranks, local_fits, remedy, stops=options.on_overflow == "raise")
        if options.on_overflow == "raise":
            raise PreflightError(message, report=report.to_dict() if report is not None else None)
        warn(message, RuntimeWarning)
    return report


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
    lines = [
        f"preflight: the run is predicted to need {format_bytes(report.verdict_bytes)} per device "
        f"({report.run_peak_phase} peak), over the usable "
        f"{format_bytes(report.usable_bytes)} (budget {format_bytes(report.budget_bytes)} "
        f"minus {report.headroom:.0%} headroom) on {report.device}.",
        f"  training step: {format_bytes(report.predicted_peak_bytes)} at {report.peak_phase}; "
        + ", ".join(f"{k} {format_bytes(v)}" for k, v in report.predicted_breakdown.items() if v),
    ]
    if report.eval_predicted_peak_bytes is not None:
        lines.append(f"  evaluation step: {format_bytes(report.eval_predicted_peak_bytes)}")
        if report.run_peak_phase == "evaluation" and not report.suggestions:
            lines.append("  The evaluation is the peak: a smaller evaluation batch, or fewer predictions kept on the "
                         "device (the HF Trainer's eval_accumulation_steps, or a preprocess_logits_for_metrics that "
                         "keeps the argmax instead of the logits), lowers it.")
    saving = next((p for p in report.phases if p["name"] == "saving"), None)
    if saving is not None:
        lines.append(f"  checkpoint save: {format_bytes(saving['peak_bytes'])}")
        if report.run_peak_phase == "saving":
            lines.append("  The save is the peak: gather the full state dict to the host (Checkpoint(offload_to_cpu="
                         "True), rank 0 only) or save a sharded one (Checkpoint(state_dict='sharded'), distributed "
                         "checkpoint), as the trainer's FSDP settings allow.")
    if report.worst_case_batch_shape is not None:  # None: the prediction failed before a batch was traced
        lines.append(f"  worst-case batch: {report.worst_case_batch_shape}")
    if report.suggestions:
        lines.append("  What to change (predicted peak with the change):")
        for s in report.suggestions[:_TOP_SUGGESTIONS]:
            lines.append(f"    - {'fits' if s['fits'] else 'still over'}: {s['description']}")
    else:
        lines.append("  What to change: a smaller micro-batch with gradient accumulation, activation checkpointing, "
                     "bf16 mixed precision, an 8-bit optimizer or LoRA; preflight.advise(...) predicts each.")
    if remedy and report.run_peak_phase == "training":  # the micro-batch search lowers the training step only
        lines.append(f"  {remedy}")
    if stops:
        lines.append("  Nothing was trained. Set on_overflow='warn' to train anyway, or a larger `budget`.")
    else:
        lines.append("  Training goes on, as on_overflow='warn' asks: expect an out-of-memory error on the device "
                     "unless one of these changes is made.")
    return "\n".join(lines)


def _emit(report: Report, options: Options, *, verified: bool = False) -> None:
    from preflight.report._console import print_report

    if options.report_path is not None:
        report.write(options.report_path)
    requested = settings_from_env().report_path  # `preflight check` reads the report back from here
    if requested is not None and requested != options.report_path:
        report.write(requested)
    print_report(report, verified=verified)
    if options.plot_path is not None:
        from preflight.report._plot import plot_report

        plot_report(report, options.plot_path)
