"""The run's phases beyond the training step, measured on CPU against preflight's prediction: checkpoint saves per
rank under FSDP2 and FSDP1 on real gloo processes, and the caching allocator's reserved memory over a sequence of
varying batch shapes.

**Saves.** For each configuration, `torch.multiprocessing` starts WORLD processes that each build the same Llama
(transformers, LAYERS layers, hidden HIDDEN, vocab VOCAB; same seed), wrap it as users do (FSDP2: ``fully_shard`` on
each decoder layer and the root; FSDP1: ``FullyShardedDataParallel`` with ``ModuleWrapPolicy({decoder layer})``,
``use_orig_params=True``, ``device_id=cpu``), run two AdamW steps on a 1 x 32-token batch (small, so that the save is
the run's peak where it gathers) and then save as the run's
`preflight.Checkpoint` says (`preflight._checkpoint.collect_state`: FSDP1's ``state_dict_type`` with
``optim_state_dict``, or torch's distributed ``get_model_state_dict`` / ``get_optimizer_state_dict`` for FSDP2).
Each rank's measured peak over the whole (steps and save, one profiler session) is the profiler's allocator events
plus what was alive before them, with the frees gloo's worker threads make put back at the end of the phase that
allocated the block (``call end``, as ``benchmarks/distributed.py`` places them); each synchronous collective waits
until gloo's worker has released its tensors, so that their frees happen where the profiler sees them
(`preflight._measure.collective_calls`). The prediction is
``preflight.estimate(model, AdamW, batch, Run(parallel=plan, checkpoint=checkpoint))`` made before any process
group exists: each rank's training figure and its save (``Estimate.phases``); the rank's run peak is the larger.
Each configuration runs REPEATS times. On CPU, FSDP1's ``offload_to_cpu`` moves nothing (it is not asked for: on CPU
tensors it frees the storage its own views read, and the real run crashes); DCP's ``cpu_offload`` still decides that
rank 0 alone keeps the full state dict.

**Reserved memory over varying shapes.** A Llama trained on STEPS batches of 4 sequences whose lengths vary (drawn
with a seeded generator, as an epoch of padded batches): `preflight.estimate_steps` traces one step per batch, in
order, and the allocator model replays its events, with and without ``empty_cache()`` after each step; the same
model replays the real CPU steps' own allocation events (the profiler's, with the same step boundaries). The table
gives the reserved bytes after the first step, the peak, and the step in which the reserve last grew, for both.

Run: python benchmarks/phases.py      (about 6 minutes on 2 shared CPU cores)
Writes benchmarks/results/phases.md and prints the same table.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

import torch

REPEATS = 3
WORLD = 2
BATCH = 4  # the steps over varying shapes: 4 sequences a batch
SAVE_BATCH, SAVE_SEQ = 1, 32  # the saves: a small batch, so that a gathered state dict is the run's peak
VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 8192, 256, 688, 4, 8, 4
STEPS = 12
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "phases.md")


def build() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, VOCAB, (SAVE_BATCH, SAVE_SEQ), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def checkpoints() -> list[tuple[str, Any]]:
    from preflight import Checkpoint

    return [("fsdp2", Checkpoint()), ("fsdp2", Checkpoint(offload_to_cpu=False, rank0_only=False)),
            ("fsdp2", Checkpoint(state_dict="sharded")), ("fsdp1", Checkpoint()),
            ("fsdp1", Checkpoint(offload_to_cpu=False, rank0_only=False)), ("fsdp1", Checkpoint(state_dict="sharded"))]


def describe(checkpoint: Any) -> str:
    if checkpoint.state_dict == "sharded":
        return "sharded"
    return "full, rank 0 on the host" if checkpoint.offload_to_cpu and checkpoint.rank0_only else \
        "full, every rank on the device"


def wrap(model: torch.nn.Module, engine: str) -> torch.nn.Module:
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({type(model.model.layers[0])}),
                                    use_orig_params=True, device_id=torch.device("cpu"))


def _worker(rank: int, world: int, engine: str, checkpoint: Any, port: int, queue: Any) -> None:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from distributed import _CALL, _alive_storages, _Phases, join_gloo
    from preflight._checkpoint import collect_state
    from preflight._device import live_storage_bytes
    from preflight._measure import collective_calls, lost_free_peaks
    from preflight._quiet import StderrFilter
    from preflight._steps import run_steps

    join_gloo(rank, world, port)
    try:
        model, batch = build()
        model = wrap(model, engine)
        optimizer = torch.optim.AdamW(model.parameters())
        local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
        before = live_storage_bytes([local, list(model.buffers()), batch], torch.device("cpu"))

        def save(module: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
            held = collect_state(module, opt, checkpoint, host_is_device=True)
            del held

        dist.barrier()
        phases = _Phases()
        with StderrFilter(), collective_calls(_CALL), profile(activities=[ProfilerActivity.CPU],
                                                              profile_memory=True) as prof:
            run_steps(model, optimizer, batch, step=None, precision=None, device_type="cpu", steps=2,
                      on_phase=phases.mark, save=save)
            phases.close()
        queue.put((rank, before + lost_free_peaks(prof, _alive_storages(), _CALL)[1]))
    finally:
        dist.destroy_process_group()


def measure_save(engine: str, checkpoint: Any) -> list[int]:
    """Each rank's measured peak in one run of WORLD fresh processes."""
    from distributed import spawn_ranks

    return spawn_ranks(_worker, WORLD, WORLD, engine, checkpoint)


