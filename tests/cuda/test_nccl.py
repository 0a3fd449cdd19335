"""NCCL's buffers as a term of a rank's device total (`preflight.cuda._nccl`): NCCL's own defaults and environment,
or the figure the user measured; one set per communicator."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import preflight
from preflight import ParallelPlan, Run, Target
from preflight.cuda._nccl import ASSUMED_CHANNELS, nccl_buffers

sys.path.insert(0, str(Path(__file__).parent.parent))
from conftest import lm_batch, make_llama  # noqa: E402

# NCCL's src/init.cc: DEFAULT_BUFFSIZE, DEFAULT_LL_BUFFSIZE, DEFAULT_LL128_BUFFSIZE
SIMPLE, LL, LL128 = 4 * 2**20, 8 * 512 * 8 * 16, 120 * 640 * 8 * 8


def test_the_model_follows_nccls_defaults_and_environment():
    nbytes, note = nccl_buffers(1, env={})
    assert nbytes == ASSUMED_CHANNELS * 2 * (SIMPLE + LL + LL128) and "assumed" in note
    nbytes, note = nccl_buffers(3, env={"NCCL_MAX_NCHANNELS": "8", "NCCL_PROTO": "Simple",
                                        "NCCL_BUFFSIZE": str(2**21)})
    assert nbytes == 3 * 8 * 2 * 2**21 and "NCCL_MAX_NCHANNELS" in note and "3 communicator(s)" in note
    assert nccl_buffers(0, env={}) is None
    assert nccl_buffers(2, "100MiB")[0] == 2 * 100 * 2**20
    # One communicator per mesh dim beside the default group: 1-D, 2-D (TP x FSDP2), 3-D (HSDP x TP)
    from preflight.cuda._nccl import rank_nccl_buffers

    counts = {sharding: rank_nccl_buffers(8, sharding, "1MiB")[0] // 2**20
              for sharding in ("fsdp2", "tp2 x fsdp2", "tp2 x fsdp2 x replicate2")}
    assert counts == {"fsdp2": 1, "tp2 x fsdp2": 3, "tp2 x fsdp2 x replicate2": 4}
    assert rank_nccl_buffers(1, "fsdp2") is None


@pytest.mark.slow
def test_a_ranks_device_total_adds_nccls_buffers_per_communicator():
    model, batch = make_llama(), lm_batch(2, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    one = preflight.estimate(model, optimizer, batch, Run(target=Target(gpu="H100-80GB")))
    assert not any("NCCL" in n for n in one.coverage.notes)  # one device: no communicator
    plan = ParallelPlan(2, "fsdp2")
    modelled = preflight.estimate(model, optimizer, batch, Run(target=Target(gpu="H100-80GB"), parallel=plan))
    given = preflight.estimate(model, optimizer, batch, Run(target=Target(gpu="H100-80GB", nccl_buffers="100MiB"),
                                                           parallel=plan))
    assert modelled.device_total_bytes - given.device_total_bytes == nccl_buffers(1)[0] - 100 * 2**20
    context = preflight.get_gpu("H100-80GB").context_bytes
    assert given.device_total_bytes - given.peak_reserved_bytes == context + 100 * 2**20
    assert any("as given" in n for n in given.coverage.notes)


def test_nccl_buffers_are_checked_and_need_a_gpu(tmp_path):
    with pytest.raises(ValueError):
        Target(nccl_buffers="600")  # no unit
    from preflight._cli import main

    config = tmp_path / "c.json"
    config.write_text('{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, '
                      '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}')
    assert main(["estimate", "--hf-config", str(config), "--batch", "2", "--seq", "16", "--nccl-buffers",
                 "600MiB"]) == 2
    assert Run(target=Target(nccl_buffers="600MiB")).cli_flags() == ["--nccl-buffers", "600MiB"]


def test_evaluation_under_a_plan_keeps_the_communicators_buffers():
    # estimate_eval with the run's plan: the job's communicators outlive training, so its device total counts them
    # as estimate does; the allocated figures do not move.
    model, batch = make_llama(), lm_batch(2, 32)
    target = Target(gpu="H100-80GB", nccl_buffers="100MiB")
    one = preflight.estimate_eval(model, batch, Run(target=target))
    ranks = preflight.estimate_eval(model, batch, Run(target=target, parallel=ParallelPlan(2, "ddp")))
    assert ranks.peak_bytes == one.peak_bytes
    assert ranks.device_total_bytes - one.device_total_bytes == 100 * 2**20
    assert any("NCCL" in n for n in ranks.coverage.notes) and not any("NCCL" in n for n in one.coverage.notes)


@pytest.mark.slow
def test_a_trainers_ddp_replicas_count_their_communicators_buffers_in_every_phase():
    # A strategy's DDP (Lightning, the HF Trainer, accelerate) is traced as one device with the buckets added: its
    # process group's NCCL buffers are in the device total of training, evaluation and the save, as for a DDP plan;
    # the allocated figures do not move.
    from preflight import Checkpoint
    from preflight.verdict import Options, predict

    model, batch = make_llama(), lm_batch(2, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    target = Target(gpu="H100-80GB", nccl_buffers="100MiB")
    reports = [predict(model, optimizer, batch, Run(target=target, checkpoint=Checkpoint(), parallel=plan),
                       options=Options(suggest=False), eval_batch=batch, ddp_gradient_buckets=True)
               for plan in (None, ParallelPlan(2, "ddp"))]
    one, two = ({p["name"]: p for p in r.phases} for r in reports)
    assert set(one) == set(two) == {"training", "evaluation", "saving"}
    for name in one:
        assert two[name]["peak_bytes"] == one[name]["peak_bytes"], name
        assert two[name]["required_bytes"] - one[name]["required_bytes"] == 100 * 2**20, name
    assert reports[1].predicted_device_total_bytes - reports[0].predicted_device_total_bytes == 100 * 2**20
    assert any("NCCL" in n and "DDP replicas" in n for n in reports[1].coverage["notes"])
