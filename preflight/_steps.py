"""One definition of "a training step", shared by the fake trace and the real measurement.

A step is: forward (under autocast for the ``*-mixed`` precisions) to a scalar loss, ``loss.backward()``,
``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``. Running the same code for prediction and for
measurement is what makes their peaks comparable.

Two things trainers do differently change the peak, and a `Loop` says which:

- **Gradient accumulation** (``accumulate > 1``): gradients of the earlier micro-batches are alive during the
  forward and backward of the next. Two micro-batches per optimizer step show the repeating pattern of any
  number >= 2, so that is what runs.
- **Where gradients are freed**: ``"after_step"`` (the HF Trainer, most hand-written loops) or
  ``"before_backward"`` (Lightning's automatic optimization: its closure runs ``training_step``, then
  ``zero_grad``, then ``backward``; lightning/pytorch/loops/optimization/automatic.py). With the latter the
  previous step's gradients are alive through the next forward (measured: +17% on a 4-layer GPT-2 at batch
  2 x 64 tokens). Or never: ``"in_place"`` is ``zero_grad(set_to_none=False)``, the default of
  ``Optimizer.zero_grad`` and ``Module.zero_grad`` before torch 2.0: the gradients are zero-filled after each
  step and stay allocated for the whole run, and the next backward accumulates into them.

Two more things a trainer adds to the step, each traced with torch's own operators when the `Loop` says so:

- **Gradient clipping** (``max_grad_norm``; the HF Trainer clips at 1.0 by default, Lightning when
  ``gradient_clip_val`` is set): ``torch.nn.utils.clip_grad_norm_`` between backward and the optimizer step, with
  its temporaries (one norm per gradient from ``_foreach_norm``, their stack, the total and the clip coefficient).
- **A GradScaler** (``grad_scaler``; fp16 mixed precision on CUDA in the HF Trainer, Lightning and accelerate):
  the loss is multiplied by the scale before backward, the gradients are unscaled and checked for infs in place
  (``_amp_foreach_non_finite_check_and_unscale_``) before clipping and the step, and the scale is updated
  (``_amp_update_scale_``), as ``torch/amp/grad_scaler.py`` does. The step is taken as in the steady state
  (no inf found): the scaler's ``found_inf.item()`` is not read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from preflight._activation_offload import OFFLOAD_MODES, offloading
from preflight._optimizer_group import STANDS_FOR, OptimizerGroup, stands_for

__all__ = [
    "PRECISIONS", "ZERO_GRAD_CHOICES", "Evaluation", "Loop", "StepFn", "check_precision", "check_step", "check_steps",
    "MODULE_MODES", "autocast_for", "compute_loss", "enter_training", "evaluating", "half_dtype", "modes_note",
    "run_steps",
]

StepFn = Callable[[nn.Module, Any], torch.Tensor]

# Lightning's vocabulary (lightning.fabric.connector._PRECISION_INPUT); None keeps the tensors' own dtypes.
PRECISIONS = (None, "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "16": "16-mixed", 16: "16-mixed", "fp16": "16-mixed"}


ZERO_GRAD_CHOICES = ("after_step", "before_backward", "in_place")
MODULE_MODES = ("train", "as_set")


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """The evaluation a trainer runs after training steps, where a per-rank trace runs it after them on the same
    fake ranks (a model laid out by tensor parallelism: each rank evaluates its own shards; `preflight.verdict`).

    Attributes:
        batch: one evaluation batch as the eval dataloader yields it.
        step: ``step(model, batch)``, the evaluation forward (a LightningModule's ``validation_step``); its return
            value is alive until it returns. None: ``model(**batch)`` for a mapping, ``model(batch)`` otherwise.
        frees_gradients: the trainer sets the gradients to None before evaluating (Lightning's default
            ``zero_grad(set_to_none=True)`` at the end of each optimizer step).
        keeps_batch: the training batch is still alive while the trainer evaluates (the HF Trainer evaluates
            inside its loop over the micro-batches); otherwise it is dropped first.
    """

    batch: Any
    step: Callable[[nn.Module, Any], Any] | None = None
    frees_gradients: bool = False
    keeps_batch: bool = False

    def forward(self, model: nn.Module, batch: Any) -> Any:
        """One evaluation forward of ``model`` on ``batch`` (the caller sets eval mode and ``no_grad``)."""
        if self.step is not None:
            return self.step(model, batch)
        return model(**batch) if isinstance(batch, Mapping) else model(batch)


@dataclasses.dataclass(frozen=True)
class Loop:
    """How the training loop steps: the loop section of a `preflight.Run`.

    Attributes:
        accumulate: micro-batches per optimizer step (gradient accumulation).
        zero_grad: ``"after_step"`` (HF Trainer, plain loops), ``"before_backward"`` (Lightning) or
            ``"in_place"`` (``zero_grad(set_to_none=False)``: gradients zero-filled, never freed).
        max_grad_norm: clip the gradients' total 2-norm to this before each optimizer step; None: no clipping.
        grad_scaler: run the step through a loss scaler, as fp16 mixed precision on CUDA does.
        steps: optimizer steps simulated (not the run's length): 2 by default, because step 1 creates the
            optimizer state and step 2 is the steady state.
        optimizer_impl: how the optimizer's step runs: ``"for-loop"`` (one parameter at a time), ``"foreach"``
            (torch's multi-tensor kernels: one temporary per step the size of every parameter it updates) or
            ``"fused"`` (one kernel, no such temporaries), set on the optimizer as torch's ``foreach=`` /
            ``fused=`` arguments (`with_optimizer_impl`); None: as the optimizer is configured (torch's default
            is foreach on CUDA, the for-loop on CPU).
        sampled_steps: on a CUDA target, also trace this many steps over batches drawn at random from the dataset
            (the callbacks' scan: `preflight.sample_batches`), in order, and replay them through the caching
            allocator (`preflight.estimate_steps`): the reserved memory an epoch of varying lengths reaches, which
            a worst-case step alone can miss (fragmentation), goes into the device total. 0: the worst case only
            (each sampled step is a traced step: this costs time).
        offload_activations: the saved activations offloaded to host memory, as the forward's saved-tensor hooks
            do it (`preflight._activation_offload`): ``"save_on_cpu"`` (torch's
            ``torch.autograd.graph.save_on_cpu(pin_memory=True)``: every saved tensor copied to the host as it is
            saved and back when the backward needs it) or ``"streams"`` (TRL's ``activation_offloading=True`` and
            torchtune's ``enable_activation_offloading``: the same copies on a side stream, each offloaded tensor
            kept on the device until its copy is done; small tensors, parameters and the output head's kept
            there). On a CUDA target the offloaded activations leave the device (`preflight.cuda._offload`); on a
            CPU target the copies are host memory like the rest, and are counted. None: no offloading.
        module_modes: the mode each module trains in: ``"train"``: the loop calls ``model.train()`` before its
            steps, so every module trains (the HF Trainer at every step, most hand-written loops); ``"as_set"``:
            each module keeps the mode it has (Lightning keeps the modes the user set, e.g. a frozen backbone left
            in ``eval()``, whose dropout saves no masks and whose BatchNorm uses its running statistics).
        autocast_cache: autocast's cache of casts (torch's ``cache_enabled``) under a ``*-mixed`` precision: True,
            torch's default and accelerate's (the HF Trainer): the low-precision copy of each weight a forward casts
            is kept until the autocast region ends, so an evaluation forward ends holding a copy of every weight it
            used; False, Lightning's precision plugins (``torch.autocast(..., cache_enabled=False)``): each copy is
            freed when its last user is (measured on Lightning bf16-mixed GPT-2: +4.2% in training and evaluation
            when traced with the cache).
        manual: the step function runs the whole training step itself: its forwards, its backward passes and its
            optimizers' steps and zero_grads (Lightning's manual optimization, a GAN's alternating updates of a
            generator and a discriminator). Preflight calls ``step(model, batch)`` once per step and counts what it
            does; the optimizers it calls are the user's (an `preflight.OptimizerGroup` of them where there are
            several), each pointed at its fake clone while the step runs. Accumulation, clipping and loss scaling
            are then the step's own business, not the loop's (leave them at their defaults).
    """

    accumulate: int = 1
    zero_grad: str = "after_step"
    max_grad_norm: float | None = None
    grad_scaler: bool = False
    # Two: step 1 creates the optimizer state, step 2 is the steady state every later step repeats.
    steps: int = 2
    optimizer_impl: str | None = None
    sampled_steps: int = 0
    offload_activations: str | None = None
    module_modes: str = "train"
    autocast_cache: bool = True
    manual: bool = False

    def __post_init__(self) -> None:
        if self.module_modes not in MODULE_MODES:
            raise ValueError(f"`module_modes` should be one of {MODULE_MODES}, got {self.module_modes!r}.")
        object.__setattr__(self, "steps", check_steps(self.steps))
        if isinstance(self.sampled_steps, bool) or not isinstance(self.sampled_steps, int) or self.sampled_steps < 0:
            raise ValueError(f"`sampled_steps` should be a whole number of steps (0: off), got {self.sampled_steps!r}.")
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise ValueError(f"`optimizer_impl` should be one of {OPTIMIZER_IMPLS}, got {self.optimizer_impl!r}.")
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(f"`accumulate` should be a positive integer, got {self.accumulate!r}.")
        if self.zero_grad not in ZERO_GRAD_CHOICES:
            raise ValueError(f"`zero_grad` should be one of {ZERO_GRAD_CHOICES}, got {self.zero_grad!r}.")
        norm = self.max_grad_norm
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float))
                                 or not math.isfinite(norm) or norm <= 0):
            raise ValueError(f"`max_grad_norm` should be a positive, finite number or None (no clipping), got "
                             f"{norm!r}.")
        if not isinstance(self.grad_scaler, bool):
            raise ValueError(f"`grad_scaler` should be True or False, got {self.grad_scaler!r}.")
        if self.offload_activations not in OFFLOAD_MODES:
            raise ValueError(f"`offload_activations` should be one of {OFFLOAD_MODES}, got "
                             f"{self.offload_activations!r}.")
        for name in ("manual", "autocast_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` should be True or False, got {getattr(self, name)!r}.")
        owned = {"accumulate": self.accumulate != 1, "max_grad_norm": self.max_grad_norm is not None,
                 "grad_scaler": self.grad_scaler, "offload_activations": self.offload_activations is not None}
        if self.manual and any(owned.values()):
            names = ", ".join(f"`{k}`" for k, v in owned.items() if v)
            raise ValueError(f"With `manual=True` the step runs its own backward passes and optimizer steps, so "
                             f"{names} would be the step's own doing: leave them at their defaults and do them in "
                             "the step (Lightning's manual optimization does).")

    @property
    def micro_steps(self) -> int:
        """Micro-batches actually run per optimizer step: 2 show the pattern of any accumulation >= 2."""
        return min(self.accumulate, 2)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def enter_training(model: nn.Module, loop: Loop) -> None:
    """Put ``model``'s modules in the modes ``loop`` trains them in (`Loop.module_modes`)."""
    if loop.module_modes == "train":
        model.train()


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode for the block, then each module back in the mode it trained in (as Lightning's
    ``_ModuleMode`` restores them; the HF Trainer's next step calls ``model.train()`` again)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def modes_note(model: nn.Module, loop: Loop) -> str | None:
    """A note where ``loop`` trains every module but the user left some in eval mode under a model in train mode
    (a frozen backbone): they are traced in train mode, which a loop that keeps them in eval does not run."""
    if loop.module_modes != "train" or not isinstance(model, nn.Module) or not model.training:
        return None  # a whole model in eval mode (as `from_pretrained` leaves it) is one the loop's `train()` sets
    names = [name for name, module in model.named_modules() if not module.training]
    tops = [name for name in names if not any(name.startswith(other + ".") for other in names)]
    if not tops:
        return None
    shown = ", ".join(tops[:3]) + (f" and {len(tops) - 3} more" if len(tops) > 3 else "")
    return (f"{len(names)} module(s) in eval mode ({shown}) were traced in train mode, as `model.train()` before "
            "the steps sets them (the HF Trainer calls it at every step); if your loop keeps them in eval, as "
            "Lightning does, say Loop(module_modes=\"as_set\")")


OPTIMIZER_IMPLS = (None, "for-loop", "foreach", "fused")


def with_optimizer_impl(optimizer: torch.optim.Optimizer, impl: str | None) -> torch.optim.Optimizer:
    """``optimizer`` as it runs with implementation ``impl`` (`Loop.optimizer_impl`): the same object when ``impl``
    is None or already in effect, else a new optimizer of the same class over the same parameter groups and
    hyperparameters with ``foreach``/``fused`` set, holding the same state. The user's optimizer is not changed.

    Raises:
        ValueError: the optimizer's class does not take the argument ``impl`` needs (``fused`` for SGD before torch
            2.5, any bitsandbytes optimizer).
    """
    if impl is None:
        return optimizer
    if isinstance(optimizer, OptimizerGroup):
        changed_members = [with_optimizer_impl(opt, impl) for opt in optimizer.optimizers]
        if all(new is opt for new, opt in zip(changed_members, optimizer.optimizers)):
            return optimizer
        return OptimizerGroup(changed_members)
    wanted = {"for-loop": {"foreach": False, "fused": False}, "foreach": {"foreach": True, "fused": False},
              "fused": {"foreach": False, "fused": True}}[impl]
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    missing = [k for k, v in wanted.items() if v and k not in accepted]
    if missing or "foreach" not in accepted:
        raise ValueError(f"`optimizer_impl={impl!r}`: {cls.__module__}.{cls.__qualname__} does not take "
                         f"`{(missing or ['foreach'])[0]}=`; leave optimizer_impl to None for it.")
    wanted = {k: v for k, v in wanted.items() if k in accepted}
    # foreach=None is torch's default for the device (foreach on CUDA), not False; fused=None is False.
    if all(group.get(k) == v or (k == "fused" and not v and not group.get(k)) for group in optimizer.param_groups
           for k, v in wanted.items()):
        return optimizer
    groups = [{**group, **wanted} for group in optimizer.param_groups]
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k not in ("params", "self")}
    changed = cls(groups, **{**defaults, **wanted})
    for p, state in optimizer.state.items():
        changed.state[p] = state
    changed.__dict__[STANDS_FOR] = stands_for(optimizer)  # a step calling the user's optimizer steps this one's clone
    return changed


class LossNotFoundError(ValueError):
    """The default step could not find a loss in the model's output."""


def check_precision(precision: Any) -> str | None:
    """Normalise ``precision`` to one of `PRECISIONS`, or raise a ValueError listing them."""
    precision = _ALIASES.get(precision, precision)
    if precision not in PRECISIONS:
        raise ValueError(f"`precision` should be one of {PRECISIONS}, got {precision!r}.")
    return precision


def check_steps(steps: Any) -> int:
    """``steps`` as an int, or a ValueError/TypeError naming it: a positive integer (numpy integers too)."""
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
        raise TypeError(f"`steps` should be a positive integer (the training steps to run), got "
                        f"{type(steps).__name__} {steps!r}.")
    if steps < 1:
        raise ValueError(f"`steps` should be at least 1, got {steps!r}.")
    return int(steps)


def check_step(step: Any, name: str = "step") -> None:
    """Raise a TypeError naming ``name`` when ``step`` is given but is not a callable taking ``(model, batch)``
    (checked on its signature, before anything runs; a callable without one is taken as it is)."""
    if step is None:
        return
    if not callable(step):
        raise TypeError(f"`{name}` should be a callable {name}(model, batch), got {type(step).__name__}: {step!r}.")
    try:
        signature = inspect.signature(step)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    try:
        signature.bind(None, None)
    except TypeError as err:
        raise TypeError(f"`{name}` is called as {name}(model, batch), but its signature is {signature} ({err}). "
                        f"Give it two positional parameters, e.g. `lambda model, batch: model(**batch).loss`.") \
            from None


def half_dtype(precision: str | None) -> torch.dtype | None:
    """The 16-bit dtype a precision computes in (``bf16-*``: bfloat16, ``16-*``: float16), or None (32-bit)."""
    return {"bf16": torch.bfloat16, "16": torch.float16}.get((precision or "").split("-")[0])


def autocast_for(precision: str | None, device_type: str, cache: bool = True) -> contextlib.AbstractContextManager:
    """The autocast context a ``*-mixed`` precision runs the forward under (a null context otherwise), with its cast
    cache on or off (`Loop.autocast_cache`)."""
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16, cache_enabled=cache)
    if precision == "16-mixed":
        return torch.autocast(device_type=device_type, dtype=torch.float16, cache_enabled=cache)
    return contextlib.nullcontext()


