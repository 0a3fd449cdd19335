"""How a trainer orders the work of one optimizer step, expressed through `preflight.estimate`'s own arguments.

`preflight.estimate` traces forward, backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``: the order
of the HF Trainer and of most hand-written loops. Two things trainers do differently change the peak:

- **Gradient accumulation** (``accumulate > 1``): gradients of the earlier micro-batches are alive during the
  forward and backward of the next one. Two micro-batches per optimizer step show the repeating pattern of any
  number >= 2, so the traced step runs one forward and backward, then the forward whose loss the trace
  backpropagates and steps.
- **Zeroing before backward** (``zero_grad="before_backward"``, Lightning's automatic optimization: its
  closure runs ``training_step``, then ``zero_grad``, then ``backward``; lightning/pytorch/loops/optimization/
  automatic.py, ``Closure.closure``): the previous step's gradients are alive through the next forward, which
  can hold the peak (measured: +17% on a 4-layer GPT-2 at batch 2 x 64 tokens). The traced optimizer's
  ``zero_grad`` does nothing and a hook on the loss frees the gradients when backward starts.

Both are applied by wrapping the step function and, for the second, the optimizer's class; the user's objects
are not touched (the wrapper class is only instantiated by the trace's optimizer clone).

Known limitations: the first micro-batch's backward runs inside the traced step's forward phase, so its events
are labelled ``stepN/forward``; gradient clipping, loss scaling (``GradScaler``) and the loss division by the
accumulation steps are not traced (a few scalars).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from preflight._steps import StepFn, compute_loss

__all__ = ["ZERO_GRAD_CHOICES", "Schedule", "scheduled"]

ZERO_GRAD_CHOICES = ("after_step", "before_backward")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A trainer's step order.

    Attributes:
        accumulate: micro-batches per optimizer step (gradient accumulation).
        zero_grad: ``"after_step"`` (HF Trainer, plain loops) or ``"before_backward"`` (Lightning).
    """

    accumulate: int = 1
    zero_grad: str = "after_step"

    def __post_init__(self) -> None:
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(f"`accumulate` should be a positive integer, got {self.accumulate!r}.")
        if self.zero_grad not in ZERO_GRAD_CHOICES:
            raise ValueError(f"`zero_grad` should be one of {ZERO_GRAD_CHOICES}, got {self.zero_grad!r}.")

    @property
    def is_default(self) -> bool:
        return self.accumulate == 1 and self.zero_grad == "after_step"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def scheduled(optimizer: torch.optim.Optimizer, step: StepFn | None,
              schedule: Schedule) -> tuple[torch.optim.Optimizer, StepFn | None]:
    """The optimizer and step to pass to `preflight.estimate` so that it traces ``schedule``.

    Returns ``(optimizer, step)`` unchanged for the default schedule.
    """
    if schedule.is_default:
        return optimizer, step
    keep = schedule.zero_grad == "before_backward"
    traced_optimizer = _keeping_gradients(optimizer) if keep else optimizer

    def trainer_step(model: nn.Module, batch: Any) -> torch.Tensor:
        if schedule.accumulate > 1:
            first = compute_loss(model, batch, step)
            if keep:
                _free_gradients_at_backward(first, model)
            # The real loop runs backward outside autocast; the trace entered it for the forward.
            with torch.autocast(device_type=first.device.type, enabled=False):
                first.backward()
            del first
            return compute_loss(model, batch, step)  # backpropagated (accumulating) and stepped by the trace
        loss = compute_loss(model, batch, step)
        if keep:
            _free_gradients_at_backward(loss, model)
        return loss

    return traced_optimizer, trainer_step


def _free_gradients_at_backward(loss: torch.Tensor, model: nn.Module) -> None:
    """Set every parameter's ``.grad`` to None when backward reaches ``loss`` (before any gradient is made)."""

    def free(grad: torch.Tensor) -> None:
        for p in model.parameters():
            p.grad = None

    loss.register_hook(free)


def _no_zero_grad(self: Any, set_to_none: bool = True) -> None:
    """Gradients are freed by the hook at the start of the next backward, as Lightning does."""


def _keeping_gradients(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A view of ``optimizer`` whose class keeps ``zero_grad`` from freeing anything.

    The trace rebuilds the optimizer from ``type(optimizer)``, ``param_groups`` and ``defaults``, so the view
    shares the user's attributes (read only) under a subclass with the same name and module.
    """
    cls = type(optimizer)
    sub = type(cls.__name__, (cls,), {"zero_grad": _no_zero_grad, "__module__": cls.__module__,
                                      "__doc__": cls.__doc__})
    view = sub.__new__(sub)
    view.__dict__.update(optimizer.__dict__)
    return view
