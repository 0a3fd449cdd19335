"""preflight_check and StepVerifier in a hand-written accelerate loop, on CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import preflight
import torch

accelerate = pytest.importorskip("accelerate")

from conftest import lm_batch, make_gpt2  # noqa: E402

from preflight.integrations.accelerate import StepVerifier, preflight_check  # noqa: E402


class Batches(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return {k: v[0] for k, v in lm_batch(1, 48).items()}


@pytest.mark.slow
def test_custom_loop_prediction_matches_the_measured_peak(tmp_path, monkeypatch):
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = make_gpt2(n_layer=2, n_embd=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Batches(), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    report = preflight_check(accelerator, model, optimizer, loader, run=preflight.Run(target=preflight.Target(budget="1GiB")), eval_dataloader=loader)
    assert report.fits is True and report.schedule == {"accumulate": 2, "zero_grad": "after_step",
                                                     "max_grad_norm": None, "grad_scaler": False,
                                                     "steps": 2, "optimizer_impl": None,
                                                     "sampled_steps": 0, "offload_activations": None,
                                                     "module_modes": "train", "autocast_cache": True,
                                                     "manual": False}
    assert report.eval_predicted_peak_bytes is not None

    verifier = StepVerifier(accelerator, model, optimizer, report, steps=2, report_path=str(tmp_path / "r.json"))
    marks = []
    phase_ended = type(verifier.session).phase_ended
    monkeypatch.setattr(type(verifier.session), "phase_ended", lambda self: (marks.append(1), phase_ended(self)))
    for batch in loader:
        with verifier.step(batch), accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["steps_measured"] == 2 and abs(data["relative_error"]) < 0.01
    # Each measured micro-batch's accelerator.backward marked the end of its forward and of its backward; the
    # accelerator is as it was once the windows closed.
    assert len(marks) == 2 * 2 * 2 and "backward" not in vars(accelerator)


@pytest.mark.slow
def test_an_evaluation_batch_between_measured_steps_is_measured_and_compared():
    accelerator = accelerate.Accelerator(cpu=True)
    model = make_gpt2(n_layer=2, n_embd=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Batches(), batch_size=4)
    eval_loader = torch.utils.data.DataLoader(Batches(), batch_size=8)
    model, optimizer, loader, eval_loader = accelerator.prepare(model, optimizer, loader, eval_loader)
    report = preflight_check(accelerator, model, optimizer, loader, run=preflight.Run(target=preflight.Target(budget="1GiB")), eval_dataloader=eval_loader)
    verifier = StepVerifier(accelerator, model, optimizer, report, steps=3)
    for i, batch in enumerate(loader):
        with verifier.step(batch):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
        if i == 1:  # evaluation after the second of three measured steps
            model.eval()
            eval_batch = next(iter(eval_loader))
            with torch.no_grad(), verifier.eval_step(eval_batch):
                model(**eval_batch)
            model.train()
    assert report.steps_measured == 3
    assert report.eval_measured_peak_bytes is not None and abs(report.eval_relative_error) < 0.01


@pytest.mark.slow
def test_a_deepspeed_plugin_loop_is_predicted_per_rank(tmp_path):
    # accelerate.prepare runs deepspeed.initialize: the model is partitioned (ZeRO-3) and the optimizer DeepSpeed's
    # when preflight_check runs; both are read back and each rank predicted under the plugin's config
    # (`benchmarks/deepspeed_trainers.py`'s run, 2 CPU processes).
    pytest.importorskip("deepspeed")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from deepspeed_trainers import run_config

    for report in run_config("accelerate", 3, "32-true", tmp_path):
        assert report["fits"] is True and report["steps"] == 3
        assert any("accelerate's DeepSpeedPlugin: zero3 over 2 rank(s)" in n for n in report["notes"])
        assert any("read back from DeepSpeed ZeRO stage 3 over 2 rank(s)" in n for n in report["notes"])
        assert abs(report["error"]) < 0.01, report
