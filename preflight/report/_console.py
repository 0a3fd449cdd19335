"""Render a `preflight.report.Report` for people: a compact table with rich, plain text without it; and say what is
happening while a trace runs (`progress`, shared by the CLI and the callbacks).

Callers print on rank zero only (`preflight.verdict` does).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from preflight._units import format_bytes, margin_text, signed_percent
from preflight.report._report import Report


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
    """Print the prediction table, or after verification the measured-vs-predicted lines, for the width of the
    terminal ``file`` is (values wrap between words, never inside a number, a unit or a bracketed shape; lines carry
    no trailing spaces); to a file or a pipe each value stays on one line."""
    file = file or sys.stdout
    title, rows = _table(report, verified)
    width = _terminal_width(file)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(_plain(title, rows, width), file=file, flush=True)
        return
    keys = max(len(k) for k, _ in rows)
    table = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False, padding=(0, 1))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(no_wrap=True)  # wrapped here, by `_wrap`, where it does not split a value
    for key, value in rows:
        table.add_row(key, "\n".join(_wrap(value, None if width is None else width - keys - 2)))
    console = Console(file=file, width=_UNLIMITED, soft_wrap=False)
    with console.capture() as captured:
        console.print(table)
    # rich pads every cell to its column's width: drop the padding at the ends of lines (before any style reset)
    file.write(_TRAILING.sub("", captured.get()))
    file.flush()


def format_report(report: Report, *, verified: bool = False, width: int | None = None) -> str:
    """The same content as plain text; ``width``: wrap values to fit that many columns (None: one line each)."""
    return _plain(*_table(report, verified), width)


_UNLIMITED = 100_000  # rich's width when preflight wraps the values itself
_TRAILING = re.compile(r"[ \t]+(?=(?:\x1b\[[0-9;]*m)*$)", re.MULTILINE)
# Where a value may not be broken: inside brackets or quotes, or between a number and its unit.
_UNIT = re.compile(r"^(B|KiB|MiB|GiB|TiB|bytes|s|ms|ranks?|%)[,;:)]*$")


def _terminal_width(file: Any) -> int | None:
    """The terminal's columns when ``file`` is one (``COLUMNS`` wins, as for ``shutil.get_terminal_size``)."""
    isatty = getattr(file, "isatty", None)
    try:
        if isatty is None or not isatty():
            return None
    except ValueError:  # a closed file
        return None
    return shutil.get_terminal_size().columns


def _table(report: Report, verified: bool) -> tuple[str, list[tuple[str, str]]]:
    if verified:
        return "preflight: measured vs predicted", _verification_rows(report)
    return "preflight: predicted peak memory", _rows(report)


def _plain(title: str, rows: list[tuple[str, str]], width: int | None) -> str:
    keys = max(len(k) for k, _ in rows)
    indent = 2 + keys + 2
    lines = [title]
    for key, value in rows:
        wrapped = _wrap(value, None if width is None else width - indent)
        lines.append(f"  {key:<{keys}}  {wrapped[0]}".rstrip())
        lines.extend((" " * indent + line).rstrip() for line in wrapped[1:])
    return "\n".join(lines)


def _wrap(value: str, width: int | None) -> list[str]:
    """``value`` in lines of at most ``width`` columns, broken only at spaces between words or between a mapping's
    entries: never inside a list (a shape such as ``[16, 256]``), a quoted name, a ``key: value`` pair, or between a
    number and its unit. A piece longer than ``width`` gets a line of its own, whole."""
    if width is None or len(value) <= width:
        return [value]
    width = max(width, 20)  # a terminal narrower than the keys: still readable, one piece a line at worst
    pieces: list[str] = []
    stack: list[str] = []
    quote, current, previous = "", "", " "
    for char in value:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"" and previous in " ([{:,":  # an apostrophe inside a word opens nothing
            quote = char
        elif char in "([{":
            stack.append(char)
        elif char in ")]}" and stack:
            stack.pop()
        breakable = not quote and "[" not in stack and (not stack or stack[-1] != "{" or previous == ",")
        if char == " " and breakable:
            pieces.append(current)
            current = ""
        else:
            current += char
        previous = char
    pieces.append(current)
    joined: list[str] = []
    for piece in pieces:  # glue a unit to its number
        if joined and _UNIT.match(piece) and re.search(r"\d$", joined[-1]):
            joined[-1] += " " + piece
        else:
            joined.append(piece)
    lines = [""]
    for piece in joined:
        if lines[-1] and len(lines[-1]) + 1 + len(piece) > width:
            lines.append(piece)
        else:
            lines[-1] = f"{lines[-1]} {piece}" if lines[-1] else piece
    return lines


