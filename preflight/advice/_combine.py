"""The search over combinations of changes: which set of moves makes the run fit at the least cost.

Greedy, from the trace of each set tried (`_Setup.trace_moves`, shared with the single options): the moves are
tried cheapest first (`COST_ORDER`), each kept while it lowers what the verdict compares, one of a group replacing
another (one precision, one optimizer); passes repeat while a pass keeps a move (a change that did not lower the
peak alone can once the peak has moved: checkpointing after the optimizer state shrank) and stop at the first set
that fits. Then the moves found unneeded are dropped, costliest first, and a micro-batch among them is raised to the
largest that fits with the others. The result is one `Suggestion` naming each change, its figure traced, with the
number of sets traced and the time it took; or the lowest set found, marked as still over, when none fits.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from preflight._units import format_bytes
from preflight.advice._setup import Move, Suggestion, _Setup, batch_size_of, need

_PASSES = 3


def combine(setup: _Setup, moves: list[Move],
            others: Callable[[_Setup, list[Move], int], tuple[Move, int, str] | None]) -> Suggestion | None:
    """The cheapest set of ``moves`` found that fits (or the lowest, marked as over), as one suggestion; None when
    fewer than two moves lower the peak together.

    Args:
        setup: the user's set-up and its baseline trace.
        moves: the candidate moves, cheapest first (the micro-batch, if any, at size 1).
        others: ``largest_micro_batch(setup, moves, below)``: the largest micro-batch that fits with ``moves``.
    """
    if len(moves) < 2:
        return None
    start = time.perf_counter()
    before = len(setup.traced)
    chosen: list[Move] = []
    best = need(setup.baseline)

    for _ in range(_PASSES):
        kept = False
        for move in moves:
            if move in chosen:
                continue
            trial = [m for m in chosen if m.group != move.group] + [move]
            found = setup.need_of(trial)
            if found is not None and found < best:
                chosen, best, kept = trial, found, True
                if best <= setup.limit:
                    break
        if best <= setup.limit or not kept:
            break
    fits = best <= setup.limit
    if fits:
        chosen, best = drop_unneeded(setup, chosen, best)
    micro = next((m for m in chosen if m.key == "micro_batch"), None)
    note = ""
    if fits and micro is not None:
        rest = [m for m in chosen if m is not micro]
        size = batch_size_of(setup.batch)
        assert size is not None  # a micro-batch move is made only for a batch with a batch dimension
        raised = others(setup, rest, size - 1)
        if raised is not None:
            move, best, note = raised
            chosen = [*rest, move]
            note = note if move.change != micro.change else ""  # a micro-batch of 1 is the largest: nothing to add
    if len(chosen) < 2:
        return None
    chosen.sort(key=lambda m: m.rank)
    traced = len(setup.traced) - before
    with setup.applied(chosen) as c:
        run = c.run
    if micro is not None and "accumulate_grad_batches" in micro.change:
        # traced as an accumulation micro-step; the run accumulates the whole global batch
        final = next(m for m in chosen if m.key == "micro_batch")
        run = run.replace(loop=dataclasses.replace(run.loop, accumulate=final.change["accumulate_grad_batches"]))
    words = " + ".join(m.words for m in chosen)
    searched = (f"found by trying changes cheapest first: {traced} set-ups traced in "
                f"{time.perf_counter() - start:.0f} s")
    if fits:
        text = f"together: {words}: {setup.versus(best)} ({searched}{'; ' + note if note else ''})"
    else:
        text = (f"no combination found fits; the lowest: {words}: {setup.versus(best)} ({searched}); "
                f"{format_bytes(best - setup.limit)} more is needed")
    return suggestion_of(chosen, text, best, fits, run)


def drop_unneeded(setup: _Setup, chosen: list[Move], best: int, *, beside: tuple[Move, ...] = ()
                  ) -> tuple[list[Move], int]:
    """``chosen`` less each move the set still fits without (``beside`` always made with it), tried costliest
    first (fewer and cheaper changes rank higher), and the figure of what is left; never emptied to no move at
    all."""
    for move in sorted(chosen, key=lambda m: -m.rank):
        trial = [m for m in chosen if m is not move]
        found = setup.need_of([*trial, *beside]) if trial or beside else None
        if found is not None and found <= setup.limit:
            chosen, best = trial, found
    return chosen, best


def suggestion_of(chosen: list[Move], text: str, best: int, fits: bool, run: Any) -> Suggestion:
    """One suggestion making every move of ``chosen``: their changes merged, their costs listed."""
    change: dict[str, Any] = {}
    for m in chosen:
        change.update(m.change)
    cost = "; ".join(f"{m.words}: {m.cost}" for m in chosen)
    return Suggestion(change, text, best, fits, cost, run, changes=tuple(m.key for m in chosen))

