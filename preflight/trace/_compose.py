"""Depth-independent traces: the event timeline of an N-block model, composed exactly from three shallow traces.

A stack of identical blocks (or of a short period of blocks, `preflight.trace._stack`) makes the same memory
events for every block: in the forward, in the backward (in reverse), in the optimizer's loops and lists over
the parameters, in ``zero_grad``. So the timeline of a model with ``a + 1`` periods is the timeline with ``a``
periods plus one period's events inserted at a few places, and the timeline with ``N`` periods has ``N - a``
copies at each of those places. `trace_composed` traces the model with ``a``, ``a + 1`` and ``a + 2`` periods
(``a`` = `BASE_PERIODS`; its first blocks, the rest of the model as it is) and composes the N-period timeline:

1. **Align** (`_embed`): each timeline is a sequence of tokens (allocation or free, bytes, category, phase and
   the operator distance from the previous event). The ``a``-period sequence is embedded in the ``a + 1`` one
   with the fewest contiguous insertions (a dynamic program over the insertion count, per phase); each insertion
   is then slid to the middle of the periodic stretch around it, so that a whole period of the same tokens lies
   on each side. The ``a + 2``-period sequence must be the ``a``-period one with every insertion twice.
2. **Lifetimes**: each free is tied to its allocation by a rule fitted on all three traces: the same event of
   the shared part (a parameter, a mask made before the stack), or an event of the copy ``t + shift`` counted
   from the first copy, or ``copies - 1 - t + shift`` counted from the last (the backward frees the forward's
   copies in reverse). Where that copy index falls outside the copies (the first copy frees the output of the
   last shared block before it), the shared event it names is learned from the traces and must be the same in
   each. A free whose allocation is ambiguous or never observed at depth N stops the composition.
3. **Compose** the N-period timeline with ``N - a`` copies per insertion, and check the composition code on the
   traced depths: the timelines it composes for ``a + 1`` and ``a + 2`` periods must equal the traced ones
   event for event (sizes, order, operators, phases, categories, which allocation each free releases).

Anything that does not fit stops the composition with a reason, and the caller traces the full model instead
(``coverage.notes`` says which). Peak, breakdown, the allocator simulation and sharding read the composed
event list as they read a full trace's.

Known limitations: a block whose code depends on its depth in a way the shallow traces do not show (a branch on
``layer_idx == 40``) is not detected. Kernel scratch (`preflight._scratch`) is measured for each shallow trace
before composing, as transient events at its operators; a caller that passes no ``scratch`` gets a full trace
for a model that logs such operators. Notes of the composed trace are those of the deepest shallow trace, with the
counts in them that grow by block extrapolated to the full depth (`scaled_notes`).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from preflight._activation_offload import FORWARD_OFFLOADS, FWD_STASH
from preflight._result import Category, Event
from preflight._steps import LossNotFoundError
from preflight.trace._restore import NotRestoredError
from preflight.trace._run import TraceResult, trace_steps
from preflight.trace._stack import find_stack, optimizer_without, truncated

__all__ = ["BASE_PERIODS", "MIN_PERIODS", "compose", "trace_composed"]

BASE_PERIODS = 2  # the shallowest trace: two periods, so each insertion has a whole period on either side
# Compose only when it saves work: the three shallow traces run 3 * BASE_PERIODS + 3 = 9 periods.
MIN_PERIODS = 10


class CompositionError(Exception):
    """The shallow timelines do not compose; the message says why."""


def trace_composed(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, *,
                   min_periods: int | None = None, scratch: Callable[[TraceResult], TraceResult] | None = None,
                   **kwargs: Any) -> tuple[TraceResult, str]:
    """`trace_steps` for ``model``, composed from traces of its first blocks when it has a repeated stack of at
    least ``min_periods`` periods (default `MIN_PERIODS`), else (or when the traces do not compose) traced in full.

    ``scratch`` inserts the kernel scratch of a shallow trace's logged operators (``op_log``) into its events
    (`preflight._scratch.Calibrator.apply`) before composing; without it, a trace that logged operators is traced
    in full.

    Returns:
        The trace, and a note for ``coverage.notes`` saying how it was obtained.
    """
    start = time.perf_counter()
    try:
        found = find_stack(model, optimizer, min_periods=max(MIN_PERIODS if min_periods is None else min_periods,
                                                              BASE_PERIODS + 3))
    except Exception as err:  # noqa: BLE001 - an unusual model is traced in full, with the reason
        found = f"could not inspect the model's blocks ({type(err).__name__}: {err})"
    if isinstance(found, str):
        return trace_steps(model, optimizer, batch, **kwargs), f"traced in full (fast=True): {found}"
    stack = found
    label = stack.name or type(model).__name__
    periods, rem = divmod(stack.blocks, stack.period)
    depths = [(BASE_PERIODS + j) * stack.period + rem for j in range(3)]
    try:
        traces, reason = _shallow_traces(model, optimizer, batch, stack, depths, kwargs, scratch)
        if reason is None:
            events, categories, num_ops, paged = compose(traces, periods - BASE_PERIODS)
    except CompositionError as err:
        reason = str(err)
    except (LossNotFoundError, NotRestoredError):
        raise
    except Exception as err:  # noqa: BLE001 - a failure of the composition is never the user's
        reason = f"{type(err).__name__}: {err}"
    if reason is not None:
        full = trace_steps(model, optimizer, batch, **kwargs)
        return full, f"traced in full (fast=True): {label}'s shallow traces did not compose: {reason}"
    deepest = traces[-1]
    result = TraceResult(events=events, categories=categories, num_ops=num_ops,
                         seconds=time.perf_counter() - start, notes=scaled_notes(traces, periods - BASE_PERIODS),
                         lower_bound=deepest.lower_bound, paged=paged, outside_bytes=deepest.outside_bytes)
    note = (f"depth-independent trace: the {stack.blocks} blocks of {label} (period {stack.period}) composed "
            f"from traces of {', '.join(map(str, depths))} blocks, checked event for event against the traced "
            "depths")
    return result, note


# A whole number (thousands grouped or not) standing alone or as a count (``x64``): not part of a decimal, a
# percentage, a version, a module index (``layers.3``) or a name (``sm_80``).
_NUMBER = re.compile(r"(?:(?<=\bx)|(?<![\w.]))(\d{1,3}(?:,\d{3})+|\d+)(?![\w.%]|,\d{3}|\.\d)")


def scaled_notes(traces: Sequence[TraceResult], copies: int) -> list[str]:
    """The deepest shallow trace's notes at the composed depth: a whole number that grows by the same amount from
    each traced depth to the next (tensors moved, kernels called: so many per block) is extrapolated to ``copies``
    more periods than the shallowest trace; a note whose changing parts are not like that is kept as the deepest
    trace wrote it."""
    out = []
    lists = [t.notes for t in traces]
    for i, note in enumerate(lists[-1]):
        parts = [_NUMBER.split(n[i]) if i < len(n) else None for n in lists]
        if any(p is None or len(p) != len(parts[-1]) for p in parts) or \
                any(parts[0][j] != p[j] for p in parts for j in range(0, len(p), 2)):
            out.append(note)
            continue
        scaled: list[str] | None = list(parts[-1])
        for j in range(1, len(parts[-1]), 2):
            numbers = [p[j] for p in parts]
            a, b, c = (int(n.replace(",", "")) for n in numbers)
            if a == b == c:
                continue
            if not a < b or b - a != c - b:
                scaled = None
                break
            value = a + copies * (b - a)
            scaled[j] = f"{value:,}" if any("," in n for n in numbers) else str(value)
        out.append(note if scaled is None else "".join(scaled))
    return out


def _shallow_traces(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, stack: Any,
                    depths: list[int], kwargs: dict[str, Any],
                    scratch: Callable[[TraceResult], TraceResult] | None) -> tuple[list[TraceResult], str | None]:
    traces, offloads = [], []
    for k in depths:
        before = FORWARD_OFFLOADS[0]
        with truncated(stack, k):
            view = optimizer_without(optimizer, stack.params_from(k))
            result = trace_steps(model, view, batch, **kwargs)
        offloads.append(FORWARD_OFFLOADS[0] - before)
        if result.error is not None:
            return traces, f"the {k}-block trace failed ({type(result.error).__name__})"
        if result.op_log and scratch is None:
            return traces, "kernel scratch calibration (convolutions, low-precision CPU matmuls) is not composed"
        traces.append(scratch(result) if result.op_log else result)
    schedule = kwargs.get("schedule")
    if schedule is not None and schedule.offload_activations == "streams":
        # The stream hooks free an offloaded tensor's device copy once FWD_STASH more are offloaded: with fewer per
        # period, that lag spans more periods than the shallow traces hold, and deeper stacks free differently.
        per = (offloads[1] - offloads[0]) / max(kwargs.get("steps", 1) * schedule.accumulate, 1)
        if 0 < per < FWD_STASH:
            return traces, (f"the stream hooks keep the last {FWD_STASH} offloaded tensors on the device and each "
                            f"period of the stack offloads {per:g} per forward (checkpointed blocks offload their "
                            "inputs only): that window spans more periods than the shallow traces hold")
    return traces, None


# ---- timelines --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Timeline:
    """A trace's events as tokens, with each free's allocation position, operator steps and the phase runs."""

    keys: np.ndarray  # token id per event
    refs: np.ndarray  # position of the freed allocation, -1 for allocations
    steps: np.ndarray  # operators since the previous event (the first event counts from -1)
    runs: list[tuple[str, int, int]]  # (phase, start, end)


class _Vocabulary:
    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}
        self.tokens: list[tuple] = []

    def id(self, token: tuple) -> int:
        found = self.ids.get(token)
        if found is None:
            found = self.ids[token] = len(self.tokens)
            self.tokens.append(token)
        return found


def _timeline(result: TraceResult, vocab: _Vocabulary) -> _Timeline:
    """Tokens: (allocation?, bytes, category, phase, same operator as the previous event?, paged optimizer
    state?). How many operators
    lie between events is kept apart: operators that allocate nothing (in-place updates of each parameter) make
    it grow with depth where the events do not."""
    keys, refs, steps = [], [], []
    where: dict[int, int] = {}
    previous_op = -1
    runs: list[tuple[str, int, int]] = []
    for i, e in enumerate(result.events):
        category = result.categories.get(e.uid, Category.TEMPORARIES)
        step = e.op - previous_op
        if e.nbytes >= 0:
            where[e.uid] = i
            refs.append(-1)
            token = (True, e.nbytes, category, e.phase, step == 0, e.uid in result.paged)
        else:
            if e.uid not in where:
                raise CompositionError(f"a free of storage {e.uid} without its allocation")
            refs.append(where.pop(e.uid))
            token = (False, -e.nbytes, category, e.phase, step == 0, e.uid in result.paged)
        previous_op = e.op
        steps.append(step)
        keys.append(vocab.id(token))
        if runs and runs[-1][0] == e.phase:
            runs[-1] = (e.phase, runs[-1][1], i + 1)
        else:
            runs.append((e.phase, i, i + 1))
    return _Timeline(np.asarray(keys, dtype=np.int64), np.asarray(refs, dtype=np.int64),
                     np.asarray(steps, dtype=np.int64), runs)


# ---- sizes that grow with depth ---------------------------------------------------------------------------------


def _scaled_sizes(lines: list[_Timeline], vocab: _Vocabulary) -> dict[int, tuple[int, int]]:
    """Find the events whose size grows with depth and give them depth-free tokens, in place.

    A few storages hold something per parameter of the whole model: gradient clipping stacks one norm per
    gradient (``torch.stack`` of ``_foreach_norm``'s outputs), a flat buffer concatenates every gradient. Their
    size is ``base + periods * slope``, so their token differs at each traced depth and no other token equals
    it. Such tokens are paired in order across the three timelines, phase by phase (the same kind, category,
    phase and operator flag, sizes in arithmetic progression), and each pair becomes a token of its own whose
    bytes at depth ``a + c`` are ``base + c * slope``. Where the unmatched tokens do not pair up like this,
    nothing is rewritten and the alignment reports the mismatch.

    Returns:
        ``{token id: (bytes at the shallowest depth, bytes added per period)}`` for the new tokens.
    """
    if len(lines) != 3 or any([r[0] for r in line.runs] != [r[0] for r in lines[0].runs] for line in lines):
        return {}
    tokens = vocab.tokens
    pairs: list[list[int]] = []  # per scaled event: its position in each timeline
    for p in range(len(lines[0].runs)):
        spans = [line.keys[line.runs[p][1]:line.runs[p][2]] for line in lines]
        seen = [set(span.tolist()) for span in spans]
        odd = [[i for i, key in enumerate(span.tolist()) if not any(key in seen[j] for j in range(3) if j != k)]
               for k, span in enumerate(spans)]
        if not any(odd):
            continue
        if len({len(o) for o in odd}) != 1:
            return {}
        for positions in zip(*odd):
            found = [tokens[int(spans[k][i])] for k, i in enumerate(positions)]
            kinds = {(t[0], *t[2:]) for t in found}
            sizes = [t[1] for t in found]
            if len(kinds) != 1 or sizes[1] - sizes[0] != sizes[2] - sizes[1]:
                return {}
            pairs.append([line.runs[p][1] + i for line, i in zip(lines, positions)])
    scaled: dict[int, tuple[int, int]] = {}
    for n, positions in enumerate(pairs):
        first = tokens[int(lines[0].keys[positions[0]])]
        second = tokens[int(lines[1].keys[positions[1]])]
        key = vocab.id((first[0], ("grows with depth", n), *first[2:]))
        scaled[key] = (first[1], second[1] - first[1])
        for line, i in zip(lines, positions):
            line.keys[i] = key
    return scaled


# ---- alignment --------------------------------------------------------------------------------------------------


def _embed(a: np.ndarray, b: np.ndarray, late: bool = True) -> list[tuple[int, int]]:
    """Embed ``a`` in ``b`` with the fewest contiguous insertions: ``[(position in a, inserted length)]``.

    Dynamic program over (tokens of ``a`` matched, tokens of ``b`` inserted so far); rows are numpy vectors.
    Among equally few insertions, ``late`` prefers matching tokens of ``a`` as late as possible in ``b`` (each
    insertion as early as possible), else as early as possible.
    """
    n, m = len(a), len(b)
    extra = m - n
    if extra < 0:
        raise CompositionError("a deeper trace has fewer events in a phase")
    inf = np.iinfo(np.int64).max // 4
    matched = np.full(extra + 1, inf, dtype=np.int64)
    matched[0] = 0
    index = np.arange(extra + 1)
    from_gap = np.zeros((n + 1, extra + 1), dtype=bool)
    gap_start = np.zeros((n + 1, extra + 1), dtype=np.int64)
    for i in range(n + 1):
        running = np.minimum.accumulate(matched)
        at = np.maximum.accumulate(np.where(matched == running, index, 0))
        gapped = np.full(extra + 1, inf, dtype=np.int64)
        gapped[1:] = running[:-1] + 1
        best = np.minimum(matched, gapped)
        from_gap[i] = gapped < matched if late else gapped <= matched
        gap_start[i, 1:] = at[:-1]
        if i == n:
            break
        same = b[i:i + extra + 1] == a[i]
        matched = np.where(same, best, inf)
    if best[extra] >= inf:
        raise CompositionError("a shallower trace's events are not found in order in a deeper one")
    gaps = []
    i, d = n, extra
    while True:
        if from_gap[i, d]:
            start = int(gap_start[i, d])
            gaps.append((i, d - start))
            d = start
        if i == 0:
            break
        i -= 1
    if d != 0:
        raise CompositionError("alignment did not close")
    return gaps[::-1]


@dataclasses.dataclass
class _Gap:
    at: int  # position in the shallowest timeline the copies are inserted before
    chunk: np.ndarray  # one copy's tokens


def _align(base: _Timeline, deeper: _Timeline, deepest: _Timeline) -> list[_Gap]:
    """The insertions that turn ``base`` into ``deeper``, phase by phase. Where several placements need equally
    few insertions (a shared tensor of the same size as a block's, next to the stack), the placement whose
    insertions, made twice, give ``deepest`` is taken."""
    if not [r[0] for r in base.runs] == [r[0] for r in deeper.runs] == [r[0] for r in deepest.runs]:
        raise CompositionError("the phases of the shallow traces differ")
    gaps: list[_Gap] = []
    for (_, s, e), (_, s2, e2), (_, s3, e3) in zip(base.runs, deeper.runs, deepest.runs):
        a, b, c = base.keys[s:e], deeper.keys[s2:e2], deepest.keys[s3:e3]
        candidates = [_place(a, b, late) for late in (True, False)]
        placed = next((p for p in candidates if np.array_equal(_inserted(a, p, 2), c)), None)
        if placed is None:
            placed = _split_at_junctions(a, candidates[0], c)
        gaps.extend(_Gap(s + i, chunk) for i, chunk in placed)
    return gaps


def _split_at_junctions(a: np.ndarray, placed: list[tuple[int, np.ndarray]],
                        c: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """Where two repeated stretches meet (the optimizer's first parameter group ends with the last block's weights
    and the second starts with the first block's biases), one insertion ``u v`` at the junction explains one more
    period as well as two, but two more periods are ``u u v v``, not ``u v u v``. Split such insertions, left to
    right, where that makes the two-period timeline ``c`` come out; leave the rest (the caller's check fails).
    Each part is then slid to the middle of its own stretch, so that its copies stand for the middle blocks of
    that stretch, as the other phases' copies do."""
    placed = list(placed)
    r = 0
    while r < len(placed):
        at, chunk = placed[r]
        options = [[(at, chunk)]] + [[(at, chunk[:j]), (at, chunk[j:])] for j in range(1, len(chunk))]
        for option in options:
            trial = placed[:r] + option + placed[r + 1:]
            end = int(at + sum(2 * len(w) for _, w in trial[:r + len(option)]))  # the junction's end in ``c``
            x = _inserted(a, trial, 2)
            if len(x) == len(c) and np.array_equal(x[:end], c[:end]):
                if len(option) == 2:
                    low = placed[r - 1][0] + 1 if r else 0
                    high = placed[r + 1][0] - 1 if r + 1 < len(placed) else len(a)
                    option = [_centre(a, at, option[0][1], low, at), _centre(a, at, option[1][1], at, high)]
                    trial = placed[:r] + option + placed[r + 1:]
                    if not np.array_equal(_inserted(a, trial, 2)[:end], c[:end]):
                        return placed
                placed = trial
                r += len(option)
                break
        else:
            return placed
    return placed


def _place(a: np.ndarray, b: np.ndarray, late: bool) -> list[tuple[int, np.ndarray]]:
    """`_embed`'s insertions as (position in ``a``, one copy's tokens), each slid to the middle of its stretch."""
    found = _embed(a, b, late)
    inserted = 0
    placed: list[tuple[int, np.ndarray]] = []
    for n, (i, length) in enumerate(found):
        chunk = b[i + inserted:i + inserted + length]
        inserted += length
        low = placed[-1][0] + 1 if placed else 0
        high = found[n + 1][0] - 1 if n + 1 < len(found) else len(a)
        placed.append(_centre(a, i, chunk, low, high))
    return placed


def _inserted(a: np.ndarray, placed: list[tuple[int, np.ndarray]], copies: int) -> np.ndarray:
    """``a`` with each insertion made ``copies`` times."""
    pieces, previous = [], 0
    for at, chunk in placed:
        pieces += [a[previous:at], np.tile(chunk, copies)]
        previous = at
    pieces.append(a[previous:])
    return np.concatenate(pieces) if pieces else a


def _centre(a: np.ndarray, at: int, chunk: np.ndarray, low: int, high: int) -> tuple[int, np.ndarray]:
    """Slide an insertion to the middle of the stretch of ``a`` that repeats its tokens (the same sequence
    results), so that a whole copy's worth of the shared part lies on each side when the stack allows."""
    length = len(chunk)
    left = 0
    while at - left - 1 >= low and a[at - left - 1] == chunk[(-1 - left) % length]:
        left += 1
    right = 0
    while at + right < high and a[at + right] == chunk[right % length]:
        right += 1
    shift = (right - left) // 2
    return at + shift, np.roll(chunk, -shift)


# ---- layouts and lifetimes ----------------------------------------------------------------------------------------


class _Template:
    """The shallowest timeline with its insertions: element ``i < n`` is its event ``i``; element
    ``n + offsets[r] + o`` is event ``o`` of a copy inserted at gap ``r``."""

    def __init__(self, base: _Timeline, gaps: list[_Gap]) -> None:
        self.n = len(base.keys)
        self.gaps = gaps
        self.lengths = [len(g.chunk) for g in gaps]
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.keys = np.concatenate([base.keys, *[g.chunk for g in gaps]]) if gaps else base.keys

    def layout(self, copies: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
        """The timeline with ``copies`` copies per gap: element and copy index (-1: shared part) per position,
        the position of each shared element, and the start position of each gap's copies."""
        pieces_e, pieces_t = [], []
        old_pos = np.empty(self.n, dtype=np.int64)
        starts: list[np.ndarray] = []
        position = previous = 0
        for r, gap in enumerate(self.gaps):
            span = np.arange(previous, gap.at)
            old_pos[previous:gap.at] = position + np.arange(len(span))
            pieces_e.append(span)
            pieces_t.append(np.full(len(span), -1))
            position += len(span)
            length = self.lengths[r]
            elements = self.n + self.offsets[r] + np.arange(length)
            pieces_e.append(np.tile(elements, copies))
            pieces_t.append(np.repeat(np.arange(copies), length))
            starts.append(position + length * np.arange(copies))
            position += length * copies
            previous = gap.at
        span = np.arange(previous, self.n)
        old_pos[previous:] = position + np.arange(len(span))
        pieces_e.append(span)
        pieces_t.append(np.full(len(span), -1))
        return np.concatenate(pieces_e), np.concatenate(pieces_t), old_pos, starts

    def gap_of(self, element: int) -> tuple[int, int]:
        r = int(np.searchsorted(self.offsets, element - self.n, side="right")) - 1
        return r, element - self.n - int(self.offsets[r])

    def element_of(self, r: int, o: int) -> int:
        return self.n + int(self.offsets[r]) + o


@dataclasses.dataclass
class _Rule:
    """Which allocation a free element releases. ``shared``: the shared element ``element``. Otherwise event
    ``offset`` of copy ``t' = t + shift`` (``reverse``: ``copies - 1 - t + shift``) at gap ``gap``, where ``t``
    is the free's copy (0 in the shared part); a ``t'`` outside the copies names a shared element, learned from
    the traces (``outside``: ``("before", t')`` or ``("after", t' - copies)`` -> element)."""

    shared: bool
    element: int = -1
    gap: int = -1
    offset: int = -1
    reverse: bool = False
    shift: int = 0
    outside: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)

    def target(self, copies: int, t: int) -> tuple[int, int] | tuple[str, int]:
        """(gap-relative copy, offset) inside the copies, or the ``outside`` key."""
        if self.shared:
            return ("shared", 0)
        copy = (copies - 1 - t if self.reverse else t) + self.shift
        if copy < 0:
            return ("before", copy)
        if copy >= copies:
            return ("after", copy - copies)
        return (copy, self.offset)

    def resolve(self, template: _Template, copies: int, t: int) -> tuple[int, int] | None:
        """(element, copy) released by copy ``t``, or None where the traces did not show it."""
        if self.shared:
            return self.element, -1
        where = self.target(copies, t)
        if isinstance(where[0], str):
            element = self.outside.get(where)
            return None if element is None else (element, -1)
        return template.element_of(self.gap, self.offset), where[0]


def _fit(template: _Template, observations: list[tuple[int, int, int, int]]) -> list[_Rule]:
    """The rules consistent with every observation ``(copies, t, element, copy)`` of one free element."""
    inside = [o for o in observations if o[3] >= 0]
    if not inside:
        elements = {o[2] for o in observations}
        return [_Rule(shared=True, element=elements.pop())] if len(elements) == 1 else []
    copies, t, element, copy = inside[0]
    gap, offset = template.gap_of(element)
    rules = [_Rule(False, gap=gap, offset=offset, reverse=False, shift=copy - t),
             _Rule(False, gap=gap, offset=offset, reverse=True, shift=copy - (copies - 1 - t))]
    fitted = []
    for rule in rules:
        ok = True
        for copies, t, element, copy in observations:
            where = rule.target(copies, t)
            if isinstance(where[0], str):
                if copy >= 0 or rule.outside.setdefault(where, element) != element:
                    ok = False
                    break
            elif (template.element_of(rule.gap, rule.offset), where[0]) != (element, copy):
                ok = False
                break
        if ok:
            fitted.append(rule)
    return fitted


def compose(traces: Sequence[TraceResult],
            copies: int) -> tuple[list[Event], dict[int, Category], int, frozenset[int]]:
    """The timeline with ``copies`` more periods than ``traces[0]``, from traces of ``a``, ``a + 1`` and
    ``a + 2`` periods (module docstring): events, categories by uid, the operator count and the uids of paged
    optimizer state (`TraceResult.paged`).

    Raises:
        CompositionError: the traces do not fit the composition rules.
    """
    vocab = _Vocabulary()
    lines = [_timeline(t, vocab) for t in traces]
    scaled = _scaled_sizes(lines, vocab)
    gaps = _align(*lines)
    template = _Template(lines[0], gaps)
    for extra, line in ((1, lines[1]), (2, lines[2])):
        elements, _, _, _ = template.layout(extra)
        if len(elements) != len(line.keys) or not np.array_equal(template.keys[elements], line.keys):
            raise CompositionError(f"the {extra + 1}-trace timeline is not the first with its insertions "
                                   f"repeated {extra} time(s)")
    rules = _fit_rules(template, lines)
    steps = [t.num_ops for t in traces]
    if steps[2] - steps[1] != steps[1] - steps[0]:
        raise CompositionError("operator counts do not grow linearly with depth")
    for extra, line in ((1, lines[1]), (2, lines[2])):
        refs = _compose_refs(template, rules, extra)
        if not np.array_equal(refs, line.refs):
            raise CompositionError(f"the composition for the {extra + 1}-trace depth differs from its trace")
    for extra, line in ((1, lines[1]), (2, lines[2])):
        if not np.array_equal(_compose_steps(template, lines, extra), line.steps):
            raise CompositionError(f"operator numbering for the {extra + 1}-trace depth differs from its trace")
    refs = _compose_refs(template, rules, copies)
    elements, _, _, _ = template.layout(copies)
    events, categories, paged = _events(vocab, template.keys[elements], refs,
                                        _compose_steps(template, lines, copies),
                                        {key: base + copies * slope for key, (base, slope) in scaled.items()})
    return events, categories, steps[0] + copies * (steps[1] - steps[0]), paged


def _compose_steps(template: _Template, lines: list[_Timeline], copies: int) -> np.ndarray:
    """Operators before each event: for the shared part, linear in the number of copies (fitted on the first two
    traces); for a copy, as in the first copy or as in later ones (the third trace)."""
    _, _, old1, starts1 = template.layout(1)
    _, _, old2, starts2 = template.layout(2)
    base = lines[0].steps
    slope = lines[1].steps[old1] - base
    elements, copy, _, _ = template.layout(copies)
    first = np.empty(len(template.keys) - template.n, dtype=np.int64)
    later = np.empty_like(first)
    for r, length in enumerate(template.lengths):
        span = slice(int(template.offsets[r]), int(template.offsets[r]) + length)
        first[span] = lines[1].steps[starts1[r][0]:starts1[r][0] + length]
        later[span] = lines[2].steps[starts2[r][1]:starts2[r][1] + length]
    out = np.empty(len(elements), dtype=np.int64)
    shared = copy < 0
    out[shared] = base[elements[shared]] + copies * slope[elements[shared]]
    inside = elements[~shared] - template.n
    out[~shared] = np.where(copy[~shared] == 0, first[inside], later[inside])
    return out


def _fit_rules(template: _Template, lines: list[_Timeline]) -> dict[int, list[_Rule]]:
    """For each free element, the rules consistent with its observations in the three traces."""
    observed: dict[int, list[tuple[int, int, int, int]]] = {}
    for copies, line in enumerate(lines):
        elements, copy, _, _ = template.layout(copies)
        for x in np.nonzero(line.refs >= 0)[0].tolist():
            y = int(line.refs[x])
            observed.setdefault(int(elements[x]), []).append(
                (copies, max(int(copy[x]), 0), int(elements[y]), int(copy[y])))
    rules = {}
    for element, observations in observed.items():
        rules[element] = _fit(template, observations)
        if not rules[element]:
            raise CompositionError("a free's allocation does not follow a rule across the traced depths")
    return rules


def _compose_refs(template: _Template, rules: dict[int, list[_Rule]], copies: int) -> np.ndarray:
    elements, copy, old_pos, starts = template.layout(copies)
    refs = np.full(len(elements), -1, dtype=np.int64)
    for x in range(len(elements)):
        element = int(elements[x])
        found = rules.get(element)
        if found is None:
            continue
        t = max(int(copy[x]), 0)
        targets = {rule.resolve(template, copies, t) for rule in found}
        if len(targets) != 1 or None in targets:
            raise CompositionError("a free's allocation is ambiguous or unseen at the composed depth")
        target_element, target_copy = targets.pop()
        if target_copy < 0:
            refs[x] = old_pos[target_element]
        else:
            r, o = template.gap_of(target_element)
            refs[x] = starts[r][target_copy] + o
    return refs


def _events(vocab: _Vocabulary, keys: np.ndarray, refs: np.ndarray, steps: np.ndarray,
            sizes: dict[int, int]) -> tuple[list[Event], dict[int, Category], frozenset[int]]:
    """The composed events, their categories and paged uids; ``sizes`` gives the bytes of the depth-scaled
    tokens (`_scaled_sizes`)."""
    events: list[Event] = []
    categories: dict[int, Category] = {}
    paged: set[int] = set()
    uids = np.full(len(keys), -1, dtype=np.int64)
    freed = np.zeros(len(keys), dtype=bool)
    nbytes_of = [sizes.get(key, token[1]) for key, token in enumerate(vocab.tokens)]
    op = -1
    tokens = vocab.tokens
    for x, (key, step) in enumerate(zip(keys.tolist(), steps.tolist())):
        is_alloc, _, category, phase, _, is_paged = tokens[key]
        nbytes = nbytes_of[key]
        op += step
        if is_alloc:
            uid = len(categories)
            uids[x] = uid
            categories[uid] = category
            if is_paged:
                paged.add(uid)
            events.append(Event(uid, nbytes, op, phase))
            continue
        y = int(refs[x])
        if not 0 <= y < x or uids[y] < 0 or freed[y] or nbytes_of[keys[y]] != nbytes:
            raise CompositionError("a composed free does not match its allocation")
        freed[y] = True
        events.append(Event(int(uids[y]), -nbytes, op, phase))
    return events, categories, frozenset(paged)
