"""Render estimates for people (text tables) and machines (JSON-ready dicts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from preflight._units import format_bytes

if TYPE_CHECKING:
    from preflight._result import Estimate

__all__ = ["format_estimate"]


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
    if est.peak_reserved_bytes is not None:
        lines.append(f"  reserved by the CUDA allocator: {format_bytes(est.peak_reserved_bytes)}")
    if est.device_total_bytes is not None:
        lines.append(f"  device total (reserved + context + workspaces): {format_bytes(est.device_total_bytes)}")
    if est.per_rank_peak_bytes is not None:
        lines.append(f"  per rank ({est.sharding}, {est.world_size} ranks; rank {est.peak_rank} peaks):")
        lines.extend(f"    rank {rank}: {format_bytes(nbytes):>12} ({nbytes:,} B)"
                     for rank, nbytes in enumerate(est.per_rank_peak_bytes))
    cov = est.coverage
    if cov.traced:
        lines.append(f"coverage: traced {est.num_ops:,} ops over {est.steps} steps in {est.trace_seconds:.1f} s")
    else:
        lines.append(f"coverage: NOT traced ({cov.reason}); failed at {cov.failed_op}")
    if cov.calibrated:
        lines.append(f"  kernel scratch calibrated for {len(cov.calibrated)} configuration(s)")
    lines.extend(f"  note: {note}" for note in cov.notes)
    return "\n".join(lines)
