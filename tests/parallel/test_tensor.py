"""Tensor parallelism (DTensor's parallelize_module), alone and with FSDP2 on a 2-D mesh: each rank traced under a
fake process group, checked against real gloo runs."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.distributed as dist
from conftest import assert_suggested_on_the_layout, call_end_peak, evaluation_peak, gloo_rank, spawned

import preflight
from preflight.parallel import TPPlan, model_styles, tp_rank_groups

VOCAB, HIDDEN, FFN, LAYERS = 512, 64, 176, 2


def _llama(vocab: int = VOCAB, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def _styles():
    """torchtitan's plan for a Llama decoder: attention and MLP column-wise in, row-wise out."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"model.layers.*.self_attn.q_proj": ColwiseParallel(), "model.layers.*.self_attn.k_proj": ColwiseParallel(),
            "model.layers.*.self_attn.v_proj": ColwiseParallel(), "model.layers.*.self_attn.o_proj": RowwiseParallel(),
            "model.layers.*.mlp.gate_proj": ColwiseParallel(), "model.layers.*.mlp.up_proj": ColwiseParallel(),
            "model.layers.*.mlp.down_proj": RowwiseParallel()}


def _run(world: int, degree: int, styles=None, sharding=None):
    return preflight.Run(parallel=preflight.ParallelPlan(world, sharding, tp=TPPlan(degree, styles)))


@pytest.mark.slow
def test_on_a_cuda_target_a_foreach_step_over_dtensor_and_plain_parameters_would_fail():
    """torch picks foreach on CUDA; with the norms left plain by the plan, one group mixes DTensors and plain
    tensors and DTensor refuses the foreach operator in the real job (on gloo, `_real_foreach_step`). Said before
    step one with the fix; stepped one at a time, or in two groups as transformers' Trainer makes them, it traces."""
    from preflight.parallel import laid_out_parameters

    model, batch = _llama()
    laid = laid_out_parameters(model, TPPlan(2, _styles()))
    assert "model.layers.0.self_attn.q_proj.weight" in laid and "model.layers.1.mlp.down_proj.weight" in laid
    assert not any("norm" in n or "embed" in n for n in laid)
    gpu = preflight.Target(gpu="H100-80GB")
    run = _run(2, 2, _styles()).replace(target=gpu)
    with pytest.raises(preflight.StepWouldFailError, match="foreach=False on the optimizer"):
        preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, run)
    for_loop = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                                  run.replace(loop=preflight.Loop(optimizer_impl="for-loop")))
    named = dict(model.named_parameters())
    split = torch.optim.AdamW([{"params": [p for n, p in named.items() if n in laid]},
                               {"params": [p for n, p in named.items() if n not in laid]}])
    grouped = preflight.estimate(model, split, batch, run)
    assert not for_loop.coverage.lower_bound and not grouped.coverage.lower_bound
    assert grouped.num_ops != for_loop.num_ops  # the foreach step, not the for-loop one, was traced
    # The real step, laid out on a one-rank gloo mesh, stepped with foreach as CUDA's default would.
    assert "got mixed torch.Tensor and DTensor" in spawned(_real_foreach_step, 1)[0]


@pytest.mark.slow
def test_a_bitsandbytes_optimizer_over_tensor_parallel_parameters_would_fail_and_says_why():
    """bitsandbytes' 8-bit optimizers keep their state as plain tensors and their kernels have no DTensor rule: under
    tensor parallelism or FSDP2 the real step raises DTensor's refusal (on a one-rank gloo mesh, `_real_bnb_step`),
    and the estimate says so by the optimizer's operator, with a torch optimizer as the fix."""
    bnb = pytest.importorskip("bitsandbytes")

    model, batch = _llama()
    fsdp2 = preflight.Run(parallel=preflight.ParallelPlan(2, "fsdp2"))
    for optimizer in (bnb.optim.AdamW8bit(model.parameters()), bnb.optim.PagedAdamW8bit(model.parameters())):
        for run in (_run(2, 2, _styles()), fsdp2):
            with pytest.raises(preflight.StepWouldFailError, match="no DTensor rule") as err:
                preflight.estimate(model, optimizer, batch, run)
            assert "bitsandbytes" in str(err.value) and "torch.optim.AdamW" in str(err.value)
    for name, said in spawned(_real_bnb_step, 1)[0].items():
        assert "got mixed torch.Tensor and DTensor" in said and "bitsandbytes." in said, (name, said)


