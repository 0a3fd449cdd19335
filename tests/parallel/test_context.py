"""Context parallelism (torch's context_parallel ring attention), alone and inside FSDP2: each place in the ring
traced under a fake process group, checked against real gloo runs."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from conftest import call_end_peak, gloo_rank, spawned

import preflight
from preflight.parallel import CPPlan, FSDP2Plan, TPPlan, cp_rank_groups, cpu_ring_attention
from preflight.parallel._context import ring_of, sequence_tensors

VOCAB, HIDDEN, FFN, LAYERS = 512, 64, 176, 2


def _llama(batch: int = 4, seq: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(2))
    return model, {"input_ids": ids, "labels": ids.clone()}


def _run(world: int, degree: int, sharding=None, rotate="allgather", **target):
    return preflight.Run(parallel=preflight.ParallelPlan(world, sharding, cp=CPPlan(degree, rotate)), **target)


def test_plan_options_are_checked():
    with pytest.raises(ValueError, match="positive int"):
        CPPlan(0)
    with pytest.raises(ValueError, match="set_rotate_method"):
        CPPlan(2, "ring")
    with pytest.raises(TypeError, match="sequence dim"):
        CPPlan(2, sequence={"input_ids": "1"})
    with pytest.raises(ValueError, match="should divide the world size 6"):
        preflight.ParallelPlan(6, "fsdp2", cp=CPPlan(4))
    with pytest.raises(ValueError, match="pass sharding='fsdp2'"):
        preflight.ParallelPlan(4, None, cp=CPPlan(2))
    with pytest.raises(ValueError, match="should be 'fsdp2'"):
        preflight.ParallelPlan(2, "zero3", cp=CPPlan(2))
    with pytest.raises(ValueError, match="not yet with offload"):
        preflight.ParallelPlan(2, None, cp=CPPlan(2), offload_optimizer=True)
    # Beside tensor parallelism: a (dp, cp, tp) mesh, tensor-parallel ranks innermost.
    assert CPPlan(2).mesh(8, TPPlan(2)) == ((2, 2, 2), ("dp", "cp", "tp"))
    assert CPPlan(2).mesh(4, TPPlan(2)) == ((2, 2), ("cp", "tp"))
    with pytest.raises(ValueError, match="`cp.degree` times `tp.degree` is 4 but the world size is 8"):
        preflight.ParallelPlan(8, None, cp=CPPlan(2), tp=TPPlan(2))
    with pytest.raises(ValueError, match="times `TPPlan.degree`"):
        preflight.ParallelPlan(6, "fsdp2", cp=CPPlan(2), tp=TPPlan(2))
    with pytest.raises(TypeError, match="CPPlan or None"):
        preflight.ParallelPlan(2, None, cp=2)
    assert CPPlan(2).mesh(8) == ((4, 2), ("dp", "cp"))
    assert CPPlan(4).mesh(4) == ((4,), ("cp",))
    assert cp_rank_groups(CPPlan(2), 6) == [[0, 2, 4], [1, 3, 5]]  # the rings are consecutive runs of 2 ranks


def test_beside_tensor_parallelism_ranks_share_a_trace_by_place_in_the_ring_and_local_shapes():
    """On the (dp, cp, tp) mesh, rank r sits at place (r // tp) % cp in its ring; the tensor-parallel ranks of one
    place hold equal shards here, and so do the places' data-parallel copies."""
    from preflight.parallel._context import _engine
    from preflight.parallel._tensor import _engine as tp_engine
    from preflight.parallel._tensor import laid_out_locals, plan_styles

    model, _ = _llama()
    assert cp_rank_groups(CPPlan(2), 4, model, TPPlan(2)) == [[0, 1], [2, 3]]
    assert cp_rank_groups(CPPlan(2), 8, model, TPPlan(2), FSDP2Plan()) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # Uneven (a vocabulary of 513 cut in 2, local dims cut over the 6 ranks of dp 3 x cp 2): the groups that laying
    # out and wrapping a meta copy as every rank gives, by place, tensor-parallel shapes and shards.
    from transformers import LlamaForCausalLM

    uneven = LlamaForCausalLM(model.config.__class__(**{**model.config.to_dict(), "vocab_size": VOCAB + 1}))
    tp = TPPlan(2)
    wrapped, laid = _engine(CPPlan(2), FSDP2Plan(), 12, tp, plan_styles(uneven, tp)), tp_engine(uneven, tp, None, 2)
    by_wrapping: dict[tuple, list[int]] = {}
    for rank in range(12):
        shards = tuple(tuple(t.shape) for t in laid_out_locals(uneven, wrapped, 12, rank))
        gathered = tuple(tuple(t.shape) for t in laid_out_locals(uneven, laid, 2, rank % 2))
        by_wrapping.setdefault((rank // 2 % 2, gathered, shards), []).append(rank)
    groups = cp_rank_groups(CPPlan(2), 12, uneven, tp, FSDP2Plan())
    assert sorted(groups) == sorted(by_wrapping.values()) and len(groups) > 2


def test_the_batch_tensors_that_carry_the_sequence_are_found_or_named():
    ids = torch.zeros(2, 8, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.zeros(2, 8, dtype=torch.long),
             "lengths": torch.zeros(2, dtype=torch.long), "pixel": torch.zeros(2, 3, 4)}
    found = sequence_tensors(batch, CPPlan(2))
    # Tensors of 2+ dims whose dim 1 is the sequence's; `labels` is `input_ids` itself, sharded once.
    assert [(t is ids, d) for t, d in found] == [(True, 1), (False, 1)]
    assert sequence_tensors(batch, CPPlan(2, sequence={"pixel": -1}))[0][1] == 2
    with pytest.raises(ValueError, match="the batch's 'mask' is missing"):
        sequence_tensors(batch, CPPlan(2, sequence={"mask": 1}))
    with pytest.raises(ValueError, match="no tensor of two or more dims"):
        sequence_tensors({"lengths": torch.zeros(2)}, CPPlan(2))


def test_the_cpu_ring_and_context_parallel_leave_torch_as_they_found_it():
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    cpu_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    propagator = DTensor._op_dispatcher.sharding_propagator
    options = ring._cp_options
    handlers, rotate, balance = dict(ring.custom_ops), options.rotate_method, options.enable_load_balance
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with cpu_ring_attention():
        assert cpu_op in propagator.op_strategy_funcs and cpu_op in ring.custom_ops
    assert cpu_op not in propagator.op_strategy_funcs and ring.custom_ops == handlers
    model, batch = _llama()
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, _run(2, 2, rotate="alltoall"))
    assert est.per_rank_peak_bytes is not None and not est.coverage.lower_bound
    assert torch.nn.functional.scaled_dot_product_attention is sdpa  # context_parallel's patch was taken off
    assert ring.custom_ops == handlers and cpu_op not in propagator.op_strategy_funcs
    assert (options.rotate_method, options.enable_load_balance) == (rotate, balance)
    assert batch["input_ids"].shape == (4, 64)  # the user's batch is not sharded; the trace's copy was


def test_each_place_in_the_ring_is_traced_and_the_batch_keeps_its_whole_storage():
    model, batch = _llama()
    optimizer = torch.optim.AdamW(model.parameters())
    whole = preflight.estimate(model, optimizer, batch)
    est = preflight.estimate(model, optimizer, batch, _run(2, 2))
    assert est.sharding == "cp2" and len(est.per_rank_peak_bytes) == 2
    # context_parallel shards the batch with resize_, which keeps the storage: each rank holds the whole batch.
    assert est.breakdown["inputs"] == sum(t.numel() * t.element_size() for t in batch.values())
    # Each rank holds the activations of its half of every sequence: fewer than one device holding all of them.
    assert est.breakdown["activations"] < whole.breakdown["activations"]
    assert est.breakdown["parameters"] == whole.breakdown["parameters"]  # replicated on every rank of the ring
    note = next(n for n in est.coverage.notes if n.startswith("context parallelism"))
    assert "head-tail load balancing" in note and "each rank traced" in note
    fsdp = preflight.estimate(model, optimizer, batch, _run(4, 2, "fsdp2"))
    assert fsdp.sharding == "cp2 x fsdp2" and len(fsdp.per_rank_peak_bytes) == 4
    assert fsdp.per_rank_peak_bytes[0] == fsdp.per_rank_peak_bytes[2]  # the same place in two rings
    assert fsdp.breakdown["parameters"] < whole.breakdown["parameters"] / 3  # sharded over the 4 ranks
    # A sequence that does not divide into 2 x degree chunks is cut without balancing, as torch cuts it.
    model, odd = _llama(seq=62)
    uneven = preflight.estimate(model, torch.optim.AdamW(model.parameters()), odd, _run(2, 2))
    assert any("in contiguous chunks" in n for n in uneven.coverage.notes)


def test_on_a_cuda_target_the_ring_runs_the_kernel_the_gpu_picks():
    model, batch = _llama()
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                             _run(2, 2, precision="bf16-mixed", target=preflight.Target(gpu="H100-80GB")))
    assert not est.coverage.lower_bound and len(est.per_rank_peak_bytes) == 2
    # 2 layers x 2 steps through torch's own ring handler of the CUDA flash kernel.
    assert any("attention kernels flash x4" in n for n in est.coverage.notes)
    assert any("over the attention kernel the target picks" in n for n in est.coverage.notes)


def test_the_cli_plans_context_parallelism(tmp_path, capsys):
    from preflight._cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": FFN,
                                  "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": VOCAB, "max_position_embeddings": 64}))
    out = tmp_path / "cp.json"
    assert main(["estimate", "--hf-config", str(config), "--batch", "2", "--seq", "64", "--cp", "2", "--world-size",
                 "4", "--sharding", "fsdp2", "--no-suggest", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "context parallel degree 2 (allgather, each rank 32 tokens of each sequence)" in printed
    report = json.loads(out.read_text())
    assert len(report["per_rank_peak_bytes"]) == 4 and not report["coverage"]["lower_bound"]
    assert main(["estimate", "--hf-config", str(config), "--batch", "2", "--seq", "64", "--cp-rotate",
                 "alltoall"]) == 2
    assert "pass --cp N" in capsys.readouterr().err
    assert main(["estimate", "--hf-config", str(config), "--batch", "2", "--seq", "64", "--cp", "2",
                 "--offload-optimizer"]) == 2
    assert "not with --offload-optimizer" in capsys.readouterr().err
    # With --tp 2 beside the ring: 4 ranks, the model laid out by its own plan, as the Python API plans it.
    both = tmp_path / "cp-tp.json"
    assert main(["estimate", "--hf-config", str(config), "--batch", "4", "--seq", "64", "--cp", "2", "--tp", "2",
                 "--no-suggest", "--json", str(both)]) == 0
    assert "4 rank(s), tensor parallel degree 2, context parallel degree 2" in capsys.readouterr().out
    model, batch = _llama()
    python = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                                preflight.Run(parallel=preflight.ParallelPlan(4, None, cp=CPPlan(2), tp=TPPlan(2))))
    assert json.loads(both.read_text())["per_rank_peak_bytes"] == list(python.per_rank_peak_bytes)


def test_accelerates_context_parallelism_is_read_into_the_plan():
    from types import SimpleNamespace

    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from accelerate.utils.dataclasses import TorchContextParallelConfig
    from torch.distributed.fsdp import CPUOffloadPolicy

    from preflight.parallel import accelerate_plan

    def state(config, **plugin):
        return SimpleNamespace(num_processes=4, distributed_type=DistributedType.FSDP, deepspeed_plugin=None,
                               fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, **plugin),
                               parallelism_config=config)

    rings = ParallelismConfig(dp_shard_size=2, cp_size=2,
                              cp_handler=TorchContextParallelConfig(cp_comm_strategy="alltoall"))
    plan = accelerate_plan(state(rings))
    assert (plan.sharding, plan.world_size, plan.cp) == ("fsdp2", 4, CPPlan(2, "alltoall"))
    assert "ParallelismConfig(cp_size=2)" in plan.note()
    # Offloading is not traced with a ring: the plan goes without it, and says the figure holds whole sequences.
    plan = accelerate_plan(state(rings, cpu_offload=CPUOffloadPolicy()))
    assert plan.cp is None and plan.offload_params and "more activations than a rank of the ring" in plan.source
    assert accelerate_plan(state(ParallelismConfig(dp_shard_size=4))).cp is None
    # With tensor parallelism the model comes laid out by transformers and wrapped by fully_shard: no plan is read
    # from the state, the model carries it (estimate reads both, as tests/parallel/test_tensor.py checks in a job).
    assert accelerate_plan(state(ParallelismConfig(dp_shard_size=2, tp_size=2))) is None
    multi = SimpleNamespace(num_processes=2, distributed_type=DistributedType.MULTI_GPU, deepspeed_plugin=None,
                            fsdp_plugin=None, parallelism_config=ParallelismConfig(tp_size=2))
    assert accelerate_plan(multi) is None


