"""Per-rank peak memory of real expert-parallel training on CPU processes (gloo), against preflight's prediction.

For each configuration, `torch.multiprocessing` starts WORLD processes that each load the same Qwen3-MoE
(transformers, 4 layers, hidden 256, 8 heads of which 4 key/value, 8 experts of which 2 per token, expert width
256, vocab 8192; saved once from its config with a fixed seed) with ``from_pretrained(path,
distributed_config=DistributedConfig(fsdp_size=WORLD, ep_size=EP))``: transformers spreads each layer's experts over
the ``ep`` ranks and shards the rest with FSDP2, and in training its experts get their tokens through two
all-to-alls. With TP > 1 (``DistributedConfig(tp_size=TP, fsdp_size=WORLD // TP, ep_size=EP)``), transformers' tensor
parallelism lays the dense layers out with the model's own plan first, and FSDP2 shards them over the other dim;
with R > 1 replicas (``dp_replicate_size=R``, HSDP) the layout is repeated R times, the ``ep`` dim inside each. Each rank runs AdamW for two real training steps on its own batch (BATCH x SEQ tokens). The routers are
hooked to route as preflight's routing assumption says (``balanced``: token t to experts (t * k + j) mod E;
``skewed``: every token to experts 0 and 1), so that the comparison checks the engine's memory, not one random
router's choices. Each rank's measured peak is the profiler's allocator events over the two steps plus the bytes
alive before them (its parameters' storages, buffers, the batch); every synchronous collective waits for gloo's
worker to let go of its tensors (`preflight._measure.collective_calls`), and the frees gloo's threads make are placed
at the end of the phase or collective that allocated the block (`preflight._measure.lost_free_peaks`). Each
configuration is measured REPEATS times, in fresh processes. The prediction is ``preflight.estimate(model, AdamW,
batch, Run(routing=..., parallel=ParallelPlan(WORLD, "fsdp2", ep=EPPlan(EP), tp=TPPlan(TP),
fsdp=FSDP2Plan(replicate=R))))`` (no ``tp`` where TP is 1, no ``fsdp`` where R is 1) on the model built from the same checkpoint before any process group exists, one figure per rank.

Run: python benchmarks/expert_parallel.py      (about 15 minutes on 2 shared CPU cores)
Writes benchmarks/results/expert_parallel.md and prints the same table.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

REPEATS = 3
BATCH, SEQ = 4, 128
# (world size, ep size, tp size, replicas, routing)
CONFIGS = ((2, 2, 1, 1, "balanced"), (2, 2, 1, 1, "skewed"), (4, 2, 1, 1, "balanced"), (4, 4, 1, 1, "balanced"),
           (4, 4, 1, 1, "skewed"), (4, 2, 2, 1, "balanced"), (4, 4, 2, 1, "balanced"), (4, 4, 2, 1, "skewed"),
           (4, 2, 1, 2, "balanced"))
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "expert_parallel.md")


def config() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=8192, hidden_size=256, intermediate_size=688, moe_intermediate_size=256,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                          num_experts=8, num_experts_per_tok=2, max_position_embeddings=SEQ)


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 8192, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def route_as(model: torch.nn.Module, routing: str) -> None:
    """Every router of ``model`` picks its experts as preflight's ``routing`` assumption does."""
    from preflight.trace._routing import routing_indices

    def hook(module: Any, inputs: Any, output: Any) -> Any:
        logits, scores, indices = output
        return logits, scores, routing_indices(routing, tuple(logits.shape), -1, indices.shape[-1])

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(hook)


def _worker(rank: int, world: int, ep: int, tp: int, replicate: int, routing: str, path: str, port: int,
            queue: Any) -> None:
    import torch.distributed as dist
    from transformers import Qwen3MoeForCausalLM

    from distributed import join_gloo, measured_peaks
    from preflight.parallel import EPPlan

    join_gloo(rank, world, port)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        model = Qwen3MoeForCausalLM.from_pretrained(path, distributed_config=EPPlan(ep).config(world, tp, replicate))
        route_as(model, routing)
        queue.put((rank, measured_peaks(model, torch.optim.AdamW(model.parameters()), batch())))
    finally:
        dist.destroy_process_group()