def _real_bnb_step(rank, world, port, queue):
    import warnings

    import bitsandbytes as bnb
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    warnings.filterwarnings("ignore")  # paged optimizers fall back to ordinary state on CPU, saying so
    with gloo_rank(rank, world, port):
        said = {}
        for name, layout in [(n, w) for n in ("AdamW8bit", "PagedAdamW8bit") for w in ("tp", "fsdp2")]:
            model, batch = _llama()
            if layout == "tp":
                parallelize_module(model, init_device_mesh("cpu", (world,)), _styles())
            else:
                fully_shard(model)
            optimizer = getattr(bnb.optim, name)(model.parameters())
            model(**batch).loss.backward()
            try:
                optimizer.step()
                said[name, layout] = "stepped"
            except RuntimeError as err:
                said[name, layout] = str(err)
        queue.put((rank, said))


def _real_foreach_step(rank, world, port, queue):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    with gloo_rank(rank, world, port):
        model, batch = _llama()
        parallelize_module(model, init_device_mesh("cpu", (world,)), _styles())
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
        model(**batch).loss.backward()
        try:
            optimizer.step()
            queue.put((rank, "stepped"))
        except RuntimeError as err:
            queue.put((rank, str(err)))


def test_the_cli_groups_the_optimizer_as_the_trainer_does_under_tensor_parallelism(tmp_path):
    import json

    from preflight._cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": FFN,
                                  "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": VOCAB, "max_position_embeddings": 64}))
    out = tmp_path / "tp.json"
    assert main(["estimate", "--hf-config", str(config), "--batch", "2", "--seq", "32", "--tp", "2", "--gpu",
                 "H100-80GB", "--json", str(out)]) == 0
    assert not json.loads(out.read_text())["coverage"]["lower_bound"]


def test_plan_options_are_checked():
    with pytest.raises(ValueError, match="positive int"):
        TPPlan(0)
    with pytest.raises(TypeError, match="ParallelStyle instances"):
        TPPlan(2, {"model.layers.*.mlp.up_proj": "colwise"})
    with pytest.raises(ValueError, match="should divide the world size 6"):
        preflight.ParallelPlan(6, "fsdp2", tp=TPPlan(4))
    with pytest.raises(ValueError, match="pass sharding='fsdp2'"):
        preflight.ParallelPlan(4, None, tp=TPPlan(2))
    with pytest.raises(ValueError, match="should be 'fsdp2'"):
        preflight.ParallelPlan(4, "zero3", tp=TPPlan(2))
    with pytest.raises(TypeError, match="TPPlan or None"):
        preflight.ParallelPlan(2, None, tp=2)
    assert TPPlan(2).mesh(8) == ((4, 2), ("dp", "tp"))
    assert TPPlan(8).mesh(8) == ((8,), ("tp",))
    # HSDP beside it: torchtitan's 3-D mesh, with a shard dim of at least 2
    from preflight.parallel import FSDP2Plan
    from preflight.parallel._tensor import tp_mesh

    assert tp_mesh(TPPlan(2), 16, FSDP2Plan(replicate=2)) == ((2, 4, 2), ("replicate", "shard", "tp"))
    with pytest.raises(ValueError, match="leave a shard dim of at least 2"):
        preflight.ParallelPlan(4, "fsdp2", tp=TPPlan(2), fsdp=FSDP2Plan(replicate=2))


def test_a_transformers_models_own_plan_is_translated_to_dtensor_styles_and_unknown_words_are_refused():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from transformers import GPT2Config, GPT2LMHeadModel, MixtralConfig, MixtralForCausalLM

    model, _ = _llama()
    styles = model_styles(model)
    assert type(styles["model.layers.*.self_attn.q_proj"]) is ColwiseParallel
    assert type(styles["model.layers.*.mlp.down_proj"]) is RowwiseParallel
    assert styles["lm_head"].output_layouts == (Replicate(),)  # colwise_gather_output
    assert styles["model.embed_tokens"].input_layouts == (Replicate(),)  # embedding_rowwise
    with pytest.raises(ValueError, match="no tensor-parallel plan of its own"):
        model_styles(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))
    mixtral = MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, num_local_experts=2))
    # The experts' entries (two naming its fused weights, one the module) become one style that runs transformers'
    # own: each weight cut by its word, the module's forward installed by moe_tp_experts.
    styles = model_styles(mixtral)
    experts = styles["model.layers.*.mlp.experts"]
    assert (experts.module_word, experts.parameter_words) == ("moe_tp_experts", {"gate_up_proj": "packed_colwise",
                                                                                 "down_proj": "rowwise"})
    assert "model.layers.*.mlp.experts.gate_up_proj" not in styles
    # DeepSeek-V2's latent attention: transformers' own style, handed the config it reads the rotary width from.
    mla = model_styles(_family("deepseek_v2")[0])["model.layers.*.self_attn.kv_a_proj_with_mqa"]
    assert (mla.module_word, mla.parameter_words) == ("mla_kv_a_proj", {})
    # Attention sinks: a bare parameter's entry folded into its module's `local_params`, whose forward runs on the
    # local shards; the module's projections keep their own DTensor styles.
    styles = model_styles(_family("granite_swa")[0])
    attention = styles["model.layers.*.self_attn"]
    assert (attention.module_word, attention.parameter_words) == ("local_params", {"sinks": "colwise"})
    assert "model.layers.*.self_attn.sinks" not in styles
    assert type(styles["model.layers.*.self_attn.q_proj"]) is ColwiseParallel
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model.config = types.SimpleNamespace(base_model_tp_plan={"0": "my_own_word"})
    with pytest.raises(ValueError, match="'my_own_word', which preflight translates to no DTensor style"):
        model_styles(model)
    # A word transformers registers and no DTensor style says: its own style lays the module out.
    model.config = types.SimpleNamespace(base_model_tp_plan={"0": "all_reduce"})
    assert model_styles(model)["0"].module_word == "all_reduce"
    # A fused weight's word outside an experts module is not folded: refused by name.
    model.config = types.SimpleNamespace(base_model_tp_plan={"0.weight": "packed_colwise"})
    with pytest.raises(ValueError, match="packed_colwise"):
        model_styles(model)


