"""Run training steps of the user's real model on fake tensors and record every allocation and free.

The user's module is run as it is (its code, hooks, checkpointing and PEFT wrappers), with its parameters and
buffers swapped for fake twins for the duration of the trace (``torch.func.functional_call``'s mechanism),
under a `FakeTensorMode`: no real memory is allocated for them, and nothing of the user's is written. On exit
the module's attributes, training flags and the RNG streams are restored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_map

from preflight._compat import real_run_paths
from preflight._result import Category, Event
from preflight._steps import LossNotFoundError, Schedule, StepFn, run_steps
from preflight._tracker import SHADOW_MAX_NUMEL, StorageTracker
from preflight._twin import TwinMaker, clone_optimizer, float_dtype_for

__all__ = ["TensorSpec", "TraceResult", "trace_steps", "preserved_state"]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Shape, stride and dtype of a tensor seen in the trace."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype)
        return x


@dataclasses.dataclass
class TraceResult:
    """What a trace recorded. ``error`` is set when the trace stopped early (then events are partial)."""

    events: list[Event]
    categories: dict[int, Category]
    num_ops: int
    seconds: float
    error: BaseException | None = None
    failed_op: str | None = None
    op_log: list[tuple[int, int, Any, Any, Any]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


def trace_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    *,
    step: StepFn | None,
    precision: str | None,
    trace_device: torch.device,
    target_device: torch.device,
    steps: int,
    schedule: Schedule = Schedule(),
    record_op: Callable[[Any], bool] | None = None,
) -> TraceResult:
    """Trace ``steps`` training steps on fake tensors.

    Args:
        record_op: ``record_op(func) -> bool``; operators for which it is true are logged with their fake
            arguments in ``op_log`` as ``(op_index, event_index, func, args, kwargs)`` (used to calibrate kernel
            scratch memory); tensors are logged as `TensorSpec`.

    Raises:
        LossNotFoundError: the step produced no loss (a wrong argument, not a tracing limitation).
    """
    start = time.perf_counter()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    op_log: list[tuple[int, int, Any, Any, Any]] = []

    def on_op(index: int, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if record_op is not None and record_op(func):
            # Shapes only: holding the fake tensors would keep their storages alive and change the trace.
            op_log.append((index, len(tracker.events), func, tree_map(TensorSpec.of, args), tree_map(TensorSpec.of, kwargs)))

    tracker = StorageTracker(fake_mode, on_op=on_op)
    twins = TwinMaker(fake_mode, trace_device, cast_dtype=float_dtype_for(precision))
    state = twins.module_state(model)
    fake_batch = twins.batch(batch, cast=float_dtype_for(precision) is not None)
    # The target's default implementation: torch picks foreach for CUDA tensors, a for-loop on CPU.
    foreach = True if target_device.type == "cuda" else None
    fake_opt = clone_optimizer(optimizer, twins, foreach=foreach)

    for name, t in model.named_parameters():
        tracker.register(state[name], Category.PARAMETERS)
    for name, t in model.named_buffers():
        tracker.register(state[name], Category.BUFFERS)
    for real, fake in zip(tree_flatten(batch)[0], tree_flatten(fake_batch)[0]):
        if isinstance(fake, torch.Tensor):
            tracker.register(fake, Category.INPUTS)
            if _can_shadow(real):
                tracker.shadow(fake, real.detach().cpu())
    for st in fake_opt.state.values():
        for key, v in list(st.items()):
            if isinstance(v, torch.Tensor) and v.device.type != "meta" and not isinstance(v, FakeTensor):
                # State some optimizers create in __init__ (Adagrad's step counter): fake it, keep its value.
                st[key] = fake_mode.from_tensor(v)
                tracker.shadow(st[key], v.detach().clone())
            if isinstance(st[key], torch.Tensor):
                tracker.register(st[key], Category.OPTIMIZER_STATE)

    fake_params = [p for group in fake_opt.param_groups for p in group["params"]]

    def on_phase(i: int, phase: str) -> None:
        if phase == "optimizer":  # gradients are complete: label them
            for p in fake_params:
                if p.grad is not None:
                    tracker.label(p.grad, Category.GRADIENTS)
        if phase in ("zero_grad", "end"):  # state exists once the step ran
            for st in fake_opt.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        tracker.label(v, Category.OPTIMIZER_STATE)
        tracker.placeholders_allowed = phase == "optimizer"
        tracker.phase = f"step{i}/{phase}"
        tracker.phase_category = Category.ACTIVATIONS if phase == "forward" else Category.TEMPORARIES

    error: BaseException | None = None
    failed_op: str | None = None
    notes: list[str] = []
    with preserved_state(model), real_run_paths(notes), fake_mode, tracker, _reparametrize_module(
        model, state, tie_weights=True, strict=False
    ):
        model.train()
        try:
            run_steps(model, fake_opt, fake_batch, step=step, precision=precision,
                      device_type=trace_device.type, steps=steps, schedule=schedule, on_phase=on_phase)
        except LossNotFoundError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure of the user's code under fake tensors is reported
            error, failed_op = err, tracker.failed_op or tracker.last_op
    if tracker.placeholders_used:
        notes.append(f"the optimizer read {tracker.placeholders_used} parameter-dependent value(s); placeholders "
                     "were used (they change arithmetic, not which tensors exist)")
    # Drop the fake objects so remaining frees are recorded, then stop listening.
    del fake_opt, fake_params, fake_batch, state
    tracker.detach()
    return TraceResult(
        events=tracker.events,
        categories=tracker.categories,
        num_ops=tracker.num_ops,
        seconds=time.perf_counter() - start,
        error=error,
        failed_op=failed_op,
        op_log=op_log,
        notes=notes,
    )


def _can_shadow(t: Any) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.device.type != "meta"
        and not t.is_floating_point()
        and not t.is_complex()
        and t.numel() <= SHADOW_MAX_NUMEL
    )


@contextlib.contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Restore module attributes, training flags and every RNG stream (torch, CUDA, Python, numpy) on exit."""
    modules = list(model.modules())
    saved = [(m, dict(m.__dict__)) for m in modules]
    python_state = random.getstate()
    np_state = _numpy_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for m, attrs in saved:
            current = m.__dict__
            for key in [k for k in current if k not in attrs]:
                del current[key]
            for key, value in attrs.items():
                if current.get(key, _MISSING) is not value:
                    current[key] = value
        random.setstate(python_state)
        if np_state is not None:
            import numpy as np

            np.random.set_state(np_state)


_MISSING = object()


def _numpy_state() -> Any:
    import sys

    np = sys.modules.get("numpy")
    return np.random.get_state() if np is not None else None