# ---- real runs with gloo: each rank measured against its prediction -------------------------------------------------

def _qlora(path: str):
    """The test Llama loaded in NF4 (double quantization) by transformers and bitsandbytes, prepared by peft and given
    LoRA adapters on every linear layer, as a QLoRA user builds it."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.float32)
    model = LlamaForCausalLM.from_pretrained(path, quantization_config=quantized, attn_implementation="sdpa")
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))


def _gloo_worker(rank: int, world: int, port: int, queue, degree: int, rotate: str, qlora: str | None = None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from preflight._device import held_tensors, live_storage_bytes
    from preflight._steps import run_steps

    with gloo_rank(rank, world, port):
        model, batch = _llama()
        if qlora is not None:
            model = _qlora(qlora)
        if world == degree:
            ring = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        else:  # torchtitan's layout: FSDP2 over every rank (dp_shard_cp), the ring over the cp dim
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world // degree, degree), mesh_dim_names=("dp", "cp"))
            ring, every = mesh["cp"], mesh._flatten("dp_cp")
            for layer in model.model.layers:
                fully_shard(layer, mesh=every)
            fully_shard(model, mesh=every)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        inside = None
        if world != degree:  # inside the job, on the model fully_shard wrapped (accelerate's prepare does so)
            inside = preflight.estimate(model, optimizer, batch, _run(world, degree, "fsdp2")).per_rank_peak_bytes
        quantization = [t for p in model.parameters() for _, t in held_tensors(p)]  # a 4-bit weight's quant_state
        before = live_storage_bytes([list(model.parameters()), list(model.buffers()), quantization, batch],
                                    torch.device("cpu"))
        dist.barrier()

        def steps(on_phase):
            # The real job: torch's context_parallel over the cp dim, with the CPU kernel's ring handler.
            with ring_of(ring, batch, CPPlan(degree, rotate), cpu=True):
                run_steps(model, optimizer, batch, step=None, precision=None, device_type="cpu", steps=2,
                          on_phase=on_phase)

        queue.put((rank, (before + call_end_peak(steps), inside)))


@pytest.mark.slow
@pytest.mark.parametrize("world, degree, rotate", [(2, 2, "allgather"), (2, 2, "alltoall"), (4, 2, "allgather")])
def test_real_gloo_context_parallel_per_rank_peak_within_3_percent(world, degree, rotate):
    model, batch = _llama()
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                             _run(world, degree, None if world == degree else "fsdp2", rotate))
    assert est.per_rank_peak_bytes is not None, est.coverage.notes
    results = spawned(_gloo_worker, world, degree, rotate)
    for rank in range(world):
        measured, inside = results[rank]
        assert inside in (None, est.per_rank_peak_bytes)  # read off the wrapped model: the figure planned before
        error = (est.per_rank_peak_bytes[rank] - measured) / measured
        assert abs(error) <= 0.03, (rank, est.per_rank_peak_bytes, results)


def _tp_worker(rank: int, world: int, port: int, queue, fsdp: bool) -> None:
    """One rank of a ring of 2 beside tensor parallelism of 2, as torchtitan lays them out: the mesh (cp 2, tp 2), the
    model laid out by parallelize_module over tp (the plan `benchmarks/distributed.py` writes), with ``fsdp`` then
    wrapped by fully_shard over the ring's ranks; two real steps inside torch's context_parallel over cp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from benchmarks.distributed import megatron_styles
    from preflight._device import live_storage_bytes
    from preflight._steps import run_steps

    with gloo_rank(rank, world, port):
        model, batch = _llama()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
        parallelize_module(model, mesh["tp"], megatron_styles(model))
        if fsdp:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["cp"])
            fully_shard(model, mesh=mesh["cp"])
        optimizer = torch.optim.AdamW(model.parameters())
        local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
        before = live_storage_bytes([local, list(model.buffers()), batch], torch.device("cpu"))
        dist.barrier()

        def steps(on_phase):
            with ring_of(mesh["cp"], batch, CPPlan(2), cpu=True):
                run_steps(model, optimizer, batch, step=None, precision=None, device_type="cpu", steps=2,
                          on_phase=on_phase)

        queue.put((rank, before + call_end_peak(steps)))


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True])
def test_real_gloo_context_parallel_beside_tensor_parallel_per_rank_peak_within_3_percent(fsdp):
    """CP 2 x TP 2 on 4 gloo processes, the model replicated over the ring or wrapped by FSDP2 over it: every rank
    against its prediction, made with the model's own tensor-parallel plan (equal to the byte when written). With a
    data-parallel dim too (8 processes): `benchmarks/context_parallel.py`."""
    model, batch = _llama()
    plan = preflight.ParallelPlan(4, "fsdp2" if fsdp else None, cp=CPPlan(2), tp=TPPlan(2))
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, preflight.Run(parallel=plan))
    assert est.per_rank_peak_bytes is not None and not est.coverage.lower_bound, est.coverage.notes
    # Tensor-parallel ranks at one place in the ring hold equal shards; the two places differ.
    assert est.per_rank_peak_bytes[0] == est.per_rank_peak_bytes[1] != est.per_rank_peak_bytes[2]
    measured = spawned(_tp_worker, 4, fsdp)
    for rank in range(4):
        assert abs(est.per_rank_peak_bytes[rank] - measured[rank]) / measured[rank] <= 0.03, (
            rank, est.per_rank_peak_bytes, measured)