def test_an_embedding_cut_along_its_width_gathers_its_output():
    """transformers' ``embedding_colwise`` (each rank looks up a slice of every vector, the slices gathered): DTensor's
    column-wise style on an embedding, its weight Shard(1), its output whole on every rank."""
    from torch.distributed.tensor import Shard

    from preflight.parallel import fake_replica, fake_world
    from preflight.parallel._rank import MetaTwins, fresh_dtensor_caches
    from preflight.parallel._tensor import lay_out

    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 8))
    model.config = types.SimpleNamespace(base_model_tp_plan={"0": "embedding_colwise"})
    with fresh_dtensor_caches(), fake_world(2, 1) as mesh:
        copy = fake_replica(model, MetaTwins())
        lay_out(copy, mesh, model_styles(model))
        assert copy[0].weight.placements == (Shard(1),) and copy[0].weight.to_local().shape == (64, 16)
        assert copy[0](torch.zeros(4, 5, dtype=torch.long, device="meta")).shape == (4, 5, 32)


def _family(name: str):
    """A small Qwen3 (per-head q/k norms between its column- and row-wise layers: ``replicated_with_grad_allreduce``),
    Olmo2 (full-width q/k norms: the projections gathered, ``rowwise_split_input`` after) or Gemma (its head tied to
    its embedding) and a batch."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa")
    if name == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32))
    elif name == "gemma":
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**common, head_dim=32, pad_token_id=0,
                                                                       bos_token_id=1, eos_token_id=2))
    elif name == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, num_local_experts=4,
                                                                           num_experts_per_tok=2))
    elif name == "deepseek_v2":  # latent attention (mla_kv_a_proj) and fused experts
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
            **common, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, first_k_dense_replace=1,
            n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=32, n_shared_experts=1))
    elif name == "granite_swa":  # attention sinks cut over the heads (`local_params`); eager attention only
        model = transformers.GraniteSWAForCausalLM(transformers.GraniteSWAConfig(
            **{**common, "attn_implementation": "eager"}, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    elif name == "longcat_flash":  # zero (identity) experts beside the fused ones: transformers' own styles
        model = transformers.LongcatFlashForCausalLM(transformers.LongcatFlashConfig(
            **{k: v for k, v in common.items() if k not in ("num_hidden_layers", "intermediate_size")}, num_layers=2,
            ffn_hidden_size=256, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
            v_head_dim=32, head_dim=16, n_routed_experts=4, moe_topk=2, zero_expert_num=2, expert_ffn_hidden_size=128))
    elif name == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**common, head_dim=32, num_experts=4,
                                                                             num_experts_per_tok=2,
                                                                             moe_intermediate_size=128))
    else:
        model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**common))
    ids = torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def test_the_plan_words_of_models_with_norms_between_their_layers_are_translated():
    """transformers registers ``rowwise_split_input`` as a row-wise layer over a replicated input (cut locally),
    ``replicated_with_grad_allreduce`` as a parameter kept whole whose gradient is summed over the ranks, and
    ``replicate`` as a parameter kept whole: the DTensor styles say the same."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    qwen3, olmo2 = model_styles(_family("qwen3")[0]), model_styles(_family("olmo2")[0])
    norm = qwen3["model.layers.*.self_attn.q_norm"]
    assert type(norm).__name__ == "GradAllReduce" and type(qwen3["model.layers.*.self_attn.q_proj"]) is ColwiseParallel
    assert type(olmo2["model.layers.*.self_attn.o_proj"]) is RowwiseParallel
    assert olmo2["model.layers.*.self_attn.o_proj"].input_layouts == (Replicate(),)
    assert olmo2["model.layers.*.self_attn.q_proj"].output_layouts == (Replicate(),)  # colwise_gather_output
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model.config = types.SimpleNamespace(base_model_tp_plan={"0": "replicate"})
    assert model_styles(model) == {}  # kept whole: nothing to lay out