def predict_save(engine: str, checkpoint: Any) -> Any:
    import preflight
    from preflight.parallel import FSDP1Plan

    model, batch = build()
    plan = preflight.ParallelPlan(WORLD, "fsdp2") if engine == "fsdp2" else preflight.ParallelPlan(
        WORLD, "fsdp-full", fsdp=FSDP1Plan(unit_types=(type(model.model.layers[0]),)))
    return preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                              preflight.Run(parallel=plan, checkpoint=checkpoint))


def step_batches() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    out = []
    for _ in range(STEPS):
        length = int(torch.randint(16, 256, (1,), generator=gen))
        ids = torch.randint(0, VOCAB, (BATCH, length), generator=gen)
        out.append({"input_ids": ids, "labels": ids})
    return out


def grew_in(peaks: tuple[int, ...]) -> int:
    return 1 + max(range(len(peaks)), key=lambda i: (peaks[i], -i))


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    warnings.filterwarnings("ignore")
    import preflight
    from preflight._epoch import _step_ends
    from preflight.allocator import simulate

    mib = 2**20
    lines = ["## Checkpoint saves per rank (2 gloo processes, two AdamW steps then the save)", "",
             f"Llama {LAYERS} layers, hidden {HIDDEN}, vocab {VOCAB}; batch {SAVE_BATCH} x {SAVE_SEQ}; {REPEATS} runs "
             "each. "
             "Predicted: the larger of the rank's training and saving figures; measured: the whole run's peak "
             "(synchronous collectives waiting for gloo's worker, lost frees of the others placed at their call's end), smallest and largest of the runs.", "",
             "| engine | save | rank | training MiB | saving MiB | predicted run peak MiB | measured min MiB | "
             "measured max MiB | error vs min |", "|---|---|---|---|---|---|---|---|---|"]
    start = time.perf_counter()
    worst = 0.0
    for engine, checkpoint in checkpoints():
        est = predict_save(engine, checkpoint)
        saving = est.phase("saving")
        runs = [measure_save(engine, checkpoint) for _ in range(REPEATS)]
        for rank in range(WORLD):
            train, save = est.per_rank_peak_bytes[rank], saving.per_rank_peak_bytes[rank]
            predicted = max(train, save)
            low, high = min(r[rank] for r in runs), max(r[rank] for r in runs)
            error = (predicted - low) / low
            worst = max(worst, abs(error))
            lines.append(f"| {engine} | {describe(checkpoint)} | {rank} | {train / mib:.2f} | {save / mib:.2f} | "
                         f"{predicted / mib:.2f} | {low / mib:.2f} | {high / mib:.2f} | {error:+.2%} |")
            print(lines[-1], flush=True)
    lines += ["", f"Largest |error| against the smallest measurement: {worst:.2%}.", ""]

    lines += ["## Reserved memory over a sequence of varying shapes", "",
              f"The same Llama, {STEPS} steps of {BATCH} sequences of 16 to 255 tokens (seeded), one device. The "
              "allocator model replays the traced events (`estimate_steps`) and the real CPU steps' own events.", "",
              "| empty_cache() after each step | source | reserved after step 1 MiB | reserved peak MiB | "
              "last grew in step |", "|---|---|---|---|---|"]
    batches = step_batches()
    model, _ = build()
    series = preflight.estimate_steps(model, torch.optim.AdamW(model.parameters()), batches)
    traced = series.estimate.events
    ends = _step_ends(traced, STEPS)
    from preflight._measure import step_events

    real_model, _ = build()
    real, real_ends = step_events(real_model, torch.optim.AdamW(real_model.parameters()), batches)
    for empty in (False, True):
        for source, events, marks in (("traced", traced, ends), ("real CPU events", real, real_ends)):
            sim = simulate(events, report_after=marks, empty_cache_after=marks if empty else ())
            lines.append(f"| {'yes' if empty else 'no'} | {source} | {sim.reserved_after[0] / mib:.0f} | "
                         f"{sim.peak_reserved_bytes / mib:.0f} | {grew_in(sim.peak_reserved_between)} |")
            print(lines[-1], flush=True)
    one = simulate(traced[:ends[0] + 1])
    lines += ["", f"One shape (the first step alone) reserves {one.peak_reserved_bytes / mib:.0f} MiB.", ""]
    lines.append(f"Command: `python benchmarks/phases.py` ({time.perf_counter() - start:.0f} s).")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
