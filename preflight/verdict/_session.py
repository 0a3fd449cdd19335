"""`VerifySession`: measure the first optimizer steps of the real run and fill in the report's measured fields, each
step compared with the prediction for its own batch."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from preflight._warnings import warn
from preflight._device import iter_tensors, map_tensors
from preflight._guard import untouched
from preflight._verify import StepPeakMeter, compare, summary
from preflight.parallel import held_by_fully_shard, held_tensors

from preflight.report._report import Report
from preflight.verdict._decide import _emit
from preflight.verdict._options import Options
from preflight.verdict._predict import _shape
from preflight.verdict._ranks import _all_gather, _rank, _world_size, internal_failures, is_rank_zero
__all__ = ["VerifySession", "training_state"]


class VerifySession:
    """Measure the first ``verify_steps`` optimizer steps and fill in the report's measured fields.

    The adapter calls ``step_started(resident)`` before the first forward of an optimizer step,
    ``micro_batch(batch)`` for each further micro-batch of a step that accumulates gradients (where all of them
    are alive from the step's start, as in the HF Trainer), and ``step_ended()``
    after its ``zero_grad``; ``step_ended`` returns True once the last step was measured, after
    which `finish` has run: results are agreed across ranks (a collective: every rank measures the same number
    of steps), written, printed, and warnings emitted. If training ends early, the adapter calls `finish` itself.
    A measurement that fails on one rank is a warning there; the collective still runs.

    Args:
        report: the prediction to compare with (None when it failed: the measurement still runs, for the
            collective, but nothing is reported).
        options: the callback's `Options` (``verify_steps``, output paths).
        device: where training runs.
        extra_resident_bytes: bytes alive during every step that the CPU profiler cannot see because they were
            allocated before it started and no Python tensor points at them (DDP's gradient buckets).
    """

    def __init__(self, report: Report | None, options: Options, device: torch.device,
                 extra_resident_bytes: int = 0) -> None:
        self.report = report
        self.options = options
        self.steps = options.verify_steps
        self.extra = extra_resident_bytes
        self.meter: StepPeakMeter | None = None
        self.done = self._finished = self.steps == 0
        self.ended = 0
        # The shape of each measured step's batch, and a host copy of one batch per shape: after the measured
        # steps, each is predicted as the worst case was, so a step is compared with the prediction for its own
        # batch. Copies, not the batches: holding those would keep them alive into the next measured step.
        self._step_shapes: list[str | None] = []
        self._batches: dict[str, Any] = {}
        self._pending_shape: str | None = None
        # Whether each measured step began with gradients (None: the adapter does not say): under a loop that frees
        # them before backward, a step after an evaluation that freed them begins without (`_own_predictions`).
        self._step_gradients: list[bool | None] = []
        self._pending_gradients: bool | None = None
        # The step's largest micro-batch so far: its elements, and the batch itself when it came after the meter
        # started (copied once the meter has stopped: a copy made inside the window would be measured).
        self._pending_size = -1
        self._pending_batch: Any = None
        # Evaluation batches run inside the measured window, measured apart: (peak, shape key) each.
        self._eval_meter: StepPeakMeter | None = None
        self._eval_peaks: list[tuple[int, str | None]] = []
        self._eval_shape: str | None = None
        with internal_failures("starting verification"):
            self.meter = StepPeakMeter(device)
        self.method = self.meter.method if self.meter is not None else None

    @property
    def active(self) -> bool:
        """Still measuring (the adapter should call the step hooks)."""
        return not self.done

    def step_started(self, resident: Any, batch: Any = None, gradients: bool | None = None) -> None:
        """A step begins; ``resident`` holds every tensor alive now that the step uses (see `StepPeakMeter`);
        ``batch``, when the adapter has it now, is the step's (first micro-)batch; ``gradients``: whether the model
        holds gradients now (None: not said)."""
        if self.done or self.meter is None:
            return
        self._pending_gradients = gradients
        self._pending_shape, self._pending_size, self._pending_batch = self._remember(batch), _elements(batch), None
        ok = False
        with internal_failures("measuring the peak"):
            self.meter.start(resident)
            ok = True
        if not ok:
            self._give_up()

    def micro_batch(self, batch: Any) -> None:
        """A micro-batch of the current step, for an adapter whose step's micro-batches are all alive from its start
        (the HF Trainer fetches them first; the reference kept here changes no lifetime). A step that accumulates
        over micro-batches of different shapes is compared with the prediction for its largest one, at every
        micro-step (an upper bound for that step): the first micro-batch alone under-predicts a step whose later
        micro-batch is longer."""
        if self.done or batch is None:
            return
        size = _elements(batch)
        if size > self._pending_size:
            self._pending_size, self._pending_batch = size, batch

    def phase_ended(self) -> None:
        """A phase of the measured step ends (its forward, its backward): see `StepPeakMeter.mark`."""
        if not self.done and self.meter is not None and self.meter.running:
            with internal_failures("measuring the peak"):
                self.meter.mark()

    def step_ended(self, also_resident: Any = None, batch: Any = None) -> bool:
        """Record the step; return True when verification has just finished. ``also_resident``: see
        `StepPeakMeter.stop`; ``batch``: the step's batch, for an adapter that only knows it now."""
        if self.done:
            return False
        if self.meter is not None and self.meter.running:
            ok = False
            with internal_failures("measuring the peak"):
                self.meter.stop(also_resident)
                ok = True
            if not ok:
                self._give_up()
            else:
                self.micro_batch(batch)
                if self._pending_batch is not None:  # the meter has stopped: copying it now is not measured
                    self._pending_shape = self._remember(self._pending_batch)
                self._step_shapes.append(self._pending_shape)
                self._step_gradients.append(self._pending_gradients)
        self._pending_shape, self._pending_size, self._pending_batch = None, -1, None
        self.ended += 1
        if self.ended >= self.steps:
            self.finish()
            return True
        return False

    @untouched()  # after the measured window: the guard's own snapshot must not be inside it
    def finish(self) -> Report | None:
        """Agree on the measured peaks across ranks and update, write and print the report (once)."""
        if self._finished:
            return self.report
        self.done = self._finished = True
        if self.meter is not None:
            self.meter.abort()
        local = None
        if self._eval_meter is not None:
            self._eval_meter.abort()
        if self.meter is not None and self.meter.step_peaks:
            own: list[int | None] = []
            with internal_failures("predicting the measured batches"):
                own = self._own_predictions()
            evals = None
            with internal_failures("predicting the measured evaluation batches"):
                evals = self._eval_comparison()
            local = ([p + self._unseen() for p in self.meter.step_peaks], list(self.meter.reserved_peaks), own,
                     list(self.meter.step_retained), evals)
        self._batches.clear()
        report = self.report
        # Each rank compares its own measurement with its own prediction (ranks can differ: a rank whose prediction
        # failed has a lower bound), then the comparisons are gathered.
        mine = None
        if report is not None and local is not None:
            with internal_failures("comparing with the measurement"):
                peaks, reserved, own, retained, evals = local
                predicted = self._own_prediction(report, self.method)
                result = compare(predicted, peaks, method=self.method, reserved_peaks=reserved,
                                 predicted_step_peaks=own, step_retained=retained)
                mine = (result, evals, bool(report.coverage.get("lower_bound")), predicted)
        everyone = _all_gather(mine)
        gathered = [g for g in everyone if g is not None]
        if report is None or not gathered:
            return report
        report.step_predictor = report.eval_predictor = None  # they hold the model; not needed past verification
        with internal_failures("comparing with the measurement"):
            # The headline: the rank with the largest measured peak among those that predicted (not a lower bound).
            result, evals, _, predicted = max(gathered, key=lambda g: (not g[2], g[0].measured_peak_bytes))
            if len(everyone) > 1:
                report.rank_measured_peak_bytes = [None if g is None else g[0].measured_peak_bytes for g in everyone]
                report.rank_relative_errors = [None if g is None else g[0].relative_error for g in everyone]
            report.measured_peak_bytes = result.measured_peak_bytes
            report.measured_reserved_bytes = result.measured_reserved_bytes
            report.relative_error = result.relative_error
            report.worst_case_headroom = result.worst_case_headroom
            report.steps_measured = result.steps_measured
            report.measured_step_peaks = list(result.step_peaks)
            report.predicted_step_peaks = list(result.predicted_step_peaks)
            report.retained_step_bytes = list(result.step_retained)
            if evals is not None:
                eval_measured, eval_predicted = evals
                report.eval_measured_peak_bytes = eval_measured + self._unseen()
                report.eval_predicted_measured_bytes = eval_predicted
                report.eval_relative_error = (None if not eval_predicted else
                                              (eval_predicted - report.eval_measured_peak_bytes) /
                                              report.eval_measured_peak_bytes)
            report.verify_method = result.method
            report.warnings.extend(result.warnings)
            if is_rank_zero():
                for message in result.warnings:
                    warn(f"preflight: {message}", RuntimeWarning)
                _emit(report, self.options, verified=True)
                print(summary(predicted, result), flush=True)
        return report

    def _unseen(self) -> int:
        """``extra_resident_bytes`` and the parameters outside the model the trace saw the step read, where the meter
        cannot see them (the CPU profiler, started after they were allocated); the CUDA allocator's peak counts every
        allocated byte already."""
        method = None if self.meter is None else self.meter.method
        if method == "cuda-allocator":
            return 0
        # The parameters of modules outside the model that the step reads (a teacher): allocated before the window.
        est = None if self.report is None else self.report.estimate
        return self.extra + (est.outside_parameter_bytes if est is not None else 0)

    @staticmethod
    def _own_prediction(report: Report, method: str | None = None) -> int:
        """This rank's own predicted peak (the report's headline is the maximum over ranks); measured by the CUDA
        allocator, what its ``max_memory_allocated`` was predicted to read, where the allocator was simulated."""
        peaks = report.rank_predicted_peak_bytes
        own = peaks[_rank()] if peaks and len(peaks) == _world_size() else None
        if own is None and method == "cuda-allocator" and report.predicted_allocated_bytes is not None:
            return report.predicted_allocated_bytes  # pragma: no cover - needs a GPU
        return report.predicted_peak_bytes if own is None else own

    def eval_started(self, resident: Any, batch: Any) -> None:
        """An evaluation batch begins inside the measured window (between measured training steps)."""
        if self.done or self.meter is None or self.meter.running or \
                (self._eval_meter is not None and self._eval_meter.running):
            return
        ok = False
        with internal_failures("measuring the evaluation peak"):
            self._eval_meter = self._eval_meter or StepPeakMeter(self.meter.device)
            self._eval_shape = self._remember(batch)
            self._eval_meter.start(resident)
            ok = True
        if not ok:
            self._eval_meter = None

    def eval_ended(self) -> None:
        """The evaluation batch started by `eval_started` is done."""
        meter = self._eval_meter
        if meter is None or not meter.running:
            return
        with internal_failures("measuring the evaluation peak"):
            self._eval_peaks.append((meter.stop(), self._eval_shape))

    def _remember(self, batch: Any) -> str | None:
        """The shape key of ``batch``; keep a host copy of the first batch of each shape."""
        if batch is None:
            return None
        key = json.dumps(_shape(batch), default=str)
        if key not in self._batches:
            self._batches[key] = map_tensors(lambda t: t.detach().to("cpu", copy=True), batch)
        return key

    def _eval_comparison(self) -> tuple[int, int | None] | None:
        """The largest measured evaluation batch and the eval prediction for that batch's own shape."""
        if not self._eval_peaks:
            return None
        peak, key = max(self._eval_peaks, key=lambda pair: pair[0])
        predictor = None if self.report is None else self.report.eval_predictor
        predicted = predictor(self._batches[key]) if predictor is not None and key is not None else None
        return peak, predicted

    def _own_predictions(self) -> list[int | None]:
        """For each measured step, the prediction for its own batch's shapes: the first step against the traced
        step 1 (it creates the optimizer state), later steps against the steady state, except a later step that
        began without the gradients the loop keeps until its next backward (``zero_grad="before_backward"``, seen
        on the parameters at another step's start; Lightning frees them to evaluate), against a step 1 traced with
        the optimizer's state. Traced once per shape."""
        predictor = None if self.report is None else self.report.step_predictor
        if predictor is None or not any(self._step_shapes):
            return []
        # A loop that keeps the gradients between steps, seen doing so (a strategy that holds them elsewhere, as
        # DeepSpeed does, never shows them on the parameters).
        keeps = (self.report.schedule or {}).get("zero_grad") == "before_backward" and any(self._step_gradients)
        per_shape, resumed = {}, {}
        for key in dict.fromkeys(k for k in self._step_shapes if k is not None):
            per_shape[key] = predictor(self._batches[key])
        own: list[int | None] = []
        for i, (key, gradients) in enumerate(zip(self._step_shapes, self._step_gradients), start=1):
            if key is not None and keeps and i > 1 and gradients is False:
                if key not in resumed:
                    resumed[key] = None
                    with internal_failures("tracing a step that begins without gradients"):
                        resumed[key] = predictor(self._batches[key], resumed=True)
                if resumed[key] is not None:
                    own.append(resumed[key].get(1))
                    continue
            peaks = per_shape.get(key) if key is not None else None
            own.append(peaks.get(min(i, max(peaks))) if peaks else None)
        return own

    def _give_up(self) -> None:
        if self.meter is not None:
            self.meter.abort()
            self.meter.step_peaks.clear()
        self.meter = None


def training_state(model: nn.Module, optimizers: Any) -> list[Any]:
    """Every tensor of the training state alive between steps, for `VerifySession`'s resident bytes: the model's
    parameters, buffers and gradients, the optimizers' state, what DeepSpeed holds beside them
    (`preflight.parallel.held_tensors`: ZeRO-3's partitions, its ZeRO optimizer's flat buffers) and what FSDP2 holds
    beside them (`preflight.parallel.held_by_fully_shard`: a root unit still gathered after an evaluation)."""
    optimizers = [o for o in optimizers if o is not None]
    return [list(model.parameters()), list(model.buffers()), [p.grad for p in model.parameters() if p.grad is not None],
            [list(s.values()) for o in optimizers for s in o.state.values()],
            [held_tensors(model, o) for o in optimizers], held_by_fully_shard(model)]


def _elements(batch: Any) -> int:
    """Elements in ``batch``'s tensors (-1 for no batch): which micro-batch of a step is the largest."""
    return -1 if batch is None else sum(t.numel() for t in iter_tensors(batch))
