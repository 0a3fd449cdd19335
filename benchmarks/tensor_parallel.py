"""Per-rank peak memory of real tensor-parallel training on CPU processes (gloo), against preflight's prediction.

For each layout, `torch.multiprocessing` starts WORLD_SIZE processes that each build the same Llama (transformers,
4 layers, hidden 256, 8 heads of which 4 key/value, vocab 8192; same seed) and lay it out as a user would with
DTensor:

    tp            ``parallelize_module`` over a 1-D mesh with torchtitan's decoder plan: q/k/v and gate/up
                  ``ColwiseParallel()``, o_proj and down_proj ``RowwiseParallel()``; embedding and head whole
    tp (own plan) the model's own transformers plan (``TPPlan(degree)``; preflight translates it to DTensor's
                  styles): also the embedding cut along the vocabulary and the head's output gathered
    sp            sequence parallelism as torchtitan applies it: the embedding's output and the norms sharded along
                  the sequence (``SequenceParallel``), ``PrepareModuleInput`` all-gathering before attention and
                  the MLP, row-wise outputs reduce-scattered back to sequence shards, the head gathering its input
    tp x fsdp2    the tp plan over the mesh's ``tp`` dim, then ``fully_shard`` on each decoder layer and the root
                  over its ``dp`` dim (mesh ``(world / 2, 2)``, torchtitan's layout)
    moe (own plan)          a Mixtral of the same sizes (4 experts, 2 per token) laid out by its own plan: the
                            fused expert weights cut by transformers' styles (``packed_colwise``, ``rowwise``,
                            ``moe_tp_experts``), the attention as in tp (own plan)
    moe (own plan) x fsdp2  the same over the ``tp`` dim, then ``fully_shard`` as in tp x fsdp2

Each builds AdamW over the laid-out parameters and runs two real training steps on the same batch (4 x 128 tokens).
Each rank's measured peak is the profiler's allocator events over the two steps plus the bytes alive before them
(its local parameter shards, buffers, the batch). The profiler loses the frees gloo's worker threads make: the steps
run inside `preflight._measure.collective_calls`, where each collective (the functional ones DTensor issues included)
returns only once gloo's worker has let go of what it was handed, so that the caller frees it on its own thread; a
free still lost is put back where the address is allocated again (an upper bound, "measured max"), and also at the
end of the phase or collective that allocated the block ("call end", `preflight._measure.lost_free_peaks`).
Each configuration is measured REPEATS times, in fresh processes. The prediction is
``preflight.estimate(model, AdamW, batch, Run(parallel=ParallelPlan(world, sharding, tp=TPPlan(2, styles))))``
made before any process group exists, one figure per rank.

Beside it, the closed form users compute by hand: Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022), activations per layer ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` bytes with tensor parallelism
and ``s*b*h/t*(34 + 5*a*s/h)`` with sequence parallelism, times the layers, for a GPT layer in 16-bit with dropout
(what the paper counts); the traced activations category (fp32 here, a Llama layer: SwiGLU, no dropout, grouped
key/value heads, plus the logits and the loss) is printed beside it. They are different programs; the column shows by
how much a hand estimate misses this one.

Run: python benchmarks/tensor_parallel.py      (about 2 to 4 minutes on 2 CPU cores)
Writes benchmarks/results/tensor_parallel.md and prints the same table.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

import torch

REPEATS = 3
BATCH, SEQ = 4, 128
VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 8192, 256, 688, 4, 8, 4
# (layout, world size): the tensor-parallel degree is 2 everywhere but "tp" over 4 ranks
CONFIGS = (("tp", 2), ("tp", 4), ("tp (own plan)", 2), ("sp", 2), ("tp x fsdp2", 4), ("moe (own plan)", 2),
           ("moe (own plan) x fsdp2", 4))
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tensor_parallel.md")


def build(layout: str = "tp") -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ)
    if layout.startswith("moe"):
        model = MixtralForCausalLM(MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2))
    else:
        model = LlamaForCausalLM(LlamaConfig(**sizes))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def styles(layout: str) -> dict[str, Any] | None:
    """The DTensor plan of ``layout`` (None: the model's own, which preflight translates)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    if "own plan" in layout:
        return None
    layer = "model.layers.*."
    plan: dict[str, Any] = {f"{layer}self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
    plan.update({f"{layer}mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")})
    if layout != "sp":
        plan.update({f"{layer}self_attn.o_proj": RowwiseParallel(), f"{layer}mlp.down_proj": RowwiseParallel()})
        return plan
    sequence = Shard(1)
    plan.update({
        # Outputs kept as DTensors: the model reads the sequence length off the embeddings (its rotary positions),
        # and the residual adds meet sequence-sharded DTensors.
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence,
                                              use_local_output=False),
        f"{layer}input_layernorm": SequenceParallel(),
        f"{layer}self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": sequence},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        f"{layer}self_attn.o_proj": RowwiseParallel(output_layouts=sequence, use_local_output=False),
        f"{layer}post_attention_layernorm": SequenceParallel(),
        f"{layer}mlp": PrepareModuleInput(input_layouts=(sequence,), desired_input_layouts=(Replicate(),)),
        f"{layer}mlp.down_proj": RowwiseParallel(output_layouts=sequence, use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=sequence, output_layouts=Replicate()),
    })
    return plan


