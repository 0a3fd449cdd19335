"""Hugging Face Trainer adapter: `PreflightCallback`, `attach` and `autotune`.

Hooks (transformers 5, ``trainer.py``): ``_inner_training_loop`` creates the optimizer, prepares the model and
the train dataloader (``callback_handler.train_dataloader = train_dataloader``), calls ``model.zero_grad()`` and
then ``on_train_begin``, whose keyword arguments carry ``model``, ``optimizer``, ``train_dataloader`` and
``eval_dataloader`` (``CallbackHandler.call_event``; the eval dataloader is only set once an evaluation ran).
Activation checkpointing from ``TrainingArguments`` is applied in ``train()`` before that, so the model arrives
as it will train. Each optimizer step fetches all its accumulated micro-batches, then runs ``on_step_begin``,
forward and backward per micro-batch, gradient clipping, ``optimizer.step()``, ``model.zero_grad()`` and
``on_step_end``: the verification window.

A callback does not see the Trainer, so it cannot build the eval dataloader or log through ``Trainer.log``;
`attach` (or `autotune`) gives it the Trainer for both, and for a ``Seq2SeqTrainer`` that generates in evaluation
(``predict_with_generate`` with a ``compute_metrics``) the Trainer's own ``prediction_step`` is the eval step
traced, with ``generation_max_length`` / ``generation_num_beams`` as ``Run.generation``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

try:
    from transformers import Trainer, TrainerCallback
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "preflight.integrations.hf needs transformers: pip install transformers (or, in your preflight clone, "
        "pip install -e '.[hf]')"
    ) from err

import torch
from torch import nn

from preflight._warnings import warn
from preflight._batches import DEFAULT_TIME_LIMIT, check_scan_seconds, scan
from preflight._budget import DEFAULT_HEADROOM, usable_bytes
from preflight.verdict import (Options, VerifySession, ddp_bucket_bytes, decide, eval_resident, internal_failures,
                               is_rank_zero, options_plan, predict, predict_or_lower_bound, training_state)
from preflight.report import Report
from preflight.report._console import progress
from preflight._guard import untouched
from preflight.trace import isolated_rng
from preflight._epoch import sample_batches
from preflight._run import Checkpoint, Loop, Run, check_run, pinned, run_budget
from preflight._eval_loop import EvalLoop
from preflight.parallel import ParallelPlan, accelerate_checkpoint, accelerate_plan
from preflight._units import format_bytes

__all__ = ["PreflightCallback", "attach", "autotune"]


class PreflightCallback(TrainerCallback):
    """Predict the peak memory of ``Trainer.train`` before step one; raise if it will not fit; verify after a few
    steps.

    Args:
        run: what the Trainer does not say of the run (`preflight.Run`): its target (``Target(gpu="H100-80GB")`` or
            ``Target(budget="24GiB")``), ``fast=False`` for a full trace. Precision (``bf16``/``fp16``), the loop
            (accumulation, ``max_grad_norm``, the GradScaler) and the ``fsdp`` / ``deepspeed`` plan are read from
            the Trainer's arguments; a field set here wins over them.
        headroom, on_overflow, verify_steps, report_path, plot_path, check_eval, suggest: as for the Lightning
            callback (`preflight.verdict.Options`).
        scan_seconds: time limit for scanning the dataset for its largest samples.

    Example:
        >>> callback = PreflightCallback(Run(target=Target(budget="24GiB")))
        >>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[callback])  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
        >>> # or, to also predict the eval step and log to the Trainer's loggers:
        >>> attach(trainer, Run(target=Target(budget="24GiB"))); trainer.train()  # doctest: +SKIP

    Environment:
        ``PREFLIGHT_DRY_RUN=1``: predict, write the report, and exit before step one with status 0 (fits) or 3
        (does not fit).

    ``TrainingArguments(auto_find_batch_size=True)``: when the training step does not fit, the callback finds the
    largest per-device batch predicted to fit and, before any step, steps the Trainer's finder (which retries only
    on out-of-memory errors) down to the first of its sizes at or under it, instead of raising; it says so, and
    the report's ``autotune`` records it (one process only: under ``torch.distributed`` it raises as usual).

    Known limitations:
        - Without `attach`, the eval step is predicted only if the Trainer already evaluated (it passes the eval
          dataloader to callbacks then), and metrics go to ``state.log_history`` instead of the loggers.
        - A loss the Trainer computes outside the model (a ``compute_loss`` override, ``compute_loss_func``) is
          traced only when the callback is attached (label smoothing is applied from the arguments either way;
          otherwise the callback warns); ``training_step`` overrides are not traced.
        - DeepSpeed and FSDP runs (``deepspeed``, ``fsdp`` / ``fsdp_config``): the prediction is this rank's
          share under their sharding and offload (`preflight.parallel.ParallelPlan`), rescaled by category from a
          trace of the model as the callback finds it.
    """

    def __init__(
        self,
        run: Run | None = None,
        *,
        headroom: float = DEFAULT_HEADROOM,
        on_overflow: str = "raise",
        verify_steps: int = 3,
        report_path: str | None = None,
        plot_path: str | None = None,
        check_eval: bool = True,
        suggest: bool = True,
        scan_seconds: float = DEFAULT_TIME_LIMIT,
    ) -> None:
        self.run = check_run(run)
        self.options = Options(headroom=headroom, on_overflow=on_overflow, verify_steps=verify_steps,
                               report_path=report_path, plot_path=plot_path, check_eval=check_eval, suggest=suggest)
        self.scan_seconds = check_scan_seconds(scan_seconds)
        self.trainer: Trainer | None = None  # set by attach() / autotune()
        self.report: Report | None = None
        self.autotuned: dict[str, Any] | None = None
        self._session: VerifySession | None = None
        self._batch: list[Any] | None = None  # the (args, kwargs) of each forward of the measured step
        self._hook: Any = None
        self._eval_hook: Any = None  # measures evaluation batches that run inside the verified window
        self._optimizer: torch.optim.Optimizer | None = None
        self._samples: Any = None  # the train set's scan, for auto_find_batch_size
        self._finder_target: int | None = None  # with auto_find_batch_size: the largest batch predicted to fit
        # A loss of the Trainer's own pops the labels before the forward (`_loss_step`): the batch of a measured
        # step is then what ``compute_loss`` received, recorded while verifying (attached), or unknown (not).
        self._loss_recorder: Any = None
        self._loss_inputs: Any = None
        self._forward_lacks_labels = False
        self._scanned_labels = False  # the train set's batches carry labels
        self._unseen_loss = False  # a loss outside the model that is not label smoothing: said once, then False

    # ---- hooks ------------------------------------------------------------------------------------------------

    @untouched()
    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       optimizer: torch.optim.Optimizer | None = None, train_dataloader: Any = None,
                       eval_dataloader: Any = None, **kwargs: Any) -> None:
        finder = bool(getattr(args, "auto_find_batch_size", False)) and _world_size() == 1
        if finder and self._finder_target is not None and state.train_batch_size > self._finder_target:
            raise _PredictedOutOfMemory(state.train_batch_size, self._finder_target)  # HF's finder steps down
        report = None
        options = dataclasses.replace(self.options, suggest=False) if finder else self.options
        # A failure here still leaves this rank a labelled lower bound, so that every rank takes part in the verdict.
        report = predict_or_lower_bound(
            lambda: self._predict(args, model, optimizer, train_dataloader, eval_dataloader, options), _unwrap(model),
            _unwrap_optimizer(optimizer), options, self._run(args), device=_device(model))
        if finder and report is not None and report.fits is False:
            target = None
            with internal_failures("choosing the batch size for auto_find_batch_size"):
                target = self._fitting_batch(args, state, model, optimizer, report)
            if target:
                self._finder_target = target
                raise _PredictedOutOfMemory(state.train_batch_size, target)
            if self.options.suggest:  # the finder cannot help: say what would, as without it
                with internal_failures("the prediction"):
                    report = self._predict(args, model, optimizer, train_dataloader, eval_dataloader, self.options)
        if report is not None and self.autotuned is not None:
            report.autotune = self.autotuned
        if report is not None and self._finder_target is not None:
            report.autotune = {"method": "auto_find_batch_size", "train_batch_size": state.train_batch_size,
                               "largest_predicted_to_fit": self._finder_target,
                               "original_train_batch_size": args.per_device_train_batch_size}
            if is_rank_zero():
                print(f"preflight: auto_find_batch_size: training with per-device batch {state.train_batch_size}, the "
                      f"first of the finder's sizes at or under {self._finder_target}.", flush=True)
        self.report = report  # kept when decide raises
        decide(report, self.options, emit=lambda r: self._log(state, r), remedy=_REMEDY)
        if self.options.verify_steps:
            self._session = VerifySession(self.report, self.options, _device(model),
                                          extra_resident_bytes=_ddp_bucket_bytes(self.trainer, model, args))
            # The Trainer has no hook before an evaluation batch: its forward, in eval mode, starts the measurement
            # and ``on_prediction_step`` (after the batch) ends it.
            self._optimizer = optimizer
            self._eval_hook = model.register_forward_pre_hook(self._evaluation_forward, with_kwargs=True)
            self._watch_loss_inputs(args)

    def on_step_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                      optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        session = self._session
        if session is None or not session.active:
            return
        # The micro-batches were fetched before this hook, which does not receive them: each forward's inputs are
        # picked up by a pre-hook and counted as alive since the start (`StepPeakMeter.stop`).
        self._batch = []
        self._hook = model.register_forward_pre_hook(self._remember_batch, with_kwargs=True)
        session.step_started(training_state(model, [optimizer]))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._session is not None:
            self._session.phase_ended()  # the forwards and backwards of the step's micro-batches

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        session = self._session
        if session is None or not session.active:
            return
        self._remove_hook()
        calls, self._batch = self._batch or [], None
        for call in calls[1:]:  # the step is predicted for its largest micro-batch (`VerifySession.micro_batch`)
            session.micro_batch(self._step_inputs(call))
        if session.step_ended(also_resident=calls, batch=self._step_inputs(calls[0]) if calls else None):
            self._unwatch_loss_inputs()
            self._log(state, session.report, verified=True)

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._session is not None:
            self._session.eval_ended()
        if self._session is None or not self._session.active:
            self._remove_eval_hook()

    @untouched()
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove_hook()
        self._remove_eval_hook()
        self._unwatch_loss_inputs()
        if self._session is not None and self._session.active:  # fewer steps than verify_steps
            self._session.finish()
            self._log(state, self._session.report, verified=True)

    # ---- translation ------------------------------------------------------------------------------------------

    def _predict(self, args: Any, model: nn.Module, optimizer: torch.optim.Optimizer, train_dataloader: Any,
                 eval_dataloader: Any, options: Options) -> Report:
        samples = self._samples = scan(train_dataloader, time_limit=self.scan_seconds,
                                             on_error=options.scan_on_error)
        batch, info = samples.worst_case()
        self._scanned_labels = isinstance(batch, Mapping) and "labels" in batch
        eval_batch = eval_info = None
        if options.check_eval:
            loader = eval_dataloader if eval_dataloader is not None else _eval_loader(self.trainer, args)
            if loader is not None:
                eval_batch, eval_info = scan(loader, time_limit=self.scan_seconds,
                                                  on_error=options.scan_on_error).worst_case()
        run = self._run(args)
        if eval_batch is not None and self.trainer is None and getattr(args, "predict_with_generate", False):
            warn("PreflightCallback: evaluation generates (predict_with_generate), but the callback cannot see the "
                 "Trainer, so the evaluation peak predicted is the loss forward's alone, without generation. Add "
                 "the callback with preflight.integrations.hf.attach(trainer) to trace the Trainer's own "
                 "prediction_step.", RuntimeWarning)
        return predict(_unwrap(model), _unwrap_optimizer(optimizer), batch, run, options=options,
                       step=_loss_step(self.trainer, args), batch_info=info, eval_batch=eval_batch,
                       eval_step=_prediction_step(self.trainer, args, run), eval_batch_info=eval_info,
                       ddp_gradient_buckets=_ddp_bucket_bytes(self.trainer, model, args) > 0,
                       make_batch=samples.batch, eval_keeps_batch=True,
                       sample_batches=lambda n: sample_batches(train_dataloader, n))

    def _run(self, args: Any) -> Run:
        """The run as the Trainer's arguments describe it, the user's `Run` laid over it."""
        return self.run.over(Run(precision=_precision(args), loop=_schedule(self.trainer, args),
                                 parallel=_parallel_plan(self.trainer), generation=_generation(self.trainer, args),
                                 checkpoint=_checkpoint(self.trainer, args),
                                 evaluation=_eval_loop(self.trainer, args)))

    def _fitting_batch(self, args: Any, state: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
                       report: Report) -> int | None:
        """With ``auto_find_batch_size``, the largest per-device batch predicted to fit, when it is under the
        current one and the training step (not evaluation, whose batch the finder does not change) is over."""
        from preflight._autotune import max_batch_size

        train_need = report.predicted_device_total_bytes or report.predicted_peak_bytes
        current = state.train_batch_size
        if report.usable_bytes is None or train_need <= report.usable_bytes or not current or current < 2:
            return None
        with progress("auto_find_batch_size: finding the largest per-device batch that fits", enabled=is_rank_zero()):
            run = self._run(args)
            run = pinned(run.replace(parallel=options_plan(_unwrap(model), run.parallel),
                                     target=dataclasses.replace(run.target, budget=report.budget_bytes)),
                         _device(model))
            result = max_batch_size(_unwrap(model), _unwrap_optimizer(optimizer), self._samples.batch, run,
                                    step=_loss_step(self.trainer, args), max_batch=current - 1,
                                    headroom=self.options.headroom)
        if not result.batch_size:
            return None
        if is_rank_zero():
            print(f"preflight: auto_find_batch_size: per-device batch {current} is predicted to need "
                  f"{format_bytes(report.verdict_bytes)}, over the usable {format_bytes(report.usable_bytes)}; "
                  f"the largest predicted to fit is {result.batch_size} ({format_bytes(result.predicted_peak_bytes)})"
                  ". Stepping the Trainer's batch-size finder down to it without running a step.", flush=True)
        return result.batch_size

    def _remember_batch(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        # (args, kwargs) of each forward of the step: all of it is alive since the step began (`also_resident`).
        taken, self._loss_inputs = self._loss_inputs, None
        if self._batch is not None:
            self._batch.append(((), taken) if taken is not None else (args, kwargs))

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _evaluation_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if module.training:  # a training forward: its batch is `_remember_batch`'s
            return
        taken, self._loss_inputs = self._loss_inputs, None
        session = self._session
        if session is None or not session.active:
            return
        session.eval_started([*training_state(module, [self._optimizer]), args, kwargs, taken],
                             self._step_inputs(((), taken) if taken is not None else (args, kwargs)))

    def _watch_loss_inputs(self, args: Any) -> None:
        """While verifying, record what the Trainer's own ``compute_loss`` receives (the batch with its labels, which
        it pops before the forward); without the Trainer, note that the forward's inputs lack the labels."""
        trainer = self.trainer
        if trainer is None:
            self._forward_lacks_labels = self._scanned_labels
            self._unseen_loss = self._scanned_labels and not _smoothing(args)
            return
        if not _custom_loss(trainer) or "compute_loss" in vars(trainer):
            return
        original = trainer.compute_loss

        def compute_loss(model: nn.Module, inputs: Any, *rest: Any, **kwargs: Any) -> Any:
            if self._session is not None and self._session.active:
                self._loss_inputs = _copied(inputs)
            return original(model, inputs, *rest, **kwargs)

        trainer.compute_loss = compute_loss  # an instance attribute over the class's method, removed after
        self._loss_recorder = compute_loss

    def _unwatch_loss_inputs(self) -> None:
        trainer, recorder = self.trainer, self._loss_recorder
        self._loss_recorder = self._loss_inputs = None
        if trainer is not None and recorder is not None and vars(trainer).get("compute_loss") is recorder:
            del trainer.compute_loss

    def _step_inputs(self, call: Any) -> Any:
        """A measured step's batch from a forward's ``(args, kwargs)`` (`_inputs`); None where the forward's
        inputs lack the labels the batches carry (the Trainer's loss popped them, without the Trainer attached):
        that step is compared with the worst-case prediction, and the loss not traced is said once."""
        batch = _inputs(call)
        if self._forward_lacks_labels and isinstance(batch, Mapping) and "labels" not in batch:
            if self._unseen_loss and is_rank_zero():
                warn("PreflightCallback: the Trainer computes the loss outside the model (its forward received no "
                     "labels: a compute_loss override or a compute_loss_func), which the callback cannot see: the "
                     "prediction traced the model's own loss. Add the callback with "
                     "preflight.integrations.hf.attach(trainer) to trace the Trainer's compute_loss.", RuntimeWarning)
            self._unseen_loss = False
            return None
        return batch

    def _remove_eval_hook(self) -> None:
        if self._eval_hook is not None:
            self._eval_hook.remove()
            self._eval_hook = None
        self._optimizer = None

    def _log(self, state: Any, report: Report | None, *, verified: bool = False) -> None:
        if report is None or not is_rank_zero():
            return
        metrics = {"preflight/predicted_peak_bytes": float(report.predicted_peak_bytes)}
        if verified and report.measured_peak_bytes is not None:
            metrics["preflight/measured_peak_bytes"] = float(report.measured_peak_bytes)
            if report.relative_error is not None:
                metrics["preflight/relative_error"] = float(report.relative_error)
        entry = {**metrics, "step": state.global_step}
        if state.epoch is not None:
            entry["epoch"] = state.epoch
        state.log_history.append(entry)
        if self.trainer is not None:
            # To the loggers as ``Trainer.log`` sends them, but not through it: its ``CallbackHandler.on_log`` resets
            # ``control.should_log``, which drops the training loss the Trainer was about to log this step. The
            # callbacks get a copy of the control, so none of them can change what the Trainer does next.
            # Not to the console printers (ProgressCallback, PrinterCallback, the notebook's): the report says it in
            # words, and a line of raw byte counts among the losses reads as noise.
            handler = self.trainer.callback_handler
            for callback in handler.callbacks:
                if type(callback).__name__ in _CONSOLE_PRINTERS:
                    continue
                event = getattr(callback, "on_log", None)
                if event is not None:
                    event(self.trainer.args, state, dataclasses.replace(self.trainer.control),
                          **_event_objects(handler), logs=dict(metrics))