def test_a_head_tied_to_its_embedding_stays_tied_when_both_are_laid_out_alike():
    """parallelize_module gives the embedding and the head a parameter each; both are cut along the vocabulary
    (Shard(0)), so the copy shares one again, as transformers' tie_weights does after its layout."""
    from preflight.parallel import fake_replica, fake_world
    from preflight.parallel._rank import MetaTwins, fresh_dtensor_caches
    from preflight.parallel._tensor import lay_out

    model, _ = _family("gemma")
    with fresh_dtensor_caches(), fake_world(2, 0) as mesh:
        copy = fake_replica(model, MetaTwins())
        lay_out(copy, mesh, model_styles(model))
        assert copy.lm_head.weight is copy.model.embed_tokens.weight
        assert copy.lm_head.weight.placements == (torch.distributed.tensor.Shard(0),)


def _family_worker(rank: int, world: int, port: int, queue, name: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    with gloo_rank(rank, world, port):
        model, batch = _family(name)
        parallelize_module(model, init_device_mesh("cpu", (world,)), model_styles(model))
        model.tie_weights()  # as transformers ties them again after its own layout (a no-op for untied models)
        queue.put((rank, _measured(model, torch.optim.AdamW(model.parameters()), batch)))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "olmo2", "gemma", "mixtral", "qwen3_moe", "deepseek_v2", "granite_swa",
                                  "longcat_flash"])
def test_real_gloo_tensor_parallel_over_the_translated_plans_per_rank_peak_within_3_percent(name):
    """DTensor's program of the translated plan, run for real on 2 gloo processes (the q/k norms' gradients
    all-reduced over gloo; Gemma's head tied to its embedding again after the layout, as transformers ties it),
    against each rank's prediction (equal to the byte when written)."""
    model, batch = _family(name)
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, _run(2, 2))
    assert not est.coverage.lower_bound, est.coverage.reason
    measured = spawned(_family_worker, 2, name)
    for rank in range(2):
        assert abs(est.per_rank_peak_bytes[rank] - measured[rank]) / measured[rank] <= 0.03, (est.per_rank_peak_bytes,
                                                                                            measured)


def _moe_worker(rank: int, world: int, port: int, queue, name: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    with gloo_rank(rank, world, port):
        model, batch = _family(name)  # torchtitan's layout over transformers' own plan: TP 2 inside, FSDP2 across
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], model_styles(model))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        optimizer = torch.optim.AdamW(model.parameters())
        inside = preflight.estimate(model, optimizer, batch)  # read off the laid-out model, inside the job
        queue.put((rank, (_measured(model, optimizer, batch), inside.per_rank_peak_bytes, inside.coverage.lower_bound)))


@pytest.mark.slow
def test_real_gloo_moe_tensor_parallel_x_fsdp2_per_rank_peak_within_3_percent():
    """A Mixtral laid out by its own plan (the fused experts cut by transformers' styles: ``packed_colwise``,
    ``rowwise``, ``moe_tp_experts``) over TP 2, then FSDP2 over 2, on 4 gloo processes: planned before the job and
    read off the laid-out model inside it, each rank against its measurement (equal to the byte when written)."""
    model, batch = _family("mixtral")
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, _run(4, 2, None, "fsdp2"))
    assert not est.coverage.lower_bound, est.coverage.reason
    results = spawned(_moe_worker, 4, "mixtral")
    for rank in range(4):
        measured, inside, bounded = results[rank]
        assert not bounded and inside == est.per_rank_peak_bytes, (inside, est.per_rank_peak_bytes)
        assert abs(est.per_rank_peak_bytes[rank] - measured) / measured <= 0.03, (est.per_rank_peak_bytes, results)


def _local_param_bytes(model: torch.nn.Module, degree: int) -> int:
    """A rank's parameter bytes under `_styles()`: the sharded projections cut in `degree`, the rest whole."""
    total = 0
    for name, p in model.named_parameters():
        sharded = "layers" in name and any(k in name for k in ("_proj",))
        total += p.numel() * p.element_size() // (degree if sharded else 1)
    return total


