"""Nothing of a trace survives it: caches, globals and attributes written during a trace are repaired, and a real
run afterwards is exactly the run of a process where preflight never ran (issue 9, section 1)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import leftover_models as lm
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import preflight

HERE = Path(__file__).resolve().parent


def _fresh_process(*flags: str) -> dict[str, dict]:
    out = subprocess.run([sys.executable, str(HERE / "leftover_models.py"), *flags], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    return {row["model"]: row for row in map(json.loads, out.splitlines()) if row}


@pytest.mark.slow
def test_training_after_estimate_equals_a_process_without_preflight():
    plain = _fresh_process()
    for flags in (["--estimate-first"], ["--estimate-first", "--same-model"]):
        after = _fresh_process(*flags)
        for name in lm.MODELS:
            assert after[name]["fake"] is False and plain[name]["fake"] is False
            # Same losses, same trained weights (bitwise), same measured peak.
            for key in ("losses", "digest", "peak"):
                assert after[name][key] == plain[name][key], (name, flags, key)
            assert after[name]["notes"], f"{name}: the trace wrote into a cache, and the repair should say so"
    notes = " ".join(after["beit"]["notes"])
    assert "generate_relative_position_index" in notes
    assert "get_patches_center_coordinates" in " ".join(after["dinov3"]["notes"])


def _reset_caches() -> None:
    lm.rotary_table.cache_clear()
    lm._TABLES.clear()
    lm._POSITIONS = None


def _fakes_in(*objects) -> list:
    found = []

    def walk(x):
        if isinstance(x, FakeTensor):
            found.append(x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)

    for obj in objects:
        walk(obj)
    return found


def test_every_kind_of_holder_is_repaired():
    _reset_caches()
    helper = _Holder()
    model, batch = _HoldingModel(helper), {"input_ids": torch.randint(0, 256, (2, 16))}
    before_attr = helper.__dict__.copy()
    est = preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), batch)
    assert est.coverage.traced
    assert lm.rotary_table.cache_info().currsize == 0  # lru_cache: cleared
    assert _unbounded.cache_info().currsize == 0  # functools.cache (unbounded: results in a private dict)
    assert not _fakes_in(lm._TABLES, lm._POSITIONS, _LIST, _SET, vars(helper), vars(_SINGLETON), _CELL_READER())
    assert vars(helper) == before_attr  # an object the model refers to is restored exactly
    assert set(vars(_SINGLETON)) == {"kept"}  # elsewhere, attributes the trace set are deleted
    assert _CELL_READER() is None  # a closure variable is reset to None, never left unbound
    assert _GLOBAL_LATER is None  # a global rebound during the trace has its old value back
    notes = " ".join(est.coverage.notes)
    for expected in ("rotary_table", "_TABLES", "_POSITIONS", "_LIST", "_SET", "_GLOBAL_LATER", "_Holder",
                     "closure"):
        assert expected in notes, expected
    # The model itself runs for real afterwards.
    out = model(**batch)
    assert not isinstance(out, FakeTensor) and torch.isfinite(out)


def test_a_real_cached_value_is_read_as_a_constant_and_kept():
    _reset_caches()
    model, batch = lm.make("caching")
    lm.step(model, batch)  # a real forward fills the caches with real tensors
    cached = lm.rotary_table(batch["input_ids"].shape[1], 64)
    rel = _relative_error(model, batch)
    assert abs(rel) < 0.005
    assert lm.rotary_table(batch["input_ids"].shape[1], 64) is cached  # the real entry survived the trace
    assert not _fakes_in(lm._TABLES, lm._POSITIONS)


def test_eval_traces_are_swept_too():
    _reset_caches()
    model, batch = lm.make("caching")
    est = preflight.estimate_eval(model, batch, step=lm.step)
    assert est.coverage.traced and any("rotary_table" in n for n in est.coverage.notes)
    assert not _fakes_in(lm._TABLES, lm._POSITIONS) and lm.rotary_table.cache_info().currsize == 0


def _relative_error(model, batch) -> float:
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, step=lm.step)
    measured = preflight.measure(model, torch.optim.AdamW(model.parameters()), batch, step=lm.step)
    return (est.peak_bytes - measured.peak_bytes) / measured.peak_bytes


@pytest.mark.slow
def test_lightning_callback_leaves_no_fakes_behind():
    L = pytest.importorskip("lightning")
    from preflight.integrations.lightning import PreflightCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.batch = lm.make("caching")
            self.losses: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            loss = lm.step(self.model, batch)
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return torch.utils.data.DataLoader([self.batch] * 3, batch_size=None)

    def run(callbacks):
        _reset_caches()  # each run starts with empty caches: the first forward is the trace's, with the callback
        torch.manual_seed(0)
        module = Module()
        L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks).fit(module)
        return module

    plain = run([])
    checked = run([PreflightCallback(verify_steps=2)])
    assert not any(isinstance(x, FakeTensor) for x in checked.losses)
    assert [float(x) for x in plain.losses] == [float(x) for x in checked.losses]
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), checked.parameters()))
    assert not _fakes_in(lm._TABLES, lm._POSITIONS)


@pytest.mark.slow
def test_hf_callback_leaves_no_fakes_behind(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments
    from transformers.models.beit.modeling_beit import BeitRelativePositionBias

    from preflight.integrations.hf import PreflightCallback

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            gen = torch.Generator().manual_seed(i)
            return {"pixel_values": torch.randn(3, 32, 32, generator=gen), "labels": i % 3}

    # transformers' compile_compatible_method_lru_cache keeps the functools cache in the wrapper's closure.
    (cache,) = [c.cell_contents for c in BeitRelativePositionBias.generate_relative_position_index.__closure__
                if isinstance(c.cell_contents, functools._lru_cache_wrapper)]

    def run(callbacks):
        cache.cache_clear()  # each run starts with an empty cache: with the callback, the trace fills it first
        model, _ = lm.make("beit")
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=2,
                                 report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                                 disable_tqdm=True, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=Images(), callbacks=callbacks)
        trainer.train()
        return list(trainer.model.parameters())

    plain = run([])
    checked = run([PreflightCallback(verify_steps=2)])
    assert all(not isinstance(p, FakeTensor) and torch.equal(a, p) for a, p in zip(plain, checked))
    assert cache.cache_info().currsize == 1 and not isinstance(cache((4, 4)), FakeTensor)  # refilled for real


# --- a model that writes into every kind of holder -------------------------------------------------------------

_LIST: list = []
_SET: set = set()
_GLOBAL_LATER = None


@functools.cache
def _unbounded(n: int) -> torch.Tensor:
    return torch.arange(n)


def _make_cell():
    box = None

    def write(value):
        nonlocal box
        box = value

    def read():
        return box

    return write, read


_CELL_WRITER, _CELL_READER = _make_cell()


class _Holder:
    """A plain object outside the model, written by the model's forward."""

    def __init__(self) -> None:
        self.kept = 1

    @functools.cached_property
    def cached(self) -> torch.Tensor:
        return torch.ones(3)


