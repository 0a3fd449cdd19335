"""Agreement across ranks under ``torch.distributed`` (the maximum over ranks decides, on every rank alike), and
`internal_failures`: a failure inside preflight becomes a warning with the reason, never a crash of training."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


from preflight._warnings import warn
from preflight._dryrun import finish_failed_step
from preflight._errors import PreflightError, StepWouldFailError
from preflight.trace import blamed_on_user

from preflight.report._report import Report
__all__ = ["is_rank_zero", "internal_failures"]


def _distributed() -> Any:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _world_size() -> int:
    dist = _distributed()
    return dist.get_world_size() if dist is not None else 1


def _rank() -> int:
    dist = _distributed()
    return dist.get_rank() if dist is not None else 0


def is_rank_zero() -> bool:
    """Rank zero of ``torch.distributed`` (True when not distributed)."""
    dist = _distributed()
    return dist is None or dist.get_rank() == 0


def wait_for_every_rank() -> None:
    """A barrier over the ranks (nothing when not distributed). A dry run's ranks meet here after rank zero wrote
    the report: a launcher such as torchrun stops every rank as soon as one exits with a failure status (3: does
    not fit), which could otherwise stop rank zero before its report is written."""
    dist = _distributed()
    if dist is None:
        return
    try:
        dist.barrier()
    except Exception as err:  # noqa: BLE001 - a broken group must not keep a rank from exiting with its verdict
        warn(f"preflight: the ranks could not meet before exiting ({type(err).__name__}: {err}); the report may be "
             "missing if another rank exits first", RuntimeWarning)


def _all_gather(value: Any) -> list[Any]:
    dist = _distributed()
    if dist is None:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _agree(report: Report | None) -> tuple[Report | None, list[tuple | None]]:
    """Every rank's ``(peak, eval peak, fits, usable, lower bound)`` (None where even the lower bound failed); the
    report updated with the maximum over ranks. ``fits``: False if any rank does not fit (a lower bound over the
    budget included), else True if a rank that predicted fits (a rank whose prediction failed, with a lower bound
    under the budget, runs the same model on the same worst-case batch), else None."""
    local = None if report is None else (report.predicted_peak_bytes, report.eval_predicted_peak_bytes, report.fits,
                                         report.usable_bytes, bool(report.coverage.get("lower_bound")))
    gathered = _all_gather(local)
    verdicts = [g[2] if g is not None else "failed" for g in gathered]
    if report is not None and len(gathered) > 1:
        peaks = [g[0] if g is not None else None for g in gathered]
        eval_peaks = [g[1] for g in gathered if g is not None and g[1] is not None]
        report.world_size = len(gathered)
        report.rank_predicted_peak_bytes = peaks
        report.rank_lower_bound = [g[4] if g is not None else None for g in gathered]
        report.predicted_peak_bytes = max(p for p in peaks if p is not None)
        if eval_peaks:
            report.eval_predicted_peak_bytes = max(eval_peaks)
        if report.usable_bytes is not None:
            over = report.verdict_bytes > report.usable_bytes or False in verdicts
            report.fits = False if over else (True if True in verdicts else None)
        bounded = [i for i, g in enumerate(gathered) if g is not None and g[4]]
        if bounded and len(bounded) < len(gathered):
            report.warnings.append(f"rank(s) {', '.join(map(str, bounded))}: the figure is a lower bound (the "
                                   "prediction failed there, or could not trace); the verdict uses the ranks that "
                                   "predicted")
    return report, gathered


@contextlib.contextmanager
def internal_failures(what: str, reraise: tuple[type[BaseException], ...] = (),
                      reasons: list[str] | None = None) -> Iterator[None]:
    """Turn an exception inside preflight (not a `PreflightError`, nor one of ``reraise``) into a warning: training
    must not stop for us. ``reasons``, when given, gets the failure's one-line reason. An exception of the user's own
    code that a trace re-raised as such (`preflight.trace.blamed_on_user`) is re-raised: not ours to swallow, and the
    real first step raises it too."""
    try:
        yield
    except StepWouldFailError as err:  # the real step would raise too: say why, before it (a dry run exits 5)
        finish_failed_step(str(err))
        raise
    except (PreflightError, *reraise):
        raise
    except Exception as err:  # noqa: BLE001 - the policy: preflight never breaks a training run by its own failure
        if blamed_on_user(err):
            raise
        reason = f"{type(err).__name__}: {err}".splitlines()[0][:500]
        if reasons is not None:
            reasons.append(reason)
        warn(f"preflight: {what} failed and was skipped; training proceeds. Reason: {reason}", RuntimeWarning)