@pytest.mark.slow
def test_real_gloo_context_parallel_over_qlora_per_rank_peak_within_3_percent(tmp_path):
    """QLoRA under a ring: bitsandbytes' 4-bit weights (their quantization state carried onto each rank's fake copy),
    peft's adapters, torch's ring; each rank of a real 2-process job within 3% (0.17% under when written)."""
    model, _ = _llama()
    model.save_pretrained(tmp_path / "llama")
    qlora = _qlora(str(tmp_path / "llama"))
    _, batch = _llama()
    optimizer = torch.optim.AdamW([p for p in qlora.parameters() if p.requires_grad])
    est = preflight.estimate(qlora, optimizer, batch, _run(2, 2))
    assert not est.coverage.lower_bound, est.coverage.reason
    results = spawned(_gloo_worker, 2, 2, "allgather", str(tmp_path / "llama"))
    for rank in range(2):
        measured, _ = results[rank]
        assert abs(est.per_rank_peak_bytes[rank] - measured) / measured <= 0.03, (rank, est.per_rank_peak_bytes,
                                                                                    results)


@pytest.mark.slow
def test_the_example_plans_each_ring_per_rank():
    import re

    from conftest import example_output

    stdout = example_output("context_parallel.py", timeout=300)
    lines = stdout.splitlines()
    single = float(re.search(r"activations ([\d.]+) MiB", lines[0]).group(1))
    per_rank = [re.findall(r"([\d.]+) MiB", line.split("per rank", 1)[1].split("(")[0]) for line in lines[1:]]
    assert [len(r) for r in per_rank] == [2, 4, 4]
    activations = [float(re.search(r"activations ([\d.]+) MiB", line).group(1)) for line in lines[1:]]
    # Each rank holds the activations of its share of the sequence: about a half and a quarter of one device's.
    assert single / 2 < activations[0] < single * 0.55 and single / 4 < activations[1] < single * 0.3


