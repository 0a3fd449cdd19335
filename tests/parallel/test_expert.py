"""Expert parallelism (transformers' DistributedConfig(ep_size=...)): each place on the ep dim traced through
transformers' own layout and token exchange under a fake process group, checked against real gloo runs."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from conftest import assert_suggested_on_the_layout, call_end_peak, evaluation_peak, gloo_rank, spawned

import preflight
from preflight.parallel import EPPlan, FSDP2Plan, TPPlan, ep_rank_groups

EXPERTS, TOP_K = 4, 2


def _moe(seed: int = 0, family: str = "qwen3_moe"):
    """A tiny mixture-of-experts causal LM of ``family`` (Qwen3-MoE, or Mixtral for a second family's own plans)
    and a batch of 4 x 32 tokens."""
    import transformers

    torch.manual_seed(seed)
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, num_experts_per_tok=TOP_K, head_dim=16, max_position_embeddings=64)
    if family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=EXPERTS, **shape))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            moe_intermediate_size=64, num_experts=EXPERTS, **shape))
    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def _run(world: int, degree: int, routing: str = "balanced", tp: int = 1, replicate: int = 1):
    return preflight.Run(routing=routing, parallel=preflight.ParallelPlan(
        world, "fsdp2", ep=EPPlan(degree), tp=TPPlan(tp) if tp > 1 else None,
        fsdp=FSDP2Plan(replicate=replicate) if replicate > 1 else None))


def test_plan_options_are_checked():
    with pytest.raises(ValueError, match="at least 2"):
        EPPlan(1)
    with pytest.raises(ValueError, match="ep_implementation"):
        EPPlan(2, "all_reduce")  # transformers' all-reduce exchange runs at inference only
    with pytest.raises(ValueError, match="should divide the world size 3"):
        preflight.ParallelPlan(3, "fsdp2", ep=EPPlan(2))
    with pytest.raises(ValueError, match="pass sharding='fsdp2'"):
        preflight.ParallelPlan(2, None, ep=EPPlan(2))
    with pytest.raises(TypeError, match="EPPlan or None"):
        preflight.ParallelPlan(2, "fsdp2", ep=2)
    assert ep_rank_groups(EPPlan(2), 4) == [[0, 2], [1, 3]]
    assert EPPlan(2).config(4).efsdp_size == 2  # the experts' FSDP over the copies of each expert group
    # Beside transformers' tensor parallelism: its own plan, over a degree dividing ep's.
    config = EPPlan(4).config(4, tp=2)
    assert (config.tp_size, config.fsdp_size, config.efsdp_size) == (2, 2, 1)
    with pytest.raises(ValueError, match="divides `ep.degree` \\(2\\)"):
        preflight.ParallelPlan(4, "fsdp2", ep=EPPlan(2), tp=TPPlan(4))
    from torch.distributed.tensor.parallel import ColwiseParallel

    with pytest.raises(ValueError, match="base_model_tp_plan"):
        preflight.ParallelPlan(4, "fsdp2", ep=EPPlan(2), tp=TPPlan(2, {"lm_head": ColwiseParallel()}))
    with pytest.raises(ValueError, match="not yet with pipeline"):
        preflight.ParallelPlan(4, "fsdp2", ep=EPPlan(2), cp=preflight.parallel.CPPlan(2))
    # Replicas (HSDP): transformers' dp_replicate_size, the ep dim inside one replica; nothing else of FSDP2's own.
    config = EPPlan(2).config(8, tp=2, replicate=2)
    assert (config.dp_replicate_size, config.fsdp_size, config.tp_size) == (2, 2, 2)
    with pytest.raises(ValueError, match="should divide the ranks of one replica"):
        preflight.ParallelPlan(4, "fsdp2", ep=EPPlan(4), fsdp=FSDP2Plan(replicate=2))
    with pytest.raises(ValueError, match="FSDP2 settings of its own"):
        preflight.ParallelPlan(4, "fsdp2", ep=EPPlan(2), fsdp=FSDP2Plan(reshard_after_forward=False))


def test_each_place_holds_its_experts_and_the_routing_decides_what_it_receives():
    model, batch = _moe()
    optimizer = torch.optim.AdamW(model.parameters())
    config = dict(vars(model.config))
    whole = preflight.estimate(model, optimizer, batch)
    balanced = preflight.estimate(model, optimizer, batch, _run(2, 2))
    assert balanced.sharding == "ep2 x fsdp2" and not balanced.coverage.lower_bound
    # Balanced routing: both places receive the same token slots and hold as many experts.
    assert balanced.per_rank_peak_bytes[0] == balanced.per_rank_peak_bytes[1]
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." not in n)
    # The experts spread over ep 2; the dense weights sharded by FSDP2 over 2 ranks, but from_pretrained keeps each
    # shard as a view into the whole loaded weight (measured), so each rank holds them whole.
    assert balanced.breakdown["parameters"] == experts // 2 + dense < whole.breakdown["parameters"]
    # Skewed routing (every token to experts 0 and 1, both on rank 0): rank 0 receives every rank's tokens.
    skewed = preflight.estimate(model, optimizer, batch, _run(2, 2, "skewed"))
    assert skewed.per_rank_peak_bytes[0] > balanced.per_rank_peak_bytes[0] > skewed.per_rank_peak_bytes[1]
    assert dict(vars(model.config)) == config  # transformers' layout recorded its config on the copy's, not this


def test_a_laid_out_model_is_read_from_its_config_and_what_a_plan_cannot_say_is_refused():
    from types import SimpleNamespace

    from preflight.parallel import read_ep

    experts = torch.nn.Linear(2, 2)
    experts._is_expert_parallel = True
    model = torch.nn.Sequential(experts)
    model.config = SimpleNamespace(distributed_config=EPPlan(4).config(8, tp=2, replicate=2))
    layout = read_ep(model)
    assert (layout.plan, layout.world_size, layout.tp, layout.replicate) == (EPPlan(4), 8, 2, 2)
    assert layout.describe() == ("expert parallel degree 4, transformers' auto exchange over 8 rank(s), tensor "
                                 "parallel degree 2, 2 replicas")
    model.config.distributed_config.tp_plan = {"lm_head": "colwise_gather_output"}
    with pytest.raises(ValueError, match="tp_plan=.*lm_head.*does not follow yet"):
        read_ep(model)
    model.config.distributed_config = EPPlan(2).config(2)
    model.config.distributed_config.fsdp_mixed_precision = True
    with pytest.raises(ValueError, match="fsdp_mixed_precision=True"):
        read_ep(model)


def test_a_model_without_transformers_expert_parallelism_is_refused_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="transformers' own engine"):
        preflight.estimate(model, torch.optim.AdamW(model.parameters()), torch.randn(2, 4), _run(2, 2),
                           step=lambda m, b: m(b).sum())


# ---- real runs with gloo: each rank measured against its prediction -------------------------------------------------

def _balanced_routers(model: torch.nn.Module) -> None:
    """Route every token as the trace's balanced assumption does (token t to experts (t * k + j) mod E): the real run
    then exchanges the tokens the prediction assumed, so the comparison checks the engine's memory, not a router."""
    from preflight.trace._routing import routing_indices

    def balanced(module, inputs, output):
        logits, scores, indices = output
        return logits, scores, routing_indices("balanced", tuple(logits.shape), -1, indices.shape[-1])

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(balanced)


def _gloo_worker(rank: int, world: int, port: int, queue, path: str, degree: int, tp: int = 1,
                 replicate: int = 1, family: str = "qwen3_moe") -> None:

    from preflight._device import live_storage_bytes
    from preflight._steps import run_steps

    with gloo_rank(rank, world, port):
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        config = EPPlan(degree).config(world, tp, replicate)
        whole, batch = _moe(family=family)
        model = type(whole).from_pretrained(path, distributed_config=config)
        _balanced_routers(model)
        optimizer = torch.optim.AdamW(model.parameters())
        inside = preflight.estimate(model, optimizer, batch).per_rank_peak_bytes  # read off the laid-out model
        from preflight.verdict import Options, predict

        eval_batch = {"input_ids": torch.randint(0, 512, (8, 32), generator=torch.Generator().manual_seed(3))}
        report = predict(model, optimizer, batch, preflight.Run(), options=Options(), eval_batch=eval_batch)
        assert report.predicted_peak_bytes == max(inside), (report.predicted_peak_bytes, report.coverage)
        evaluation = next(p for p in report.phases if p["name"] == "evaluation")
        assert report.eval_predicted_peak_bytes == max(evaluation["per_rank_peak_bytes"])
        if rank == 0 and world == 2:  # over a budget: each option traced on the model as it is laid out
            assert_suggested_on_the_layout(model, optimizer, batch, inside, micro_batch=True)
        local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
        before = live_storage_bytes([local, list(model.buffers()), batch], torch.device("cpu"))
        dist.barrier()
        measured = before + call_end_peak(lambda on_phase: run_steps(
            model, optimizer, batch, step=None, precision=None, device_type="cpu", steps=2, on_phase=on_phase))
        queue.put((rank, (measured, inside, evaluation_peak(model, optimizer, eval_batch),
                          evaluation["per_rank_peak_bytes"])))


@pytest.mark.slow
@pytest.mark.parametrize(("world", "degree", "tp", "replicate", "family"),
                         [(2, 2, 1, 1, "qwen3_moe"), (4, 2, 1, 1, "qwen3_moe"), (2, 2, 2, 1, "qwen3_moe"),
                          (4, 2, 2, 1, "qwen3_moe"), (4, 2, 1, 2, "qwen3_moe"), (4, 2, 2, 1, "mixtral")])
def test_real_gloo_expert_parallel_per_rank_peak_within_3_percent(tmp_path, world, degree, tp, replicate, family):
    """Expert parallelism with transformers' FSDP2, with its tensor parallelism of the dense layers beside it (tp 2
    with ep 2 over 2 ranks: no FSDP2 at all; over 4: each expert group FSDP-sharded over 2 ranks; ep 4 beside tp 2, each expert on one rank, is in
    benchmarks/expert_parallel.py), and in 2 replicas (HSDP: dp_replicate_size=2); a second family (Mixtral)
    under TP x EP with its own plans."""
    model, batch = _moe(family=family)
    model.save_pretrained(tmp_path / "moe")
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                             _run(world, degree, tp=tp, replicate=replicate))
    assert est.per_rank_peak_bytes is not None and not est.coverage.lower_bound, est.coverage.notes
    assert est.sharding == f"ep{degree}" + (f" x tp{tp}" if tp > 1 else "") + " x fsdp2" + (
        f" x replicate{replicate}" if replicate > 1 else "")
    results = spawned(_gloo_worker, world, str(tmp_path / "moe"), degree, tp, replicate, family)
    for rank in range(world):
        measured, inside, _, _ = results[rank]
        assert inside == est.per_rank_peak_bytes  # inside the job, off the laid-out model: the figure planned
        error = (est.per_rank_peak_bytes[rank] - measured) / measured
        assert abs(error) <= 0.03, (rank, est.per_rank_peak_bytes, results)
    # The callbacks' evaluation of the laid-out model (a batch twice training's), traced on each rank after the
    # steps, against the evaluation each rank measured after its real steps.
    for rank in range(world):
        _, _, measured, predicted = results[rank]
        assert abs(predicted[rank] - measured) / measured <= 0.03, (rank, predicted, measured)