@contextlib.contextmanager
def forward_context(precision: str | None, device_type: str, schedule: Loop) -> Iterator[None]:
    """What a training forward runs under: the precision's autocast, and torch's ``save_on_cpu`` where the loop
    offloads activations that way (users enter it around the forward)."""
    with autocast_for(precision, device_type, schedule.autocast_cache), \
            offloading(schedule.offload_activations if schedule.offload_activations == "save_on_cpu" else None, None):
        yield


def step_offloading(schedule: Loop, model: nn.Module | None) -> contextlib.AbstractContextManager:
    """What a micro-step's forward and backward run under together: the stream-based offloading hooks where the loop
    offloads activations that way (TRL's trainers enter them around the whole training step), for ``model``'s
    parameters and output head (`preflight._activation_offload.StashedOffload`)."""
    return offloading("streams" if schedule.offload_activations == "streams" else None, model)


def compute_loss(model: nn.Module, batch: Any, step: StepFn | None) -> torch.Tensor:
    """Run the forward and return the scalar loss.

    Without ``step``: ``model(**batch)`` for a mapping, ``model(batch)`` otherwise, then ``.loss``,
    ``["loss"]``, a scalar tensor output, or the first element of a tuple output.
    """
    if step is not None:
        out = step(model, batch)
        loss = _find_loss(out)
        if loss is None:
            raise LossNotFoundError(_without_grad(out, model) or (
                f"`step` returned {_describe(out)}; it should return a scalar loss tensor (or an output with .loss)."
            ))
        return loss
    out = model(**batch) if isinstance(batch, Mapping) else model(batch)
    loss = _find_loss(out)
    if loss is None:
        raise LossNotFoundError(_without_grad(out, model) or (
            f"Could not find a loss in the model's output ({_describe(out)}). Pass `step=lambda model, batch: ...` "
            "returning a scalar loss, or include labels in the batch so the model computes its loss."
        ))
    return loss