_SINGLETON = _Holder()


class _HoldingModel(nn.Module):
    def __init__(self, helper: _Holder) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 64)
        self.helper = helper

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        global _GLOBAL_LATER
        s = input_ids.shape[1]
        x = self.emb(input_ids)
        cos, sin = lm.rotary_table(s, 64)
        x = x * cos[:, :32].repeat(1, 2) + lm.scale_table(s, 64) + lm.positions(s)[:, None]
        _LIST.append(x.sum())
        _SET.add(x.mean())
        _GLOBAL_LATER = x.max()
        _CELL_WRITER(x.min())
        self.helper.added = x.std()
        self.helper.cached.add_(0)  # a cached_property, computed during the trace
        _SINGLETON.added = x.var()
        _SINGLETON.cached.add_(0)
        return (x + _unbounded(s)[:, None]).pow(2).mean()


def test_a_slot_holding_a_container_of_a_fake_is_looked_up_without_a_weak_reference():
    """A leftover can be a tuple holding a fake tensor (a cache's entry): what the slot held before is looked up by
    the slot, not by the tuple (which cannot be weakly referenced)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from preflight.trace._leftovers import _MISSING, _Before

    with FakeTensorMode():
        fake = torch.empty(2)
    holder = {"entry": (fake, 1)}
    assert _Before().previous(holder, "entry", holder["entry"]) is _MISSING