@pytest.mark.slow
def test_tensor_parallel_ranks_hold_their_shards_and_every_rank_is_named():
    model, batch = _llama()
    optimizer = torch.optim.AdamW(model.parameters())
    whole = preflight.estimate(model, optimizer, batch)
    est = preflight.estimate(model, optimizer, batch, _run(2, 2, _styles()))
    assert est.per_rank_peak_bytes is not None and len(est.per_rank_peak_bytes) == 2
    assert est.breakdown["parameters"] == _local_param_bytes(model, 2)
    # AdamW: two fp32 moments of each local shard, and a 4-byte step count per parameter.
    steps = 4 * len(list(model.parameters()))
    assert est.breakdown["optimizer_state"] == 2 * _local_param_bytes(model, 2) + steps
    assert est.peak_bytes < whole.peak_bytes
    assert "fake tp 2 mesh" in est.coverage.notes[-1]
    assert not est.coverage.lower_bound
    # A name that matches no module is skipped, by parallelize_module and so by the trace, and said.
    from torch.distributed.tensor.parallel import ColwiseParallel

    typo_plan = {**_styles(), "model.layer.*.mlp": ColwiseParallel()}
    typo = preflight.estimate(model, optimizer, batch, _run(2, 2, typo_plan))
    assert typo.peak_bytes == est.peak_bytes
    assert "'model.layer.*.mlp' match no module" in typo.coverage.notes[-1]


def test_the_closed_form_is_set_beside_the_trace():
    from preflight.parallel._tensor import closed_form_activations

    model, batch = _llama()
    s, b, h, a, layers = 32, 2, HIDDEN, 4, LAYERS  # the batch's sequence and size, the config's dims
    assert closed_form_activations(model, batch, 2, False) == layers * s * b * h * (10 + 24 / 2 + 5 * a * s / (h * 2))
    assert closed_form_activations(model, batch, 2, True) == layers * s * b * h / 2 * (34 + 5 * a * s / h)
    assert closed_form_activations(model, batch["input_ids"], 2, False) is None  # no input_ids to read s and b from
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, _run(2, 2, _styles()))
    assert "216.00 KiB of activations" in est.coverage.notes[-1]


def test_uneven_shards_give_ranks_their_own_traces():
    model, _ = _llama(vocab=VOCAB + 1)  # the vocabulary cut in 2 along the embedding's rows: 257 and 256
    plan = TPPlan(2)  # the model's own plan cuts the embedding and the head
    assert tp_rank_groups(model, plan, 2) == [[0], [1]]
    assert tp_rank_groups(model, TPPlan(2, _styles()), 2) == [[0, 1]]


@pytest.mark.parametrize("world, replicate", [(6, 1), (8, 2)])
def test_groups_counted_from_each_tensor_parallel_layout_are_those_wrapping_every_rank_gives(world, replicate):
    """The groups are counted from one layout per tensor-parallel rank and FSDP2's chunk of each local tensor over
    the shard dim; they equal the groups that laying out and wrapping a meta copy as every rank of the job gives, by
    its tensor-parallel shapes (what FSDP2 gathers back) and its shards (uneven: a vocabulary of 257 cut in 2, local
    dims cut over 3 and 2 shard ranks)."""
    from preflight.parallel import FSDP2Plan
    from preflight.parallel._tensor import _engine, laid_out_locals

    model, _ = _llama(vocab=VOCAB + 1)
    plan, fsdp = TPPlan(2), FSDP2Plan(replicate=replicate)
    wrapped, laid = _engine(model, plan, fsdp, world), _engine(model, plan, None, 2)
    by_wrapping: dict[tuple, list[int]] = {}
    for rank in range(world):
        shards = tuple(tuple(t.shape) for t in laid_out_locals(model, wrapped, world, rank))
        gathered = tuple(tuple(t.shape) for t in laid_out_locals(model, laid, 2, rank % 2))
        by_wrapping.setdefault((gathered, shards), []).append(rank)
    groups = tp_rank_groups(model, plan, world, fsdp)
    assert sorted(groups) == sorted(by_wrapping.values())
    assert len(groups) > 2  # the shards split the tensor-parallel ranks' groups