def _without_grad(out: Any, model: nn.Module) -> str | None:
    """Why a scalar loss the step did return records no gradient, or None when it returned none."""
    candidate = _find_loss(out, requiring_grad=False)
    if candidate is None or candidate.requires_grad:
        return None
    if torch.is_inference_mode_enabled():
        why = "the step ran under torch.inference_mode()"
    elif not torch.is_grad_enabled():
        why = "the step ran under torch.no_grad() (or set_grad_enabled(False))"
    elif not any(p.requires_grad for p in model.parameters()):
        why = "no parameter of the model requires grad (all frozen)"
    else:
        why = ("no parameter that requires grad reached it: the step ran its forward under torch.no_grad() or "
               "torch.inference_mode(), disabled its adapters (peft's disable_adapter()), or used only frozen "
               "parameters")
    return (f"The step's loss ({_describe(candidate)}) records no gradient: {why}. A training step needs a loss "
            "that backward can run from; fix the step, not the batch.")


def _find_loss(out: Any, *, requiring_grad: bool = True) -> torch.Tensor | None:
    candidate = None
    if isinstance(out, torch.Tensor):
        candidate = out
    elif getattr(out, "loss", None) is not None:
        candidate = out.loss
    elif isinstance(out, Mapping) and out.get("loss") is not None:
        candidate = out["loss"]
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        candidate = out[0]
    wanted = isinstance(candidate, torch.Tensor) and candidate.numel() == 1
    if wanted and (candidate.requires_grad or not requiring_grad):
        return candidate.reshape(()) if requiring_grad else candidate
    return None


