"""The report: what preflight predicted for a run, and its renderers. `Report` holds the prediction (and, once the
first steps were measured, the measurement) of the training and evaluation peaks, the verdict against the budget and
the suggestions, as plain numbers; ``to_dict()`` is the JSON the callbacks and ``preflight check`` write. The
renderers read it and nothing else: `print_report` (a compact table, with rich where installed), `plot_report` and
`plot_estimate` (PNGs, with matplotlib), and `progress`, the one-line "doing X ... done in N s" that long work
prints. This package computes nothing: `preflight.verdict` fills the report, `preflight._result.format_estimate`
renders a bare `Estimate`.
"""

from preflight.report._console import format_report, print_report, progress
from preflight.report._plot import plot_estimate, plot_report
from preflight.report._report import Report

__all__ = ["Report", "format_report", "plot_estimate", "plot_report", "print_report", "progress"]