def _event_objects(handler: Any) -> dict[str, Any]:
    """The objects ``CallbackHandler.call_event`` passes each callback (``processing_class`` was ``tokenizer``
    before transformers 4.46)."""
    names = ["model", "processing_class" if hasattr(handler, "processing_class") else "tokenizer", "optimizer",
             "lr_scheduler", "train_dataloader", "eval_dataloader"]
    return {name: getattr(handler, name, None) for name in names}


_CONSOLE_PRINTERS = frozenset({"ProgressCallback", "PrinterCallback", "NotebookProgressCallback"})

_REMEDY = ("Or let preflight choose the micro-batch: preflight.integrations.hf.autotune(trainer) before train() sets "
           "the largest that fits and keeps the global batch (`max_batch_size` caps it); with "
           "TrainingArguments(auto_find_batch_size=True) the callback steps the Trainer's finder down to it.")


class _PredictedOutOfMemory(RuntimeError):
    """Raised from ``on_train_begin`` under ``auto_find_batch_size``, before any step, so that the Trainer's finder
    (``accelerate.utils.find_executable_batch_size``) retries with a smaller batch: it retries on a ``RuntimeError``
    with one argument containing " out of memory." (``accelerate.utils.memory.should_reduce_batch_size``)."""

    def __init__(self, batch: int, target: int) -> None:
        super().__init__(f"preflight: per-device batch {batch} is predicted to run out of memory. (the largest "
                         f"predicted to fit is {target}; the Trainer's auto_find_batch_size retries with less)")