def test_an_evaluation_after_the_steps_is_traced_on_each_rank_without_changing_the_training_figure():
    """`estimate_evaluating` traces the trainer's evaluation after the steps on the same fake ranks: the training
    figure is `estimate`'s, the evaluation holds this rank's shards and optimizer state, the gradients only where
    the trainer keeps them, and the training batch only where the trainer keeps it (the HF Trainer)."""
    from preflight._estimate import estimate_evaluating
    from preflight._steps import Evaluation

    model, batch = _llama()
    optimizer = torch.optim.AdamW(model.parameters())
    run = _run(2, 2, _styles())
    eval_batch = {"input_ids": torch.randint(0, VOCAB, (8, 32), generator=torch.Generator().manual_seed(4))}
    alone = preflight.estimate(model, optimizer, batch, run)
    freed = estimate_evaluating(model, optimizer, batch, run, evaluation=Evaluation(eval_batch, frees_gradients=True))
    kept = estimate_evaluating(model, optimizer, batch, run, evaluation=Evaluation(eval_batch, keeps_batch=True))
    assert freed.per_rank_peak_bytes == kept.per_rank_peak_bytes == alone.per_rank_peak_bytes
    assert freed.breakdown == alone.breakdown and alone.phase("evaluation") is None
    a, b = freed.phase("evaluation"), kept.phase("evaluation")
    assert a.where == b.where == "eval/forward" and len(a.per_rank_peak_bytes) == 2
    local_parameters = alone.breakdown["parameters"]
    assert a.breakdown["parameters"] == b.breakdown["parameters"] == local_parameters  # the rank's shards
    assert a.breakdown["optimizer_state"] == b.breakdown["optimizer_state"] > 0
    assert a.breakdown["gradients"] == 0 and b.breakdown["gradients"] == 0  # run_steps sets them to None too
    batch_bytes = batch["input_ids"].untyped_storage().nbytes()  # input_ids and labels share one tensor
    assert a.breakdown["inputs"] == eval_batch["input_ids"].nbytes
    assert b.breakdown["inputs"] == eval_batch["input_ids"].nbytes + batch_bytes
    assert b.peak_bytes - a.peak_bytes == batch_bytes
    # The evaluation batch's small integer tensors carry their values into the trace, as the training batch's do.
    counted = estimate_evaluating(model, optimizer, batch, run, evaluation=Evaluation(
        {"input_ids": eval_batch["input_ids"], "count": torch.tensor(16)},
        step=lambda m, b: m(input_ids=b["input_ids"][:, :int(b["count"])])))
    assert counted.phase("evaluation") is not None and counted.per_rank_peak_bytes == alone.per_rank_peak_bytes
    # An evaluation the trace cannot run leaves the training figure as it is, without an evaluation phase.
    stopped = estimate_evaluating(model, optimizer, batch, run, evaluation=Evaluation(
        eval_batch, step=lambda m, b: torch.nonzero(m(**b).logits > 0)))
    assert stopped.per_rank_peak_bytes == alone.per_rank_peak_bytes and not stopped.coverage.lower_bound
    assert stopped.phase("evaluation") is None
    assert any(n.startswith("evaluation after the steps: not traced (aten.nonzero") for n in stopped.coverage.notes)


def test_a_plan_that_cannot_be_applied_gives_a_labelled_lower_bound():
    from torch.distributed.tensor.parallel import ColwiseParallel

    model, batch = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # ColwiseParallel applies to nn.Linear and nn.Embedding only: a decoder layer cannot be cut so.
        est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                                 _run(2, 2, {"model.layers.0": ColwiseParallel()}))
    assert est.coverage.lower_bound and not est.coverage.traced
    assert "NotImplementedError" in est.coverage.failed_op
    assert any("could not be traced" in note for note in est.coverage.notes)
    assert est.sharding == "tp2" and not any("fsdp-full" in note for note in est.coverage.notes)
    # The lower bound: every category of the model's state divided between the 2 ranks, no activations.
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    assert est.breakdown["parameters"] == whole // 2 and est.breakdown["activations"] == 0


@pytest.mark.slow
def test_the_cli_plans_tensor_parallelism_with_the_models_own_plan(tmp_path, capsys):
    import json

    from preflight._cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": FFN,
                                  "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": VOCAB, "max_position_embeddings": 64}))
    base = ["estimate", "--hf-config", str(config), "--batch", "2", "--seq", "32"]
    out = tmp_path / "tp.json"
    assert main([*base, "--tp", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["run"]["parallel"]["tp_degree"] == 2 and report["world_size"] == 2
    assert len(report["per_rank_peak_bytes"]) == 2
    assert "tensor parallel degree 2" in capsys.readouterr().out
    both = tmp_path / "tp_fsdp.json"
    assert main([*base, "--tp", "2", "--world-size", "4", "--sharding", "fsdp2", "--json", str(both)]) == 0
    report_both = json.loads(both.read_text())
    assert len(report_both["per_rank_peak_bytes"]) == 4
    # FSDP2 over the data-parallel dim halves the parameters a rank holds again.
    assert report_both["breakdown"]["parameters"] < report["breakdown"]["parameters"]
    capsys.readouterr()
    assert main([*base, "--tp", "2", "--world-size", "4"]) == 2
    assert "--sharding fsdp2" in capsys.readouterr().err


@pytest.mark.slow
def test_the_cli_suggests_per_rank_under_tensor_parallelism_and_its_command_fits(tmp_path, capsys, monkeypatch):
    """Over budget with --tp, each suggestion is traced under the same tensor-parallel plan (no DDP laid over it);
    LoRA is left out with the reason (DTensor's styles lay out nn.Linear, not peft's layers); the first fitting
    suggestion's command exits 0. Two options are traced (test_options.py traces each under a plan), and the budget
    (three quarters of the need) is one bf16-true alone fits."""
    import json

    from conftest import only_options

    only_options(monkeypatch, "LoRA", "bf16 precision")
    from preflight._cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": FFN,
                                  "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": VOCAB, "max_position_embeddings": 64}))
    flags = ["estimate", "--hf-config", str(config), "--batch", "2", "--seq", "32", "--tp", "2"]
    assert main([*flags, "--json", str(tmp_path / "base.json")]) == 0
    needed = json.loads((tmp_path / "base.json").read_text())["required_bytes"]
    over = tmp_path / "over.json"
    with pytest.warns(RuntimeWarning, match="left out the LoRA option: ValueError: tensor parallelism lays out"):
        assert main([*flags, "--budget", f"{int(needed * 0.75)}B", "--json", str(over)]) == 3
    suggestions = json.loads(over.read_text())["suggestions"]
    assert suggestions and not any("peft" in s["change"] for s in suggestions)
    first = next(s for s in suggestions if s["fits"])
    assert "--tp" in first["command"]
    capsys.readouterr()
    assert main(first["command"][1:]) == 0, first


