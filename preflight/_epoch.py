"""`estimate_steps`: training steps over a sequence of batches of varying shapes, as a loader yields them, traced in
one run, and the CUDA caching allocator's reserved memory over them, with or without ``torch.cuda.empty_cache()``
between steps.

Two steps at the worst-case shape give the peak of allocated memory. Reserved memory is another matter: the
allocator keeps freed blocks cached, and a step of a new shape may find no cached block of its size and reserve a
new segment beside the ones it cannot reuse, so that reserved memory grows over an epoch of varying lengths beyond
what one shape shows (issue reports put it at 16% over a two-step, one-shape simulation). Here the user's real
step runs once per batch of the sequence, in order, on fake tensors; the allocation events of all of them are
replayed through `preflight.allocator.simulate`, with ``empty_cache`` after each step when asked; the result says
how many steps were simulated and after which step the reserved memory stopped growing.

Known limitations: the sequence is the caller's (a loader's batches in the order they come; `sample_batches` draws
such a sequence from a dataloader without touching it); each step is traced in full (the depth-independent
composition of `preflight.trace` needs one shape), so the cost grows with the number of steps; one device only.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from preflight._device import resolve_device, trace_device_for, unmodelled_device_note
from preflight._estimate import _allocator_config, _traced_coverage, uncalibrated_notes, summarize_events
from preflight._gpus import with_context
from preflight._guard import untouched
from preflight._result import Estimate
from preflight._run import Run, check_run
from preflight._scratch import Calibrator, scratch_ops
from preflight._steps import StepFn, check_step, with_optimizer_impl
from preflight._target import add_workspaces, resolve_gpu, round_events
from preflight._units import format_bytes
from preflight.allocator import simulate
from preflight.cuda import CudaTarget
from preflight.parallel._pipeline import refuse_job_pipeline
from preflight.trace import trace_steps

__all__ = ["StepsEstimate", "estimate_steps", "sample_batches"]


@dataclasses.dataclass(frozen=True)
class StepsEstimate:
    """Training steps over a sequence of batches, predicted.

    Attributes:
        estimate: the `Estimate` over all the steps (its peak is the largest step's; ``steps`` their number).
        step_peak_bytes: the peak of allocated memory within each step, in order.
        reserved_after_step: on a CUDA target, the allocator's reserved bytes at the end of each step (before an
            ``empty_cache``); None on another target.
        peak_reserved_bytes: on a CUDA target, the reserved peak over the sequence.
        stopped_growing_at: on a CUDA target, the step (from 1) in which the reserved memory last grew; later steps
            reused what was reserved.
        empty_cache: whether ``torch.cuda.empty_cache()`` ran after each step.
    """

    estimate: Estimate
    step_peak_bytes: tuple[int, ...]
    reserved_after_step: tuple[int, ...] | None
    peak_reserved_bytes: int | None
    stopped_growing_at: int | None
    empty_cache: bool

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("step_peak_bytes", "reserved_after_step", "peak_reserved_bytes",
                                             "stopped_growing_at", "empty_cache")}
        out["estimate"] = self.estimate.to_dict()
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    def __str__(self) -> str:
        n = len(self.step_peak_bytes)
        lines = [f"{n} steps over batches of varying shapes: allocated peak {format_bytes(max(self.step_peak_bytes))}"
                 f" (steps from {format_bytes(min(self.step_peak_bytes))})"]
        if self.reserved_after_step is not None:
            lines.append(f"  reserved peak {format_bytes(self.peak_reserved_bytes)}"
                         f"{' with empty_cache() after each step' if self.empty_cache else ''}; it last grew in "
                         f"step {self.stopped_growing_at} of {n}")
            lines.append("  reserved after each step: " + ", ".join(format_bytes(b) for b in self.reserved_after_step))
        return "\n".join(lines)


@untouched()
def estimate_steps(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[Any], run: Run | None = None,
                   *, step: StepFn | None = None, empty_cache: bool = False) -> StepsEstimate:
    """Predict training steps over ``batches``, one step per batch in order, and on a CUDA target the reserved
    memory over them (module docstring). Nothing of the user's changes, as with `preflight.estimate`.

    Args:
        model, optimizer, step: as for `preflight.estimate`.
        batches: the batches of consecutive steps, as the loader yields them (at least one).
        run: as for `preflight.estimate`, one device (no parallel plan); its loop's ``steps`` is ignored (one step
            per batch).
        empty_cache: call ``torch.cuda.empty_cache()`` after each step, as some training loops do.

    Returns:
        A `StepsEstimate`.

    Raises:
        ValueError: no batches, or a parallel plan over several ranks.

    Example:
        >>> run = Run(target=Target(gpu="A100-80GB"))
        >>> series = preflight.estimate_steps(model, opt, sample_batches(loader, 16), run)  # doctest: +SKIP
        >>> series.reserved_after_step, series.stopped_growing_at  # doctest: +SKIP
    """
    refuse_job_pipeline(model, "estimate_steps")
    run = check_run(run)
    check_step(step)
    batches = list(batches)
    if not batches:
        raise ValueError("`batches` should hold the batches of at least one step, in the order the loader yields "
                         "them (preflight.sample_batches(loader, n) draws such a sequence).")
    if run.world_size > 1:
        raise ValueError("`estimate_steps` predicts one device's steps: leave `run.parallel` out (per-rank figures "
                         "over a sequence of shapes are not traced yet).")
    optimizer = with_optimizer_impl(optimizer, run.loop.optimizer_impl)
    gpu_info = resolve_gpu(run.target.gpu, torch.device("cuda")) if run.target.gpu is not None else None
    target = resolve_device(run.target.planned_device, model)
    if gpu_info is None:
        gpu_info = resolve_gpu(None, target)
    gpu_info = with_context(gpu_info, run.target.cuda_context)
    trace_device = trace_device_for(target)
    result = trace_steps(model, optimizer, None, step=step, precision=run.precision, trace_device=trace_device,
                         target_device=target, steps=len(batches), schedule=run.loop, record_op=scratch_ops(target),
                         routing=run.routing, cuda=CudaTarget.of(gpu_info) if target.type == "cuda" else None,
                         batches=batches)
    if result.error is not None:
        raise RuntimeError(f"preflight could not trace the steps (stopped at {result.failed_op}: "
                           f"{type(result.error).__name__}: {result.error})".splitlines()[0]) from result.error
    notes = list(result.notes) + unmodelled_device_note(target)
    if target != trace_device:
        notes.append(f"traced on {trace_device.type} for a {target.type} target")
    calibrator = Calibrator(target, can_run=(trace_device == target), gpu=gpu_info)
    scratch = calibrator(result.events, result.op_log)
    notes.extend(uncalibrated_notes(calibrator.skipped, target))
    notes.extend(n for n in [calibrator.reduction_note()] if n)
    events, categories = scratch.events, {**result.categories, **scratch.categories}
    if target.type == "cuda":
        events, note = add_workspaces(events, gpu_info)
        notes.append(note)
        events = round_events(events)
    ends = _step_ends(events, len(batches))
    peaks, live, start = [], 0, 0
    for end in ends:
        span = 0
        for e in events[start:end + 1]:
            live += e.nbytes
            span = max(span, live)
        peaks.append(span)
        start = end + 1
    reserved = reserved_peak = grew = total = sim = None
    if target.type == "cuda":
        sim = simulate(events, _allocator_config(run.target.allocator), report_after=ends,
                       empty_cache_after=ends if empty_cache else ())
        reserved, reserved_peak = sim.reserved_after, sim.peak_reserved_bytes
        grew = 1 + max(range(len(ends)), key=lambda i: (sim.peak_reserved_between[i], -i))
        total = None if gpu_info is None else reserved_peak + gpu_info.context_bytes
        notes.append(f"reserved memory replayed through the CUDA caching allocator's rules over {len(ends)} steps"
                     f"{', with empty_cache() after each' if empty_cache else ''}; it last grew in step {grew}")
    peak, breakdown, phase, timeline = summarize_events(events, categories)
    est = Estimate(peak_bytes=peak, breakdown=breakdown, peak_phase=phase, device=str(target),
                   coverage=_traced_coverage(result, calibrator.skipped, calibrator.calibrated, notes),
                   timeline=timeline, steps=len(batches), trace_seconds=result.seconds, num_ops=result.num_ops,
                   peak_reserved_bytes=reserved_peak, device_total_bytes=total,
                   peak_allocated_bytes=None if sim is None else sim.peak_allocated_bytes,
                   gpu=None if gpu_info is None else gpu_info.name, events=tuple(events), categories=categories)
    return StepsEstimate(est, tuple(peaks), reserved, reserved_peak, grew, empty_cache)


def _step_ends(events: Sequence[Any], steps: int) -> list[int]:
    """The index of each step's last event (a step is the events of phases ``step{i}/...``; the trace's last event
    closes the last step)."""
    ends = []
    for i in range(1, steps + 1):
        head = f"step{i}/"
        last = max((j for j, e in enumerate(events) if e.phase.startswith(head)), default=None)
        ends.append(last if last is not None else (ends[-1] if ends else 0))
    ends[-1] = len(events) - 1
    return ends


def sample_batches(dataloader: torch.utils.data.DataLoader, n: int, *, seed: int = 0) -> list[Any]:
    """``n`` batches as ``dataloader`` would make them, of samples drawn at random from its map-style dataset
    (a private ``random.Random(seed)``), collated with its own ``collate_fn`` at its batch size: a sequence of the
    shapes an epoch brings, for `estimate_steps`. The loader is not iterated (its sampler, generator and workers are
    untouched) and every global RNG stream is restored, as `preflight.worst_case_batch` leaves them."""
    from preflight._batches import loader_batch_size
    from preflight.trace import isolated_rng

    if n < 1:
        raise ValueError(f"`n` should be at least 1, got {n!r}.")
    dataset = dataloader.dataset
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise ValueError("sample_batches reads samples out of order: an iterable dataset cannot be; pass the batches "
                         "of its first steps to estimate_steps yourself.")
    size = loader_batch_size(dataloader)
    rng = random.Random(seed)
    with isolated_rng():
        return [dataloader.collate_fn([dataset[rng.randrange(len(dataset))] for _ in range(size)])
                for _ in range(n)]