def attach(trainer: Trainer, run: Run | None = None, **options: Any) -> PreflightCallback:
    """Add a `PreflightCallback` with ``run`` and ``options`` to ``trainer`` and give it the Trainer (eval
    dataloader, logging).

    Returns the callback (its ``report`` holds the prediction after ``trainer.train()`` starts).
    """
    callback = PreflightCallback(run, **options)
    callback.trainer = trainer
    trainer.add_callback(callback)
    return callback


@untouched()
def autotune(
    trainer: Trainer,
    run: Run | None = None,
    *,
    headroom: float = DEFAULT_HEADROOM,
    max_batch_size: int | None = None,
    multiple_of: int = 1,
    scan_seconds: float = DEFAULT_TIME_LIMIT,
) -> dict[str, Any] | None:
    """Before ``trainer.train()``: set the largest micro-batch that fits, keeping the global batch.

    Sets ``args.per_device_train_batch_size`` and ``args.gradient_accumulation_steps`` (global batch =
    micro-batch x accumulation, kept as `preflight._autotune.split_global_batch` explains), and
    ``args.per_device_eval_batch_size`` from the eval step's own prediction (no gradients, so usually larger).
    Predictions use the dataset's worst-case samples and trace the training step as an accumulation micro-step.
    A `PreflightCallback` already on the Trainer is given the Trainer and the chosen values for its report.

    Args:
        trainer: the Trainer, before ``train()``.
        run: what the Trainer does not say (`preflight.Run`): its target's budget (``Target(budget="24GiB")``,
            else a catalog ``gpu``'s memory, else the CUDA device's capacity; required on CPU), ``fast``.
            Precision and the loop are read from the Trainer's arguments; a field set here wins.
        headroom: fraction of the budget kept free.
        max_batch_size: largest micro-batch to consider (default: the global batch for training; for evaluation,
            the eval dataset's size).
        multiple_of: chosen batch sizes are multiples of this.
        scan_seconds: time limit for scanning each dataset.

    Returns:
        The chosen values and predicted peaks (also printed on rank zero), or None when tuning failed: then the
        arguments are unchanged and a warning says why.

    Known limitations: activation checkpointing requested in ``TrainingArguments`` is applied by ``train()``,
    after this runs: enable it on the model first for it to count. The optimizer is built with
    ``trainer.create_optimizer()`` when the Trainer has none yet, then dropped again.
    """
    options = Options(headroom=headroom)  # validates
    run = check_run(run)
    args = trainer.args
    saved = (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.per_device_eval_batch_size,
             trainer._train_batch_size)
    chosen = None
    with internal_failures("autotune"):
        chosen = _tune(trainer, run, options, max_batch_size, multiple_of, scan_seconds)
    if chosen is None:
        (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.per_device_eval_batch_size,
         trainer._train_batch_size) = saved
        return None
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, PreflightCallback):
            callback.trainer = trainer
            callback.autotuned = chosen
    return chosen


