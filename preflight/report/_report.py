"""`Report`: what preflight predicted (and, after verification, measured) for a training run; ``to_dict()`` is the
JSON the callbacks, ``preflight.check`` and ``preflight check`` write."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any


from preflight._result import Estimate

__all__ = ["Report"]


@dataclasses.dataclass
class Report:
    """What preflight predicted (and, after verification, measured) for a training run; ``to_dict()`` is the JSON.

    Byte counts are per device (per rank under data parallelism). ``predicted_peak_bytes`` is the training
    step's peak of tensor bytes (the maximum over ranks when distributed). ``fits`` compares the larger of it and
    ``eval_predicted_peak_bytes`` (``predicted_required_bytes`` in the JSON) with ``usable_bytes``; it is None
    when there is no budget, or when a lower bound is under the budget. For a CUDA target,
    ``predicted_allocated_bytes`` is what ``torch.cuda.max_memory_allocated`` will read (the caching allocator
    counts its blocks: the tensor bytes plus each block's rounding), and ``predicted_reserved_bytes`` and
    ``predicted_device_total_bytes`` add the allocator's reserve and the CUDA context: what the headroom is there
    to cover. ``phases`` lists every phase of
    the run that was predicted (training, evaluation, saving), each with its peak, what the verdict compares for it
    (``required_bytes``) and how it was obtained; the verdict takes the largest (``run_peak_phase``).
    """

    version: str
    device: str
    budget_bytes: int | None
    headroom: float
    usable_bytes: int | None
    predicted_peak_bytes: int
    predicted_breakdown: dict[str, int]
    peak_phase: str
    eval_predicted_peak_bytes: int | None
    eval_peak_phase: str | None
    worst_case_batch_shape: Any
    worst_case_batch: dict[str, Any] | None
    eval_batch_shape: Any
    fits: bool | None
    coverage: dict[str, Any]
    precision: str | None
    schedule: dict[str, Any]
    # The run's description as predicted (`preflight.Run.to_dict`): precision, loop, target, parallel plan.
    run: dict[str, Any] | None = None
    predicted_reserved_bytes: int | None = None
    predicted_allocated_bytes: int | None = None
    predicted_device_total_bytes: int | None = None
    eval_predicted_device_total_bytes: int | None = None
    world_size: int = 1
    rank_predicted_peak_bytes: list[int | None] | None = None
    # Per rank under torch.distributed: whose figure is only a lower bound (its prediction failed), and each rank's
    # own measurement and its error against that rank's own prediction.
    rank_lower_bound: list[bool | None] | None = None
    rank_measured_peak_bytes: list[int | None] | None = None
    rank_relative_errors: list[float | None] | None = None
    suggestions: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    autotune: dict[str, Any] | None = None
    measured_peak_bytes: int | None = None
    measured_reserved_bytes: int | None = None
    relative_error: float | None = None
    steps_measured: int = 0
    measured_step_peaks: list[int] = dataclasses.field(default_factory=list)
    predicted_step_peaks: list[int | None] = dataclasses.field(default_factory=list)
    worst_case_headroom: float | None = None
    retained_step_bytes: list[int] = dataclasses.field(default_factory=list)
    eval_measured_peak_bytes: int | None = None
    eval_predicted_measured_bytes: int | None = None
    eval_relative_error: float | None = None
    verify_method: str | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    phases: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    estimate: Estimate | None = dataclasses.field(default=None, repr=False)
    eval_estimate: Estimate | None = dataclasses.field(default=None, repr=False)
    # step_predictor(batch) -> {step: peak bytes}: the same prediction for another batch (`VerifySession`).
    step_predictor: Callable[..., dict[int, int]] | None = dataclasses.field(default=None, repr=False)
    # eval_predictor(batch) -> bytes: the eval prediction for another eval batch.
    eval_predictor: Callable[[Any], int] | None = dataclasses.field(default=None, repr=False)

    @property
    def verdict_bytes(self) -> int:
        """What the verdict compares with the usable budget: the largest need of the run's phases: training (the
        device total when a GPU target was simulated: reserved memory + CUDA context + cuBLAS workspace; else the
        peak of tensor storages), evaluation, loading and saving (likewise)."""
        return max(self.phase_needs().values())

    @property
    def run_peak_phase(self) -> str:
        """The phase whose need the verdict compares: ``"training"``, ``"evaluation"``, ``"loading"``, ``"saving"``."""
        needs = self.phase_needs()
        return max(needs, key=lambda name: needs[name])

    def phase_needs(self) -> dict[str, int]:
        """What each phase of the run needs, as the verdict compares it (`verdict_bytes`): ``{"training": ...,
        "evaluation": ... (0 without one), "loading": ..., "saving": ...}`` (the phases the run has)."""
        train = self.predicted_device_total_bytes
        if train is None:
            train = self.predicted_peak_bytes
        needs = {"training": train,
                 "evaluation": self.eval_predicted_device_total_bytes or self.eval_predicted_peak_bytes or 0}
        for phase in self.phases:
            if phase["name"] not in needs:
                needs[phase["name"]] = phase["required_bytes"]
        return needs

    def to_dict(self) -> dict[str, Any]:
        """The JSON report (without the timelines)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("estimate", "eval_estimate", "step_predictor", "eval_predictor")}
        out["relative_error"] = None if self.relative_error is None else round(self.relative_error, 6)
        if self.worst_case_headroom is not None:
            out["worst_case_headroom"] = round(self.worst_case_headroom, 6)
        out["predicted_required_bytes"] = self.verdict_bytes  # what the verdict compared with usable_bytes
        out["run_peak_phase"] = self.run_peak_phase
        return out

    def write(self, path: str | os.PathLike) -> None:
        """Write ``to_dict()`` as JSON to ``path`` (parent directories are created)."""
        path = os.fspath(path)
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, default=str)
            f.write("\n")