def test_token_counts_exchanged_in_a_fake_group_are_answered_as_if_every_rank_routed_alike():
    """The shadow rules behind the exchange: ``empty_like`` has no values (zeros stand for them, never the
    allocator's leftovers), and an all-to-all of shadowed counts in a fake group gives this rank, from every rank,
    the block it sends itself."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from preflight.parallel import fake_world
    from preflight.trace._tracker import StorageTracker

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracker = StorageTracker(fake_mode)
    counts = torch.tensor([[1, 2, 3], [4, 5, 6]])  # what this rank sends each rank
    with fake_world(2, 1):
        with fake_mode, tracker:
            sent = torch.empty(2, 3, dtype=torch.long)
            tracker.shadow(sent, counts)
            received = torch.empty_like(sent)
            before = tracker.shadow_of(received)
            dist.all_to_all_single(received, sent)
            after = tracker.shadow_of(received)
            sums = received.sum(dim=1).tolist()  # a data-dependent read, answered from the shadow
    tracker.detach()
    assert before.tolist() == [[0, 0, 0], [0, 0, 0]]
    assert after.tolist() == [[4, 5, 6], [4, 5, 6]]  # from each of the 2 ranks, what rank 1 sends to rank 1
    assert sums == [15, 15]


def _moe_config(folder):
    """The tests' Qwen3-MoE as a config file the CLI reads."""
    import json

    config = folder / "moe.json"
    config.write_text(json.dumps({"model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64,
                                  "intermediate_size": 128, "moe_intermediate_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": EXPERTS,
                                  "num_experts_per_tok": TOP_K, "head_dim": 16, "max_position_embeddings": 64}))
    return config


