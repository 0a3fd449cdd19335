"""`preflight.advice._evaluation`: fewer kept evaluation batches, and the evaluation counted in training changes."""

from __future__ import annotations

from preflight import EvalLoop, Run
from preflight.advice import Suggestion, fewer_kept_batches, moving_every_batch, smaller_eval_batch, with_evaluation


def _need(per_batch: int, step: int, calls: list[int]):
    def evaluate(loop: EvalLoop) -> int:
        calls.append(loop.kept_batches)
        assert loop.moved_off  # every k batches moved to the host
        return step + per_batch * loop.kept_batches

    return evaluate


def test_the_largest_number_of_kept_batches_that_fits_is_found_by_bisection():
    calls: list[int] = []
    run = Run(precision="bf16-mixed", evaluation=EvalLoop(100))
    # 1,000 + 10 per kept batch: 37 kept need 1,370, 38 need 1,380.
    found = fewer_kept_batches(_need(10, 1_000, calls), run, limit=1_375, others=900)
    assert found is not None
    suggestion, evaluation = found
    assert suggestion.change == {"eval_accumulation_steps": 37} and evaluation == 1_370
    assert suggestion.fits and suggestion.predicted_peak_bytes == 1_370
    assert suggestion.run == Run(precision="bf16-mixed", evaluation=EvalLoop(37, moved_off=True))
    assert suggestion.changes == ("eval_kept",) and "eval_accumulation_steps=37" in suggestion.description
    assert len(calls) == len(set(calls)) <= 8  # log2(99) traces, none twice


def test_the_rest_of_the_run_decides_whether_it_fits():
    found = fewer_kept_batches(_need(10, 1_000, []), Run(evaluation=EvalLoop(10)), limit=1_375, others=2_000)
    suggestion, evaluation = found
    assert suggestion.change == {"eval_accumulation_steps": 9} and evaluation == 1_090  # 9 of the 10 kept now
    assert not suggestion.fits and suggestion.predicted_peak_bytes == 2_000
    assert "a training change is needed too" in suggestion.description


def test_no_number_fits_when_one_batch_is_over():
    calls: list[int] = []
    suggestion, evaluation = fewer_kept_batches(_need(10, 2_000, calls), Run(evaluation=EvalLoop(10)), limit=1_375,
                                                others=0)
    assert calls == [1] and evaluation == 2_010 and not suggestion.fits
    assert "a smaller evaluation batch" in suggestion.description


def test_a_loop_keeping_nothing_has_no_such_change():
    assert fewer_kept_batches(_need(10, 0, []), Run(), limit=10, others=0) is None
    assert fewer_kept_batches(_need(10, 0, []), Run(evaluation=EvalLoop(1)), limit=10, others=0) is None


def _training(figure: int, fits: bool) -> Suggestion:
    return Suggestion({"gradient_checkpointing": True}, "activation checkpointing", figure, fits, "recompute",
                      Run(precision="bf16-mixed"), changes=("checkpointing",))


def test_a_training_change_is_made_with_the_evaluation_change_where_the_evaluation_is_over():
    fix = fewer_kept_batches(_need(10, 1_000, []), Run(evaluation=EvalLoop(100)), limit=1_375, others=1_500)
    (made,) = with_evaluation([_training(1_200, True)], evaluation=2_000, fix=fix, limit=1_375)
    assert made.fits and made.predicted_peak_bytes == 1_370  # the evaluation with 37 kept is now the run's peak
    assert made.change == {"gradient_checkpointing": True, "eval_accumulation_steps": 37}
    assert made.run == Run(precision="bf16-mixed", evaluation=EvalLoop(37, moved_off=True))
    assert made.changes == ("checkpointing", "eval_kept")
    (over,) = with_evaluation([_training(1_400, False)], evaluation=2_000, fix=fix, limit=1_375)
    assert not over.fits and over.predicted_peak_bytes == 1_400


def test_without_an_evaluation_change_the_evaluation_bounds_each_training_change():
    (s,) = with_evaluation([_training(1_200, True)], evaluation=2_000, fix=None, limit=1_375)
    assert not s.fits and s.predicted_peak_bytes == 2_000 and "the evaluation needs" in s.description
    (s,) = with_evaluation([_training(1_200, True)], evaluation=1_300, fix=None, limit=1_375)
    assert s.fits and s.predicted_peak_bytes == 1_300 and s.change == {"gradient_checkpointing": True}
    (s,) = with_evaluation([_training(1_200, True)], evaluation=1_000, fix=None, limit=1_375)
    assert s == _training(1_200, True)


