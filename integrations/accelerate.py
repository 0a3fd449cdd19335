"""accelerate adapter for hand-written training loops: `preflight_check` before the loop, `StepVerifier` around
its first optimizer steps.

Works on the objects ``accelerator.prepare`` returns: the model is unwrapped (DDP) with its mixed-precision
forward kept, the optimizer's torch optimizer is traced, and the dataloader's dataset and ``collate_fn`` give the
worst-case batch. The loop is assumed to run forward, ``accelerator.backward``, ``optimizer.step()``,
``optimizer.zero_grad()`` per optimizer step (``zero_grad="before_backward"`` if yours zeroes first). Under a
DeepSpeed or FSDP plugin the prediction is this rank's share (`preflight.parallel.ParallelPlan`, read from
``accelerator.state``), rescaled by category from a trace of the model as ``prepare`` returned it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

try:
    import accelerate
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("preflight.integrations.accelerate needs accelerate: pip install accelerate "
                      "(or, in your preflight clone, pip install -e '.[hf]')") from err

import torch
from torch import nn

from preflight._batches import DEFAULT_TIME_LIMIT, check_scan_seconds, scan
from preflight._budget import DEFAULT_HEADROOM
from preflight.verdict import (Options, VerifySession, ddp_bucket_bytes, decide, predict, predict_or_lower_bound,
                               training_state)
from preflight.report import Report
from preflight._eval import EvalStepFn
from preflight._guard import untouched
from preflight._run import Loop, Run, check_run
from preflight._steps import StepFn
from preflight.parallel import accelerate_plan

__all__ = ["StepVerifier", "preflight_check"]

_PRECISIONS = {"no": None, "bf16": "bf16-mixed", "fp16": "16-mixed"}


@untouched()
def preflight_check(
    accelerator: accelerate.Accelerator,
    model: nn.Module,
    optimizer: Any,
    dataloader: Any,
    run: Run | None = None,
    *,
    eval_dataloader: Any = None,
    step: StepFn | None = None,
    eval_step: EvalStepFn | None = None,
    headroom: float = DEFAULT_HEADROOM,
    on_overflow: str = "raise",
    report_path: str | None = None,
    plot_path: str | None = None,
    check_eval: bool = True,
    suggest: bool = True,
    scan_seconds: float = DEFAULT_TIME_LIMIT,
) -> Report | None:
    """Predict the peak of the loop's training (and eval) step on the worst-case batch; raise if it will not fit.

    Call it on every process after ``accelerator.prepare`` and before the first step.

    Args:
        accelerator: the ``Accelerator``: the run's precision, gradient accumulation and parallel plan (its DeepSpeed
            or FSDP plugin) are read from it.
        model, optimizer, dataloader: as returned by ``accelerator.prepare``.
        run: what the accelerator does not know (`preflight.Run`): the target (``Target(gpu="H100-80GB")`` or a
            ``budget``), where the loop zeroes gradients (``Loop(zero_grad="before_backward")`` if yours zeroes
            first; ``"in_place"`` for ``zero_grad(set_to_none=False)``), clipping, ``fast``. A field set here wins
            over what the accelerator says.
        eval_dataloader: the evaluation dataloader, to predict the no-grad eval step.
        step: ``step(model, batch) -> loss`` if the loop does more than ``model(**batch).loss``.
        eval_step: ``eval_step(model, batch)``; default ``model(**batch)``.
        headroom, on_overflow, report_path, plot_path, check_eval, suggest: see `preflight.verdict.Options`.
        scan_seconds: time limit for scanning the dataset for its largest samples.

    Returns:
        The `preflight.report.Report` (None when the prediction failed: a warning says why and the loop can run).

    Raises:
        preflight.PreflightError: the run does not fit and ``on_overflow="raise"`` (on every process alike).

    Example:
        >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # doctest: +SKIP
        >>> report = preflight_check(accelerator, model, optimizer, loader,
        ...                          Run(target=Target(budget="24GiB")))  # doctest: +SKIP
        >>> verifier = StepVerifier(accelerator, model, optimizer, report)  # doctest: +SKIP
        >>> for batch in loader:  # doctest: +SKIP
        ...     with verifier.step(batch):
        ...         accelerator.backward(model(**batch).loss); optimizer.step(); optimizer.zero_grad()
        >>> with torch.no_grad(), verifier.eval_step(eval_batch):  # doctest: +SKIP
        ...     model(**eval_batch)
    """
    options = Options(headroom=headroom, on_overflow=on_overflow, verify_steps=0, report_path=report_path,
                      plot_path=plot_path, check_eval=check_eval, suggest=suggest)
    check_scan_seconds(scan_seconds)
    given = check_run(run)
    base = Run(precision=_PRECISIONS.get(str(accelerator.mixed_precision)),
               loop=Loop(accumulate=accelerator.gradient_accumulation_steps),
               parallel=accelerate_plan(accelerator.state))
    run = given.over(base)
    # A failure here still leaves this rank a labelled lower bound, so that every rank takes part in the verdict.
    report = predict_or_lower_bound(
        lambda: _predict(accelerator, model, optimizer, dataloader, eval_dataloader, options, run, step, eval_step,
                         scan_seconds), accelerator.unwrap_model(model), optimizer, options, run,
        device=accelerator.device)
    return decide(report, options)


class StepVerifier:
    """Measure the first ``steps`` optimizer steps of a custom loop and fill in ``report``'s measured fields.

    Wrap each loop iteration in ``with verifier.step(batch):``, and each evaluation batch inside the measured steps
    in ``with verifier.eval_step(batch):``. A window opens at the first micro-batch and closes
    when ``accelerator.sync_gradients`` is True on exit (the optimizer stepped), so ``accelerator.accumulate``
    loops are measured per optimizer step. After ``steps`` steps (or `finish`) the report is updated, written,
    printed, and warnings are emitted; then the context does nothing.
    """

    def __init__(self, accelerator: accelerate.Accelerator, model: nn.Module, optimizer: Any,
                 report: Report | None, *, steps: int = 3, report_path: str | None = None,
                 plot_path: str | None = None) -> None:
        options = Options(verify_steps=steps, report_path=report_path, plot_path=plot_path)
        self.accelerator = accelerator
        self.model = accelerator.unwrap_model(model)
        self.optimizer = _torch_optimizer(optimizer)
        self.session = VerifySession(report, options, accelerator.device,
                                     extra_resident_bytes=ddp_bucket_bytes(model))
        self._open = False
        self._restore: Callable[[], None] | None = None

    @contextlib.contextmanager
    def step(self, batch: Any) -> Iterator[None]:
        """Around one loop iteration (one micro-batch) on ``batch``. While a window is open, each
        ``accelerator.backward`` call marks the end of the forward before it and of the backward after it (the
        meter places a free gloo's threads lose at the end of its phase), as the Lightning callback's hooks do."""
        if not self.session.active:
            yield
            return
        if not self._open:
            self.session.step_started([*training_state(self.model, [self.optimizer]), batch], batch=batch)
            self._open = True
        if self._restore is None:  # the window's start, or its next micro-batch after one that raised
            self._restore = _marked_backward(self.accelerator, self.session)
        try:
            yield
        except BaseException:
            self._unmark()
            raise
        if self.accelerator.sync_gradients:
            self._open = False
            self._unmark()
            self.session.step_ended()  # its finishing work (traces, the printed report) is guarded

    def _unmark(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None

    @contextlib.contextmanager
    def eval_step(self, batch: Any) -> Iterator[None]:
        """Around one evaluation batch that runs while steps are still being measured: it is measured apart and
        compared with the eval prediction for that batch's shape (``report.eval_relative_error``)."""
        if not self.session.active or self._open:
            yield
            return
        self.session.eval_started([*training_state(self.model, [self.optimizer]), batch], batch)
        try:
            yield
        finally:
            self.session.eval_ended()

    @untouched()
    def finish(self) -> Report | None:
        """End verification early (fewer steps than asked); returns the report."""
        self._unmark()
        return self.session.finish()


def _marked_backward(accelerator: accelerate.Accelerator, session: VerifySession) -> Callable[[], None]:
    """Make ``accelerator.backward`` mark the phases of the measured step around the call (`VerifySession.phase_ended`;
    accelerate has no hooks of its own there); return what puts the accelerator back as it was. The instance gets
    an attribute of that name for the window only, and the call itself is accelerate's."""
    missing = object()
    own = vars(accelerator).get("backward", missing)
    backward = accelerator.backward

    def marked(*args: Any, **kwargs: Any) -> Any:
        session.phase_ended()  # the forward
        try:
            return backward(*args, **kwargs)
        finally:
            session.phase_ended()  # the backward

    accelerator.backward = marked

    def restore() -> None:
        if own is missing:
            vars(accelerator).pop("backward", None)
        else:
            accelerator.backward = own

    return restore


def _predict(accelerator: accelerate.Accelerator, model: nn.Module, optimizer: Any, dataloader: Any,
             eval_dataloader: Any, options: Options, run: Run, step: StepFn | None,
             eval_step: EvalStepFn | None, scan_seconds: float) -> Report:
    samples = scan(dataloader, time_limit=scan_seconds, on_error=options.scan_on_error)
    batch, info = samples.worst_case()
    eval_batch = eval_info = None
    if options.check_eval and eval_dataloader is not None:
        eval_batch, eval_info = scan(eval_dataloader, time_limit=scan_seconds,
                                     on_error=options.scan_on_error).worst_case()
    mixed = str(accelerator.mixed_precision)
    if mixed not in _PRECISIONS:
        raise ValueError(f"mixed_precision={mixed!r} is not modelled (only no, bf16 and fp16)")
    # unwrap_model keeps accelerate's mixed-precision forward wrapper (autocast + fp32 outputs): traced as it runs.
    report = predict(accelerator.unwrap_model(model), _torch_optimizer(optimizer), batch, run, options=options,
                     step=step, batch_info=info, eval_batch=eval_batch, eval_step=eval_step,
                     eval_batch_info=eval_info, ddp_gradient_buckets=ddp_bucket_bytes(model) > 0,
                     make_batch=samples.batch)
    return report


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    inner = getattr(optimizer, "optimizer", None)  # accelerate's AcceleratedOptimizer
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer
