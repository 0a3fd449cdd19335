"""The combination search of `advise`: a set of changes that fits where no single one does, its figure checked
against a measurement of that set-up made by hand, its ranking, and the command the CLI prints for it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import preflight
from preflight import Loop, Run, Target
from preflight._cli import main
from preflight.advice import Suggestion, advise
from preflight.advice._options import ranking

from conftest import lm_batch, make_gpt2


def _setup():
    model = make_gpt2(n_layer=2, n_embd=128)
    return model, torch.optim.AdamW(model.parameters()), lm_batch(4, 64)


def _measure_change(change: dict, precision: str | None = None) -> int:
    """The measured peak of the set-up ``change`` describes, built by hand from a fresh model."""
    model, optimizer, batch = _setup()
    loop = Loop()
    if "micro_batch_size" in change:
        batch = lm_batch(change["micro_batch_size"], 64)
        loop = Loop(accumulate=2)  # the peak of an accumulation micro-step, as predicted
    if change.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if change.get("optimizer") == "bitsandbytes.optim.AdamW8bit":
        import bitsandbytes as bnb

        optimizer = bnb.optim.AdamW8bit(model.parameters())
    if "optimizer_impl" in change:
        loop = dataclasses.replace(loop, optimizer_impl=change["optimizer_impl"])
    unknown = set(change) - {"micro_batch_size", "accumulate_grad_batches", "gradient_checkpointing", "optimizer",
                             "optimizer_impl", "precision"}
    assert not unknown, f"the test cannot build {unknown}"
    run = Run(precision=change.get("precision", precision), loop=loop)
    return preflight.measure(model, optimizer, batch, run=run).peak_bytes


@pytest.mark.slow
def test_a_combination_fits_where_no_single_change_does_and_matches_its_measured_peak():
    model, optimizer, batch = _setup()
    baseline = preflight.estimate(model, optimizer, batch, Run()).peak_bytes
    budget = baseline // 2  # the test's choice: no single change halves this model's peak
    found = advise(model, optimizer, batch, Run(target=Target(budget=budget)))
    singles = [s for s in found if len(s.changes) == 1]
    assert singles and not any(s.fits for s in singles)
    best = found[0]
    assert best.fits and len(best.changes) >= 2 and best.predicted_peak_bytes <= budget
    assert "together:" in best.description and "set-ups traced" in best.description
    measured = _measure_change(best.change)
    assert abs(best.predicted_peak_bytes - measured) <= 0.01 * measured, (best.change, best.predicted_peak_bytes,
                                                                           measured)
    # The run it carries says the accumulation the global batch needs.
    if "micro_batch_size" in best.change:
        assert best.run.loop.accumulate == best.change["accumulate_grad_batches"]
        assert best.change["micro_batch_size"] * best.change["accumulate_grad_batches"] >= 4


@pytest.mark.slow
def test_no_combination_is_searched_when_the_cheapest_change_fits_alone(monkeypatch):
    from conftest import only_options

    only_options(monkeypatch, "micro-batch", "bf16 precision", combination=True)  # the search is what is asserted
    model, optimizer, batch = _setup()
    baseline = preflight.estimate(model, optimizer, batch, Run()).peak_bytes
    found = advise(model, optimizer, batch, Run(target=Target(budget=baseline - 1)))
    assert found[0].fits and found[0].changes == ("micro_batch",)
    assert all(len(s.changes) == 1 for s in found)


def _suggestion(changes: tuple[str, ...], fits: bool, peak: int) -> Suggestion:
    return Suggestion({}, "", peak, fits, "", Run(), changes=changes)


def test_ranking_fits_first_then_the_costliest_change_then_fewer_changes():
    cheap_pair = _suggestion(("fused", "checkpointing"), True, 90)
    costly_single = _suggestion(("bf16-true",), True, 50)
    cheap_single = _suggestion(("checkpointing",), True, 95)
    over = _suggestion(("fused",), False, 10)
    ranked = sorted([over, costly_single, cheap_pair, cheap_single], key=ranking)
    assert ranked == [cheap_single, cheap_pair, costly_single, over]


LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 256}


@pytest.mark.slow
def test_cli_prints_a_command_for_the_first_fitting_set_up_and_it_exits_0(tmp_path, capsys, monkeypatch):
    from conftest import only_options

    # The combination is searched over every applicable move; of the singles, two are traced (the test above
    # traces them all).
    only_options(monkeypatch, "micro-batch", "bf16 precision", combination=True)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    flags = ["--hf-config", str(config), "--batch", "4", "--seq", "128", "--precision", "bf16-mixed"]
    assert main(["estimate", *flags, "--json", str(tmp_path / "base.json")]) == 0
    needed = json.loads((tmp_path / "base.json").read_text())["required_bytes"]
    budget = int(needed * 0.5)  # the test's choice: under what any single change reaches here
    assert main(["estimate", *flags, "--budget", f"{budget}B", "--json", str(tmp_path / "over.json")]) == 3
    out = capsys.readouterr().out
    suggestions = json.loads((tmp_path / "over.json").read_text())["suggestions"]
    first = next(s for s in suggestions if s["fits"])
    assert first is suggestions[0] and first["command"][:2] == ["preflight", "estimate"]
    assert "rerun: " + " ".join(first["command"]) in out
    assert main(first["command"][1:]) == 0
    assert "FITS" in capsys.readouterr().out


@pytest.mark.parametrize("change, flags", [
    ({"gradient_checkpointing": True, "optimizer": "bitsandbytes.optim.AdamW8bit", "precision": "bf16-true"},
     ["--precision", "bf16-true", "--optimizer", "adamw8bit", "--checkpointing"]),
    ({"micro_batch_size": 2, "accumulate_grad_batches": 4, "optimizer_impl": "fused"},
     ["--batch", "2", "--optimizer-impl", "fused", "--accumulate", "4"]),
    ({"peft": "lora", "r": 16, "target_modules": "all-linear", "base_dtype": "bfloat16"},
     ["--param-dtype", "bfloat16", "--lora-r", "16"]),
    ({"offload_optimizer": True, "zero_stage": 2, "world_size": 1}, ["--sharding", "zero2", "--offload-optimizer"]),
    ({"peft": "lora", "r": 16, "target_modules": "all-linear", "quantize": "nf4", "double_quant": True},
     ["--quantize", "nf4", "--double-quant", "--lora-r", "16"]),
    ({"micro_batch_size": 1, "microbatches": 8}, ["--batch", "1", "--microbatches", "8"]),
    ({"offload_activations": "streams", "gradient_checkpointing": True},
     ["--checkpointing", "--offload-activations", "streams"]),
    ({"fsdp_param_dtype": "bfloat16"}, ["--fsdp-param-dtype", "bfloat16"]),
    ({"optimizer": "some.Other"}, None),
])
def test_a_change_as_cli_flags(change, flags):
    from preflight._cli import _parser, _rerun_command

    args = _parser().parse_args(["estimate", "--hf-config", "c.json", "--batch", "8", "--gpu", "RTX-4090"])
    command = _rerun_command(args, change)
    if flags is None:
        assert command is None
        return
    assert command[:2] == ["preflight", "estimate"]
    rest = command[2:]
    for flag in flags:
        assert flag in rest
    assert rest[rest.index("--hf-config") + 1] == "c.json" and rest[rest.index("--gpu") + 1] == "RTX-4090"
    assert rest.count("--batch") == 1


BIG_LLAMA = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 4,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 512}


@pytest.mark.slow
def test_when_one_gpu_cannot_train_it_as_it_is_the_fewest_gpus_under_zero3_are_offered(tmp_path, capsys, monkeypatch):
    from conftest import only_options

    only_options(monkeypatch, "activation checkpointing", "bf16 precision")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(BIG_LLAMA))  # ~1B parameters, built on meta
    # The test's budget: under what any single-GPU change that keeps full fine-tuning reaches, over ZeRO-3's own
    # buffers at DeepSpeed's defaults; no context or NCCL terms, so that the figures are the traced ones.
    flags = ["--hf-config", str(config), "--batch", "2", "--seq", "256", "--gpu", "H100-80GB", "--budget", "5GiB",
             "--cuda-context", "0", "--nccl-buffers", "0"]
    assert main(["estimate", *flags, "--json", str(tmp_path / "over.json")]) == 3
    suggestions = json.loads((tmp_path / "over.json").read_text())["suggestions"]
    assert not any(s["fits"] and "more_gpus" not in s["changes"] for s in suggestions)
    more = next(s for s in suggestions if "more_gpus" in s["changes"])
    assert more["fits"] and more["change"]["sharding"] == "zero3" and more["changes"][-1] == "more_gpus"
    n = more["change"]["world_size"]
    assert n >= 2 and n & (n - 1) == 0
    assert f"{n} is the fewest GPUs" in more["description"]
    capsys.readouterr()
    assert main(more["command"][1:]) == 0  # the plan it prints fits ...
    assert "FITS" in capsys.readouterr().out
    fewer = list(more["command"][1:])
    fewer[fewer.index("--world-size") + 1] = str(n // 2)
    assert main(fewer) == 3  # ... and half as many GPUs with the same changes do not


def test_more_gpus_are_offered_only_for_one_cuda_gpu_that_no_same_training_change_fits():
    from types import SimpleNamespace

    from preflight.advice._options import _more_gpus

    over = SimpleNamespace(world_size=1, run_required_bytes=200, device="cuda:0")
    setup = SimpleNamespace(plan=None, baseline=over, limit=100)
    same_training = _suggestion(("bf16-true",), True, 90)
    assert _more_gpus(setup, [same_training]) == []  # it fits on the one GPU, training unchanged

    def changed(**fields):
        return SimpleNamespace(**{**vars(setup), **fields})

    assert _more_gpus(changed(plan=object()), []) == []  # a multi-GPU plan gets the stronger shardings instead
    assert _more_gpus(changed(baseline=SimpleNamespace(**{**vars(over), "device": "cpu"})), []) == []
    assert _more_gpus(changed(limit=300), []) == []  # it fits as it is
