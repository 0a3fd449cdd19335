"""Verification inside the trainers compares like with like: each measured step against the prediction for its own
batch, the worst case's headroom apart, and leaks from what steps leave alive (issue 10, section 2)."""

from __future__ import annotations

import warnings

import pytest
import torch

L = pytest.importorskip("lightning")

from conftest import VariableTokens, make_gpt2, pad_tokens  # noqa: E402

from preflight.integrations.lightning import PreflightCallback  # noqa: E402


class Ordered(torch.utils.data.Dataset):
    """Token lists of the given lengths, in order (one sample per batch, no shuffling)."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return torch.randint(1, 1000, (self.lengths[i],), generator=torch.Generator().manual_seed(i)).tolist()


class GPT(L.LightningModule):
    def __init__(self, lengths, leak=False):
        super().__init__()
        self.model = make_gpt2(n_layer=1, n_embd=64)
        self.lengths, self.leak = lengths, leak
        self.kept = []

    def training_step(self, batch, batch_idx):
        out = self.model(**batch)
        if self.leak:
            self.kept.append(out.logits)  # caches every step's outputs
        return out.loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Ordered(self.lengths), batch_size=1, collate_fn=pad_tokens)


def fit(module, callback):
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(max_steps=len(module.lengths), accelerator="cpu", devices=1, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  callbacks=[callback]).fit(module)
    return [str(w.message) for w in caught if "preflight" in str(w.message)]


@pytest.mark.parametrize("lengths", [[24, 40, 56, 72, 96], [96, 72, 56, 40, 24], [40, 96, 24, 72, 56]],
                         ids=["ascending", "descending", "mixed"])
@pytest.mark.slow
def test_each_step_is_compared_with_its_own_batch_and_nothing_leaks(lengths, capsys):
    callback = PreflightCallback(verify_steps=4)
    messages = fit(GPT(lengths), callback)
    report = callback.report
    assert report.steps_measured == 4 and len(report.predicted_step_peaks) == 4
    # Steps after the first (whose CPU measurement depends on what ran before it in the process: see compare).
    for predicted, measured in zip(report.predicted_step_peaks[1:], report.measured_step_peaks[1:]):
        assert abs(predicted - measured) / measured < 0.01
    assert abs(report.relative_error) < 0.01  # the prediction's accuracy, not the worst case's margin
    # The worst case (length 96) covers every measured step (to the prediction's accuracy: in the mixed order
    # the worst case itself is measured).
    assert report.worst_case_headroom > -0.01
    assert not any("step after step" in m or "grows" in m for m in messages)
    out = capsys.readouterr().out
    assert "preflight: verified 4 step(s)" in out and "worst case predicted" in out


@pytest.mark.slow
def test_a_module_that_caches_outputs_is_reported_as_a_leak():
    callback = PreflightCallback(verify_steps=4)
    messages = fit(GPT([40, 24, 56, 32, 48], leak=True), callback)
    assert any("step after step" in m for m in messages)
    assert all(r > 0 for r in callback.report.retained_step_bytes[1:])


class WithValidation(GPT):
    def validation_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def val_dataloader(self):
        return torch.utils.data.DataLoader(Ordered([80, 64]), batch_size=2, collate_fn=pad_tokens)


@pytest.mark.slow
def test_evaluation_inside_the_measured_window_is_measured_and_compared(capsys):
    callback = PreflightCallback(verify_steps=4)
    module = WithValidation([24, 40, 56, 72, 96])
    torch.manual_seed(0)
    L.Trainer(max_steps=5, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
              val_check_interval=2, limit_val_batches=1, callbacks=[callback]).fit(module)
    report = callback.report
    assert report.eval_measured_peak_bytes is not None  # validation ran after step 2, inside the window
    assert abs(report.eval_relative_error) < 0.01  # against the eval prediction for that eval batch
    assert "eval" in capsys.readouterr().out
