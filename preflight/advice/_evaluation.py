"""What to change when a run's evaluation is over the budget, and what the evaluation adds to a training change.

The evaluation loop of the HF Trainer with a ``compute_metrics`` keeps every batch's predictions on the device until
the end of the evaluation set (`preflight.EvalLoop`); moving them to the host every k batches
(``eval_accumulation_steps=k``) keeps at most k. `fewer_kept_batches` finds the largest k that fits, each k's
figure traced by the caller's ``evaluate`` (the evaluation step as `preflight.estimate_eval` predicts it, with the
run's resident training state); where even one batch kept is over, or the loop keeps nothing, `smaller_eval_batch`
finds the largest evaluation batch that fits the same way. `with_evaluation` makes each training suggestion's
figure the run's: the larger of its own (training, loading, saving) and the evaluation's, with the evaluation
change made where it is needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from preflight._eval_loop import EvalLoop
from preflight._run import Run
from preflight._units import format_bytes
from preflight.advice._setup import Suggestion

__all__ = ["KEPT_COST", "fewer_kept_batches", "moving_every_batch", "smaller_eval_batch", "with_evaluation"]

KEPT_COST = ("the kept predictions copied to the host every {k} batches, and held there (host memory) until the "
             "metrics are computed: a slower evaluation, the same metrics")


def fewer_kept_batches(evaluate: Callable[[EvalLoop], int], run: Run, *, limit: int, others: int
                       ) -> tuple[Suggestion, int] | None:
    """The run with the evaluation loop keeping the largest number of batches on the device whose evaluation fits in
    ``limit`` (moved to the host every k batches), or the fewest (1) when none does, with the evaluation's need
    there; None when the loop keeps nothing across batches. The suggestion fits when the rest of the run fits too.

    ``evaluate(loop)`` is the evaluation's need with the evaluation loop ``loop`` (what the verdict compares: the
    device total on a simulated GPU, else the allocated peak), traced; ``others`` is the largest need of the run's
    other phases (training, loading, saving), which this change leaves as they are. The need grows with k, so k is
    found by bisection: about log2(kept batches) traces."""
    loop = run.evaluation
    if loop is None or loop.kept_batches < 2:
        return None
    best, evaluation, traces = _searched(lambda k: evaluate(_keeping(loop, k)), loop.kept_batches - 1, limit)
    figure = max(evaluation, others)
    verdict = _verdict(evaluation, others, limit, alone=f"still {format_bytes(figure - limit)} over: the evaluation "
                       "step itself needs more than the budget with one batch kept; a smaller evaluation batch is "
                       "needed too")
    text = (f"keep at most {best} evaluation batch(es) of predictions on the device, moving them to the host every "
            f"{best} (the HF Trainer's eval_accumulation_steps={best}; {loop.kept_batches} kept now): evaluation "
            f"{format_bytes(evaluation)}; {verdict} ({traces} evaluation trace(s))")
    return Suggestion({"eval_accumulation_steps": best}, text, figure, figure <= limit, KEPT_COST.format(k=best),
                      run.replace(evaluation=_keeping(loop, best)), changes=("eval_kept",)), evaluation


def smaller_eval_batch(evaluate: Callable[[EvalLoop | None, int], int], run: Run, size: int, *,
                       kept: Suggestion | None, limit: int, others: int) -> tuple[Suggestion, int] | None:
    """The run evaluating in the largest batch below ``size`` samples whose evaluation fits in ``limit``, or in
    batches of 1 when none does, with the evaluation's need there; None for a batch of 1 already.

    ``evaluate(loop, b)`` is the evaluation's need on a batch of ``b`` samples (the traced batch resized) with the
    evaluation loop ``loop``; ``kept`` is `fewer_kept_batches`'s suggestion where the loop keeps predictions (its
    fewest kept batches are made with the smaller batch: the kept number counts batches, so they shrink with it);
    a loop that keeps every batch keeps the same samples in more batches (`preflight.EvalLoop.at_batch_size`).
    The need grows with the batch, so the size is found by bisection: about log2(size) traces."""
    if size < 2:
        return None
    loop = run.evaluation if kept is None else kept.run.evaluation

    def at(b: int) -> EvalLoop | None:  # the same samples in more, smaller batches, kept as the loop keeps them
        return None if loop is None else loop.at_batch_size(b, size)

    best, evaluation, traces = _searched(lambda b: evaluate(at(b), b), size - 1, limit)
    figure = max(evaluation, others)
    verdict = _verdict(evaluation, others, limit,
                       alone=f"still {format_bytes(evaluation - limit)} over with one sample a batch")
    also = "" if kept is None else f", with eval_accumulation_steps={kept.change['eval_accumulation_steps']}"
    text = (f"evaluate in batches of {best} instead of {size} (the HF Trainer's per_device_eval_batch_size, the "
            f"evaluation DataLoader's batch_size){also}: evaluation {format_bytes(evaluation)}; {verdict} "
            f"({traces} evaluation trace(s))")
    cost = ("more, smaller evaluation steps: a slower evaluation, the same metrics"
            + ("" if kept is None else f"; {kept.cost}"))
    change = {**({} if kept is None else kept.change), "eval_batch_size": best}
    return Suggestion(change, text, figure, figure <= limit, cost, run.replace(evaluation=at(best)),
                      changes=("eval_batch",) + (() if kept is None else kept.changes)), evaluation


def moving_every_batch(run: Run) -> Suggestion | None:
    """The change that moves the kept predictions to the host after every batch (``eval_accumulation_steps=1``),
    to make with a smaller evaluation batch (`smaller_eval_batch`'s ``kept``) where the loop keeps every batch now
    (one batch, or several that `fewer_kept_batches` leaves as they are): smaller batches alone keep the same
    samples' outputs. None where the loop keeps nothing, or moves each batch off already. Not traced itself."""
    loop = run.evaluation
    if loop is None or (loop.moved_off and loop.kept_batches == 1):
        return None
    return Suggestion({"eval_accumulation_steps": 1}, "", 0, False, KEPT_COST.format(k=1),
                      run.replace(evaluation=_keeping(loop, 1)), changes=("eval_kept",))


def with_evaluation(found: list[Suggestion], *, evaluation: int, fix: tuple[Suggestion, int] | None, limit: int,
                    retraced: Callable[[Suggestion, Suggestion | None], int | None] | None = None
                    ) -> list[Suggestion]:
    """``found`` (training suggestions: their figures cover training, loading and saving) with the evaluation's need
    counted: ``evaluation`` as predicted for the run as it is, which a training change is taken not to raise (each
    lowers the resident training state or leaves the evaluation step as it is). Where that is over ``limit``,
    ``fix`` (`fewer_kept_batches` or `smaller_eval_batch`: the suggestion and its evaluation's need) is made with
    each training change; a suggestion fits only where its training and that evaluation both do. A change that can
    raise the evaluation (mixed precision: autocast's cached low-precision copies of the weights) has its
    evaluation traced again where ``retraced(suggestion, fix)`` gives it, with the fix's evaluation changes made
    (None: not a change that needs it)."""
    kept, base_kept_need = fix if fix is not None else (None, 0)
    base_evaluation = evaluation
    out = []
    for s in found:
        evaluation, kept_need = base_evaluation, base_kept_need
        how = "as predicted for the run as it is: this change does not raise it"
        if retraced is not None:
            again = retraced(s, kept)
            if again is not None:
                evaluation = kept_need = again
                how = "traced with this change"
        if kept is not None and evaluation > limit:
            figure = max(s.predicted_peak_bytes, kept_need)
            made = ", ".join(f"{k}={v}" for k, v in kept.change.items())
            text = (f"{s.description}; with {made} (the evaluation {format_bytes(kept_need)} {how}"
                    + (", still over the budget)" if kept_need > limit else ")"))
            out.append(dataclasses.replace(
                s, change={**s.change, **kept.change}, description=text, predicted_peak_bytes=figure,
                fits=s.fits and figure <= limit, cost=f"{s.cost}; {kept.cost}",
                run=s.run.replace(evaluation=kept.run.evaluation), changes=(*s.changes, *kept.changes)))
        elif evaluation > s.predicted_peak_bytes:
            fits = s.fits and evaluation <= limit
            text = (f"{s.description}; " + ("" if fits else "but ") + f"the evaluation needs "
                    f"{format_bytes(evaluation)} ({how})" + ("" if fits else ", over the budget"))
            out.append(dataclasses.replace(s, description=text, predicted_peak_bytes=evaluation, fits=fits))
        else:
            out.append(s)
    return out


def _searched(need: Callable[[int], int], high: int, limit: int) -> tuple[int, int, int]:
    """The largest n in [1, ``high``] with ``need(n) <= limit``, found by bisection over a need that grows with n (1
    when even that is over: the caller says so), its need, and how many needs were traced (each once)."""
    figures: dict[int, int] = {}

    def traced(n: int) -> int:
        if n not in figures:
            figures[n] = need(n)
        return figures[n]

    low = 1
    if traced(1) <= limit:
        while low < high:  # traced(low) fits; the largest n in [low, high] that fits
            middle = (low + high + 1) // 2
            if traced(middle) <= limit:
                low = middle
            else:
                high = middle - 1
    return low, traced(low), len(figures)


def _verdict(evaluation: int, others: int, limit: int, *, alone: str) -> str:
    """In words, whether a run whose evaluation needs ``evaluation`` and whose other phases need ``others`` fits in
    ``limit``: ``alone`` where the evaluation itself is over."""
    if max(evaluation, others) <= limit:
        return "fits"
    if evaluation > limit:
        return alone
    return (f"the evaluation fits, but the rest of the run needs {format_bytes(others)}, "
            f"{format_bytes(others - limit)} over: a training change is needed too")


def _keeping(loop: EvalLoop, k: int) -> EvalLoop:
    return dataclasses.replace(loop, kept_batches=k, moved_off=True)
