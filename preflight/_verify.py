"""Measure the real peak of the first optimizer steps of a training run, and compare it with the prediction.

A `StepPeakMeter` is started and stopped around each optimizer step by a trainer adapter (Lightning's
``on_train_batch_start``/``on_train_batch_end``, HF's ``on_step_begin``/``on_step_end``, or a custom loop), for
the first ``verify_steps`` steps only, then switched off so training runs at full speed:

- CUDA: ``torch.cuda.reset_peak_memory_stats`` at the start of a step and ``max_memory_allocated`` /
  ``max_memory_reserved`` at its end: everything the caching allocator holds, as `preflight.measure` reads it.
- CPU: the profiler's allocator events (``profile_memory=True``) over the step, summed in time order, on top of
  the bytes of the storages the step starts with (parameters, buffers, gradients, optimizer state and the
  batch), as `preflight.measure` does. Memory the trainer holds outside these (the next batch a loader has
  prefetched, logged metrics, DDP's gradient buckets) is outside the measured window, as it is outside the
  prediction; a measured step therefore covers what `preflight.estimate` predicts: one optimizer step (all its
  micro-batches) from the first forward to the optimizer step and ``zero_grad``.

What is measured is the batches the run actually draws, which may be smaller than the worst case the
prediction used: each measured step is compared with the prediction for its own batch (``relative_error``, the
prediction's accuracy), and the worst case's margin over the measured steps is reported apart
(``worst_case_headroom``). A leak is what a step leaves allocated after ``zero_grad``, step after step: peaks
follow batch lengths, retained memory does not.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
from typing import Any

import torch

from preflight._device import cuda_peaks, cuda_reset_peaks, live_storages
from preflight._measure import _walked_profile, frees_placed, session_peak, session_survivors
from preflight._quiet import StderrFilter
from preflight._units import format_bytes, margin_text, signed_percent

__all__ = ["LEAK_TOLERANCE", "UNDER_PREDICTION_TOLERANCE", "StepPeakMeter", "Verification", "compare", "summary"]

# Measured above predicted by more than this is worth a warning: the CPU method agrees to ~100 bytes on the
# models we test, so 5% means something the trace did not see (custom kernels, a different step order).
UNDER_PREDICTION_TOLERANCE = 0.05
# Memory a step may leave allocated as noise (scalars a trainer logs), relative to the peak; a leak retaining
# a graph keeps megabytes.
LEAK_TOLERANCE = 0.001


# The profiler range `StepPeakMeter.mark` records at the end of each phase of a measured step.
_PHASE_MARK = "preflight::phase_end"


def _alive_addresses(device: torch.device) -> set[int] | None:
    """The addresses of the storages live tensors on ``device`` hold now (one pass over the garbage collector's
    objects); None where the scan fails."""
    import gc

    try:
        # type(), not isinstance: a dead weakref proxy raises on __class__ (Lightning keeps such proxies)
        return set(live_storages([o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)], device))
    except Exception:  # noqa: BLE001 - unknown: every block counts as held
        return None


class StepPeakMeter:
    """Measure the peak memory of consecutive training steps on ``device`` (see the module docstring).

    Example:
        >>> meter = StepPeakMeter(torch.device("cpu"))
        >>> meter.start([list(model.parameters()), batch])  # doctest: +SKIP
        >>> ...  # one optimizer step
        >>> meter.stop()  # doctest: +SKIP
        >>> meter.step_peaks  # doctest: +SKIP
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.step_peaks: list[int] = []
        self.reserved_peaks: list[int] = []
        # Bytes each step allocated that are still alive: at its end on CUDA (allocated memory's growth over the
        # step); on CPU, at the end of the last measured step, since a block a step leaves is often freed by the
        # next one (an output kept until the next iteration, gradients Lightning frees at the next backward).
        self.step_retained: list[int] = []
        self._held: dict[int, tuple[int, int]] = {}  # CPU: address -> (step index, bytes) of blocks steps left alive
        self._resident: dict[int, int] = {}  # address -> bytes of the storages alive at the step's start
        self._allocated_at_start = 0
        self._profiler: Any = None
        self._quiet: StderrFilter | None = None
        self._running = False
        if self.device.type == "cuda":
            self.method = "cuda-allocator"
        elif self.device.type == "cpu":
            self.method = "cpu-profiler"
        else:
            raise ValueError(f"Cannot measure on {self.device.type!r}: verification runs on CUDA or CPU.")

    @property
    def running(self) -> bool:
        """A step is being measured."""
        return self._running

    def start(self, resident: Any) -> None:
        """Start measuring a step. ``resident``: every tensor alive at its start that the step uses (CPU only)."""
        if self.method == "cuda-allocator":  # pragma: no cover - needs a GPU
            cuda_reset_peaks(self.device)
            self._allocated_at_start = torch.cuda.memory_allocated(self.device)
            self._running = True
            return
        from torch.profiler import ProfilerActivity, profile

        self._resident = live_storages(resident, self.device)
        self._release_unheld()
        self._quiet = StderrFilter().open()  # the profiler's native log lines (see preflight._quiet)
        try:
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.start()
        except BaseException:
            self._profiler = None
            self._close_quiet()
            raise
        # A step that raises out of a trainer without an exception hook (HF) leaves the profiler running, and
        # torch segfaults at exit with one running: stop it at exit (atexit runs this before the filter's close).
        atexit.register(self.abort)
        self._running = True

    def stop(self, also_resident: Any = None) -> int:
        """Stop measuring the current step; return and record its peak.

        ``also_resident``: tensors alive since before the step that only became known during it (the batch, for
        a trainer that does not pass it to the step-start hook); counted like ``start``'s ``resident``.
        """
        if self.method == "cuda-allocator":  # pragma: no cover - needs a GPU
            peak, reserved = cuda_peaks(self.device)
            self.reserved_peaks.append(reserved)
            retained = torch.cuda.memory_allocated(self.device) - self._allocated_at_start
        else:
            profiler, self._profiler = self._profiler, None
            if profiler is None:
                raise RuntimeError("StepPeakMeter.stop() called without start().")
            try:
                profiler.stop()
            finally:
                self._close_quiet()
                atexit.unregister(self.abort)
            if also_resident is not None:
                self._resident.update(live_storages(also_resident, self.device))
            allocations, marks, handed = _walked_profile(profiler, _PHASE_MARK)
            events = frees_placed(allocations, handed, [start for start, _ in marks],
                                  functools.partial(_alive_addresses, self.device))
            profiled_peak, _ = session_peak(events, self._resident)
            peak = sum(self._resident.values()) + profiled_peak
            retained = self._hold(events)
        self._running = False
        self.step_peaks.append(peak)
        if self.method == "cuda-allocator":  # pragma: no cover - needs a GPU
            self.step_retained.append(retained)
        return peak

    def mark(self) -> None:
        """A phase of the measured step ends here (the forward, the backward): on CPU, the latest a block a
        collective allocated can have been freed by gloo's worker thread, out of the profiler's sight
        (`preflight._measure.frees_placed`). Nothing on CUDA."""
        if self._profiler is not None:
            from torch.autograd.profiler import record_function

            with record_function(_PHASE_MARK):
                pass

    def _hold(self, events: list[tuple[int, int]]) -> int:
        """Update which blocks earlier steps left alive with this step's events (a free of one, or a new block at
        its address, which means it was freed between the steps), record those this step leaves, and recount
        every step's still-held bytes into ``step_retained``."""
        for nbytes, ptr in events:
            self._held.pop(ptr, None)
        index = len(self.step_peaks)
        for ptr, nbytes in session_survivors(events).items():
            self._held[ptr] = (index, nbytes)
        self._recount(index + 1)
        return self.step_retained[index]

    def _recount(self, steps: int) -> None:
        """Each of ``steps`` steps' bytes still held (``_held``) into ``step_retained``."""
        held = [0] * steps
        for step, nbytes in self._held.values():
            held[step] += nbytes
        self.step_retained[:] = held

    def _release_unheld(self) -> None:
        """Forget the blocks earlier steps left that no Python tensor holds any more: they were freed between the
        measured windows, outside every profile (Lightning sets the gradients to None as its validation starts; an
        evaluation in between frees the last step's outputs), where no later allocation happened to reuse their
        address. A block a Python object still holds (a loss kept in a list) stays counted; one only C++ holds (DDP's
        rebuilt buckets) is forgotten too, so a leak there goes unnoticed. Where the scan fails, nothing is
        forgotten."""
        if not self._held:
            return
        alive = _alive_addresses(self.device)
        if alive is None:  # the scan failed: the blocks stay counted, as before this scan existed
            return
        for ptr in [ptr for ptr in self._held if ptr not in alive]:
            del self._held[ptr]
        self._recount(len(self.step_retained))

    def abort(self) -> None:
        """Stop a running profiler without recording (training ended inside a measured step)."""
        profiler, self._profiler = self._profiler, None
        try:
            if profiler is not None:
                profiler.stop()
        finally:
            self._close_quiet()
        self._running = False

    def _close_quiet(self) -> None:
        atexit.unregister(self.abort)
        quiet, self._quiet = self._quiet, None
        if quiet is not None:
            quiet.close()


