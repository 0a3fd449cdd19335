"""One run description through every door (issue 23): a bf16-mixed FSDP2 run over 4 ranks, planned with
`preflight.estimate`, `check`, `max_batch_size`, `advise`, the Lightning and HF callbacks, accelerate's
`preflight_check`, ``preflight estimate`` and ``preflight check`` gets the same per-rank figure everywhere.

A door that also reads the loop off a trainer (Lightning zeroes gradients before backward, the HF Trainer clips at
1.0) is compared with `estimate` of the same description laid over that loop (`Run.over`): what differs between
doors is only what the trainer really does differently.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import VariableTokens, make_gpt2, pad_tokens

import preflight
from preflight import Loop, ParallelPlan, Run, Target

TESTS = Path(__file__).resolve().parent
BATCH, SEQ = 4, 48
RUN = Run(precision="bf16-mixed", target=Target(budget="1GiB"), parallel=ParallelPlan(4, "fsdp2"))


def _model():
    torch.manual_seed(0)
    return make_gpt2(n_layer=2, n_embd=64)


def _batch(b: int = BATCH):
    """What the loaders below yield at their largest: ``b`` samples of ``SEQ`` tokens, no padding."""
    data = VariableTokens(8, fixed=SEQ)
    return pad_tokens([data[i % 8] for i in range(b)])


def _loader():
    return torch.utils.data.DataLoader(VariableTokens(8, fixed=SEQ, key="input_ids"), batch_size=BATCH,
                                       collate_fn=pad_tokens)


def _planned(model=None, run: Run = RUN, step=None) -> int:
    model = model if model is not None else _model()
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), _batch(), run, step=step)
    assert est.per_rank_peak_bytes is not None and len(est.per_rank_peak_bytes) == 4  # each rank traced
    return est.peak_bytes


@pytest.fixture(scope="module")
def planned() -> int:
    return _planned()


def test_check(planned):
    model = _model()
    report = preflight.check(model, torch.optim.AdamW(model.parameters()), _batch(), RUN, suggest=False)
    assert report.predicted_peak_bytes == planned and report.fits is True
    assert report.run["parallel"]["sharding"] == "fsdp2" and report.run["precision"] == "bf16-mixed"


@pytest.mark.slow
def test_max_batch_size(planned):
    model = _model()
    result = preflight.max_batch_size(model, torch.optim.AdamW(model.parameters()), _batch, RUN, max_batch=BATCH)
    assert int(result) == BATCH and result.predicted_peak_bytes == planned


@pytest.mark.slow
def test_advise_predicts_each_option_under_the_same_plan(planned, monkeypatch):
    from conftest import only_options

    only_options(monkeypatch, "bf16 precision")  # the option asserted on (test_options.py traces each)
    model = _model()
    tight = RUN.replace(target=Target(budget=planned - 1))  # single changes fit: no combination is searched
    suggestions = preflight.advise(model, torch.optim.AdamW(model.parameters()), _batch(), tight)
    bf16 = next(s for s in suggestions if s.change == {"precision": "bf16-true"})
    assert bf16.run == tight.replace(precision="bf16-true")  # the suggestion is the description, changed
    assert bf16.predicted_peak_bytes == _planned(run=bf16.run)
    assert "--precision bf16-true" in " ".join(bf16.run.cli_flags())
    assert "--sharding fsdp2" in " ".join(bf16.run.cli_flags())


@pytest.mark.slow
def test_cli_estimate(planned, tmp_path):
    from preflight import _cli

    config = tmp_path / "config.json"
    _model().config.to_json_file(config)
    out = tmp_path / "est.json"
    argv = ["estimate", "--hf-config", str(config), "--batch", str(BATCH), "--seq", str(SEQ), "--precision",
            "bf16-mixed", "--world-size", "4", "--sharding", "fsdp2", "--budget", "1GiB", "--json", str(out),
            "--no-suggest"]
    assert _cli.main(argv) == 0  # in this process (tests/test_cli.py runs the command as a user does)
    # The CLI builds the model from the config on the meta device, with its own batch: the same description
    # given to `estimate` over those objects is its figure.
    args = _cli._parser().parse_args(argv)
    dtype, _ = _cli._param_dtype(args)
    model, optimizer, batch = _cli._build(args, _cli._config(args), dtype)
    expected = preflight.estimate(model, optimizer, batch, RUN).peak_bytes
    written = json.loads(out.read_text())
    assert written["peak_bytes"] == expected
    assert written["run"]["parallel"]["world_size"] == 4 and written["run"]["precision"] == "bf16-mixed"
    # (Its batch has no attention mask, 4 x 48 int64 less than the loaders' batches above.)
    assert planned - expected == BATCH * SEQ * 8


@pytest.mark.slow
def test_cli_check_lays_its_plan_over_the_scripts(planned, tmp_path):
    report = tmp_path / "report.json"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        import torch, preflight
        from test_doors import _batch, _model
        model = _model()
        preflight.check(model, torch.optim.AdamW(model.parameters()), _batch(),
                        preflight.Run(precision="bf16-mixed", target=preflight.Target(budget="1GiB")),
                        suggest=False, report_path={str(report)!r})
        raise SystemExit("trained in a dry run")
    """))
    result = subprocess.run([sys.executable, "-m", "preflight", "check", "--world-size", "4", "--sharding", "fsdp2",
                             "--", sys.executable, str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert json.loads(report.read_text())["predicted_peak_bytes"] == planned


@pytest.mark.slow
def test_lightning_callback(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from preflight.integrations.lightning import PreflightCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model()

        def forward(self, batch):
            return self.model(**batch).loss

        def training_step(self, batch, batch_idx):
            return self(batch)  # through the root's forward, where fully_shard's root hooks run

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

        def train_dataloader(self):
            return _loader()

    module = Module()
    # Lightning frees gradients before backward: its loop, under the user's description.
    expected = _planned(module, RUN.over(Run(loop=Loop(zero_grad="before_backward"))),
                        step=lambda m, b: m.training_step(b, 0))
    callback = PreflightCallback(RUN, verify_steps=0, suggest=False, check_eval=False)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[callback])
    trainer.fit(module)
    assert callback.report.predicted_peak_bytes == expected
    assert callback.report.run["loop"]["zero_grad"] == "before_backward"


@pytest.mark.slow
def test_hf_callback(tmp_path):
    transformers = pytest.importorskip("transformers")
    from preflight.integrations.hf import PreflightCallback

    model = _model()
    # The Trainer clips gradients at 1.0 by default: its loop, under the user's description.
    expected = _planned(_model(), RUN.over(Run(loop=Loop(max_grad_norm=1.0))))
    callback = PreflightCallback(RUN, verify_steps=0, suggest=False, check_eval=False)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=BATCH,
                                          report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=VariableTokens(8, fixed=SEQ, key="input_ids"),
                                   data_collator=pad_tokens, callbacks=[callback],
                                   optimizers=(torch.optim.AdamW(model.parameters()), None))
    trainer.train()
    assert callback.report.predicted_peak_bytes == expected


@pytest.mark.slow
def test_accelerate_preflight_check(planned):
    accelerate = pytest.importorskip("accelerate")
    from preflight.integrations.accelerate import preflight_check

    accelerator = accelerate.Accelerator(cpu=True)
    model = _model()
    model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters()), _loader())
    report = preflight_check(accelerator, model, optimizer, loader, RUN, suggest=False, check_eval=False)
    assert report.predicted_peak_bytes == planned
