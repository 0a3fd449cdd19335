"""The loading phase measured on CPU against preflight's prediction: each rank of FSDP2 and FSDP1 on real gloo
processes, and transformers' ``from_pretrained`` on one device.

**Per rank.** For each configuration, `torch.multiprocessing` starts WORLD processes; inside one profiler session
each builds the same Llama (transformers, LAYERS layers, hidden HIDDEN, vocab VOCAB; same seed) and wraps it as
users do: ``device``, built on the CPU (the device here) and then FSDP2's ``fully_shard`` on each decoder layer and
the root, or ``FullyShardedDataParallel`` with ``ModuleWrapPolicy({decoder layer})``, ``use_orig_params=True``,
``device_id=cpu``; ``meta``, built under ``torch.device("meta")``, then ``fully_shard`` as above and ``to_empty`` on
the CPU, or FSDP1 as above with ``param_init_fn`` materialising each unit on the CPU (``to_empty``); ``meta-rank0``,
FSDP2 built on meta as above, its shards then filled from the full state dict rank 0 builds on the CPU, by torch's
``set_model_state_dict(..., StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))``, or FSDP1 with
``sync_module_states=True`` over rank 0's model built on the CPU and the others' on meta (``param_init_fn`` as
above; FSDP1's check that refuses CPU states there, NCCL's rule, is skipped: gloo broadcasts them). Each rank's
measured peak is the profiler's allocator events over the session (nothing is alive before it: every free is of a
block the session allocated); the broadcasts wait until gloo has let go of their tensors
(`preflight._measure.collective_calls`), so no free is lost on gloo's threads, except FSDP1's, whose buckets torch's
C++ makes: each ``sync_module_states`` call runs in a named range, and a block allocated there that neither is
freed in view nor belongs to the wrapped model is freed at the range's end (`preflight._measure.lost_free_peaks`).
The prediction is ``preflight.estimate(model, AdamW, batch, Run(parallel=plan, loading=Loading(placement)))`` made
before any process group exists: the phase ``"loading"``'s figure for each rank. Each configuration runs REPEATS
times. ``host`` needs a CUDA device to differ from ``device`` (on a CPU target the host is the device) and is not
measured here.

**One device.** The model is saved with ``save_pretrained`` (safetensors) and loaded back with
``AutoModelForCausalLM.from_pretrained`` under the profiler; the prediction is the loaded model's loading phase
(``Loading()``: its parameters and buffers).

Run: python benchmarks/loading.py      (under 2 minutes on 2 shared CPU cores)
Writes benchmarks/results/loading.md and prints the same table.
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
WORLD = 2
VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 8192, 256, 688, 4, 8, 4
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "loading.md")
CONFIGURATIONS = (("fsdp2", "device"), ("fsdp2", "meta"), ("fsdp2", "meta-rank0"), ("fsdp-full", "device"),
                  ("fsdp-full", "meta"), ("fsdp-full", "meta-rank0"))


def build() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512)
    return LlamaForCausalLM(config)


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _on_cpu(module: torch.nn.Module) -> None:
    """FSDP1's ``param_init_fn`` for a model built on meta: the unit's own tensors materialised on the CPU."""
    module.to_empty(device="cpu", recurse=False)


def loaded_peak(build_model: Any, engine: str, placement: str, rank: int, unit_types: Any = None) -> int:
    """This rank's measured peak (B) while it builds a transformers Llama with ``build_model()`` and wraps it as
    ``placement`` says (module docstring), in a gloo job already started; the model is kept until it returns.
    ``unit_types``: the module classes FSDP1 wraps (the Llama's decoder layer)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from torch.profiler import ProfilerActivity, profile

    from preflight._device import live_storages
    from preflight._measure import collective_calls, lost_free_peaks
    from preflight._quiet import StderrFilter
    from preflight.parallel._rank import patched

    kept = {}
    policy = ModuleWrapPolicy(unit_types or {LlamaDecoderLayer})

    def load() -> None:  # built inside the measured window: every block's free is seen
        on_cpu = placement == "device" or (placement == "meta-rank0" and engine != "fsdp2" and rank == 0)
        with torch.device("cpu" if on_cpu else "meta"):
            model = build_model()
        if engine == "fsdp2":
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            if placement != "device":
                model.to_empty(device="cpu")
            if placement == "meta-rank0":  # rank 0's full state dict (its "checkpoint"), broadcast tensor by tensor
                full = build_model().state_dict() if rank == 0 else {}
                set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                           broadcast_from_rank0=True))
        elif placement == "meta-rank0":  # rank 0 on the CPU, the others on meta: FSDP1 broadcasts rank 0's states
            from torch.distributed.fsdp import _init_utils

            # FSDP1's check that refuses CPU states is NCCL's rule, not gloo's
            with patched([(_init_utils, "_check_module_states_for_sync_module_states", lambda states: None)]):
                model = FullyShardedDataParallel(model, auto_wrap_policy=policy,
                                                 device_id=torch.device("cpu"), use_orig_params=True,
                                                 param_init_fn=_on_cpu, sync_module_states=True)
        else:
            model = FullyShardedDataParallel(model, auto_wrap_policy=policy,
                                             device_id=torch.device("cpu"), use_orig_params=True,
                                             param_init_fn=_on_cpu if placement == "meta" else None)
        kept["model"] = model

    dist.barrier()
    with collective_calls("## "), _ranged_sync("## "):  # the broadcasts' frees on this thread, or placed
        with StderrFilter(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            load()
    # What the load keeps: the wrapped model's tensors (FSDP1's flat parameters too). A block allocated inside a
    # named call, never freed in view and not among them, was freed on gloo's thread: placed at its call's end.
    model = kept["model"]
    kept_tensors = [*model.parameters(), *model.buffers(),
                    *(m._handle.flat_param for m in FullyShardedDataParallel.fsdp_modules(model) if m._handle)]
    alive = set(live_storages(kept_tensors, torch.device("cpu")))
    return lost_free_peaks(prof, alive, "## ")[1]  # nothing is alive before: every free is of the session's blocks


def _ranged_sync(prefix: str) -> Any:
    """FSDP1's ``sync_module_states`` broadcasts in torch's C++ ``_broadcast_coalesced``, whose flattened buckets
    gloo's worker may free out of the profiler's sight once the call has waited for them: each call runs in a range
    named ``prefix + "sync"``, at whose end `preflight._measure.lost_free_peaks` places such a free."""
    from torch.distributed.fsdp import _init_utils
    from torch.profiler import record_function

    from preflight.parallel._rank import patched

    original = _init_utils._sync_params_and_buffers

    def ranged(*args: Any, **kwargs: Any) -> Any:
        with record_function(prefix + "sync"):
            return original(*args, **kwargs)

    return patched([(_init_utils, "_sync_params_and_buffers", ranged)])


def _worker(rank: int, world: int, engine: str, placement: str, port: int, queue: Any) -> None:
    import torch.distributed as dist

    from distributed import join_gloo

    join_gloo(rank, world, port)
    try:
        queue.put((rank, loaded_peak(build, engine, placement, rank)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(engine: str, placement: str) -> list[int]:
    """Each rank's measured peak in one run of WORLD fresh processes."""
    from distributed import spawn_ranks

    return spawn_ranks(_worker, WORLD, WORLD, engine, placement)


def predict(engine: str, placement: str) -> tuple[int, ...]:
    import preflight

    model = build()
    loading = (preflight.Loading("meta", from_rank0=True) if placement == "meta-rank0" else
               preflight.Loading(placement))
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch(),
                             preflight.Run(parallel=preflight.ParallelPlan(WORLD, engine), loading=loading))
    return est.phase("loading").per_rank_peak_bytes


def one_device() -> tuple[int, int, int]:
    """``(predicted, measured, header)`` of ``from_pretrained`` of a saved model on the CPU."""
    from transformers import AutoModelForCausalLM

    import preflight
    from preflight._measure import cpu_profiled_peak

    with tempfile.TemporaryDirectory() as folder:
        build().save_pretrained(folder)
        header = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
        loaded = {}
        measured, _ = cpu_profiled_peak(lambda: loaded.update(model=AutoModelForCausalLM.from_pretrained(folder)),
                                        resident={})
    model = loaded["model"]
    header -= sum(p.numel() * p.element_size() for p in model.parameters())
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch(),
                             preflight.Run(loading=preflight.Loading()))
    return est.phase("loading").peak_bytes, measured, header


def main() -> None:
    warnings.filterwarnings("ignore")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `distributed`'s helpers, in the workers too
    start = time.perf_counter()
    rows = ["| engine | placement | rank | predicted (B) | measured min / max (B) | error |",
            "|---|---|---|---|---|---|"]
    for engine, placement in CONFIGURATIONS:
        predicted = predict(engine, placement)
        runs = [measure(engine, placement) for _ in range(REPEATS)]
        for rank in range(WORLD):
            low, high = min(r[rank] for r in runs), max(r[rank] for r in runs)
            error = (predicted[rank] - high) / high
            rows.append(f"| {engine} | {placement} | {rank} | {predicted[rank]:,} | {low:,} / {high:,} | "
                        f"{error:+.4%} |")
        print(f"{engine} {placement}: done", file=sys.stderr)
    predicted, measured, header = one_device()
    rows.append("")
    rows.append("| one device | predicted (B) | measured (B) | difference | of which the safetensors header |")
    rows.append("|---|---|---|---|---|")
    rows.append(f"| from_pretrained (CPU) | {predicted:,} | {measured:,} | {measured - predicted:+,} B | "
                f"{header:,} B |")
    table = "\n".join(rows)
    from distributed import write_results

    write_results(f"Loading phase, {WORLD} gloo processes, Llama {LAYERS} layers x hidden {HIDDEN}, vocab {VOCAB}; "
                  f"{REPEATS} runs each (torch {torch.__version__}); {time.perf_counter() - start:.0f} s\n\n{table}",
                  RESULTS)


if __name__ == "__main__":
    main()