def _describe(out: Any) -> str:
    if isinstance(out, torch.Tensor):
        note = "" if out.requires_grad else ", not requiring grad"
        return f"a tensor of shape {tuple(out.shape)}{note}"
    return f"a {type(out).__name__}"


def run_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    *,
    step: StepFn | None,
    precision: str | None,
    device_type: str,
    steps: int,
    schedule: Loop = Loop(),
    on_phase: Callable[[int, str], None] = lambda i, phase: None,
    before_backward: Callable[[torch.Tensor], None] = lambda loss: None,
    drive: Callable[[Any], None] | None = None,
    save: Callable[[nn.Module, torch.optim.Optimizer], None] | None = None,
    batches: Callable[[int], Any] | None = None,
    manual: Callable[[Callable[[bool], None]], Any] | None = None,
) -> None:
    """Run ``steps`` optimizer steps in ``schedule``'s order, calling ``on_phase(step_index, phase)`` as each
    phase starts (``forward``, ``backward``, ``optimizer``, ``zero_grad``, and ``end`` once at the end), and
    ``before_backward(loss)`` just before each ``loss.backward()``.

    ``drive``: ``drive(batch)`` runs the forward and the backward itself (a pipeline schedule's ``step``, which
    interleaves its micro-batches' forwards and backwards), in one phase named ``pipeline``; ``before_backward`` is
    then called with each root of every backward it runs (`_watching_backward`).

    ``save``: ``save(model, optimizer)`` runs once after the last step, in the phase ``save`` (a checkpoint save,
    with the training state the steps leave: `preflight._checkpoint.collect_state`).

    ``batches``: ``batches(i)`` is step ``i``'s batch (from 1), fetched as the step starts, as a loader yields a new
    one each step; ``batch`` is then not used.

    ``manual`` (with `Loop.manual`): ``manual(on_step)`` is a context in which the optimizers the user's step calls
    step ``optimizer``'s parameters and state, calling ``on_step(True)`` as each step starts and ``on_step(False)``
    as it ends (`preflight._optimizer_group.manual_optimizers`); None: they are stepped as they are (a real run).
    The whole step is one phase named ``manual``, with ``optimizer`` phases inside it."""
    # A training step records gradients, whatever the caller's mode.
    with torch.inference_mode(False), torch.enable_grad():
        if schedule.manual:
            _run_manual_steps(model, batch, step=step, precision=precision, device_type=device_type, steps=steps,
                              schedule=schedule, on_phase=on_phase, before_backward=before_backward,
                              batches=batches, manual=manual)
        elif drive is not None:
            _run_driven_steps(optimizer, batch, drive=drive, precision=precision, device_type=device_type,
                              steps=steps, schedule=schedule, on_phase=on_phase, before_backward=before_backward)
        else:
            _run_steps(model, optimizer, batch, step=step, precision=precision, device_type=device_type, steps=steps,
                       schedule=schedule, on_phase=on_phase, before_backward=before_backward, batches=batches)
    if save is not None:
        on_phase(steps, "save")
        with torch.no_grad():  # trainers save outside autograd
            save(model, optimizer)