def _tune(trainer: Trainer, run: Run, options: Options, max_batch_size: int | None, multiple_of: int,
          scan_seconds: float) -> dict[str, Any]:
    from preflight._autotune import max_batch_size as largest_batch, max_eval_batch_size, split_global_batch

    args, model = trainer.args, trainer.model
    device = _device(model)
    run = pinned(run.over(Run(precision=_precision(args), loop=_schedule(trainer, args))), device)
    budget = run_budget(run, model)
    # transformers 5 names the property is_activation_checkpointing (reading the old name warns).
    enabled = getattr(model, "is_activation_checkpointing", None)
    if enabled is None:
        enabled = getattr(model, "is_gradient_checkpointing", False)
    if (getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False)) and \
            not enabled:
        warn("preflight autotune: TrainingArguments asks for activation checkpointing, which Trainer.train() "
             "applies later; the batch size is tuned without it (call model.gradient_checkpointing_enable() "
             "first to tune with it).", RuntimeWarning)
    optimizer = trainer.optimizer
    if optimizer is None:
        optimizer = trainer.create_optimizer()
        trainer.optimizer = None  # train() creates its own, after the model is prepared
    with isolated_rng():
        loader = trainer.get_train_dataloader()
    samples = scan(loader, time_limit=scan_seconds)
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
    # Traced with accumulation: any micro-batch below the global batch will accumulate.
    micro = run.replace(loop=dataclasses.replace(run.loop, accumulate=2 if global_batch > 1 else 1))
    with progress("autotune: finding the largest micro-batch that fits", enabled=is_rank_zero()):
        result = largest_batch(model, _unwrap_optimizer(optimizer), samples.batch, micro,
                               step=_loss_step(trainer, args),
                               max_batch=min(global_batch, max_batch_size or global_batch), multiple_of=multiple_of,
                               headroom=options.headroom)
    if result.batch_size == 0:
        raise ValueError(f"no micro-batch fits ({'; '.join(result.notes)})")
    plan = split_global_batch(global_batch, result.batch_size)
    chosen: dict[str, Any] = {
        "per_device_train_batch_size": plan.micro_batch_size, "gradient_accumulation_steps": plan.accumulation_steps,
        "global_batch_size": plan.global_batch_size, "exact": plan.exact, "note": plan.note,
        "predicted_peak_bytes": result.predicted_peak_bytes, "traces": result.traces,
        "original": {"per_device_train_batch_size": args.per_device_train_batch_size,
                     "gradient_accumulation_steps": args.gradient_accumulation_steps,
                     "per_device_eval_batch_size": args.per_device_eval_batch_size},
    }
    if trainer.eval_dataset is not None:
        with isolated_rng():
            eval_loader = trainer.get_eval_dataloader()
        eval_samples = scan(eval_loader, time_limit=scan_seconds)
        resident = eval_resident(model, optimizer, precision=run.precision, schedule=Loop())
        cap = max_batch_size or max(1, eval_samples.dataset_size or args.per_device_eval_batch_size)
        size, peak = max_eval_batch_size(model, eval_samples.batch, run, resident=resident,
                                          usable=usable_bytes(budget, options.headroom), max_batch=cap,
                                          multiple_of=multiple_of)
        if size:
            chosen.update(per_device_eval_batch_size=size, eval_predicted_peak_bytes=peak)
    args.per_device_train_batch_size = plan.micro_batch_size
    args.gradient_accumulation_steps = plan.accumulation_steps
    if "per_device_eval_batch_size" in chosen:
        args.per_device_eval_batch_size = chosen["per_device_eval_batch_size"]
    trainer._train_batch_size = args.train_batch_size  # Trainer.__init__ copied it; train() reads the copy
    if is_rank_zero():
        original = chosen["original"]
        print(f"preflight autotune: per_device_train_batch_size {original['per_device_train_batch_size']} -> "
              f"{plan.micro_batch_size}, gradient_accumulation_steps {original['gradient_accumulation_steps']} -> "
              f"{plan.accumulation_steps} ({plan.note}); per_device_eval_batch_size "
              f"{original['per_device_eval_batch_size']} -> {args.per_device_eval_batch_size}", flush=True)
    return chosen