def measure(world: int, ep: int, tp: int, replicate: int, routing: str, path: str) -> list[tuple[int, ...]]:
    """Each rank's (repaired, call-end, dropped) peaks in one run of ``world`` fresh processes."""
    from distributed import spawn_ranks

    return spawn_ranks(_worker, world, world, ep, tp, replicate, routing, path)


def predict(world: int, ep: int, tp: int, replicate: int, routing: str, path: str) -> Any:
    import preflight
    from preflight.parallel import EPPlan, FSDP2Plan, TPPlan
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(path)
    run = preflight.Run(routing=routing, parallel=preflight.ParallelPlan(
        world, "fsdp2", ep=EPPlan(ep), tp=TPPlan(tp) if tp > 1 else None,
        fsdp=FSDP2Plan(replicate=replicate) if replicate > 1 else None))
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch(), run)
    assert est.per_rank_peak_bytes is not None and not est.coverage.lower_bound, est.coverage.notes
    return est


def main() -> int:
    warnings.filterwarnings("ignore")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `distributed`'s helpers, in the workers too
    from transformers import Qwen3MoeForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    mib = 1 << 20
    rows, worst = [], 0.0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(config()).save_pretrained(folder)
        for world, ep, tp, replicate, routing in CONFIGS:
            runs = [measure(world, ep, tp, replicate, routing, folder) for _ in range(REPEATS)]
            est = predict(world, ep, tp, replicate, routing, folder)
            for rank in range(world):
                low, high = min(r[rank][1] for r in runs), max(r[rank][1] for r in runs)
                predicted = est.per_rank_peak_bytes[rank]
                error = (predicted - high) / high
                worst = max(worst, abs(error))
                rows.append((world, ep, tp, replicate, routing, rank, low, high, predicted, error, est.breakdown["parameters"]))
            print(f"  world {world} ep {ep} tp {tp} replicas {replicate} {routing}: measured {runs}, predicted {est.per_rank_peak_bytes}",
                  file=sys.stderr)
    lines = [
        "Real expert parallelism (transformers' DistributedConfig(dp_replicate_size=R, tp_size=T, fsdp_size=W / (R "
        "T), ep_size=N), its all-to-all exchange; tp 1: no tensor parallelism, replicas 1: none) on gloo CPU "
        "processes: a Qwen3-MoE of 4 layers, hidden 256, 8 experts (2 per token), vocab 8192, batch "
        f"{BATCH} x {SEQ} per rank, AdamW, 2 steps; routers hooked to the routing named; {REPEATS} runs per "
        "configuration in fresh processes; lost frees placed at the end of their phase or collective. Command: "
        f"`python benchmarks/expert_parallel.py`. torch {torch.__version__}.",
        "",
        "| world size | ep | tp | replicas | routing | rank | measured min (MiB) | measured max (MiB) | "
        "predicted (MiB) | error vs max | parameters at the peak (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world, ep, tp, replicate, routing, rank, low, high, predicted, error, params in rows:
        lines.append(f"| {world} | {ep} | {tp} | {replicate} | {routing} | {rank} | {low / mib:.3f} | {high / mib:.3f} | "
                     f"{predicted / mib:.3f} | {error:+.3%} | {params / mib:.2f} |")
    lines += ["", f"largest |error| vs each rank's largest measurement: {worst:.3%} "
              f"({time.perf_counter() - start:.0f} s)"]
    from distributed import write_results

    write_results("\n".join(lines), RESULTS)
    return 0 if worst <= 0.03 else 1


if __name__ == "__main__":
    sys.exit(main())