def _run_manual_steps(model: nn.Module, batch: Any, *, step: StepFn | None, precision: str | None, device_type: str,
                      steps: int, schedule: Loop, on_phase: Callable[[int, str], None],
                      before_backward: Callable[[torch.Tensor], None], batches: Callable[[int], Any] | None,
                      manual: Callable[[Callable[[bool], None]], Any] | None) -> None:
    """`run_steps` with `Loop.manual`: ``step(model, batch)`` runs the whole step (forwards, backwards, optimizer
    steps), under the precision's autocast as Lightning runs ``training_step``; what it returns is not used."""
    if step is None:
        raise ValueError("`Loop(manual=True)` needs `step=`: the function that runs the step's forwards, backward "
                         "passes and optimizer steps (step(model, batch)).")
    for i in range(1, steps + 1):
        on_phase(i, "manual")
        if batches is not None:
            batch = batches(i)  # the previous step's batch is released here, as a loader's is

        def on_step(starting: bool, i: int = i) -> None:
            on_phase(i, "optimizer" if starting else "manual")

        with manual(on_step) if manual is not None else contextlib.nullcontext():
            with forward_context(precision, device_type, schedule), \
                    _watching_backward(before_backward, after=lambda i=i: on_phase(i, "manual")):
                step(model, batch)
    on_phase(steps, "end")