# ---- helpers --------------------------------------------------------------------------------------------------


def _precision(args: Any) -> str | None:
    if getattr(args, "bf16", False):
        return "bf16-mixed"
    if getattr(args, "fp16", False):
        return "16-mixed"
    return None


def _schedule(trainer: Trainer | None, args: Any) -> Loop:
    """The Trainer's step: accumulation, gradients freed after the step, clipping at ``max_grad_norm`` (1.0 by
    default; ``<= 0`` or None turns it off, as in ``Trainer._inner_training_loop``), accelerate's GradScaler
    when it made one (fp16 mixed precision), and TRL's activation offloading (``SFTConfig(activation_offloading=
    True)``: its stream-based ``OffloadActivations`` around each training step)."""
    norm = getattr(args, "max_grad_norm", None)
    accelerator = getattr(trainer, "accelerator", None) if trainer is not None else None
    scaler = getattr(accelerator, "scaler", None) is not None
    return Loop(accumulate=args.gradient_accumulation_steps, zero_grad="after_step",
                max_grad_norm=float(norm) if norm is not None and norm > 0 else None, grad_scaler=scaler,
                offload_activations="streams" if getattr(args, "activation_offloading", False) is True else None)


def _inputs(forward_call: Any) -> Any:
    """The batch as the Trainer collated it, from the ``(args, kwargs)`` its forward received: the Trainer calls
    ``model(**inputs)`` (plus ``num_items_in_batch`` when the model takes it, which is not part of the batch)."""
    if forward_call is None:
        return None
    args, kwargs = forward_call
    if args:
        return None  # not the Trainer's call: no batch to predict from
    return {k: v for k, v in kwargs.items() if k != "num_items_in_batch"}


