"""Choose the largest micro-batch that fits a memory budget, from a few fake traces and no trial OOMs.

Peak memory is not affine in the batch size: the moment that holds the peak moves (activations at the end of
the forward for large batches, the optimizer step for small ones). But each allocation event's size is: a
trace at batch 2 and one at batch 3 take the same operators in the same order, and every storage's bytes are
``a + s * b``. Replaying the fitted events gives the exact peak at any batch size >= 2 in milliseconds
(``shared/notes/feasibility.md``: fitted from batches 2 and 3, it reproduced batch 8 to the byte), so the
search costs two traces plus one to confirm the answer. Batch 1 can take another code path (squeezed
dimensions, other kernels) and is always traced itself.

`split_global_batch` then turns the micro-batch into gradient-accumulation steps that keep the global batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from preflight._budget import check_headroom, usable_bytes
from preflight._estimate import estimate
from preflight._guard import untouched
from preflight._result import Estimate, Event
from preflight._run import Run, check_run, run_budget
from preflight._steps import StepFn
from preflight._units import format_bytes
from preflight.parallel._pipeline import refuse_job_pipeline

__all__ = [
    "BatchPeakModel",
    "BatchSizeResult",
    "GlobalBatchPlan",
    "fit_batch_model",
    "max_batch_size",
    "max_eval_batch_size",
    "split_global_batch",
]

# The two batch sizes the affine model is fitted from: the smallest ones whose code path matches larger batches
# (batch 1 may squeeze a dimension or pick another kernel).
_FIT_SIZES = (2, 3)
# Without `max_batch`, never try more samples than this: make_batch(b) builds real tensors, and a micro-batch
# beyond it is rarely wanted. Pass max_batch to search further.
_DEFAULT_MAX_BATCH = 1 << 14


@dataclasses.dataclass(frozen=True)
class BatchPeakModel:
    """The peak memory of a training step as a function of the batch size, fitted per allocation event.

    Event ``i`` allocates or frees ``intercepts[i] + slopes[i] * b`` bytes at batch size ``b``; replaying the
    events in order gives the live-bytes curve and its peak. Valid for ``b >= valid_from`` (batch 1 may take
    another code path).

    Attributes:
        template: the events of the trace at ``valid_from`` (uids, operators and phases; sizes at that batch).
        slopes: bytes per extra sample for each event.
        valid_from: the smallest batch size the model describes.
    """

    template: tuple[Event, ...] = dataclasses.field(repr=False)
    slopes: tuple[int, ...] = dataclasses.field(repr=False)
    valid_from: int = 2

    def __call__(self, batch_size: int) -> int:
        """The predicted peak bytes at ``batch_size``."""
        self._check(batch_size)
        live = peak = 0
        shift = batch_size - self.valid_from
        for e, s in zip(self.template, self.slopes):
            live += e.nbytes + s * shift
            if live > peak:
                peak = live
        return peak

    def events(self, batch_size: int) -> list[Event]:
        """The predicted allocation events at ``batch_size`` (e.g. for `preflight.allocator.simulate`)."""
        self._check(batch_size)
        shift = batch_size - self.valid_from
        return [Event(e.uid, e.nbytes + s * shift, e.op, e.phase) for e, s in zip(self.template, self.slopes)]

    def largest_fitting(self, limit: int, *, multiple_of: int = 1, max_batch: int | None = None) -> int | None:
        """The largest multiple of ``multiple_of`` in ``[valid_from, max_batch]`` whose peak is <= ``limit``.

        Returns 0 when none is, and None when the peak does not grow with the batch size and ``max_batch`` is
        None (no upper end).
        """
        # peak(b) = max over event prefixes of (A + S * b): a maximum of affine functions, so convex in b, and
        # {b : peak(b) <= limit} is an interval whose upper end is set by the prefixes with S > 0.
        total = slope = 0
        upper: int | None = None
        shift0 = self.valid_from
        for e, s in zip(self.template, self.slopes):
            total += e.nbytes - s * shift0
            slope += s
            if slope > 0:
                bound = (limit - total) // slope
                upper = bound if upper is None else min(upper, bound)
        if upper is None:
            if max_batch is None:
                return None
            upper = max_batch
        elif max_batch is not None:
            upper = min(upper, max_batch)
        candidate = upper // multiple_of * multiple_of
        if candidate < self.valid_from or self(candidate) > limit:
            return 0
        return candidate

    def _check(self, batch_size: int) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < self.valid_from:
            raise ValueError(
                f"The batch-size model covers batch sizes >= {self.valid_from}, got {batch_size!r}; "
                "batch 1 can take another code path: trace it with preflight.estimate."
            )


def fit_batch_model(a: Estimate, batch_a: int, b: Estimate, batch_b: int) -> tuple[BatchPeakModel | None, str]:
    """Fit a `BatchPeakModel` from the traces ``a`` (at ``batch_a``) and ``b`` (at ``batch_b > batch_a``).

    Returns:
        ``(model, "")``, or ``(None, reason)`` when the two traces do not line up event for event (the operator
        sequence changes with the batch size) or a size is not affine in it.
    """
    if not 2 <= batch_a < batch_b:
        raise ValueError(f"Fit from two batch sizes 2 <= batch_a < batch_b, got {batch_a} and {batch_b}.")
    ea, eb = a.events, b.events
    if not ea or not eb:
        return None, "a trace recorded no events"
    if len(ea) != len(eb):
        return None, f"the traces at batch {batch_a} and {batch_b} have {len(ea)} and {len(eb)} events"
    step = batch_b - batch_a
    slopes: list[int] = []
    for i, (x, y) in enumerate(zip(ea, eb)):
        if (x.uid, x.op, x.phase) != (y.uid, y.op, y.phase) or (x.nbytes > 0) != (y.nbytes > 0):
            return None, f"the traces at batch {batch_a} and {batch_b} diverge at event {i} (operator {x.op})"
        grown = y.nbytes - x.nbytes
        if grown % step:
            return None, f"event {i} grows by {grown} bytes over {step} samples: not a whole number per sample"
        slopes.append(grown // step)
    # Re-anchor at batch_a: the template holds the sizes there.
    return BatchPeakModel(template=tuple(ea), slopes=tuple(slopes), valid_from=batch_a), ""


@dataclasses.dataclass(frozen=True)
class BatchSizeResult:
    """The outcome of `max_batch_size`. ``int(result)`` is ``result.batch_size``.

    Attributes:
        batch_size: the largest micro-batch (a multiple of ``multiple_of``, at most ``max_batch``) whose traced
            peak fits ``usable_bytes``; 0 when not even the smallest candidate fits.
        predicted_peak_bytes: the traced peak at ``batch_size``; when ``batch_size`` is 0, the traced peak of
            the smallest candidate (batch 1, or ``multiple_of``), to show how far it is from fitting.
        traces: fake traces run (each is ``steps`` training steps of `preflight.estimate`).
        budget_bytes: the budget as resolved.
        usable_bytes: ``budget_bytes * (1 - headroom)``, the bound the peak was held to.
        peak_model: the fitted `BatchPeakModel` (callable: batch size -> predicted peak bytes, for sizes >= 2),
            or None when the traces at batch 2 and 3 did not line up and a trace search was used instead.
        notes: how the answer was reached, and anything it assumed.
    """

    batch_size: int
    predicted_peak_bytes: int
    traces: int
    budget_bytes: int
    usable_bytes: int
    peak_model: BatchPeakModel | None = dataclasses.field(default=None, repr=False)
    notes: tuple[str, ...] = ()

    def __int__(self) -> int:
        return self.batch_size


def _require_traced(est: Estimate, step: str, batch_size: int) -> None:
    """A batch size cannot be chosen from a lower bound: raise when the trace did not run to the end."""
    if est.coverage.lower_bound:
        raise RuntimeError(
            f"preflight could not trace the {step} step at batch size {batch_size} (operator "
            f"{est.coverage.failed_op}: {est.coverage.reason}). A batch size cannot be chosen from a lower bound: "
            "pass `step=` with a step that traces, or choose the batch size by measurement."
        )


class _Tracer:
    """Trace the training step at a batch size, counting traces and remembering peaks."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, make_batch: Callable[[int], Any],
                 step: StepFn | None, run: Run, progress: Callable[[str], None] | None, limit: int) -> None:
        self.model, self.optimizer, self.make_batch = model, optimizer, make_batch
        self.step, self.run = step, run  # each trace per rank under the run's plan, if any
        self.progress = progress
        self.limit = limit
        self.count = 0
        self.peaks: dict[int, int] = {}

    def __call__(self, batch_size: int) -> Estimate:
        self.count += 1
        self._say(f"tracing batch size {batch_size} (trace {self.count})")
        est = estimate(self.model, self.optimizer, self.make_batch(batch_size), self.run, step=self.step)
        _require_traced(est, "training", batch_size)
        self.peaks[batch_size] = est.peak_bytes
        verdict = "fits" if est.peak_bytes <= self.limit else "does not fit"
        self._say(f"batch size {batch_size}: traced peak {format_bytes(est.peak_bytes)} ({verdict})")
        return est

    def peak(self, batch_size: int) -> int:
        if batch_size not in self.peaks:
            self(batch_size)
        return self.peaks[batch_size]

    def _say(self, message: str) -> None:
        if self.progress is not None:
            self.progress(f"preflight: {message}")


