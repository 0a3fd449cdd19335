"""Render a `preflight._check.Report` for people: a compact table with rich, plain text without it; and say what is
happening while a trace runs (`progress`, shared by the CLI and the callbacks).

Callers print on rank zero only (`preflight._check` does).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from preflight._units import format_bytes

if TYPE_CHECKING:
    from preflight._check import Report

__all__ = ["format_report", "print_report", "progress"]

_TOP_SUGGESTIONS = 3
_TICK = 0.2  # seconds between spinner frames on a terminal


@contextlib.contextmanager
def progress(what: str, *, enabled: bool = True) -> Iterator[None]:
    """Say on stderr what is happening and, when it is done, how long it took; on a terminal, keep the elapsed time
    ticking meanwhile. ``enabled=False`` (other ranks) prints nothing.

    Example:
        >>> with progress("tracing the training step on fake tensors"):  # doctest: +SKIP
        ...     estimate(...)
    """
    if not enabled:
        yield
        return
    start = time.perf_counter()
    done = threading.Event()
    thread = None
    if sys.stderr.isatty():
        def spin() -> None:
            frames = "|/-\\"
            i = 0
            while not done.wait(_TICK):
                print(f"\rpreflight: {what} {frames[i % 4]} {time.perf_counter() - start:5.1f} s",
                      end="", file=sys.stderr, flush=True)
                i += 1

        thread = threading.Thread(target=spin, daemon=True)
        thread.start()
    else:
        print(f"preflight: {what} ...", file=sys.stderr, flush=True)
    try:
        yield
    finally:
        done.set()
        if thread is not None:
            thread.join()
            print("\r\033[K", end="", file=sys.stderr)  # clear the spinner's line
        print(f"preflight: {what}: done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def print_report(report: Report, *, verified: bool = False, file: Any = None) -> None:
    """Print the prediction table, or after verification the measured-vs-predicted lines."""
    rows = _verification_rows(report) if verified else _rows(report)
    title = "preflight: measured vs predicted" if verified else "preflight: predicted peak memory"
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_report(report, verified=verified), file=file or sys.stdout, flush=True)
        return
    table = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    Console(file=file or sys.stdout, soft_wrap=True).print(table)


def format_report(report: Report, *, verified: bool = False) -> str:
    """The same content as plain text."""
    rows = _verification_rows(report) if verified else _rows(report)
    width = max(len(k) for k, _ in rows)
    title = "preflight: measured vs predicted" if verified else "preflight: predicted peak memory"
    return "\n".join([title] + [f"  {k:<{width}}  {v}" for k, v in rows])


def _rows(r: Report) -> list[tuple[str, str]]:
    rows = [("device", f"{r.device}" + (f" x {r.world_size} ranks (max over ranks)" if r.world_size > 1 else ""))]
    kind = "lower bound" if r.coverage.get("lower_bound") else "training peak"
    rows.append((kind, f"{format_bytes(r.predicted_peak_bytes)} at {r.peak_phase}"))
    total = r.predicted_peak_bytes or 1
    for name, nbytes in r.predicted_breakdown.items():
        if nbytes:
            rows.append((f"  {name}", f"{format_bytes(nbytes):>11}  {nbytes / total:6.1%}"))
    if r.eval_predicted_peak_bytes is not None:
        rows.append(("eval peak", f"{format_bytes(r.eval_predicted_peak_bytes)} (no grad, batch {r.eval_batch_shape})"))
    batch = f"{r.worst_case_batch_shape}"
    if r.worst_case_batch:
        batch += f" ({r.worst_case_batch['method']}: {r.worst_case_batch['note']})"
    rows.append(("worst-case batch", batch))
    sched = r.schedule
    if sched.get("accumulate", 1) > 1 or r.precision:
        precision = r.precision or "as the tensors are"
        rows.append(("step", f"precision {precision}, accumulate {sched.get('accumulate', 1)}"))
    if r.budget_bytes is None:
        rows.append(("budget", "none (CPU): pass budget= to get a verdict"))
        rows.append(("verdict", "not checked"))
    else:
        rows.append(("budget", f"{format_bytes(r.budget_bytes)}, headroom {r.headroom:.0%} -> usable "
                               f"{format_bytes(r.usable_bytes)}"))
        share = r.verdict_bytes / r.usable_bytes if r.usable_bytes else float("inf")
        verdict = {True: "fits", False: "DOES NOT FIT", None: "no verdict (lower bound)"}[r.fits]
        rows.append(("verdict", f"{verdict} ({share:.0%} of usable)"))
    for i, s in enumerate(r.suggestions[:_TOP_SUGGESTIONS]):
        # advise's descriptions carry the predicted peak and whether it fits
        rows.append(("suggestion" if i == 0 else "", f"{'FITS' if s['fits'] else 'over'}: {s['description']}"))
    for w in r.warnings:
        rows.append(("warning", w))
    return rows


def _verification_rows(r: Report) -> list[tuple[str, str]]:
    rows = [("predicted", format_bytes(r.predicted_peak_bytes)),
            ("measured", f"{format_bytes(r.measured_peak_bytes)} over {r.steps_measured} step(s) ({r.verify_method})")]
    if r.relative_error is not None:
        rows.append(("error", f"{r.relative_error:+.2%} (predicted - measured) / measured"))
    if r.measured_reserved_bytes is not None:
        rows.append(("reserved", format_bytes(r.measured_reserved_bytes)))
    rows.append(("per step", ", ".join(format_bytes(p) for p in r.measured_step_peaks)))
    return rows