def _loss_step(trainer: Trainer | None, args: Any = None) -> Any:
    """The loss as the Trainer computes it where that is not the model's own (``model(**batch)``, the default
    step): a subclass's ``compute_loss``, label smoothing (``label_smoothing_factor``: a log-softmax over the
    logits) or a ``compute_loss_func``, traced through the Trainer's ``compute_loss`` on a copy of the batch (it
    pops the labels). Without the Trainer (the callback not attached), label smoothing is applied from the
    arguments as ``compute_loss`` applies it. None where the default step is the Trainer's."""
    if trainer is not None:
        if not _custom_loss(trainer):
            return None
        return lambda model, batch: trainer.compute_loss(model, _copied(batch))
    epsilon = _smoothing(args)
    return None if not epsilon else _smoothed_step(epsilon, keep_outputs=False)


def _smoothing(args: Any) -> float:
    """The arguments' ``label_smoothing_factor`` (0: none)."""
    return getattr(args, "label_smoothing_factor", 0) or 0


def _custom_loss(trainer: Trainer) -> bool:
    return (type(trainer).compute_loss is not Trainer.compute_loss or trainer.label_smoother is not None
            or getattr(trainer, "compute_loss_func", None) is not None)


def _copied(batch: Any) -> Any:
    return {**batch} if isinstance(batch, Mapping) else batch