def test_the_cli_plans_expert_parallelism(tmp_path, capsys):
    import json

    from preflight._cli import main

    config, out = _moe_config(tmp_path), tmp_path / "ep.json"
    assert main(["estimate", "--hf-config", str(config), "--batch", "4", "--seq", "32", "--ep", "2", "--world-size",
                 "4", "--no-suggest", "--json", str(out)]) == 0
    assert "expert parallel degree 2" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert len(report["per_rank_peak_bytes"]) == 4 and not report["coverage"]["lower_bound"]
    assert main(["estimate", "--hf-config", str(config), "--batch", "4", "--seq", "32", "--ep", "2", "--cp",
                 "2"]) == 2
    assert "not with --cp" in capsys.readouterr().err
    assert main(["estimate", "--hf-config", str(config), "--batch", "4", "--seq", "32", "--ep", "2", "--tp",
                 "4"]) == 2
    assert "divides --ep's" in capsys.readouterr().err


@pytest.mark.slow  # three plans traced per rank from the command line: about 50 s on 2 cores
def test_the_cli_plans_expert_parallelism_beside_tensor_parallelism_and_in_replicas(tmp_path, capsys):
    import json

    from preflight._cli import main

    config, out = _moe_config(tmp_path), tmp_path / "ep.json"
    assert main(["estimate", "--hf-config", str(config), "--batch", "4", "--seq", "32", "--ep", "2", "--world-size",
                 "4", "--no-suggest", "--json", str(out)]) == 0
    capsys.readouterr()
    report = json.loads(out.read_text())
    # Beside transformers' tensor parallelism of the dense layers: the world is ep's ranks (tp's are among them).
    assert main(["estimate", "--hf-config", str(config), "--batch", "4", "--seq", "32", "--ep", "4", "--tp", "2",
                 "--no-suggest", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "4 rank(s), tensor parallel degree 2, expert parallel degree 4" in printed, printed
    assert "dense fsdp 2 x tp 2, the model's own tp plan, experts efsdp 1 x ep 4" in printed, printed
    with_tp = json.loads(out.read_text())
    assert len(with_tp["per_rank_peak_bytes"]) == 4 and not with_tp["coverage"]["lower_bound"]
    # The dense layers' activations are cut among the tensor-parallel ranks: each rank holds less.
    assert max(with_tp["per_rank_peak_bytes"]) < max(report["per_rank_peak_bytes"])
    # In replicas (HSDP): the world defaults to ep's ranks times the replicas.
    assert main(["estimate", "--hf-config", str(config), "--batch", "4", "--seq", "32", "--ep", "2", "--replicate",
                 "2", "--sharding", "fsdp2", "--no-suggest", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "4 rank(s), expert parallel degree 2" in printed and "of each of 2 replicas" in printed, printed
    assert "dense replicate 2 x fsdp 2, experts replicate 2 x efsdp 1 x ep 2" in printed, printed
    assert json.loads(out.read_text())["sharding"] == "ep2 x fsdp2 x replicate2"