def _rows(r: Report) -> list[tuple[str, str]]:
    rows = [("device", f"{r.device}" + (f" x {r.world_size} ranks (max over ranks)" if r.world_size > 1 else ""))]
    kind = "lower bound" if r.coverage.get("lower_bound") else "training peak"
    rows.append((kind, f"{format_bytes(r.predicted_peak_bytes)} at {r.peak_phase}"))
    total = r.predicted_peak_bytes or 1
    for name, nbytes in r.predicted_breakdown.items():
        if nbytes:
            rows.append((f"  {name}", f"{format_bytes(nbytes):>11}  {nbytes / total:6.1%}"))
    if r.predicted_allocated_bytes is not None:
        rows.append(("max allocated", f"{format_bytes(r.predicted_allocated_bytes)} (the allocator's blocks, as "
                                      "torch.cuda.max_memory_allocated counts)"))
    if r.predicted_reserved_bytes is not None:
        rows.append(("reserved", format_bytes(r.predicted_reserved_bytes)))
    if r.predicted_device_total_bytes is not None:
        rows.append(("device total", f"{format_bytes(r.predicted_device_total_bytes)} (reserved + CUDA context)"))
    if r.eval_predicted_peak_bytes is not None:
        kept = (r.run or {}).get("evaluation") or {}
        also = f", outputs of {kept['kept_batches']} batches kept" if kept.get("kept_batches", 1) > 1 else ""
        rows.append(("eval peak", f"{format_bytes(r.eval_predicted_peak_bytes)} (no grad, batch {r.eval_batch_shape}"
                                  f"{also})"))
        if r.eval_predicted_device_total_bytes is not None:
            rows.append(("eval device total", f"{format_bytes(r.eval_predicted_device_total_bytes)} (reserved + "
                                              "CUDA context + workspace)"))
    for phase in r.phases:
        if phase["name"] in ("training", "evaluation"):
            continue
        ranks = phase.get("per_rank_peak_bytes")
        spread = "" if not ranks or len(set(ranks)) == 1 else \
            f" (ranks {format_bytes(min(ranks))} to {format_bytes(max(ranks))})"
        rows.append((f"{phase['name']} peak", f"{format_bytes(phase['peak_bytes'])} at {phase['where']}{spread}"))
    if len(r.phases) > 1:
        rows.append(("run peak", f"{r.run_peak_phase}: {format_bytes(r.verdict_bytes)}"))
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
        rows.append(("verdict", f"{verdict} ({share_text(share)} of usable)"))
    for i, s in enumerate(r.suggestions[:_TOP_SUGGESTIONS]):
        # advise's descriptions carry the predicted peak and whether it fits
        rows.append(("suggestion" if i == 0 else "", f"{'FITS' if s['fits'] else 'over'}: {s['description']}"))
    for w in r.warnings:
        rows.append(("warning", w))
    return rows


def share_text(share: float) -> str:
    """A share of the usable budget with two significant digits: ``"0.23%"``, ``"9.9%"``, ``"32%"``, never a ``0%``
    beside a prediction that is not zero."""
    if share == 0 or share >= 0.1:
        return f"{share:.0%}"
    return f"{share * 100:.2g}%"


def _verification_rows(r: Report) -> list[tuple[str, str]]:
    own = [p for p in r.predicted_step_peaks if p]
    rows = [("predicted", f"{format_bytes(max(own))} for the measured batches" if own else
             format_bytes(r.predicted_peak_bytes)),
            ("measured", f"{format_bytes(r.measured_peak_bytes)} over {r.steps_measured} step(s) ({r.verify_method})")]
    if r.relative_error is not None:
        error = f"{signed_percent(r.relative_error, 2)} (predicted - measured) / measured"
        rows.append(("error", f"{error}, the largest of one step" if own else error))
    if r.worst_case_headroom is not None and own:
        rows.append(("worst case", f"{format_bytes(r.predicted_peak_bytes)} predicted, "
                     f"{margin_text(r.worst_case_headroom)} the largest measured step"))
    if r.eval_measured_peak_bytes is not None:
        predicted = "" if not r.eval_predicted_measured_bytes else \
            f", predicted {format_bytes(r.eval_predicted_measured_bytes)} ({signed_percent(r.eval_relative_error, 2)})"
        rows.append(("eval", f"measured {format_bytes(r.eval_measured_peak_bytes)}{predicted}"))
    if r.measured_reserved_bytes is not None:
        rows.append(("reserved", format_bytes(r.measured_reserved_bytes)))
    rows.append(("per step", ", ".join(format_bytes(p) for p in r.measured_step_peaks)))
    if own:
        rows.append(("predicted", ", ".join("?" if p is None else format_bytes(p) for p in r.predicted_step_peaks)))
    return rows
