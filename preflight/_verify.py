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
prediction used: with variable-length data a negative ``relative_error`` is expected; only an under-prediction
is a warning.
"""

from __future__ import annotations

import atexit
import dataclasses
from typing import Any

import torch

from preflight._device import cuda_peaks, cuda_reset_peaks, live_storage_bytes
from preflight._measure import profiled_memory_peak
from preflight._quiet import StderrFilter
from preflight._units import format_bytes

__all__ = ["LEAK_TOLERANCE", "UNDER_PREDICTION_TOLERANCE", "StepPeakMeter", "Verification", "compare"]

# Measured above predicted by more than this is worth a warning: the CPU method agrees to ~100 bytes on the
# models we test, so 5% means something the trace did not see (custom kernels, a different step order).
UNDER_PREDICTION_TOLERANCE = 0.05
# Step-over-step growth ignored as noise (scalars a trainer logs); a leak retaining a graph grows by megabytes.
LEAK_TOLERANCE = 0.001


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
        self._before = 0
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
            self._running = True
            return
        from torch.profiler import ProfilerActivity, profile

        self._before = live_storage_bytes(resident, self.device)
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
        else:
            profiler, self._profiler = self._profiler, None
            if profiler is None:
                raise RuntimeError("StepPeakMeter.stop() called without start().")
            try:
                profiler.stop()
            finally:
                self._close_quiet()
            late = live_storage_bytes(also_resident, self.device) if also_resident is not None else 0
            peak = self._before + late + profiled_memory_peak(profiler)
        self._running = False
        self.step_peaks.append(peak)
        return peak

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
    """The measured peak of the first steps, compared with the prediction.

    Attributes:
        measured_peak_bytes: the largest step peak.
        measured_reserved_bytes: CUDA only: the largest reserved peak.
        step_peaks: the peak of each measured step, in order.
        relative_error: ``(predicted - measured) / measured``; negative means under-predicted.
        method: ``"cuda-allocator"`` or ``"cpu-profiler"``.
        warnings: under-prediction beyond `UNDER_PREDICTION_TOLERANCE`, step-over-step growth (a leak).
    """

    measured_peak_bytes: int
    measured_reserved_bytes: int | None
    step_peaks: tuple[int, ...]
    relative_error: float | None
    method: str
    warnings: tuple[str, ...] = ()

    @property
    def steps_measured(self) -> int:
        return len(self.step_peaks)


def compare(predicted_peak_bytes: int | None, step_peaks: list[int] | tuple[int, ...], *, method: str,
            reserved_peaks: list[int] | tuple[int, ...] = ()) -> Verification:
    """Compare measured step peaks (e.g. `StepPeakMeter.step_peaks`) with the predicted peak; see `Verification`."""
    peaks = tuple(step_peaks)
    if not peaks:
        raise ValueError("No step was measured.")
    measured = max(peaks)
    error = None
    notes: list[str] = []
    if predicted_peak_bytes:
        error = (predicted_peak_bytes - measured) / measured
        if measured > predicted_peak_bytes * (1 + UNDER_PREDICTION_TOLERANCE):
            notes.append(
                f"measured peak {format_bytes(measured)} is {-error:.1%} above the predicted "
                f"{format_bytes(predicted_peak_bytes)}: something in the step was not traced (custom kernels, "
                "a different step order, memory kept across steps). Keep more headroom, and please report it."
            )
    if _growth(peaks):
        notes.append(
            f"memory grows step over step ({', '.join(format_bytes(p) for p in peaks)}): something keeps tensors "
            "across steps (e.g. appending the loss without .item() or .detach(), caching outputs), which will run "
            "out of memory later."
        )
    return Verification(measured_peak_bytes=measured,
                        measured_reserved_bytes=max(reserved_peaks) if reserved_peaks else None,
                        step_peaks=peaks, relative_error=error, method=method, warnings=tuple(notes))


def _growth(peaks: tuple[int, ...]) -> bool:
    """True when every step after the first (which creates the optimizer state) grows beyond the tolerance."""
    steady = peaks[1:]
    if len(steady) < 2:
        return False
    return all(b - a > max(4096, LEAK_TOLERANCE * a) for a, b in zip(steady, steady[1:]))
