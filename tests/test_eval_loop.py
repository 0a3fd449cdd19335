"""`preflight.EvalLoop`: what an evaluation loop keeps of each batch, predicted against a measured loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import preflight
from preflight import EvalLoop, Run
from preflight._device import live_storages
from preflight._measure import cpu_profiled_peak


def test_the_section_checks_its_fields():
    with pytest.raises(ValueError, match="kept_batches"):
        EvalLoop(kept_batches=0)
    with pytest.raises(ValueError, match="ranks"):
        EvalLoop(kept_batches=2, ranks=0)
    with pytest.raises(TypeError, match="concatenated"):
        EvalLoop(kept_batches=2, concatenated="yes")
    with pytest.raises(TypeError, match="Run.evaluation"):
        Run(evaluation=3)
    assert Run(evaluation=EvalLoop(5)).to_dict()["evaluation"] == {"kept_batches": 5, "concatenated": True,
                                                                    "ranks": 1, "moved_off": False, "samples": None}
    with pytest.raises(ValueError, match="samples"):
        EvalLoop(samples=0)


def test_a_smaller_evaluation_batch_keeps_the_same_samples_in_more_batches():
    assert EvalLoop(1, samples=64).at_batch_size(24, 64) == EvalLoop(3, samples=64)
    assert EvalLoop(4).at_batch_size(3, 8) == EvalLoop(11)  # 32 samples kept now, in batches of 3
    # Moved off every 2 batches: at most 2 kept, however small the batches
    assert EvalLoop(2, moved_off=True, samples=64).at_batch_size(4, 16) == EvalLoop(2, moved_off=True, samples=64)
    assert EvalLoop(2, moved_off=True, samples=64).at_batch_size(64, 16) == EvalLoop(1, moved_off=False, samples=64)


def test_kept_bytes_follow_the_loop():
    # (earlier batches kept, previous batch's own outputs, gathered copy, new concatenated tensor)
    assert EvalLoop(1).kept_bytes(100) == (0, 0, 0, 0)
    assert EvalLoop(2).kept_bytes(100) == (100, 0, 0, 200)  # batch 1's outputs are the kept tensor itself
    assert EvalLoop(5).kept_bytes(100) == (400, 100, 0, 500)
    assert EvalLoop(5, concatenated=False).kept_bytes(100) == (400, 0, 0, 0)
    assert EvalLoop(3, ranks=4).kept_bytes(100) == (800, 400, 400, 1200)


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 2000))

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("kept", [2, 3, 6])
def test_an_evaluation_keeping_every_batchs_outputs_is_predicted_at_its_last_concatenation(kept):
    # A loop that keeps each batch's scores, concatenated as transformers' nested_concat does: its peak is the last
    # concatenation (the old kept tensor, the batch's scores and the new kept tensor at once), not one forward.
    torch.manual_seed(0)
    model = Scorer().eval()
    batches = [torch.randn(32, 64) for _ in range(kept)]

    def evaluate():
        collected = None
        with torch.no_grad():
            for x in batches:
                scores = model(x)
                collected = scores if collected is None else torch.cat((collected, scores))
        return collected

    resident = live_storages([list(model.parameters()), batches], torch.device("cpu"))
    peak, _ = cpu_profiled_peak(evaluate, resident=resident)
    measured = sum(resident.values()) + peak
    others = sum(b.untyped_storage().nbytes() for b in batches[:-1])  # the loop's other batches, alive throughout
    est = preflight.estimate_eval(model, batches[-1], Run(evaluation=EvalLoop(kept)), step=lambda m, x: m(x))
    assert est.peak_bytes + others == measured
    assert any(n.startswith("kept outputs:") for n in est.coverage.notes)
    alone = preflight.estimate_eval(model, batches[-1], step=lambda m, x: m(x))
    assert alone.peak_bytes + others < measured  # one forward alone is under it


def test_a_step_returning_no_tensor_keeps_nothing():
    model = Scorer().eval()
    x = torch.randn(32, 64)
    kept = preflight.estimate_eval(model, x, Run(evaluation=EvalLoop(6)), step=lambda m, b: [m(b)] and None)
    alone = preflight.estimate_eval(model, x, step=lambda m, b: [m(b)] and None)
    assert kept.peak_bytes == alone.peak_bytes
    assert any("returned no tensor" in n for n in kept.coverage.notes)


def test_one_batch_moved_off_each_step_leaves_a_view_over_it_on_the_cpu():
    # transformers with eval_accumulation_steps=1: each batch's scores go to NumPy as a view over their storage; the
    # first one is alive during the second batch's step (later ones are NumPy's own memory after the concatenation).
    # Before: a loop keeping one batch kept nothing, 24% under a measured HF Trainer evaluation.
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    model = Scorer().eval()
    batches = [torch.randn(32, 64) for _ in range(4)]

    def evaluate():
        arrays = None
        with torch.no_grad():
            for x in batches:
                new = model(x).numpy()
                arrays = new if arrays is None else np.concatenate((arrays, new))
                del new
        return arrays

    resident = live_storages([list(model.parameters()), batches], torch.device("cpu"))
    peak, _ = cpu_profiled_peak(evaluate, resident=resident)
    measured = sum(resident.values()) + peak
    others = sum(b.untyped_storage().nbytes() for b in batches[:-1])
    est = preflight.estimate_eval(model, batches[-1], Run(evaluation=EvalLoop(1, moved_off=True)),
                                  step=lambda m, x: m(x))
    assert est.peak_bytes + others == measured
    alone = preflight.estimate_eval(model, batches[-1], step=lambda m, x: m(x))
    assert alone.peak_bytes + others < measured