@dataclasses.dataclass(frozen=True)
class Verification:
    """The measured peak of the first steps, compared with the prediction for the same batches.

    Attributes:
        measured_peak_bytes: the largest step peak.
        measured_reserved_bytes: CUDA only: the largest reserved peak.
        step_peaks: the peak of each measured step, in order.
        predicted_step_peaks: the prediction for each measured step's own batch (None where unknown).
        relative_error: ``(predicted - measured) / measured`` of the step that differs most from its own
            prediction, the first step left out when later ones were measured (or, without per-step predictions,
            of the largest step against ``predicted_peak_bytes``): the prediction's accuracy. Negative means
            under-predicted.
        worst_case_headroom: ``(worst-case prediction - largest measured step) / largest measured step``: how far
            below the planned worst case these batches stayed.
        step_retained: bytes each step left alive after ``zero_grad`` (its allocations minus its frees).
        method: ``"cuda-allocator"`` or ``"cpu-profiler"``.
        warnings: under-prediction beyond `UNDER_PREDICTION_TOLERANCE`, memory retained step after step (a leak).
    """

    measured_peak_bytes: int
    measured_reserved_bytes: int | None
    step_peaks: tuple[int, ...]
    relative_error: float | None
    method: str
    warnings: tuple[str, ...] = ()
    predicted_step_peaks: tuple[int | None, ...] = ()
    worst_case_headroom: float | None = None
    step_retained: tuple[int, ...] = ()

    @property
    def steps_measured(self) -> int:
        return len(self.step_peaks)