def _run_driven_steps(optimizer: torch.optim.Optimizer, batch: Any, *, drive: Callable[[Any], None],
                      precision: str | None, device_type: str, steps: int, schedule: Loop,
                      on_phase: Callable[[int, str], None], before_backward: Callable[[torch.Tensor], None]) -> None:
    """`run_steps` with ``drive``: the optimizer and zero_grad phases as the loop has them, the forward and backward
    in ``drive``."""
    if schedule.grad_scaler or needs_closure(optimizer):
        raise ValueError("a step driven by a schedule (pipeline parallelism) is traced without a loss scaler or a "
                         "closure optimizer")
    if schedule.offload_activations == "streams":
        raise ValueError("activation offloading with streams (TRL's, torchtune's) is not traced under a pipeline "
                         "schedule; describe the run with Loop(offload_activations=\"save_on_cpu\") or without it")
    for i in range(1, steps + 1):
        for micro in range(schedule.micro_steps):
            if schedule.zero_grad == "before_backward" and micro == 0:
                on_phase(i, "zero_grad")
                optimizer.zero_grad(set_to_none=True)
            on_phase(i, "pipeline")
            with forward_context(precision, device_type, schedule), _watching_backward(before_backward):
                drive(batch)
        _optimizer_phase(i, optimizer, schedule, on_phase)
    on_phase(steps, "end")


