"""A checkpoint save under DeepSpeed ZeRO (`preflight.parallel._deepspeed.deepspeed_save`): what the HF Trainer's
``save_model`` consolidates (ZeRO-3's 16-bit gather, ZeRO-1/2's clone of the state dict) beside each rank's
partitions, per rank. Measured on real DeepSpeed runs: ``benchmarks/deepspeed_save.py`` (the slow test below runs
two of its configurations)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import preflight
from preflight import Checkpoint, Run, Target
from preflight._sharding import read_deepspeed_config, zero3_consolidation
from preflight.parallel._deepspeed import zero3_terms_for

sys.path.insert(0, str(Path(__file__).parent.parent))
from conftest import lm_batch, make_gpt2  # noqa: E402

GATHER = "stage3_gather_16bit_weights_on_model_save"
OFF = {"offload_optimizer": False, "offload_params": False}


def _config(stage: int, gather: bool | None = None) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 200_000, "stage3_param_persistence_threshold": 1_000}
    if gather is not None:
        zero[GATHER] = gather
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}


def _save(config: dict, state_dict: str, target: Target | None = None):
    model = make_gpt2(n_layer=2, n_embd=64, n_positions=64)
    run = Run(parallel=preflight.deepspeed_plan(config, world_size=2), checkpoint=Checkpoint(state_dict=state_dict),
              target=target or Target())
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), lm_batch(2, 32), run)
    saving = next(p for p in est.phases if p.name == "saving")
    return model, est, saving


def _padded(params, world: int = 2, itemsize: int = 4) -> int:
    return sum(itemsize * world * -(-p.numel() // world) for p in {id(p): p for p in params}.values())


def test_the_consolidation_gathers_each_modules_own_parameters_padded_and_keeps_them_on_rank_zero_alone():
    # Two modules, the second sharing the first's parameter (tied weights): gathered again, not kept twice.
    params, walk = [(1, 10), (2, 3)], [[1], [2, 1]]
    kept = zero3_consolidation(params, walk, world_size=4, itemsize=2, keep=True)
    passing = zero3_consolidation(params, walk, world_size=4, itemsize=2, keep=False)
    assert [n for _, n in kept] == [24, 8, 24, -24]  # ceil(10 / 4) * 4 * 2 B; ceil(3 / 4) * 4 * 2 B
    assert sum(n for _, n in kept) == 24 + 8  # every parameter once
    assert sum(n for _, n in passing) == 0 and max(n for _, n in passing) == 24
    # gloo stages each all-gather's output: one more block of the gathered size while the collective runs
    staged = zero3_consolidation(params, walk, world_size=4, itemsize=2, keep=False, staged=True)
    live = peak = 0
    for _, n in staged:
        live += n
        peak = max(peak, live)
    assert live == 0 and peak == 2 * (24 + 8)  # the second module: both parameters and their stages
    assert len({key for key, n in staged if n > 0}) == sum(n > 0 for _, n in staged)  # one key per allocation


def test_zero3_saves_start_from_the_state_the_step_leaves_and_the_16bit_gather_adds_its_modules_per_rank():
    config = _config(3, gather=True)
    model, est, sharded = _save(config, "sharded")
    terms, _ = zero3_terms_for(model, "zero3", read_deepspeed_config(config), None, 2, OFF)
    steps_end = sum(e.nbytes for e in est.events)
    # The partitions alone: the training state less the non-persistent parameters the backward released.
    assert terms.gathered_bytes > 0 and sharded.peak_bytes == steps_end - terms.gathered_bytes
    assert "each rank's partitions" in " ".join(est.coverage.notes)
    _, est, full = _save(config, "full")
    rank0, rank1 = full.per_rank_peak_bytes
    assert full.peak_rank == 0 and full.peak_bytes == rank0 > rank1
    persistent = terms.persistent_bytes
    modules = list(model.modules())
    # Rank 1: the largest module's own parameters and gloo's stage of them, once the persistent ones are released.
    largest = max(_padded(m.parameters(recurse=False)) for m in modules)
    assert rank1 == max(sharded.peak_bytes, sharded.peak_bytes - persistent + 2 * largest)
    # Rank 0 keeps every parameter (padded) to the end, and gathers the persistent ones again after the walk;
    # transients on top are at most the largest parameter gathered again with its stage.
    whole = _padded(model.parameters())
    base = sharded.peak_bytes - persistent + whole + persistent
    assert base <= rank0 <= base + 2 * max(_padded([p]) for p in model.parameters())
    assert "16-bit consolidation" in " ".join(est.coverage.notes)
    # Without the option accelerate raises and the Trainer saves the partitions alone.
    _, est, off = _save(_config(3, gather=False), "full")
    assert off.peak_bytes == sharded.peak_bytes and off.per_rank_peak_bytes is None
    assert f"{GATHER} is off" in " ".join(est.coverage.notes)


def test_on_a_cuda_target_rank_zero_copies_each_module_to_the_host_and_no_stage_is_made():
    config, target = _config(3, gather=True), Target(gpu="H100-80GB")
    model, _, sharded = _save(config, "sharded", target)
    _, _, full = _save(config, "full", target)
    terms, _ = zero3_terms_for(model, "zero3", read_deepspeed_config(config), None, 2, OFF)
    assert full.per_rank_peak_bytes is None  # every rank the same: nothing kept on the device
    largest = max(_padded(m.parameters(recurse=False)) for m in model.modules())
    expected = max(sharded.peak_bytes, sharded.peak_bytes - terms.persistent_bytes + largest)
    assert abs(full.peak_bytes - expected) <= 512 * 4  # the allocator's 512-byte rounding, per block


def test_zero12_full_saves_clone_the_state_dict_on_every_rank_where_the_host_is_the_device():
    for stage in (1, 2):
        model, est, sharded = _save(_config(stage), "sharded")
        _, _, full = _save(_config(stage), "full")
        entries = sum(t.numel() * t.element_size() for t in model.state_dict().values())  # tied weights per key
        assert full.peak_bytes - sharded.peak_bytes == entries and full.per_rank_peak_bytes is None
    target = Target(gpu="H100-80GB")  # clone_tensors_for_torch_save copies to the host
    assert _save(_config(2), "full", target)[2].peak_bytes == _save(_config(2), "sharded", target)[2].peak_bytes


@pytest.mark.slow
def test_real_deepspeed_saves_match_each_ranks_measured_peak():
    pytest.importorskip("deepspeed")
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import deepspeed_save

    for stage, gather in ((3, True), (2, None)):
        config = deepspeed_save.ds_config(stage, gather)
        measured = deepspeed_save.measure(config, "full")
        predicted, train, note = deepspeed_save.predict(config, "full")
        for rank in (0, 1):
            save, run = measured[rank]
            assert abs(predicted[rank] - save) <= 0.03 * save, (stage, rank, predicted, measured, note)
            assert abs(max(train, predicted[rank]) - run) <= 0.03 * run, (stage, rank, train, measured)


def test_the_cli_plans_a_deepspeed_save_per_rank(tmp_path):
    import json

    from preflight._cli import main

    llama = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    (tmp_path / "ds.json").write_text(json.dumps(_config(3, gather=True)))
    base = ["estimate", "--hf-config", str(tmp_path / "config.json"), "--batch", "2", "--seq", "32",
            "--world-size", "2", "--deepspeed-config", str(tmp_path / "ds.json")]
    saved = {}
    for kind in ("full", "sharded"):
        assert main([*base, "--checkpoint", kind, "--json", str(tmp_path / f"{kind}.json")]) == 0
        result = json.loads((tmp_path / f"{kind}.json").read_text())
        saved[kind] = next(p for p in result["phases"] if p["name"] == "saving")
        assert any("checkpoint save under DeepSpeed" in n for n in result["coverage"]["notes"])
    rank0, rank1 = saved["full"]["per_rank_peak_bytes"]
    assert rank0 > rank1 >= saved["sharded"]["peak_bytes"] and saved["sharded"]["per_rank_peak_bytes"] is None
