"""The data preflight computes: an `Estimate` (predicted) and a `Measurement` (measured). Renderers live elsewhere."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from preflight._units import format_bytes

__all__ = ["Category", "Coverage", "Estimate", "Measurement", "Event", "PhaseEstimate", "TimelinePoint",
           "format_estimate"]


class Category(str, enum.Enum):
    """What a live byte belongs to. Every byte at the peak is in exactly one category."""

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"  # made in the forward pass (saved for backward, or alive at the peak)
    TEMPORARIES = "temporaries"  # made in backward or the optimizer step, neither a gradient nor state
    INPUTS = "inputs"  # the batch
    COMMUNICATION = "communication"  # collective buffers: FSDP's all-gather outputs, reduce-scatter inputs/outputs


@dataclasses.dataclass(frozen=True)
class Event:
    """One allocation (``nbytes > 0``) or free (``nbytes < 0``) of a tensor storage, in trace order.

    ``uid`` identifies the storage across its allocation and its free. ``op`` is the index of the operator
    that made it (-1 for storages alive before the trace: parameters, buffers, the batch).
    """

    uid: int
    nbytes: int
    op: int
    phase: str


@dataclasses.dataclass(frozen=True)
class TimelinePoint:
    """Live bytes after operator ``op`` during ``phase`` (e.g. ``"step1/forward"``)."""

    op: int
    live_bytes: int
    phase: str


@dataclasses.dataclass(frozen=True)
class Coverage:
    """What a prediction covered.

    Attributes:
        traced: the steps ran to the end on fake tensors; the peak is a traced figure, not analytic.
        lower_bound: ``peak_bytes`` is a lower bound (the trace failed, or part of the run is unseen).
        failed_op: what stopped the trace, when it failed: the operator and the model's line that called it
            (``aten._local_scalar_dense.default at modeling_x.py:123 in forward (step1/forward)``), or for an
            error raised in Python, that error and the line that raised it.
        reason: why the trace failed, in words.
        calibrated: kernel configurations whose hidden scratch memory was measured for real (e.g. convolutions).
        notes: anything else the prediction assumed or left out.
    """

    traced: bool
    lower_bound: bool = False
    failed_op: str | None = None
    reason: str | None = None
    calibrated: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PhaseEstimate:
    """The predicted peak of one phase of the run other than the training step (``"saving"``: a checkpoint save
    traced after the steps, with the training state they leave alive).

    Attributes:
        name: the phase (``"saving"``, ``"evaluation"``: traced on each rank after the training steps).
        peak_bytes: live tensor bytes at the phase's peak, everything alive then included (the peak rank's, where
            ranks were traced).
        breakdown: bytes at that peak per `Category` value.
        where: the phase label of the peak (``"save"``).
        device_total_bytes: reserved plus CUDA context and workspaces while the phase runs, when a GPU target was
            simulated (the allocator keeps what training reserved).
        per_rank_peak_bytes: each rank's peak in this phase, where ranks were traced (rank 0 alone keeps a full
            state dict by default, so ranks differ).
        peak_rank: the rank with the largest figure, where ranks were traced.
        how: how the figure was obtained, in words (``"traced"``, or what was modelled and from which source).
        host_bytes: for ``"loading"`` on a GPU target, the host memory the rank that holds the most keeps for its
            model while it loads, counted from the model's tensors: the whole model with ``Loading("host")`` (each
            rank), rank 0's full state dict with ``from_rank0``, else 0 (a checkpoint read through safetensors' file
            mapping is page cache, not counted). None where the host is the device (a CPU target).
    """

    name: str
    peak_bytes: int
    breakdown: dict[str, int]
    where: str
    device_total_bytes: int | None = None
    per_rank_peak_bytes: tuple[int, ...] | None = None
    peak_rank: int | None = None
    how: str = "traced"
    host_bytes: int | None = None

    @property
    def required_bytes(self) -> int:
        """What a verdict compares with the budget: the device total when simulated, else ``peak_bytes``."""
        return self.device_total_bytes if self.device_total_bytes is not None else self.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out["per_rank_peak_bytes"] is not None:
            out["per_rank_peak_bytes"] = list(out["per_rank_peak_bytes"])
        out["required_bytes"] = self.required_bytes
        return out


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A predicted training peak.

    Attributes:
        peak_bytes: the maximum, over the simulated steps, of the bytes of all live tensor storages on the
            device, including those alive before the step (parameters, buffers, the batch). On CUDA,
            ``torch.cuda.max_memory_allocated()`` reads ``peak_allocated_bytes`` (its blocks, a little more).
        breakdown: bytes at the peak per `Category` value; sums to ``peak_bytes``.
        peak_phase: where the peak happens, e.g. ``"step2/backward"``.
        device: the device planned for.
        coverage: what was traced, calibrated, or estimated analytically.
        timeline: live bytes by operator index, compacted for plotting.
        steps: simulated training steps.
        trace_seconds: wall time of the trace.
        num_ops: operators traced.
        managed_bytes: optimizer state in CUDA managed memory (bitsandbytes paged optimizers), outside
            ``peak_bytes``.
        peak_reserved_bytes: the CUDA caching allocator's predicted reserved peak, when simulated.
        peak_allocated_bytes: what ``torch.cuda.max_memory_allocated()`` will read, when simulated: the allocator
            counts the blocks it hands out, so ``peak_bytes`` plus each request's rounding to 512 B and the
            remainder of a cached block it did not split (up to 1 MiB per large block), at their own peak.
        device_total_bytes: reserved plus CUDA context and library workspaces (what ``nvidia-smi`` shows),
            when known.
        gpu: the catalog GPU planned for, if any.
        world_size: data-parallel ranks; with more than one, ``peak_bytes`` and ``breakdown`` are per rank.
        sharding: the sharding scheme the per-rank figures assume (``"ddp"``, ``"zero1"`` ... ``"fsdp-full"``; tensor
            parallelism is ``"tp2"`` for degree 2, ``"tp2 x fsdp2"`` with FSDP2 over the other mesh dim).
        unsharded_peak_bytes: the single-device traced peak the per-rank figures were derived from (None when
            each rank's own step was traced).
        per_rank_peak_bytes: the peak of each rank, ``[rank 0, rank 1, ...]``, when each rank's step was traced
            (``sharding="fsdp2"``, ``"fsdp-full"``, ``"fsdp-grad-op"``); ranks holding equal shard shapes share one
            trace. None otherwise.
        per_rank_breakdown: each rank's ``breakdown`` at its own peak, with ``"phase"`` (where that rank peaks), in
            the order of ``per_rank_peak_bytes``; None when ranks were not traced. Stages of a pipeline differ by
            category: the first holds the most activations, the last the head and the loss.
        peak_rank: the rank with the largest peak (the lowest such rank); ``peak_bytes``, ``breakdown``,
            ``peak_phase``, ``timeline`` and ``events`` are that rank's. None when ranks were not traced.
        events: every allocation and free in order (for the allocator simulator); not shown in repr.
        categories: the `Category` of each storage uid in ``events``; not shown in repr.
        rank_events: each rank's ``events`` when ranks were traced (`step_peaks`' ``rank``); not shown in repr.
        phases: the run's other phases traced with the steps (`PhaseEstimate`): ``"saving"`` when ``run.checkpoint``
            says the run saves. ``peak_bytes`` and the fields above are the training step's alone.
        outside_parameter_bytes: the parameters and buffers of the modules the step calls that are not part of the
            model (a distillation teacher, a reference model, a loss module's class weights) on the model's device,
            counted in ``peak_bytes`` as ``"parameters"`` from the first call on (``coverage.notes`` names the
            module and the line): they stay on the device for the whole run. Not counted for a compiled model.
    """

    peak_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    device: str
    coverage: Coverage
    timeline: tuple[TimelinePoint, ...] = ()
    steps: int = 2
    trace_seconds: float = 0.0
    num_ops: int = 0
    managed_bytes: int = 0
    peak_reserved_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    device_total_bytes: int | None = None
    gpu: str | None = None
    world_size: int = 1
    sharding: str | None = None
    unsharded_peak_bytes: int | None = None
    per_rank_peak_bytes: tuple[int, ...] | None = None
    per_rank_breakdown: tuple[dict[str, Any], ...] | None = None
    peak_rank: int | None = None
    events: tuple[Event, ...] = dataclasses.field(default=(), repr=False, compare=False)
    categories: dict[int, Category] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    rank_events: tuple[tuple[Event, ...], ...] | None = dataclasses.field(default=None, repr=False, compare=False)
    phases: tuple[PhaseEstimate, ...] = ()
    outside_parameter_bytes: int = 0

    def phase(self, name: str) -> PhaseEstimate | None:
        """The `PhaseEstimate` called ``name`` (``"saving"``), or None when it was not predicted."""
        return next((p for p in self.phases if p.name == name), None)

    @property
    def required_bytes(self) -> int:
        """What a verdict compares with the budget: the device total when simulated, else ``peak_bytes``."""
        return self.device_total_bytes if self.device_total_bytes is not None else self.peak_bytes

    @property
    def run_required_bytes(self) -> int:
        """What a verdict on the whole run compares with the budget: the largest ``required_bytes`` of the training
        step and the other phases traced with it (a checkpoint save)."""
        return max([self.required_bytes, *(p.required_bytes for p in self.phases)])

    def step_peaks(self, rank: int | None = None) -> dict[int, int]:
        """The peak of live bytes within each simulated step (``{1: ..., 2: ...}``), replaying ``events``: step 1
        creates the optimizer state, later steps are the steady state. Empty for an analytic lower bound.
        ``rank``: that rank's steps, where each rank was traced (else the figure's own)."""
        events = self.events if rank is None or self.rank_events is None else self.rank_events[rank]
        peaks: dict[int, int] = {}
        live = 0
        for e in events:
            live += e.nbytes
            step = _step_of(e.phase)
            if step is not None:
                peaks[step] = max(peaks.get(step, 0), live)
        return peaks

    def step_allocated_peaks(self, rank: int | None = None, config: Any = None) -> dict[int, int] | None:
        """On a CUDA target, what ``torch.cuda.max_memory_allocated()`` reads over each simulated step when the peak
        stats are reset at its start (``{1: ..., 2: ...}``): ``events`` replayed through the caching allocator's
        model (``config``: a `preflight.allocator.AllocatorConfig`, default PyTorch's), its blocks counted whole.
        None where the allocator was not simulated (a CPU target)."""
        if self.peak_allocated_bytes is None:
            return None
        from preflight.allocator import simulate

        events = self.events if rank is None or self.rank_events is None else self.rank_events[rank]
        spans: dict[int, tuple[int, int]] = {}  # step -> (its first event, its last)
        for i, e in enumerate(events):
            step = _step_of(e.phase)
            if step is not None:
                spans[step] = (spans.get(step, (i, i))[0], i)
        if not spans:
            return {}
        ends = sorted({first - 1 for first, _ in spans.values() if first} | {last for _, last in spans.values()})
        peaks = dict(zip(ends, simulate(events, config, report_after=ends).peak_allocated_between))
        return {step: peaks[last] for step, (_, last) in spans.items()}

    def resident_bytes(self, category: Category | str) -> int | None:
        """Live bytes of ``category`` when the traced steps have ended (what stays from one step to the next: the
        optimizer state after its creation in step 1), replaying ``events``; None without events."""
        if not self.events:
            return None
        wanted = Category(category)
        return sum(e.nbytes for e in self.events if self.categories.get(e.uid) is wanted)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (without the event list)."""
        return {
            "peak_bytes": self.peak_bytes,
            "breakdown": dict(self.breakdown),
            "peak_phase": self.peak_phase,
            "device": self.device,
            "coverage": self.coverage.to_dict(),
            "steps": self.steps,
            "trace_seconds": round(self.trace_seconds, 3),
            "num_ops": self.num_ops,
            "managed_bytes": self.managed_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "device_total_bytes": self.device_total_bytes,
            "required_bytes": self.required_bytes,
            "run_required_bytes": self.run_required_bytes,
            "gpu": self.gpu,
            "world_size": self.world_size,
            "sharding": self.sharding,
            "unsharded_peak_bytes": self.unsharded_peak_bytes,
            "per_rank_peak_bytes": None if self.per_rank_peak_bytes is None else list(self.per_rank_peak_bytes),
            "per_rank_breakdown": None if self.per_rank_breakdown is None else [dict(b) for b in
                                                                                self.per_rank_breakdown],
            "peak_rank": self.peak_rank,
            "phases": [p.to_dict() for p in self.phases],
        }

    def __str__(self) -> str:
        return format_estimate(self)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A measured training peak over real steps.

    Attributes:
        peak_bytes: peak bytes of live tensor storages on the device, including those alive before the steps.
        device: where the steps ran.
        method: ``"cuda-allocator"`` or ``"cpu-profiler"``.
        managed_bytes: optimizer state in CUDA managed memory (bitsandbytes paged optimizers), outside
            ``peak_bytes``.
        peak_reserved_bytes: the CUDA caching allocator's reserved peak (CUDA only).
        steps: real training steps run.
        step_seconds: mean wall time of one step.
    """

    peak_bytes: int
    device: str
    method: str
    peak_reserved_bytes: int | None = None
    steps: int = 2
    step_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _step_of(phase: str) -> int | None:
    """The training step a phase belongs to (``"step2/backward"`` -> 2), or None outside the steps."""
    head = phase.split("/", 1)[0]
    return int(head[4:]) if head.startswith("step") and head[4:].isdigit() else None