@contextlib.contextmanager
def _watching_backward(before_backward: Callable[[torch.Tensor], None],
                       after: Callable[[], None] | None = None) -> Iterator[None]:
    """For the block, call ``before_backward(root)`` for each root of every ``torch.autograd.backward`` and
    ``torch.autograd.grad`` (a schedule runs its own backwards, one per micro-batch), then run it. Only fake roots
    (the trace's own) are passed on: a real backward another thread runs meanwhile is left alone."""
    from torch._subclasses.fake_tensor import FakeTensor

    backward, grad = torch.autograd.backward, torch.autograd.grad

    def announce(roots: Any) -> None:
        for root in (roots,) if isinstance(roots, torch.Tensor) else roots:
            if isinstance(root, FakeTensor) and root.grad_fn is not None:
                before_backward(root)

    def watched_backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        announce(tensors)
        out = backward(tensors, *args, **kwargs)
        if after is not None:  # what runs next is not the backward (a manual step's own code)
            after()
        return out

    def watched_grad(outputs: Any, *args: Any, **kwargs: Any) -> Any:
        announce(outputs)
        out = grad(outputs, *args, **kwargs)
        if after is not None:
            after()
        return out

    torch.autograd.backward, torch.autograd.grad = watched_backward, watched_grad
    try:
        yield
    finally:
        torch.autograd.backward, torch.autograd.grad = backward, grad


def _run_steps(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, *, step: StepFn | None,
               precision: str | None, device_type: str, steps: int, schedule: Loop,
               on_phase: Callable[[int, str], None], before_backward: Callable[[torch.Tensor], None],
               batches: Callable[[int], Any] | None = None) -> None:
    scaler = _LossScaler() if schedule.grad_scaler else None
    if batches is not None and needs_closure(optimizer):
        raise ValueError("steps over a sequence of batches are run without a closure optimizer (LBFGS)")
    if needs_closure(optimizer):
        _run_closure_steps(model, optimizer, batch, step=step, precision=precision, device_type=device_type,
                           steps=steps, schedule=schedule, on_phase=on_phase, before_backward=before_backward)
        return
    for i in range(1, steps + 1):
        for micro in range(schedule.micro_steps):
            on_phase(i, "forward")
            if batches is not None and micro == 0:
                batch = batches(i)  # the previous step's batch is released here, as a loader's is
            with step_offloading(schedule, model):
                with forward_context(precision, device_type, schedule):
                    loss = compute_loss(model, batch, step)
                if schedule.zero_grad == "before_backward" and micro == 0:
                    on_phase(i, "zero_grad")
                    optimizer.zero_grad(set_to_none=True)
                on_phase(i, "backward")
                if scaler is not None:
                    loss = scaler.scale(loss)
                before_backward(loss)
                loss.backward()
                del loss
        _optimizer_phase(i, optimizer, schedule, on_phase, scaler)
    on_phase(steps, "end")