def _smoothed_step(epsilon: float, *, keep_outputs: bool) -> Any:
    """``Trainer.compute_loss`` with ``label_smoothing_factor=epsilon`` and neither a subclass nor a loss function:
    the labels go to transformers' ``LabelSmoother`` (shifted for a causal LM) instead of the model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.trainer_pt_utils import LabelSmoother

    smoother = LabelSmoother(epsilon=epsilon)

    def step(model: nn.Module, batch: Any) -> Any:
        if "labels" not in batch:  # the Trainer's batches are mappings
            return model(**batch)  # `compute_loss` takes the model's own loss then
        inputs = dict(batch)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        inner = model.base_model.model if hasattr(model, "peft_config") else model
        loss = smoother(outputs, labels, shift_labels=inner._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
        return (loss, outputs) if keep_outputs else loss

    return step


def _generation(trainer: Trainer | None, args: Any) -> dict[str, Any] | None:
    """``generate``'s arguments as ``Seq2SeqTrainer.evaluate`` builds them from ``predict_with_generate`` arguments
    (over the model's ``generation_config``, which the trainer loaded ``args.generation_config`` into)."""
    if not _generates_in_evaluation(trainer, args):
        return None
    kwargs = {"max_length": getattr(args, "generation_max_length", None),
              "num_beams": getattr(args, "generation_num_beams", None)}
    return {k: v for k, v in kwargs.items() if v is not None}


def _generates_in_evaluation(trainer: Trainer | None, args: Any) -> bool:
    """Whether the Trainer's evaluation generates: ``predict_with_generate``, and predictions asked for
    (`_loss_only`)."""
    return (trainer is not None and bool(getattr(args, "predict_with_generate", False))
            and not _loss_only(trainer, args))


def _prediction_step(trainer: Trainer | None, args: Any, run: Run) -> Any:
    """The Trainer's own ``prediction_step`` where evaluation is not the model's forward alone: a ``Seq2SeqTrainer``
    that generates in evaluation (``predict_with_generate`` and a ``compute_metrics``: generate, then the loss
    forward), a loss of the Trainer's own (`_loss_step`: ``compute_loss`` runs in evaluation too), or predictions
    the evaluation loop keeps (`_eval_loop`): the step then returns what ``Trainer.evaluation_loop`` keeps of the
    batch (the loss repeated to the batch size, the predictions after ``preprocess_logits_for_metrics``, the labels,
    the inputs where ``include_for_metrics`` asks). Without the Trainer, label smoothing from the arguments; None
    otherwise (the default eval step: the forward). The model's ``generation_config``, which ``prediction_step``
    updates, is put back after the trace."""
    if trainer is None:
        epsilon = _smoothing(args)
        return None if not epsilon else _smoothed_step(epsilon, keep_outputs=True)
    generation = dict(run.generation or {}) if _generates_in_evaluation(trainer, args) else None
    kept = _keeps_predictions(trainer, args)
    if generation is None and not kept and not _custom_loss(trainer):
        return None
    loss_only = _loss_only(trainer, args)

    def step(model: nn.Module, batch: Any) -> Any:
        owner = trainer.model
        saved = copy.deepcopy(getattr(owner, "generation_config", None)) if generation is not None else None
        try:
            loss, logits, labels = trainer.prediction_step(model, _copied(batch), prediction_loss_only=loss_only,
                                                           **(generation or {}))
        finally:
            if saved is not None:
                owner.generation_config = saved
        if not kept:
            return loss, logits, labels
        if loss is not None:
            loss = loss.repeat(args.eval_batch_size)
        if logits is not None and trainer.preprocess_logits_for_metrics is not None:
            logits = trainer.preprocess_logits_for_metrics(logits, labels)
        name = getattr(trainer.model, "main_input_name", "input_ids")
        inputs = batch.get(name) if "inputs" in (args.include_for_metrics or ()) else None
        return loss, logits, labels, inputs

    return step


def _loss_only(trainer: Trainer, args: Any) -> bool:
    """``prediction_loss_only`` as ``Trainer.evaluate`` asks it: True without a ``compute_metrics``."""
    return bool(args.prediction_loss_only) or trainer.compute_metrics is None


def _keeps_predictions(trainer: Trainer | None, args: Any) -> bool:
    """Whether ``Trainer.evaluation_loop`` keeps every batch's predictions on the device (`EvalLoopContainer`)."""
    return (trainer is not None and trainer.eval_dataset is not None and not _loss_only(trainer, args)
            and not getattr(args, "batch_eval_metrics", False))


def _eval_loop(trainer: Trainer | None, args: Any) -> EvalLoop | None:
    """What the Trainer's evaluation loop keeps of each batch (`preflight.EvalLoop`): with predictions asked for,
    every batch of the largest evaluation set this rank sees, or ``eval_accumulation_steps`` of them, gathered from
    every rank (``gather_for_metrics``), with the samples they hold (a set of one batch keeps nothing across
    batches now, but would in smaller batches). None where the set has no length; one batch moved off at each step
    is kept (a NumPy view over it is alive during the next, on a CPU target)."""
    if not _keeps_predictions(trainer, args):
        return None
    sets = trainer.eval_dataset
    try:
        sizes = [len(d) for d in (sets.values() if isinstance(sets, dict) else [sets])]
    except TypeError:  # an iterable dataset: its length is unknown
        return None
    world, size = max(1, args.world_size), max(1, args.eval_batch_size)
    per_rank = math.ceil(max(sizes, default=0) / world)
    batches = per_rank // size if args.dataloader_drop_last else math.ceil(per_rank / size)
    kept = min(args.eval_accumulation_steps or batches, batches)
    if batches < 1:
        return None
    samples = batches * size if args.dataloader_drop_last else per_rank
    return EvalLoop(kept_batches=kept, concatenated=bool(args.eval_do_concat_batches), ranks=world,
                    moved_off=batches > kept, samples=samples)


def _eval_loader(trainer: Trainer | None, args: Any) -> Any:
    strategy = getattr(args, "eval_strategy", "no")
    if trainer is None or trainer.eval_dataset is None or getattr(strategy, "value", strategy) == "no":
        return None
    # The Trainer builds (and prepares) a new eval dataloader at every evaluation; one more leaves nothing behind.
    with isolated_rng():
        return trainer.get_eval_dataloader()


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer``."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _ddp_bucket_bytes(trainer: Trainer | None, model: nn.Module, args: Any) -> int:
    """DDP's gradient buckets (a flat copy of every gradient) when the model trains under DDP without bucket views."""
    wrapped = getattr(trainer, "model_wrapped", None) if trainer is not None else None
    if isinstance(wrapped, nn.parallel.DistributedDataParallel):
        return ddp_bucket_bytes(wrapped)
    if not (_world_size() > 1 and not getattr(args, "deepspeed", None) and not getattr(args, "fsdp", None)):
        return 0
    # Not wrapped yet (the callback saw the model first), but the Trainer will wrap it in DDP with its defaults.
    params = {id(p): p for p in _unwrap(model).parameters() if p.requires_grad}.values()
    return sum(p.numel() * p.element_size() for p in params)


def _checkpoint(trainer: Trainer | None, args: Any) -> Checkpoint | None:
    """How the Trainer saves (``_save_checkpoint``, at each ``save_strategy`` point, after the optimizer step):
    None with ``save_strategy="no"``; the optimizer's state unless ``save_only_model``; under FSDP the state dict
    accelerate's plugin saves (`preflight.parallel.accelerate_checkpoint`)."""
    strategy = getattr(args, "save_strategy", "no")
    if str(getattr(strategy, "value", strategy)).lower() == "no":
        return None
    weights_only = bool(getattr(args, "save_only_model", False))
    state = _accelerator_state(trainer)
    return accelerate_checkpoint(state, weights_only=weights_only) if state is not None else \
        Checkpoint(optimizer=not weights_only)


def _accelerator_state(trainer: Trainer | None) -> Any:
    """The accelerator's state of the attached Trainer, else accelerate's shared state; None before either exists."""
    from accelerate.state import AcceleratorState

    accelerator = getattr(trainer, "accelerator", None) if trainer is not None else None
    if accelerator is not None:
        return accelerator.state
    if not AcceleratorState._shared_state:  # accelerate's documented singleton: empty until an Accelerator exists
        return None
    return AcceleratorState()


def _parallel_plan(trainer: Trainer | None) -> ParallelPlan | None:
    """The sharded strategy the Trainer runs with (``deepspeed``, ``fsdp`` / ``fsdp_config``) as accelerate, which
    the Trainer hands both to, applied it (`preflight.parallel.accelerate_plan`): from the attached Trainer's
    accelerator, else from accelerate's shared state; None before the Trainer made its accelerator."""
    state = _accelerator_state(trainer)
    return None if state is None else accelerate_plan(state)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