def format_estimate(est: Estimate) -> str:
    """A plain-text table of an estimate: peak, breakdown at the peak, phase and coverage."""
    kind = "lower bound" if est.coverage.lower_bound else "predicted peak"
    lines = [f"{kind}: {format_bytes(est.peak_bytes)} ({est.peak_bytes:,} B) on {est.device}, at {est.peak_phase}"]
    width = max(len(k) for k in est.breakdown)
    for name, nbytes in est.breakdown.items():
        share = nbytes / est.peak_bytes if est.peak_bytes else 0.0
        lines.append(f"  {name:<{width}}  {format_bytes(nbytes):>12}  {share:6.1%}")
    if est.managed_bytes:
        lines.append(f"  + paged optimizer state in managed memory: {format_bytes(est.managed_bytes)}")
    if est.peak_allocated_bytes is not None:
        lines.append(f"  max_memory_allocated (the allocator's blocks): {format_bytes(est.peak_allocated_bytes)}")
    if est.peak_reserved_bytes is not None:
        lines.append(f"  reserved by the CUDA allocator: {format_bytes(est.peak_reserved_bytes)}")
    if est.device_total_bytes is not None:
        lines.append(f"  device total (reserved + context + workspaces): {format_bytes(est.device_total_bytes)}")
    if est.per_rank_peak_bytes is not None:
        lines.append(f"  per rank ({est.sharding}, {est.world_size} ranks; rank {est.peak_rank} peaks):")
        for rank, nbytes in enumerate(est.per_rank_peak_bytes):
            line = f"    rank {rank}: {format_bytes(nbytes):>12} ({nbytes:,} B)"
            if est.per_rank_breakdown is not None and est.sharding and est.sharding.startswith("pp"):
                parts = est.per_rank_breakdown[rank]  # stages differ by what they hold: say it
                line += (f", at {parts['phase']}: activations {format_bytes(parts['activations'])}, parameters "
                         f"{format_bytes(parts['parameters'])}")
            lines.append(line)
    for p in est.phases:
        line = f"  {p.name}: {format_bytes(p.peak_bytes)} ({p.peak_bytes:,} B) at {p.where}"
        if p.device_total_bytes is not None:
            line += f", device total {format_bytes(p.device_total_bytes)}"
        if p.per_rank_peak_bytes is not None and p.peak_rank is not None:
            line += f" (rank {p.peak_rank})"
        if p.host_bytes:
            line += f"; host memory {format_bytes(p.host_bytes)} for the model"
        lines.append(line)
    cov = est.coverage
    if cov.traced:
        what = "of the generate call" if est.peak_phase.startswith("generate") else \
            f"over {est.steps} step{'s' if est.steps != 1 else ''}"
        lines.append(f"coverage: traced {est.num_ops:,} ops {what} in {est.trace_seconds:.1f} s")
    else:
        lines.append(f"coverage: NOT traced ({cov.reason}); failed at {cov.failed_op}")
    if cov.calibrated:
        lines.append(f"  kernel scratch calibrated for {len(cov.calibrated)} configuration(s)")
    lines.extend(f"  note: {note}" for note in cov.notes)
    return "\n".join(lines)