def test_a_ring_over_the_math_kernel_would_fail_and_says_why():
    """A T4 (sm_75) has no flash kernel, and its memory-efficient kernel takes no grouped-query heads: attention falls
    back to the math kernel, which torch's ring does not handle; the real step fails, and so does the plan."""
    model, batch = _llama()
    with pytest.raises(preflight.StepWouldFailError, match="falls back to the math kernel") as err:
        preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                           _run(2, 2, precision="bf16-mixed", target=preflight.Target(gpu="T4")))
    assert "flash: sm_75 is outside" in str(err.value) and "efficient: head counts differ" in str(err.value)


@pytest.mark.slow  # a search of traced ring plans: about 60 s on 2 cores
def test_advice_under_a_ring_keeps_the_ring_and_offers_fsdp2_over_every_rank(monkeypatch):
    from conftest import only_options

    only_options(monkeypatch, "sharding", "micro-batch")
    model, batch = _llama()
    optimizer = torch.optim.AdamW(model.parameters())
    run = _run(2, 2, target=preflight.Target(budget="3.9MiB"))  # rank 0 needs 4,175,260 B
    found = {s.changes: s for s in preflight.advise(model, optimizer, batch, run, headroom=0.0)}
    sharded = found[("zero3",)]  # FSDP2's cost class
    assert sharded.run.parallel.sharding == "fsdp2" and sharded.run.parallel.cp == CPPlan(2)
    # The figure is the ring inside FSDP2's, as estimate plans it.
    assert sharded.predicted_peak_bytes == preflight.estimate(model, optimizer, batch, sharded.run).peak_bytes
    assert found[("micro_batch",)].run.parallel.cp == CPPlan(2)


def test_each_ranks_trace_counts_checkpointings_rng_snapshots_on_a_cpu_target():
    """Non-reentrant checkpointing keeps the CPU generator's state (a 5,056-byte host tensor no operator makes) per
    checkpointed layer until its recomputation: host memory on a CPU target, counted in every rank's trace as in a
    single-device one (a real 2-process run measured them: benchmarks/context_parallel.py's "+ ac" rows)."""
    from preflight.parallel import trace_cp

    model, batch = _llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    snapshot = torch.get_rng_state().untyped_storage().nbytes()
    counts = {}
    for cuda in (None, preflight.cuda.CudaTarget.of(None)):
        result = trace_cp(model, torch.optim.AdamW(model.parameters()), batch, world_size=2, rank=0, plan=CPPlan(2),
                          step=None, precision="bf16-mixed", steps=2, cuda=cuda)
        assert result.error is None
        counts[cuda is None] = sum(1 for e in result.events if e.nbytes == snapshot)
    # Per layer and step: the one kept from the forward to the recomputation, and the one fork_rng holds during it.
    # Host memory on a CUDA target.
    assert counts == {True: LAYERS * 2 * 2, False: 0}
