"""Lightning adapter: `PreflightCallback` predicts the training peak before step one, stops a run that will not
fit, and checks the prediction against the first steps.

Hooks (Lightning 2.x, ``lightning/pytorch/trainer/trainer.py`` ``_run`` and ``loops/fit_loop.py``):

- ``on_fit_start``: after ``strategy.setup`` configured the optimizers and precision, before the dataloaders
  exist. Used only by ``autotune``, like ``BatchSizeFinder.on_fit_start``.
- ``on_train_start``: after the sanity check and ``fit_loop.setup_data()``, so ``trainer.train_dataloader`` and
  ``trainer.val_dataloaders`` exist, and before the first batch is trained: the prediction and the verdict.
- ``on_train_batch_start`` / ``on_train_batch_end`` around each optimizer step (all its accumulated
  micro-batches; the optimizer steps inside the last one's closure): the verification window.

Lightning's automatic optimization runs ``training_step``, then ``zero_grad``, then ``backward`` (``Closure``
in ``loops/optimization/automatic.py``), so the previous step's gradients are alive through the next forward;
the prediction traces that order (`preflight._steps.Loop`).

Both distributions of Lightning 2 work: ``lightning`` (``import lightning.pytorch as pl``) and the standalone
``pytorch-lightning`` (``import pytorch_lightning as pl``), one or both installed. The callback derives from the
``Callback`` of each one installed, so either Trainer accepts it; every Lightning utility it calls comes from the
package of the Trainer it is given (`_lightning`), since those utilities reject a module of the other package
("You passed a `pytorch_lightning` object ... to a `lightning.pytorch` Trainer").
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from preflight._warnings import warn
from preflight._batches import DEFAULT_TIME_LIMIT, check_scan_seconds, scan
from preflight._budget import DEFAULT_HEADROOM
from preflight.verdict import (Options, VerifySession, ddp_bucket_bytes, decide, held_module_bytes, internal_failures,
                               is_rank_zero, predict, predict_or_lower_bound, training_state)
from preflight.report import Report
from preflight.report._console import progress
from preflight._guard import untouched
from preflight.trace import isolated_rng
from preflight._epoch import sample_batches
from preflight._optimizer_group import OptimizerGroup
from preflight._run import Checkpoint, Loop, Run, check_run, run_budget
from preflight._steps import PRECISIONS, needs_closure
from preflight.parallel import ParallelPlan, deepspeed_plan, fsdp_plan

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["PreflightCallback"]

_REMEDY = ("Or let preflight choose the micro-batch: PreflightCallback(autotune=True) sets the largest that fits "
           "and keeps the global batch with accumulate_grad_batches (`max_batch_size` caps it).")
# The two distributions of Lightning 2 ship the same trainer under these names.
_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _callback_bases() -> tuple[type, ...]:
    """``Callback`` of every Lightning package installed, so that a Trainer of either accepts the callback."""
    bases = []
    for name in _PACKAGES:
        try:
            bases.append(importlib.import_module(name).Callback)
        except ImportError:
            continue
    if not bases:
        raise ImportError("preflight.integrations.lightning needs Lightning 2 (the `lightning` or the "
                          "`pytorch-lightning` package): pip install lightning (or, in your preflight clone, "
                          "pip install -e '.[lightning]')")
    return tuple(bases)


def _lightning(trainer: Any) -> ModuleType:
    """The Lightning package ``trainer`` comes from (``lightning.pytorch`` or ``pytorch_lightning``), found from its
    class (or the first Lightning class it derives from), not from what happens to be installed."""
    for cls in type(trainer).__mro__:
        for name in _PACKAGES:
            if cls.__module__ == name or cls.__module__.startswith(name + "."):
                return importlib.import_module(name)
    raise TypeError(f"preflight's Lightning callback needs a Lightning Trainer (from {' or '.join(_PACKAGES)}), "
                    f"got {type(trainer).__module__}.{type(trainer).__qualname__}.")


class PreflightCallback(*_callback_bases()):
    """Predict the peak memory of ``trainer.fit`` before step one; raise if it will not fit; verify after a few steps.

    Args:
        run: what the trainer does not say of the run (`preflight.Run`): above all its target,
            ``Run(target=Target(gpu="H100-80GB"))`` or ``Target(budget="24GiB")`` (default: the CUDA device's
            capacity; on CPU no budget, no verdict, unless given); ``fast=False`` for a full trace. Precision, the
            loop (accumulation, clipping, GradScaler, Lightning's zero_grad before backward) and the strategy's
            parallel plan are read from the trainer; a field set here wins over it.
        headroom: fraction of the budget kept free for the allocator's cache and the CUDA context (0.10: see
            `preflight._budget.DEFAULT_HEADROOM`).
        on_overflow: ``"raise"`` (`preflight.PreflightError` before any optimizer step) or ``"warn"``.
        verify_steps: optimizer steps measured at the start to check the prediction; 0 disables.
        report_path: JSON report path (rank zero).
        plot_path: PNG of the predicted timeline and breakdown (needs matplotlib).
        check_eval: predict the validation step too (no grad, validation batch size), when there is one.
        autotune: choose the largest micro-batch that fits, setting the ``batch_size`` attribute (of the module,
            its hparams, or the datamodule: Lightning's ``lightning_setattr``, as ``BatchSizeFinder`` does) and
            ``trainer.accumulate_grad_batches`` so the global batch is kept; the original set-up is restored if
            anything fails.
        max_batch_size: with ``autotune``, the largest micro-batch to consider (default: the global batch).
        multiple_of: with ``autotune``, micro-batches are multiples of this.
        suggest: when the run does not fit, rank what to change (traces each option: ~10 more traces).
        scan_seconds: time limit for scanning the dataset for its largest samples.

    Example:
        >>> trainer = L.Trainer(callbacks=[PreflightCallback(Run(target=Target(gpu="H100-80GB")))])  # doctest: +SKIP
        >>> trainer.fit(module, datamodule)  # doctest: +SKIP

    Environment:
        ``PREFLIGHT_DRY_RUN=1``: predict, write the report, and exit before step one with status 0 (fits) or 3
        (does not fit).

    Known limitations:
        - Manual optimization (``automatic_optimization = False``) and several train dataloaders are not
          predicted (a warning says so).
        - The trace runs ``training_step`` / ``validation_step`` with ``self.log`` switched off; code in other
          hooks (``on_before_backward``, gradient clipping) is not traced.
        - Iterable datasets use their first batch (reported as ``first-batch``), not the worst case.
        - FSDP, DeepSpeed and ModelParallel strategies: the prediction is this rank's share under the strategy's
          sharding and offload (`preflight.parallel.ParallelPlan`), rescaled by category from a trace of the model
          as the callback finds it; tensor parallelism is not modelled (an upper bound for its ranks).
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
        autotune: bool = False,
        max_batch_size: int | None = None,
        multiple_of: int = 1,
        suggest: bool = True,
        scan_seconds: float = DEFAULT_TIME_LIMIT,
    ) -> None:
        self.run = check_run(run)
        self.options = Options(headroom=headroom, on_overflow=on_overflow, verify_steps=verify_steps,
                               report_path=report_path, plot_path=plot_path, check_eval=check_eval, suggest=suggest)
        if not isinstance(autotune, bool):
            raise ValueError(f"`autotune` should be True or False, got {autotune!r}.")
        if max_batch_size is not None and (isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int)
                                           or max_batch_size < 1):
            raise ValueError(f"`max_batch_size` should be None or a positive integer, got {max_batch_size!r}.")
        if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
            raise ValueError(f"`multiple_of` should be a positive integer, got {multiple_of!r}.")
        check_scan_seconds(scan_seconds)
        self.autotune = autotune
        self.max_batch_size = max_batch_size
        self.multiple_of = multiple_of
        self.scan_seconds = scan_seconds
        self.report: Report | None = None
        self._session: VerifySession | None = None
        self._autotuned: dict[str, Any] | None = None

    # ---- hooks ------------------------------------------------------------------------------------------------

    @untouched()
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.autotune and stage == "fit":
            if trainer.world_size > 1:
                raise ValueError("PreflightCallback(autotune=True) picks the batch size on one process; under a "
                                 f"distributed strategy ({trainer.world_size} processes) set the batch size yourself "
                                 "(preflight.max_batch_size on one process gives it) and keep autotune=False.")
            if not trainer.fit_loop._data_source.is_module():
                raise ValueError("PreflightCallback(autotune=True) cannot change dataloaders passed directly to "
                                 "`.fit()`. Please disable autotune or build the dataloader in your LightningModule "
                                 "or LightningDataModule from a `batch_size` attribute.")

    @untouched()
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.report, self._session, self._autotuned = None, None, None
        if self.autotune:
            self._autotune(trainer, pl_module)

    @untouched()
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report = None
        supported = _unsupported_reason(trainer, pl_module)
        if supported is None:
            # The user's Run laid over what the trainer says may contradict it (clipping under manual optimization),
            # and several optimizers may share a parameter, which `OptimizerGroup` refuses.
            try:
                run = self._run(trainer)
                optimizer = _optimizer(trainer)
            except ValueError as err:
                reason = str(err).rstrip(".")
                supported = f"the Run or configure_optimizers' optimizers cannot be traced as given: {reason}"
        if supported is not None:
            if is_rank_zero():
                warn(f"preflight: {supported}; the run is not predicted.", RuntimeWarning)
            return
        held = None  # counted once: for the prediction and for the verification's resident bytes
        with internal_failures("counting the model copies other callbacks keep"):
            held = _held_by_callbacks(trainer, pl_module)
        # A failure here still leaves this rank a labelled lower bound, so that every rank takes part in the verdict.
        report = predict_or_lower_bound(lambda: self._predict(trainer, pl_module, run, optimizer, held), pl_module,
                                        optimizer, self.options, run, device=pl_module.device)
        if report is not None and self._autotuned is not None:
            report.autotune = self._autotuned
        self.report = report  # kept when decide raises
        decide(report, self.options, emit=lambda r: _log(trainer, r, verified=False),
               remedy=_REMEDY if pl_module.automatic_optimization else "")
        if self.options.verify_steps:
            self._session = VerifySession(self.report, self.options, pl_module.device,
                                          extra_resident_bytes=_ddp_buckets(trainer) + (held[0] if held else 0))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        session = self._session
        if session is None or not session.active or batch_idx % trainer.accumulate_grad_batches:
            return
        session.step_started([*training_state(pl_module, trainer.optimizers), batch], batch=batch,
                             gradients=any(p.grad is not None for p in pl_module.parameters()))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        session = self._session
        if session is None or not session.active:
            return
        # The optimizer stepped in this batch's closure: the last micro-batch of the accumulation, or of the epoch.
        last = (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or \
            trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if not last:
            return
        with _quiet_logging(pl_module):  # the last step's end traces the measured batches (`VerifySession`)
            finished = session.step_ended()
        if finished:
            _log(trainer, session.report, verified=True)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._session is not None:
            self._session.phase_ended()  # the forward

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._session is not None:
            self._session.phase_ended()  # the backward

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        session = self._session
        if session is None or not session.active or trainer.sanity_checking:
            return
        session.eval_started([*training_state(pl_module, trainer.optimizers), batch], batch)

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._session is not None:
            self._session.eval_ended()

    @untouched()
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._session is not None and self._session.active:  # fewer steps than verify_steps
            with _quiet_logging(pl_module):
                self._session.finish()
            _log(trainer, self._session.report, verified=True)

    @untouched()
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._session is not None and self._session.meter is not None:
            self._session.meter.abort()

    # ---- translation ------------------------------------------------------------------------------------------

    def _predict(self, trainer: pl.Trainer, pl_module: pl.LightningModule, run: Run,
                 optimizer: torch.optim.Optimizer, held: tuple[int, str] | None = None) -> Report:
        loader = _single_loader(trainer.train_dataloader, "train")
        samples = scan(loader, time_limit=self.scan_seconds, on_error=self.options.scan_on_error)
        batch, info = samples.worst_case()
        # The loops convert each batch with the precision plugin before `training_step` (64-true: floats to double).
        convert = trainer.precision_plugin.convert_input
        batch = convert(batch)
        eval_batch = eval_info = None
        val_loader = _val_loader(trainer, pl_module) if self.options.check_eval else None
        if val_loader is not None:
            eval_batch, eval_info = scan(val_loader, time_limit=self.scan_seconds,
                                           on_error=self.options.scan_on_error).worst_case()
            eval_batch = convert(eval_batch)
        _, note = _precision(trainer)
        with _quiet_logging(pl_module):
            report = predict(
                pl_module, optimizer, batch, run, options=self.options,
                step=_step_for(pl_module), batch_info=info, eval_batch=eval_batch, eval_step=_validation_step,
                eval_batch_info=eval_info, ddp_gradient_buckets=_ddp_buckets(trainer) > 0,
                make_batch=lambda b: convert(samples.batch(b)),
                eval_frees_gradients=_frees_gradients_before_eval(trainer, pl_module),
                sample_batches=lambda n: [convert(b) for b in sample_batches(loader, n)],
                held=held,
            )
        if note:
            report.warnings.append(note)
        return report

    def _run(self, trainer: pl.Trainer) -> Run:
        """The run as the trainer describes it (precision, loop, strategy's plan), the user's `Run` laid over it."""
        return self.run.over(Run(precision=_precision(trainer)[0], loop=_schedule(trainer),
                                 parallel=_parallel_plan(trainer), checkpoint=_checkpoint(trainer)))

    def _autotune(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        parsing = importlib.import_module(_lightning(trainer).__name__ + ".utilities.parsing")
        lightning_getattr, lightning_hasattr, lightning_setattr = (parsing.lightning_getattr, parsing.lightning_hasattr,
                                                                   parsing.lightning_setattr)
        if not pl_module.automatic_optimization:
            warn("preflight: autotune keeps the global batch with accumulate_grad_batches, which manual optimization "
                 "does not use; the batch size was not tuned (preflight.max_batch_size predicts a size that fits).",
                 RuntimeWarning)
            return
        if not lightning_hasattr(pl_module, "batch_size"):
            warn("preflight: autotune needs a `batch_size` attribute on the LightningModule, its hparams or "
                 "the datamodule (as BatchSizeFinder does); the batch size was not tuned.", RuntimeWarning)
            return
        original = (lightning_getattr(pl_module, "batch_size"), trainer.accumulate_grad_batches)
        done = False
        with internal_failures("autotune"):
            self._autotuned = self._tune(trainer, pl_module, original, lightning_setattr)
            done = True
        if not done:  # restore the original set-up
            lightning_setattr(pl_module, "batch_size", original[0])
            trainer.accumulate_grad_batches = original[1]
        _reset_train_dataloader(trainer)

    def _tune(self, trainer: pl.Trainer, pl_module: pl.LightningModule, original: tuple[int, int],
              setattr_: Any) -> dict[str, Any]:
        from preflight._autotune import max_batch_size, split_global_batch

        run = self._run(trainer)
        run_budget(run, pl_module)  # a ValueError naming the fix before the dataset is scanned
        with isolated_rng():  # the loader built here is discarded; training builds its own from the same RNG state
            trainer.fit_loop.setup_data()
        samples = scan(_single_loader(trainer.train_dataloader, "train"), time_limit=self.scan_seconds)
        global_batch = original[0] * original[1]
        # Traced with accumulation: any micro-batch below the global batch will accumulate.
        run = run.replace(loop=dataclasses.replace(run.loop, accumulate=2 if global_batch > 1 else 1))
        with _quiet_logging(pl_module), progress("autotune: finding the largest micro-batch that fits",
                                                  enabled=is_rank_zero()):
            convert = trainer.precision_plugin.convert_input  # as the loop does before `training_step`
            result = max_batch_size(pl_module, _optimizer(trainer), lambda b: convert(samples.batch(b)), run,
                                    step=_step_for(pl_module),
                                    max_batch=min(global_batch, self.max_batch_size or global_batch),
                                    multiple_of=self.multiple_of, headroom=self.options.headroom)
        if result.batch_size == 0:
            raise ValueError(f"no micro-batch fits ({'; '.join(result.notes)})")
        plan = split_global_batch(global_batch, result.batch_size)
        setattr_(pl_module, "batch_size", plan.micro_batch_size)
        trainer.accumulate_grad_batches = plan.accumulation_steps
        chosen = {"batch_size": plan.micro_batch_size, "accumulate_grad_batches": plan.accumulation_steps,
                  "global_batch_size": plan.global_batch_size, "original_batch_size": original[0],
                  "original_accumulate_grad_batches": original[1], "exact": plan.exact, "note": plan.note,
                  "predicted_peak_bytes": result.predicted_peak_bytes, "traces": result.traces}
        if is_rank_zero():
            print(f"preflight autotune: batch_size {original[0]} -> {plan.micro_batch_size}, accumulate_grad_batches "
                  f"{original[1]} -> {plan.accumulation_steps} ({plan.note}); traced {result.traces} time(s)",
                  flush=True)
        return chosen


# ---- helpers --------------------------------------------------------------------------------------------------


def _training_step(module: pl.LightningModule, batch: Any) -> Any:
    return module.training_step(*_step_args(module.training_step, batch))


def _step_for(module: pl.LightningModule) -> Any:
    """The step preflight traces: ``training_step`` (automatic optimization: the loss it returns; preflight runs the
    backward and the optimizer step as Lightning's loop does), or, under manual optimization, ``training_step`` as
    the whole step, with `_manual_surface`."""
    return _training_step if module.automatic_optimization else _manual_step


def _manual_step(module: pl.LightningModule, batch: Any) -> Any:
    with _manual_surface(module):
        return _training_step(module, batch)


def _optimizer(trainer: pl.Trainer) -> torch.optim.Optimizer:
    """The trainer's optimizer, or its optimizers as one `preflight.OptimizerGroup` (manual optimization)."""
    optimizers = list(trainer.optimizers)
    return optimizers[0] if len(optimizers) == 1 else OptimizerGroup(optimizers)


class _Stepping:
    """What ``self.optimizers()`` gives a manual ``training_step`` while it is traced: the optimizer's own ``step``
    and ``zero_grad``, without Lightning's loop around them (its step counters, which set ``global_step`` under
    manual optimization, the profiler, the callbacks' ``on_before_optimizer_step``); a closure is evaluated before
    the step, as Lightning's precision plugins do (by the step itself for an optimizer that needs it, LBFGS).
    Anything else is the optimizer's."""

    def __init__(self, module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        self._module, self.optimizer = module, optimizer

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        if closure is None:
            return self.optimizer.step(**kwargs)
        if needs_closure(self.optimizer):  # LBFGS evaluates it as many times as it decides
            return self.optimizer.step(closure, **kwargs)
        with torch.enable_grad():  # the closure's forward and backward before the step, as Lightning's plugins
            result = closure()
        self.optimizer.step(**kwargs)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @contextlib.contextmanager
    def toggle_model(self, sync_grad: bool = True) -> Iterator[None]:
        self._module.toggle_optimizer(self)
        try:
            yield
        finally:
            self._module.untoggle_optimizer(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class _Scheduling:
    """What ``self.lr_schedulers()`` gives a manual ``training_step`` while it is traced: ``step`` does nothing (the
    learning rate changes no memory, and the user's scheduler must not count a step that never trained)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


@contextlib.contextmanager
def _manual_surface(module: pl.LightningModule) -> Iterator[None]:
    """For a manual ``training_step`` traced on fake tensors: ``self.manual_backward(loss)`` is ``loss.backward()``
    (Lightning's adds its callbacks' hooks and the precision plugin's scaling around it), ``self.optimizers()`` and
    ``self.lr_schedulers()`` give `_Stepping` and `_Scheduling` stand-ins; the instance attributes are removed
    afterwards."""
    trainer = module.trainer
    steppers = [_Stepping(module, opt) for opt in trainer.optimizers]
    schedulers = [_Scheduling(config.scheduler) for config in trainer.lr_scheduler_configs]

    def optimizers(use_pl_optimizer: bool = True) -> Any:
        chosen = steppers if use_pl_optimizer else list(trainer.optimizers)  # those point at the clones already
        return chosen[0] if len(chosen) == 1 else chosen

    def lr_schedulers() -> Any:
        return None if not schedulers else schedulers[0] if len(schedulers) == 1 else schedulers

    def manual_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward(*args, **kwargs)

    module.optimizers, module.lr_schedulers, module.manual_backward = optimizers, lr_schedulers, manual_backward
    try:
        yield
    finally:
        del module.optimizers, module.lr_schedulers, module.manual_backward


def _validation_step(module: pl.LightningModule, batch: Any) -> Any:
    return module.validation_step(*_step_args(module.validation_step, batch))


def _step_args(hook: Any, batch: Any) -> tuple[Any, ...]:
    """What Lightning's loops pass to a step hook: ``batch_idx`` only when the hook takes it (a parameter of that
    name, ``*args``, or a second parameter; `lightning.pytorch.utilities.signature_utils.is_param_in_hook_signature`
    as ``training_epoch_loop._build_kwargs`` calls it), so the trace calls the user's step as the real run does."""
    fn = getattr(hook, "__wrapped__", hook)
    spec = inspect.getfullargspec(fn)
    args = spec.args[1:]  # without self
    takes_index = "batch_idx" in args or spec.varargs is not None or len(args) >= 2
    return (batch, 0) if takes_index else (batch,)


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _quiet_logging(module: pl.LightningModule) -> Iterator[None]:
    """Switch ``self.log``/``self.log_dict`` off while the steps run on fake tensors (they would store them in the
    trainer's results); the instance attributes are removed afterwards."""
    module.log = _noop
    module.log_dict = _noop
    try:
        yield
    finally:
        del module.log, module.log_dict


def _frees_gradients_before_eval(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Lightning's fit loop calls ``on_validation_model_zero_grad`` before validating, and its default sets the
    gradients to None; a module that overrides it may keep them (then they are counted, the worst case)."""
    is_overridden = importlib.import_module(_lightning(trainer).__name__ + ".utilities.model_helpers").is_overridden
    return not is_overridden("on_validation_model_zero_grad", pl_module)


def _precision(trainer: pl.Trainer) -> tuple[str | None, str | None]:
    precision = str(trainer.precision)
    if precision in PRECISIONS:
        return precision, None
    if precision == "64-true":  # the module is already double: trace the tensors as they are
        return None, None
    return None, f"precision {precision!r} is traced with the tensors' own dtypes (not modelled)"


def _schedule(trainer: pl.Trainer) -> Loop:
    """Lightning's automatic-optimization step: zero_grad before backward, accumulation, clipping by norm when
    ``gradient_clip_val`` is set with the "norm" algorithm (value clipping allocates nothing), and the precision
    plugin's GradScaler when it has one (``16-mixed``); each module in the mode the user left it (Lightning's fit
    loop calls no ``train()``: it warns about modules in eval mode and keeps them so). Under manual optimization
    ``training_step`` runs the whole step (`preflight.Loop.manual`): Lightning refuses accumulation and clipping
    there, and the step's ``manual_backward`` is traced without the ``16-mixed`` loss scaler. Lightning's precision
    plugins autocast with ``cache_enabled=False`` (`preflight.Loop.autocast_cache`)."""
    if not trainer.lightning_module.automatic_optimization:
        return Loop(manual=True, module_modes="as_set", autocast_cache=False)
    clip = trainer.gradient_clip_val
    by_norm = str(getattr(trainer, "gradient_clip_algorithm", None) or "norm").lower().endswith("norm")
    return Loop(accumulate=trainer.accumulate_grad_batches, zero_grad="before_backward", autocast_cache=False,
                    max_grad_norm=float(clip) if clip and by_norm else None,
                    grad_scaler=getattr(trainer.precision_plugin, "scaler", None) is not None, module_modes="as_set")


def _unsupported_reason(trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
    if not trainer.optimizers:
        return "configure_optimizers returned no optimizer, so there is no training step to predict"
    if pl_module.automatic_optimization and len(trainer.optimizers) != 1:
        return f"{len(trainer.optimizers)} optimizers under automatic optimization are not supported"
    if trainer.train_dataloader is None:
        return "there is no train dataloader"
    return None


def _single_loader(loaders: Any, what: str) -> Any:
    if isinstance(loaders, (list, tuple)) and len(loaders) == 1:
        loaders = loaders[0]
    if isinstance(loaders, torch.utils.data.DataLoader):
        return loaders
    raise ValueError(f"preflight reads one {what} DataLoader; got {type(loaders).__name__}")


def _val_loader(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
    """The validation DataLoader (the first, when there are several), or None without validation."""
    is_overridden = importlib.import_module(_lightning(trainer).__name__ + ".utilities.model_helpers").is_overridden
    loaders = trainer.val_dataloaders
    if loaders is None or trainer.limit_val_batches == 0 or not is_overridden("validation_step", pl_module):
        return None
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        if not loaders:
            return None
        loaders = loaders[0]
    return _single_loader(loaders, "validation")


def _parallel_plan(trainer: pl.Trainer) -> ParallelPlan | None:
    """The trainer's sharded strategy as a `ParallelPlan`: ``FSDPStrategy`` (sharding strategy, CPU offload; hybrid
    sharding over one node's devices), ``DeepSpeedStrategy`` (its config), ``ModelParallelStrategy`` (FSDP2 over the
    data-parallel ranks). None for anything else (DDP is predicted as a replica with its buckets)."""
    strategy = trainer.strategy
    names = {cls.__name__ for cls in type(strategy).__mro__}
    world = max(int(trainer.world_size), 1)
    if "FSDPStrategy" in names:
        sharding = getattr(strategy, "sharding_strategy", None)
        offload = bool(getattr(getattr(strategy, "cpu_offload", None), "offload_params", False))
        name = getattr(sharding, "name", sharding)
        kwargs = getattr(strategy, "kwargs", None) or {}
        policy = kwargs.get("auto_wrap_policy")  # Lightning turns a set of classes into a ModuleWrapPolicy
        units = () if policy is None else getattr(policy, "_module_classes", None)
        return fsdp_plan(sharding, world_size=world, ranks_per_node=max(int(trainer.num_devices), 1),
                         cpu_offload=offload, source=f"Lightning FSDPStrategy({name})",
                         use_orig_params=kwargs.get("use_orig_params"),
                         unit_types=None if units is None else tuple(units))
    if "DeepSpeedStrategy" in names:
        return deepspeed_plan(getattr(strategy, "config", None) or {}, world_size=world,
                              source="Lightning DeepSpeedStrategy")
    if "ModelParallelStrategy" in names:
        data_parallel = getattr(strategy, "_data_parallel_size", "auto")  # "auto": Lightning uses num_nodes
        data_parallel = data_parallel if isinstance(data_parallel, int) else max(int(trainer.num_nodes), 1)
        return fsdp_plan("fsdp2", world_size=max(data_parallel, 1),
                         source=f"Lightning ModelParallelStrategy(data_parallel_size={data_parallel})")
    return None


def _checkpoint(trainer: pl.Trainer) -> Checkpoint | None:
    """How the trainer saves: None without a ``ModelCheckpoint`` (``enable_checkpointing=False``); the optimizer's
    state unless every one saves weights only; ``FSDPStrategy``'s ``state_dict_type`` (``"full"`` by default,
    gathered to rank 0's host memory), ``ModelParallelStrategy``'s distributed checkpoint (sharded) unless
    ``save_distributed_checkpoint=False``, ``DeepSpeedStrategy``'s partitions (``engine.save_checkpoint``: sharded,
    the model never consolidated)."""
    callbacks = list(getattr(trainer, "checkpoint_callbacks", None) or [])
    if not callbacks:
        return None
    weights_only = all(bool(getattr(cb, "save_weights_only", False)) for cb in callbacks)
    names = {cls.__name__ for cls in type(trainer.strategy).__mro__}
    state_dict = "full"
    if "FSDPStrategy" in names:
        state_dict = getattr(trainer.strategy, "_state_dict_type", "full")
    elif "ModelParallelStrategy" in names:
        state_dict = "sharded" if getattr(trainer.strategy, "_save_distributed_checkpoint", True) else "full"
    elif "DeepSpeedStrategy" in names:
        state_dict = "sharded"
    return Checkpoint(optimizer=not weights_only,
                      state_dict=state_dict if state_dict in ("full", "sharded") else "full")


def _held_by_callbacks(trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[int, str] | None:
    """The modules the trainer's callbacks keep beside the LightningModule (the averaged model of
    ``WeightAveraging``, ``EMAWeightAveraging`` and ``StochasticWeightAveraging``, made in ``setup`` /
    ``on_fit_start``, before training starts): their bytes on the module's device and the callbacks' names."""
    names, modules = [], []
    for callback in trainer.callbacks:
        held = [v for v in getattr(callback, "__dict__", {}).values()
                if isinstance(v, nn.Module) and v is not pl_module]
        if held:
            names.append(type(callback).__name__)
            modules.extend(held)
    nbytes = held_module_bytes(modules, pl_module, pl_module.device) if modules else 0
    return (nbytes, "the model copies " + ", ".join(names) + " keeps") if nbytes else None


def _ddp_buckets(trainer: pl.Trainer) -> int:
    return ddp_bucket_bytes(getattr(trainer.strategy, "model", None))  # the DDP-wrapped module, when there is one


def _reset_train_dataloader(trainer: pl.Trainer) -> None:
    """Drop the loader built for autotune so ``fit_loop.run`` builds it again with the chosen batch size (what
    ``lightning.pytorch.tuner.batch_size_scaling._reset_dataloaders`` does)."""
    loop = trainer.fit_loop
    if loop._data_fetcher is not None:
        loop._data_fetcher.teardown()
        loop._data_fetcher = None
    loop._combined_loader = None


def _log(trainer: pl.Trainer, report: Report | None, *, verified: bool) -> None:
    if report is None or not trainer.is_global_zero:
        return
    metrics = {"preflight/predicted_peak_bytes": float(report.predicted_peak_bytes)}
    if verified and report.measured_peak_bytes is not None:
        metrics["preflight/measured_peak_bytes"] = float(report.measured_peak_bytes)
        if report.relative_error is not None:
            metrics["preflight/relative_error"] = float(report.relative_error)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