def test_the_largest_evaluation_batch_that_fits_is_found_with_the_fewest_kept_batches():
    calls: list[tuple[int, int]] = []

    def evaluate(loop, b=None):
        calls.append((loop.kept_batches, b))
        return 1_000 + 100 * (b or 32) + 10 * loop.kept_batches * (b or 32)

    run = Run(evaluation=EvalLoop(6))
    kept = fewer_kept_batches(evaluate, run, limit=3_000, others=0)
    assert kept[1] > 3_000 and not kept[0].fits  # one kept batch of 32 is still over
    suggestion, evaluation = smaller_eval_batch(evaluate, run, 32, kept=kept[0], limit=3_000, others=0)
    # 1,000 + 110 b <= 3,000: b = 18 (2,980); 19 needs 3,090
    assert suggestion.change == {"eval_accumulation_steps": 1, "eval_batch_size": 18} and evaluation == 2_980
    assert suggestion.fits and suggestion.run.evaluation == EvalLoop(1, moved_off=True)
    assert suggestion.changes == ("eval_batch", "eval_kept")
    assert all(k == 1 for k, b in calls if b is not None)


def test_a_smaller_evaluation_batch_without_kept_predictions():
    suggestion, evaluation = smaller_eval_batch(lambda loop, b: 500 * b, Run(), 8, kept=None, limit=1_999, others=0)
    assert suggestion.change == {"eval_batch_size": 3} and evaluation == 1_500 and suggestion.run == Run()
    over, _ = smaller_eval_batch(lambda loop, b: 5_000 * b, Run(), 8, kept=None, limit=1_999, others=0)
    assert over.change == {"eval_batch_size": 1} and not over.fits and "one sample a batch" in over.description
    assert smaller_eval_batch(lambda loop, b: 0, Run(), 1, kept=None, limit=1, others=0) is None


def test_a_single_batch_that_keeps_its_outputs_keeps_them_in_every_smaller_batch():
    # 64 samples in one batch now: in batches of b the loop keeps ceil(64 / b) of them, each traced so.
    seen = {}

    def evaluate(loop, b):
        seen[b] = loop.kept_batches
        return 100 * b + 10 * 64  # the step, and the kept outputs of every sample

    run = Run(evaluation=EvalLoop(1, samples=64))
    suggestion, evaluation = smaller_eval_batch(evaluate, run, 64, kept=None, limit=3_000, others=0)
    assert suggestion.change == {"eval_batch_size": 23} and evaluation == 2_940
    assert all(k == -(-64 // b) for b, k in seen.items())
    assert suggestion.run.evaluation == EvalLoop(3, samples=64)


def test_a_loop_keeping_every_batch_is_split_with_its_predictions_moved_off():
    run = Run(evaluation=EvalLoop(1, samples=64))
    stub = moving_every_batch(run)
    assert stub.change == {"eval_accumulation_steps": 1} and stub.run.evaluation == EvalLoop(1, moved_off=True,
                                                                                              samples=64)
    suggestion, _ = smaller_eval_batch(lambda loop, b: 100 * b + (10 * b if loop.moved_off else 640), run, 64,
                                       kept=stub, limit=3_000, others=0)
    assert suggestion.change == {"eval_accumulation_steps": 1, "eval_batch_size": 27}  # 110 x 27 = 2,970
    assert suggestion.changes == ("eval_batch", "eval_kept")
    assert moving_every_batch(Run()) is None
    assert moving_every_batch(Run(evaluation=EvalLoop(1, moved_off=True))) is None


def test_a_change_that_can_raise_the_evaluation_has_it_traced_again():
    # Mixed precision under autocast's cache keeps a bf16 copy of each weight the evaluation uses: its evaluation is
    # traced again (here by the caller's stand-in), not bounded by the run's as it is.
    mixed = Suggestion({"precision": "bf16-mixed"}, "bf16-mixed", 1_000, True, "none", Run(precision="bf16-mixed"),
                       changes=("bf16-mixed",))
    asked = []

    def retraced(s, fix):
        asked.append((s.change, fix))
        return 1_500 if s.change.get("precision") == "bf16-mixed" else None

    made, other = with_evaluation([mixed, _training(1_200, True)], evaluation=1_300, fix=None, limit=1_375,
                                  retraced=retraced)
    assert not made.fits and made.predicted_peak_bytes == 1_500 and "traced with this change" in made.description
    assert other.fits and other.predicted_peak_bytes == 1_300
    assert asked[0] == ({"precision": "bf16-mixed"}, None)