# ---- real runs with gloo: each rank measured against its prediction -------------------------------------------------

# Activations large beside the small model, as in the FSDP tests; VOCAB stays small so four processes fit.
BIG_BATCH = (8, 64)
EVAL_BATCH = (16, 64)  # larger than training's: the evaluation's logits are the peak of its phase


def _big_setup():
    model, _ = _llama()
    ids = torch.randint(0, VOCAB, BIG_BATCH, generator=torch.Generator().manual_seed(2))
    return model, {"input_ids": ids, "labels": ids}


def _measured(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> int:
    """This rank's measured peak over two real steps: the bytes alive before (its local shards, buffers, the batch)
    plus the profiled rise, gloo's lost frees placed at the end of their phase (`conftest.call_end_peak`)."""
    from preflight._device import live_storage_bytes
    from preflight._steps import run_steps

    before = live_storage_bytes([list(model.parameters()), list(model.buffers()), batch], torch.device("cpu"))
    dist.barrier()
    return before + call_end_peak(lambda on_phase: run_steps(model, optimizer, batch, step=None, precision=None,
                                                             device_type="cpu", steps=2, on_phase=on_phase))


def _gloo_worker(rank: int, world: int, port: int, queue, degree: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    with gloo_rank(rank, world, port):
        model, batch = _big_setup()
        if degree == world:
            parallelize_module(model, init_device_mesh("cpu", (world,)), _styles())
        else:  # torchtitan's layout: tensor parallel inside, FSDP2 across
            mesh = init_device_mesh("cpu", (world // degree, degree), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh["tp"], _styles())
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        optimizer = torch.optim.AdamW(model.parameters())
        # Inside the job, on the model as the job laid it out (and wrapped), and as the callbacks predict it.
        from preflight.verdict import Options, predict

        inside = preflight.estimate(model, optimizer, batch).per_rank_peak_bytes
        eval_batch = {"input_ids": torch.randint(0, VOCAB, EVAL_BATCH, generator=torch.Generator().manual_seed(3))}
        report = predict(model, optimizer, batch, preflight.Run(), options=Options(), eval_batch=eval_batch)
        evaluation = next(p for p in report.phases if p["name"] == "evaluation")
        assert report.predicted_peak_bytes == max(inside)
        assert report.eval_predicted_peak_bytes == max(evaluation["per_rank_peak_bytes"])
        assert any("evaluation traced on each rank" in note for note in report.coverage["notes"])
        if rank == 0 and degree == world:  # over a budget: each option traced on the model as it is laid out
            assert_suggested_on_the_layout(model, optimizer, batch, inside)
        measured = _measured(model, optimizer, batch)
        queue.put((rank, (measured, inside, evaluation_peak(model, optimizer, eval_batch),
                          evaluation["per_rank_peak_bytes"])))


@pytest.mark.slow
@pytest.mark.parametrize("world, degree", [(2, 2), (4, 2)])  # TP over 2 ranks; TP 2 x FSDP2 2 on a 2-D mesh
def test_real_gloo_tensor_parallel_per_rank_peak_within_3_percent(world, degree):
    model, batch = _big_setup()
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                             _run(world, degree, _styles(), None if world == degree else "fsdp2"))
    assert est.per_rank_peak_bytes is not None, est.coverage.notes
    results = spawned(_gloo_worker, world, degree)
    for rank in range(world):
        measured, inside, _, _ = results[rank]
        assert inside == est.per_rank_peak_bytes  # read off the laid-out model: the figure planned before
        error = (est.per_rank_peak_bytes[rank] - measured) / measured
        assert abs(error) <= 0.03, (rank, est.per_rank_peak_bytes, {r: m[0] for r, m in results.items()})
    # The callbacks' evaluation of the laid-out model, traced on each rank after the steps, against the evaluation
    # each rank measured after its real steps.
    for rank in range(world):
        _, _, measured, predicted = results[rank]
        assert abs(predicted[rank] - measured) / measured <= 0.03, (rank, predicted, measured)


def _hsdp_worker(rank: int, world: int, port: int, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    with gloo_rank(rank, world, port):
        model, batch = _big_setup()  # torchtitan's 3-D layout: tensor parallel inside, HSDP across
        mesh = init_device_mesh("cpu", (2, world // 4, 2), mesh_dim_names=("replicate", "shard", "tp"))
        parallelize_module(model, mesh["tp"], _styles())
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["replicate", "shard"])
        fully_shard(model, mesh=mesh["replicate", "shard"])
        optimizer = torch.optim.AdamW(model.parameters())
        inside = preflight.estimate(model, optimizer, batch).per_rank_peak_bytes  # read off the 3-D layout
        queue.put((rank, (_measured(model, optimizer, batch), inside)))


@pytest.mark.slow
def test_real_gloo_hsdp_x_tensor_parallel_on_a_3d_mesh_per_rank_peak_within_3_percent():
    """HSDP beside tensor parallelism (replicate 2 x shard 2 x tp 2 over 8 gloo processes): planned before the job
    and read off the laid-out model inside it, each rank's figure against its measured peak."""
    from preflight.parallel import FSDP2Plan

    model, batch = _big_setup()
    plan = preflight.ParallelPlan(8, "fsdp2", tp=TPPlan(2, _styles()), fsdp=FSDP2Plan(replicate=2))
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, preflight.Run(parallel=plan))
    assert est.sharding == "tp2 x fsdp2 x replicate2" and not est.coverage.lower_bound
    assert any("replicate 2 x shard 2 x tp 2 mesh" in n for n in est.coverage.notes)
    results = spawned(_hsdp_worker, 8)
    for rank in range(8):
        measured, inside = results[rank]
        assert inside == est.per_rank_peak_bytes  # the layout read inside the job: the figure planned before
        measurements = {r: m for r, (m, _) in results.items()}
        assert abs(est.per_rank_peak_bytes[rank] - measured) / measured <= 0.03, (rank, est.per_rank_peak_bytes,
                                                                                 measurements)


@pytest.mark.slow
def test_the_example_plans_each_layout_per_rank():
    import re

    from conftest import example_output

    stdout = example_output("tensor_parallel.py", timeout=300)
    lines = stdout.splitlines()
    single = float(re.search(r"one device: ([\d.]+) MiB", lines[0]).group(1))
    per_rank = [re.findall(r"([\d.]+) MiB", line.split("per rank", 1)[1].split("(")[0]) for line in lines[1:]]
    assert [len(r) for r in per_rank] == [2, 2, 4, 4, 4]
    assert all(float(b) < single for ranks in per_rank for b in ranks)
    # Pipeline and ring beside tensor parallelism hold less per rank than tensor parallelism alone.
    assert max(map(float, per_rank[3])) < max(map(float, per_rank[0]))
    assert max(map(float, per_rank[4])) < max(map(float, per_rank[0]))


def _hf_tp_worker(rank: int, world: int, port: int, queue, path: str) -> None:
    from transformers import LlamaForCausalLM

    with gloo_rank(rank, world, port):
        import os

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        model = LlamaForCausalLM.from_pretrained(path, tp_plan="auto")  # transformers' own tensor parallelism
        ids = torch.randint(0, model.config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(2))
        batch = {"input_ids": ids, "labels": ids}
        optimizer = torch.optim.AdamW(model.parameters())
        inside = preflight.estimate(model, optimizer, batch).per_rank_peak_bytes
        queue.put((rank, (_measured(model, optimizer, batch), inside)))


@pytest.mark.slow
def test_transformers_own_tensor_parallelism_is_read_inside_the_job(tmp_path):
    """``from_pretrained(tp_plan="auto")`` lays the model out with DTensor parameters and replaces each parallel
    module's ``forward`` by a closure over the module and the mesh; it keeps each shard as a view into the whole
    loaded weight. Read inside a real 2-process gloo job, every rank within 3% of its measurement.

    The model is benchmarks/tensor_parallel.py's size (hidden 256, vocab 8192, 4 layers): on the 2-layer test model
    the measurement alone swung by 6.5% from run to run, one collective's buffer (532,544 B) freed on a gloo thread
    and placed late; here that buffer is under 0.5% of the figure."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128))
    model.save_pretrained(tmp_path / "llama")
    results = spawned(_hf_tp_worker, 2, str(tmp_path / "llama"))
    assert results[0][1] == results[1][1]  # every process traces the same ranks
    for rank in range(2):
        measured, inside = results[rank]
        assert abs(inside[rank] - measured) / measured <= 0.03, (rank, inside, measured)