def compare(predicted_peak_bytes: int | None, step_peaks: list[int] | tuple[int, ...], *, method: str,
            reserved_peaks: list[int] | tuple[int, ...] = (),
            predicted_step_peaks: list[int | None] | tuple[int | None, ...] = (),
            step_retained: list[int] | tuple[int, ...] = ()) -> Verification:
    """Compare measured step peaks (e.g. `StepPeakMeter.step_peaks`) with their predictions; see `Verification`.

    ``predicted_peak_bytes`` is the worst-case prediction; ``predicted_step_peaks`` the prediction for each
    measured step's own batch, when known.
    """
    peaks = tuple(step_peaks)
    if not peaks:
        raise ValueError("No step was measured.")
    measured = max(peaks)
    own = tuple(predicted_step_peaks)
    # The first measured step is shown but, with later steps to judge by, left out of the error: on CPU its window
    # can see frees of blocks allocated before any profiling, which the profiler may size from a stale record of
    # the same address (measured: the same step read 665 KB apart depending on what ran earlier in the process).
    pairs = [(p, m) for i, (p, m) in enumerate(zip(own, peaks)) if p and (i > 0 or len(peaks) == 1)]
    error = headroom = None
    notes: list[str] = []
    if pairs:
        error = max(((p - m) / m for p, m in pairs), key=abs)
    elif predicted_peak_bytes:
        error = (predicted_peak_bytes - measured) / measured
    if predicted_peak_bytes:
        headroom = (predicted_peak_bytes - measured) / measured
    if error is not None and error < -UNDER_PREDICTION_TOLERANCE:
        notes.append(
            f"a measured step is {-error:.1%} above the prediction for its own batch: something in the step was "
            "not traced (custom kernels, a different step order, memory kept across steps). Keep more headroom, "
            "and please report it."
        )
    retained = tuple(step_retained)
    if _leaks(retained, measured):
        notes.append(
            "memory stays allocated step after step (" + ", ".join(format_bytes(r) for r in retained[1:]) +
            " left alive by each step after the first): something keeps tensors across steps (e.g. appending the "
            "loss without .item() or .detach(), caching outputs), which will run out of memory later."
        )
    return Verification(measured_peak_bytes=measured,
                        measured_reserved_bytes=max(reserved_peaks) if reserved_peaks else None,
                        step_peaks=peaks, relative_error=error, method=method, warnings=tuple(notes),
                        predicted_step_peaks=own, worst_case_headroom=headroom, step_retained=retained)


def _leaks(retained: tuple[int, ...], peak: int) -> bool:
    """True when every step after the first (which creates the optimizer state) leaves more memory alive than
    the tolerance: what a step keeps after ``zero_grad``, unlike its peak, does not follow the batch's length."""
    steady = retained[1:]
    if len(steady) < 2:
        return False
    return all(r > max(4096, LEAK_TOLERANCE * peak) for r in steady)


def summary(predicted_peak_bytes: int | None, result: Verification) -> str:
    """One line: the prediction for the measured batches, the measurement, the error computed from those two
    numbers, the largest error of one step where that differs, and the worst case's margin. Every figure printed is
    the one its neighbours give: an error beside two sizes is computed from them."""
    own = [p for p in result.predicted_step_peaks if p]
    predicted = max(own) if own else predicted_peak_bytes
    measured = result.measured_peak_bytes
    line = f"preflight: verified {result.steps_measured} step(s): measured {format_bytes(measured)}"
    if predicted:
        shown = (predicted - measured) / measured
        line += f", predicted {format_bytes(predicted)} for these batches (error {signed_percent(shown, 2)})"
        if result.relative_error is not None and signed_percent(result.relative_error, 2) != signed_percent(shown, 2):
            line += f"; largest error of one step {signed_percent(result.relative_error, 2)}"
    if result.worst_case_headroom is not None and predicted_peak_bytes:
        line += (f"; worst case predicted {format_bytes(predicted_peak_bytes)}, "
                 f"{margin_text(result.worst_case_headroom)} the largest measured step")
    return line