def _optimizer_phase(i: int, optimizer: torch.optim.Optimizer, schedule: Loop, on_phase: Callable[[int, str], None],
                     scaler: _LossScaler | None = None) -> None:
    """Step ``i``'s end as the loop has it: unscale, clip, ``optimizer.step()``, and zero_grad unless the loop
    zeroes before backward."""
    on_phase(i, "optimizer")
    if scaler is not None:
        scaler.unscale_(optimizer)
    if schedule.max_grad_norm is not None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, schedule.max_grad_norm, foreach=_clip_foreach(params))
    optimizer.step()
    if scaler is not None:
        scaler.update()
    if schedule.zero_grad != "before_backward":
        on_phase(i, "zero_grad")
        optimizer.zero_grad(set_to_none=schedule.zero_grad == "after_step")


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` must be given a closure (``LBFGS``): its ``closure`` parameter has no default."""
    try:
        parameter = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _run_closure_steps(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, *, step: StepFn | None,
                       precision: str | None, device_type: str, steps: int, schedule: Loop,
                       on_phase: Callable[[int, str], None],
                       before_backward: Callable[[torch.Tensor], None]) -> None:
    """The loop a closure optimizer is trained with (the LBFGS example in torch.optim's documentation): each step
    is ``optimizer.step(closure)``, the closure zeroing the gradients, computing the loss and running backward; the
    optimizer calls it as many times as it decides."""
    for i in range(1, steps + 1):
        def closure(i: int = i) -> torch.Tensor:
            on_phase(i, "zero_grad")
            optimizer.zero_grad(set_to_none=True)
            on_phase(i, "forward")
            with step_offloading(schedule, model):
                with forward_context(precision, device_type, schedule):
                    loss = compute_loss(model, batch, step)
                on_phase(i, "backward")
                before_backward(loss)
                loss.backward()
            on_phase(i, "optimizer")
            return loss.detach()

        on_phase(i, "optimizer")
        optimizer.step(closure)
    on_phase(steps, "end")


def _clip_foreach(params: list[torch.Tensor]) -> bool | None:
    """What ``clip_grad_norm_(foreach=None)`` picks for the real run's plain tensors: foreach where the device
    supports it. Said explicitly, since fake tensors (not plain ``Tensor``s) would take the per-tensor loop."""
    try:
        from torch.utils._foreach_utils import _device_has_foreach_support
    except ImportError:  # pragma: no cover - older torch
        return None
    return True if params and _device_has_foreach_support(params[0].device) else None


class _LossScaler:
    """What ``torch.amp.GradScaler`` allocates and runs, with its defaults (init_scale 2**16, growth 2.0, backoff
    0.5, interval 2000), on the loss's device: a scale and a growth tracker for the run, per step an inverse scale
    and a found-inf flag, the in-place unscale and inf check, and the in-place scale update."""

    def __init__(self) -> None:
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._found_inf: torch.Tensor | None = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        if self._scale is None:  # GradScaler._lazy_init_scale_growth_tracker
            self._scale = torch.full((), 2.0**16, dtype=torch.float32, device=loss.device)
            self._growth_tracker = torch.full((), 0, dtype=torch.int32, device=loss.device)
        return loss * self._scale.to(device=loss.device, non_blocking=True)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self._scale is None:
            return
        inv_scale = self._scale.double().reciprocal().float()
        self._found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
        by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_dtype.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        for grads in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self._found_inf, inv_scale)

    def update(self) -> None:
        if self._scale is None or self._found_inf is None:
            return
        torch._amp_update_scale_(self._scale, self._growth_tracker, self._found_inf, 2.0, 0.5, 2000)
        self._found_inf = None