@untouched()
def max_batch_size(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    make_batch: Callable[[int], Any],
    run: Run | None = None,
    *,
    step: StepFn | None = None,
    max_batch: int | None = None,
    multiple_of: int = 1,
    headroom: float = 0.0,  # 0: the budget is taken as given; pass preflight._budget.DEFAULT_HEADROOM for a margin
    progress: Callable[[str], None] | None = None,
) -> BatchSizeResult:
    """The largest micro-batch whose predicted training peak fits ``budget``, from at most a few fake traces.

    Traces the training step (as `preflight.estimate` does: nothing of the user's changes) at batch 2 and 3,
    fits each allocation event's size as affine in the batch size, and replays the fitted events to find the
    largest multiple of ``multiple_of`` whose peak is at most ``budget * (1 - headroom)``. One more trace at
    that size confirms it; if the confirmation does not fit, the next smaller candidate is traced. When the two
    traces do not line up (the operator sequence changes with the batch size), a doubling-then-bisection search
    over traces is used instead (it assumes the peak grows with the batch size). The answer always has a
    traced peak within the budget: no size is returned on the strength of the fit alone.

    Args:
        model, optimizer, step: as for `preflight.estimate`.
        run: how the run trains (`preflight.Run`). Its target's budget is what the training peak may use
            (``run.target.budget``: an int or a size such as ``"24GiB"``; else the catalog GPU's memory, else the CUDA
            device's capacity). Pass ``Loop(accumulate=2)`` (or more) when the micro-batch will be accumulated into
            a larger global batch: the earlier micro-batches' gradients are alive during the next one's forward and
            backward. Under ``run.parallel`` each trace is the per-rank prediction `preflight.estimate` makes, and
            the budget is one GPU's (the largest rank's peak must fit).
        make_batch: ``make_batch(b)`` returns one batch of ``b`` samples, as the dataloader would. Only shapes,
            dtypes and the values of small integer tensors matter: floating tensors may be on the meta device,
            which saves building large real batches.
        max_batch: the largest batch size to consider (e.g. the global batch). Default: no bound but the
            budget, capped at 16384 samples.
        multiple_of: only multiples of this are returned (e.g. 8 for tensor cores).
        headroom: the fraction of ``budget`` kept free, in [0, 1).
        progress: optional ``progress(message)`` called before and after each trace.

    Returns:
        A `BatchSizeResult`; ``int(result)`` is the batch size. ``batch_size`` is 0 when not even the smallest
        candidate fits (not an exception: the caller decides what to do; ``notes`` says by how much it missed).

    Raises:
        ValueError: a bad option (the message shows the value and what is accepted), no budget on a machine
            without CUDA, or traces at batch 2 and 3 that are identical (``make_batch`` ignores its argument).
        RuntimeError: the step could not be traced at some batch size (the estimate would be a lower bound).

    Example:
        >>> def make_batch(b):
        ...     ids = torch.randint(0, 1000, (b, 512))
        ...     return {"input_ids": ids, "labels": ids}
        >>> result = preflight.max_batch_size(model, opt, make_batch, Run(target=Target(budget="24GiB")),
        ...                                  multiple_of=8)  # doctest: +SKIP
        >>> int(result), result.traces  # doctest: +SKIP
        (48, 3)

    Known limitations:
        - Budget and peaks are tensor-storage bytes (``torch.cuda.max_memory_allocated`` reads up to about 2%
          more: the allocator's blocks); the allocator's cached blocks, the CUDA context and library workspaces
          are outside them: keep them in ``headroom``.
        - Each trace is ``steps=2`` training steps of the default (or given) step; the blind spots of
          `preflight.estimate` apply (unseen kernel scratch, CPU kernels traced for a CUDA target).
        - The trace search used when the traces do not line up assumes the peak never shrinks as the batch
          grows, and costs about ``2 * log2(batch_size)`` traces.
    """
    run = check_run(run)
    refuse_job_pipeline(model, "max_batch_size")
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` should be a torch.nn.Module, got {type(model).__name__}.")
    if not callable(make_batch):
        raise TypeError(f"`make_batch` should be a callable make_batch(batch_size) -> batch, got "
                        f"{type(make_batch).__name__}.")
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        raise ValueError(f"`multiple_of` should be a positive integer, got {multiple_of!r}.")
    if max_batch is not None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"`max_batch` should be None or a positive integer, got {max_batch!r}.")
        if max_batch < multiple_of:
            raise ValueError(f"`max_batch` ({max_batch}) is smaller than `multiple_of` ({multiple_of}): no batch "
                             "size is allowed. Lower multiple_of or raise max_batch.")
    check_headroom(headroom)
    if progress is not None and not callable(progress):
        raise TypeError(f"`progress` should be None or a callable progress(message), got {type(progress).__name__}.")
    budget_bytes = run_budget(run, model)
    limit = usable_bytes(budget_bytes, headroom)
    tracer = _Tracer(model, optimizer, make_batch, step, run, progress, limit)
    notes: list[str] = []
    if run.parallel is not None:
        notes.append(f"each trace per rank under the plan ({run.parallel.note()})")
    if run.loop.accumulate > 1:
        notes.append("traced with gradient accumulation (the accumulated gradients are alive)")
    capped = max_batch is None
    upper = max_batch if max_batch is not None else _DEFAULT_MAX_BATCH

    peak_model: BatchPeakModel | None = None
    if upper >= max(_FIT_SIZES) + 1:
        small, large = _FIT_SIZES
        est_small, est_large = tracer(small), tracer(large)
        peak_model, reason = fit_batch_model(est_small, small, est_large, large)
        del est_small, est_large
        if peak_model is None:
            notes.append(f"batch-size model not used: {reason}; searched by tracing instead")
        elif not any(peak_model.slopes):
            raise ValueError(
                f"The traces at batch {small} and {large} are identical: make_batch seems to ignore its argument. "
                "make_batch(b) should return a batch of b samples."
            )
        else:
            notes.append(f"batch-size model fitted from traces at batch {small} and {large} "
                         f"({len(peak_model.template)} events)")
    else:
        notes.append(f"max_batch={max_batch} is small: the candidates are traced directly, largest first")
        tracer(upper // multiple_of * multiple_of)

    found: int | None = None
    if peak_model is not None:
        found = _from_model(peak_model, tracer, limit, multiple_of, upper, notes)
    if found is None:
        found = _search(tracer, limit, multiple_of, upper // multiple_of, notes)

    if found:
        peak = tracer.peaks[found]
        if capped and found + multiple_of > upper:
            notes.append(f"stopped at the default cap of {_DEFAULT_MAX_BATCH} samples; pass max_batch to go further")
    else:
        smallest = 1 if multiple_of == 1 else multiple_of
        peak = tracer.peak(smallest)
        notes.append(f"nothing fits: batch size {smallest} is predicted to need {format_bytes(peak)}, over the "
                     f"usable {format_bytes(limit)}")
    return BatchSizeResult(
        batch_size=found,
        predicted_peak_bytes=peak,
        traces=tracer.count,
        budget_bytes=budget_bytes,
        usable_bytes=limit,
        peak_model=peak_model,
        notes=tuple(notes),
    )


def _from_model(peak_model: BatchPeakModel, tracer: _Tracer, limit: int, multiple_of: int, max_batch: int,
                notes: list[str]) -> int | None:
    """Pick with the fitted model and confirm by tracing; None hands over to the trace search."""
    candidate = peak_model.largest_fitting(limit, multiple_of=multiple_of, max_batch=max_batch)
    if candidate == 0:  # not even the smallest candidate of the model's range fits
        if multiple_of == 1:
            return 1 if tracer.peak(1) <= limit else 0  # batch 1 may take its own path: traced, never fitted
        # A trace of the smallest candidate confirms before answering 0; if it fits, the model was wrong.
        return None if tracer.peak(multiple_of) <= limit else 0
    predicted = peak_model(candidate)
    if tracer.peak(candidate) <= limit:
        traced = tracer.peaks[candidate]
        if traced != predicted:
            higher = f": the true maximum may be above {candidate}" if traced < predicted else ""
            notes.append(f"the model predicted {predicted} bytes at batch {candidate}, the trace {traced}{higher}")
        return candidate
    notes.append(f"the model predicted {format_bytes(predicted)} at batch {candidate} but the trace needs "
                 f"{format_bytes(tracer.peaks[candidate])}: trying the next smaller size")
    lower = candidate - multiple_of
    if lower >= 1 and tracer.peak(lower) <= limit:
        return lower
    return None


def _search(tracer: _Tracer, limit: int, multiple_of: int, k_max: int, notes: list[str]) -> int:
    """Largest ``k * multiple_of`` (``k <= k_max``) whose traced peak fits, by doubling then bisection.

    Uses the peaks already traced; assumes the peak does not shrink as the batch grows.
    """
    def bounds() -> tuple[int, int | None]:
        good = max((b // multiple_of for b, p in tracer.peaks.items() if p <= limit), default=0)
        bad = min((-(-b // multiple_of) for b, p in tracer.peaks.items() if p > limit), default=None)
        good = min(good, k_max)
        if bad is not None and bad <= good:  # a larger size fitted where a smaller did not: trust the failure
            good = bad - 1
        return good, bad

    good, bad = bounds()
    while bad is None and good < k_max:  # doubling: find a size that does not fit
        k = min(k_max, max(1, 2 * good))
        if tracer.peak(k * multiple_of) <= limit:
            good = k
        else:
            bad = k
    bad = k_max + 1 if bad is None else bad
    while True:
        while bad - good > 1:  # bisection between a fitting and a failing multiple
            mid = (good + bad) // 2
            if tracer.peak(mid * multiple_of) <= limit:
                good = mid
            else:
                bad = mid
        if good == 0:
            return 0
        if tracer.peak(good * multiple_of) <= limit:  # traced, never inferred
            return good * multiple_of
        notes.append(f"batch {good * multiple_of} does not fit although a larger one did: the peak is not "
                     "monotone in the batch size")
        bad = good
        good = max((b // multiple_of for b, p in tracer.peaks.items() if p <= limit and b < bad * multiple_of),
                   default=0)


class _EvalTracer:
    """`_Tracer`'s interface for evaluation steps: trace the no-grad forward at a batch size, remember peaks."""

    def __init__(self, model: nn.Module, make_batch: Callable[[int], Any], run: Run,
                 resident: dict[str, int] | None) -> None:
        self.model, self.make_batch, self.run, self.resident = model, make_batch, run, resident
        self.peaks: dict[int, int] = {}

    def peak(self, batch_size: int) -> int:
        if batch_size not in self.peaks:
            from preflight._eval import estimate_eval

            est = estimate_eval(self.model, self.make_batch(batch_size), self.run, resident=self.resident)
            _require_traced(est, "evaluation", batch_size)
            self.peaks[batch_size] = est.peak_bytes
        return self.peaks[batch_size]


def max_eval_batch_size(model: nn.Module, make_batch: Callable[[int], Any], run: Run, *, usable: int,
                        max_batch: int, multiple_of: int = 1,
                        resident: dict[str, int] | None = None) -> tuple[int, int]:
    """The largest evaluation batch (a multiple of ``multiple_of``, at most ``max_batch``) whose no-grad peak,
    with ``resident`` training state alive (see `preflight.estimate_eval`), is at most ``usable`` bytes; and its
    traced peak. ``(0, 0)`` when not even the smallest fits.

    Eval traces are one forward each, so this searches by tracing (doubling, then bisection) without a fitted
    model.

    Raises:
        RuntimeError: the evaluation step could not be traced (a lower bound cannot choose a batch size).
    """
    tracer = _EvalTracer(model, make_batch, run, resident)
    found = _search(tracer, usable, multiple_of, max(1, max_batch // multiple_of), [])  # type: ignore[arg-type]
    return found, tracer.peaks.get(found, 0)


@dataclasses.dataclass(frozen=True)
class GlobalBatchPlan:
    """How to reach a global batch with micro-batches and gradient accumulation.

    Attributes:
        micro_batch_size: samples per forward/backward (at most the micro-batch asked for).
        accumulation_steps: micro-batches per optimizer step.
        global_batch_size: ``micro_batch_size * accumulation_steps``, the samples per optimizer step.
        requested_global_batch_size: the global batch asked for.
        exact: ``global_batch_size == requested_global_batch_size``.
        note: why this shape, and the rounding when not exact (for logs and reports).
    """

    micro_batch_size: int
    accumulation_steps: int
    global_batch_size: int
    requested_global_batch_size: int
    exact: bool
    note: str


def split_global_batch(global_batch: int, micro_batch: int, *, min_fraction: float = 0.5) -> GlobalBatchPlan:
    """Split ``global_batch`` into micro-batches of at most ``micro_batch`` samples and accumulation steps.

    The global batch is kept exactly with the largest divisor of ``global_batch`` that is at most
    ``micro_batch``, as long as that divisor is at least ``min_fraction * micro_batch`` (so it costs at most
    about ``1 / min_fraction`` times the accumulation steps strictly needed). Otherwise (e.g. a prime global
    batch) it uses the fewest accumulation steps, ``ceil(global_batch / micro_batch)``, with the micro-batch
    that brings the global batch closest to the one asked for (below it on a tie), and ``note`` explains the
    rounding.

    Args:
        global_batch: samples per optimizer step wanted (e.g. the current batch size times accumulation).
        micro_batch: the largest micro-batch that fits (e.g. from `max_batch_size`).
        min_fraction: in (0, 1]; the smallest divisor, as a fraction of ``micro_batch``, worth keeping the
            global batch exact for. 0.5 by default: up to twice the accumulation steps for an exact global batch.

    Returns:
        A `GlobalBatchPlan`.

    Raises:
        ValueError: a non-positive ``global_batch`` or ``micro_batch`` (``micro_batch=0`` means nothing fits:
            there is no plan), or ``min_fraction`` outside (0, 1].

    Example:
        >>> plan = split_global_batch(64, 24)
        >>> plan.micro_batch_size, plan.accumulation_steps, plan.global_batch_size, plan.exact
        (16, 4, 64, True)
        >>> plan.note
        'micro-batch 16 (largest divisor of 64 up to 24) x 4 accumulation steps = 64'
        >>> plan = split_global_batch(97, 30)
        >>> plan.micro_batch_size, plan.accumulation_steps, plan.global_batch_size, plan.exact
        (24, 4, 96, False)
    """
    for name, value in (("global_batch", global_batch), ("micro_batch", micro_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            hint = ""
            if name == "micro_batch":
                hint = " A micro-batch of 0 means nothing fits the budget: there is no plan."
            raise ValueError(f"`{name}` should be a positive integer, got {value!r}.{hint}")
    if isinstance(min_fraction, bool) or not isinstance(min_fraction, (int, float)) or not 0 < min_fraction <= 1:
        raise ValueError(f"`min_fraction` should be in (0, 1], got {min_fraction!r}.")
    if micro_batch >= global_batch:
        return GlobalBatchPlan(global_batch, 1, global_batch, global_batch, True,
                               f"the global batch {global_batch} fits in one micro-batch")
    divisor = max(d for d in range(1, micro_batch + 1) if global_batch % d == 0)
    if divisor >= min_fraction * micro_batch:
        steps = global_batch // divisor
        why = "" if divisor == micro_batch else f" (largest divisor of {global_batch} up to {micro_batch})"
        return GlobalBatchPlan(divisor, steps, global_batch, global_batch, True,
                               f"micro-batch {divisor}{why} x {steps} accumulation steps = {global_batch}")
    steps = -(-global_batch // micro_batch)
    below, above = global_batch // steps, -(-global_batch // steps)  # both <= micro_batch
    micro = below if global_batch - below * steps <= above * steps - global_batch else above
    total = micro * steps
    diff = total - global_batch
    return GlobalBatchPlan(
        micro, steps, total, global_batch, False,
        f"{global_batch} has no divisor between {int(min_fraction * micro_batch + 0.999999)} and {micro_batch}: "
        f"micro-batch {micro} x {steps} accumulation steps = {total} ({abs(diff)} sample(s) "
        f"{'more' if diff > 0 else 'fewer'} per optimizer step; scale the learning rate by {total}/{global_batch} "
        f"or use micro-batch {divisor} x {global_batch // divisor} steps to keep it exact)",
    )
