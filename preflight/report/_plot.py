"""Render a `preflight.report.Report` as a PNG: the predicted live-memory timeline and the breakdown at the peak.

matplotlib is an optional extra (``pip install matplotlib``, or ``pip install -e ".[plot]"`` in a preflight clone). Only its object-oriented API is used
(``Figure`` with an Agg canvas), so plotting changes no global matplotlib state (backend, pyplot figures).
"""

from __future__ import annotations

import os
from typing import Any

from preflight._units import format_bytes
from preflight._result import Estimate
from preflight.report._report import Report

__all__ = ["plot_estimate", "plot_report"]

_MIB = 2**20


def plot_report(report: Report, path: str | os.PathLike) -> None:
    """Write a PNG to ``path``: live MiB by operator, coloured by phase, with the usable budget, the budget and
    (once verified) the measured peak as horizontal lines; beside it, the bytes per category at the peak.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
    """
    points = report.estimate.timeline if report.estimate is not None else ()
    _draw(path, points, report.predicted_breakdown, report.predicted_peak_bytes, report.peak_phase,
          budget_bytes=report.budget_bytes, usable_bytes=report.usable_bytes,
          measured_bytes=report.measured_peak_bytes, eval_bytes=report.eval_predicted_peak_bytes)


def plot_estimate(est: Estimate, path: str | os.PathLike, *, budget_bytes: int | None = None,
                  usable_bytes: int | None = None) -> None:
    """The same picture for a bare `Estimate` (``preflight estimate --plot``), with the budget lines if given.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
    """
    _draw(path, est.timeline, est.breakdown, est.peak_bytes, est.peak_phase, budget_bytes=budget_bytes,
          usable_bytes=usable_bytes)


def _draw(path: str | os.PathLike, points: Any, breakdown: dict[str, int], peak: int, phase: str, *,
          budget_bytes: int | None, usable_bytes: int | None, measured_bytes: int | None = None,
          eval_bytes: int | None = None) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "plotting (plot_path=, --plot) needs matplotlib, which is not installed: pip install matplotlib "
            "(or, in your preflight clone, pip install -e '.[plot]')"
        ) from err

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    timeline_ax, bar_ax = fig.subplots(1, 2, width_ratios=(3, 1))
    phases: dict[str, tuple[list[int], list[float]]] = {}
    for p in points:
        xs, ys = phases.setdefault(p.phase, ([], []))
        xs.append(p.op)
        ys.append(p.live_bytes / _MIB)
    colours: dict[str, str] = {}  # one colour per phase kind (forward, backward, ...) across steps
    cycle = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]
    for name, (xs, ys) in phases.items():
        kind = name.split("/")[-1]
        new = kind not in colours
        colour = colours.setdefault(kind, cycle[len(colours) % len(cycle)])
        timeline_ax.plot(xs, ys, color=colour, linewidth=1.2, label=kind if new else None)
    if usable_bytes is not None:
        timeline_ax.axhline(usable_bytes / _MIB, color="tab:red", linestyle="--",
                            label=f"usable ({format_bytes(usable_bytes)})")
    if budget_bytes is not None:
        timeline_ax.axhline(budget_bytes / _MIB, color="tab:red", linestyle=":",
                            label=f"budget ({format_bytes(budget_bytes)})")
    if measured_bytes is not None:
        timeline_ax.axhline(measured_bytes / _MIB, color="black", linestyle="-.",
                            label=f"measured peak ({format_bytes(measured_bytes)})")
    if eval_bytes is not None:
        timeline_ax.axhline(eval_bytes / _MIB, color="grey", linestyle="--",
                            label=f"eval peak ({format_bytes(eval_bytes)})")
    timeline_ax.set_xlabel("operator")
    timeline_ax.set_ylabel("live MiB")
    timeline_ax.set_title(f"predicted peak {format_bytes(peak)} at {phase}")
    timeline_ax.legend(loc="upper left", fontsize="small")

    names = [k for k, v in breakdown.items() if v]
    values = [breakdown[k] / _MIB for k in names]
    bar_ax.barh(names, values, color="tab:blue")
    bar_ax.invert_yaxis()
    bar_ax.set_xlabel("MiB at the peak")
    bar_ax.set_title("breakdown")
    path = os.fspath(path)
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