def lay_out(model: torch.nn.Module, layout: str, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from preflight.parallel import model_styles

    plan = styles(layout) or model_styles(model)
    if not layout.endswith("x fsdp2"):
        return parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], plan)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def _worker(rank: int, world: int, layout: str, port: int, queue: Any) -> None:
    import torch.distributed as dist

    from distributed import join_gloo, measured_peaks

    join_gloo(rank, world, port)
    try:
        model, batch = build(layout)
        model = lay_out(model, layout, world)
        queue.put((rank, measured_peaks(model, torch.optim.AdamW(model.parameters()), batch)))
    finally:
        dist.destroy_process_group()


def measure(layout: str, world: int) -> list[tuple[int, ...]]:
    """Each rank's (repaired, ..., call-end) peaks in one run of ``world`` fresh processes."""
    from distributed import spawn_ranks

    return spawn_ranks(_worker, world, world, layout)


def predict(layout: str, world: int) -> Any:
    import preflight
    from preflight.parallel import TPPlan

    model, batch = build(layout)
    degree = world if "fsdp" not in layout and layout != "sp" else 2
    sharding = "fsdp2" if "fsdp2" in layout else None
    run = preflight.Run(parallel=preflight.ParallelPlan(world, sharding, tp=TPPlan(degree, styles(layout))))
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, run)
    assert est.per_rank_peak_bytes is not None, est.coverage.notes  # traced per rank
    return est


def closed_form(layout: str, world: int) -> int | None:
    """Korthikanti et al.'s activation bytes for the run's layers (module docstring), as the estimate's note gives
    them (`preflight.parallel._tensor.closed_form_activations`)."""
    from preflight.parallel._tensor import closed_form_activations

    model, batch = build(layout)
    return closed_form_activations(model, batch, 2 if "fsdp" in layout else world, sequence_parallel=layout == "sp")


def main() -> int:
    warnings.filterwarnings("ignore")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `distributed`'s helpers, in the workers too
    mib = 1 << 20
    rows, worst, worst_placed = [], 0.0, 0.0
    start = time.perf_counter()
    for layout, world in CONFIGS:
        runs = [measure(layout, world) for _ in range(REPEATS)]
        est = predict(layout, world)
        formula = closed_form(layout, world)
        for rank in range(world):
            low, high = min(r[rank][0] for r in runs), max(r[rank][0] for r in runs)
            placed = max(r[rank][-1] for r in runs)
            predicted = est.per_rank_peak_bytes[rank]
            error, placed_error = (predicted - high) / high, (predicted - placed) / placed
            worst, worst_placed = max(worst, abs(error)), max(worst_placed, abs(placed_error))
            rows.append((layout, world, rank, low, high, placed, predicted, error, placed_error,
                         est.breakdown["activations"], formula))
        print(f"  {layout} x{world}: measured {runs}, predicted {est.per_rank_peak_bytes}", file=sys.stderr)
    lines = [
        f"Real DTensor tensor parallelism on gloo CPU processes: a Llama of {LAYERS} layers, hidden {HIDDEN}, "
        f"{HEADS} heads ({KV_HEADS} key/value), vocab {VOCAB} (the moe rows: a Mixtral of the same sizes, 4 experts, 2 "
        f"per token), batch {BATCH} x {SEQ}, AdamW, 2 steps; {REPEATS} runs "
        "per configuration in fresh processes; tensor-parallel degree 2 except tp over 4 ranks. Closed form: "
        "Korthikanti et al.'s activations per layer (16-bit GPT layer with dropout) x layers, beside the traced "
        f"activations category at the peak. Command: `python benchmarks/tensor_parallel.py`. torch "
        f"{torch.__version__}.",
        "",
        "| layout | world size | rank | measured min (MiB) | measured max (MiB) | max, lost frees at call end (MiB) | "
        "predicted (MiB) | error vs max | error vs call-end max | traced activations (MiB) | closed form (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for layout, world, rank, low, high, placed, predicted, error, placed_error, acts, formula in rows:
        lines.append(f"| {layout} | {world} | {rank} | {low / mib:.2f} | {high / mib:.2f} | {placed / mib:.2f} | "
                     f"{predicted / mib:.2f} | {error:+.2%} | {placed_error:+.2%} | {acts / mib:.2f} | "
                     f"{'n/a' if formula is None else f'{formula / mib:.2f}'} |")
    lines += ["", f"largest |error| vs the largest measurement: {worst:.2%}; vs the call-end figure: "
              f"{worst_placed:.2%} ({time.perf_counter() - start:.0f} s)"]
    from distributed import write_results

    write_results("\n".join(lines), RESULTS)
    return 0 if worst_placed <= 0.03 else 1


if __name__ == "__main__":
    sys.exit(main())
