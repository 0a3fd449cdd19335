"""Real DeepSpeed ZeRO-1/2/3 on CPU processes (gloo) against preflight's prediction from the same config, per rank.

DeepSpeed is not a dependency of preflight or of its tests; this measurement needs it installed
(``pip install deepspeed``; checked with 0.19.8, whose CPU accelerator talks gloo when oneCCL is absent). For each
stage, ``reduce_bucket_size`` (DeepSpeed's default 500,000,000 elements, and 50,000,000) and ``overlap_comm``, 2
fresh processes build the GPT-2 of ``benchmarks/distributed.py`` (4 layers, hidden 256, vocab 8192, batch 4 x 128,
fp32), call ``deepspeed.initialize`` with AdamW (``torch_adam``) and run two training steps. Each rank's peak is the
profiler's allocator events over building the model and batch, ``initialize`` and the steps. The model is built
inside the profiled session because DeepSpeed frees its parameter storages (ZeRO-3 partitions them, stages 1 and 2
move them into flat buffers): frees of blocks allocated before a session are not recorded, so a model built before
would stay counted.

The profiler also loses frees made on gloo's worker threads (`preflight._measure.repaired_memory_peak`): a
collective's buffer whose last reference the worker drops. An address allocated again with no free in between, and
a block the replay still holds at the end that no live tensor holds (``gc.get_objects()`` after the steps), are
those lost frees (`preflight._measure.lost_free_peaks`); each peak is given three ways:
    repaired         an unrecorded free is placed where the address is allocated again, or never (the measurement
                     of earlier versions; it varies from run to run with the threads' timing).
    call end         a lost free is placed at the end of the profiled call that allocated the block, or before the
                     address is allocated again if that comes first (build,
                     ``initialize``, forward, backward, step): DeepSpeed waits for each collective within the call
                     that starts it, and gloo's worker drops a finished work right after running it
                     (``ProcessGroupGloo::runLoop``). An upper bound under that reading of the source.
    dropped          the lost blocks are not counted at all: a lower bound.
Three runs per configuration; ``predicted`` is ``preflight.estimate(..., world_size=2, deepspeed_config=<the same
config>)``: the per-category rescale of one single-device trace plus ZeRO's gradient reduction buffers sized from
the config (the ``buffers`` column) and, at stage 3, ZeRO-3's own terms (`preflight._sharding.zero3_terms`).
``DeepSpeed's estimator`` is DeepSpeed's own model-states estimate for the same case, the figure its
``estimate_zero3_model_states_mem_needs_all_live`` / ``estimate_zero2_model_states_mem_needs_all_live`` print
for 2 GPUs on 1 node without offload (``estimate_zero3_model_states_mem_needs`` /
``estimate_zero2_model_states_mem_needs``; it has none for stage 1): parameters, gradients and optimizer states
only, sized for 16-bit parameters.

Run: python benchmarks/deepspeed_cpu.py     (about 5 minutes on 2 CPU cores)
Writes benchmarks/results/deepspeed_cpu.md and prints the same table.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import distributed  # noqa: E402  (the same model and batch)

WORLD, RUNS = 2, 3
# (stage, reduce_bucket_size, overlap_comm); None: DeepSpeed's default (off at stages 1 and 2, on at stage 3).
CONFIGS = ((1, 500_000_000, None), (2, 500_000_000, None), (3, 500_000_000, None), (1, 50_000_000, None),
           (2, 50_000_000, None), (2, 50_000_000, True), (3, 50_000_000, None))
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "deepspeed_cpu.md")


def ds_config(stage: int, bucket: int, overlap: bool | None) -> dict:
    """The DeepSpeed config of one configuration (the run's and the prediction's)."""
    zero = {"stage": stage, "reduce_bucket_size": bucket}
    if overlap is not None:
        zero["overlap_comm"] = overlap
    return {"train_micro_batch_size_per_gpu": distributed.BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "zero_optimization": zero}


def profiled_run(rank: int, world: int, port: int, config: dict, then: Callable[[Any], None] | None = None
                 ) -> tuple[Any, set[int]]:
    """Rank ``rank`` of a fresh ``world``-process DeepSpeed run under ``config``: the model built, ``initialize``
    and two training steps in one profiled session, each in a range named `_CALL` + its name; ``then(engine)``
    after the steps, inside the session, in the range ``_CALL + "then"``. The profile and the storage addresses of
    the tensors alive at the end (`preflight._measure.lost_free_peaks`' ``alive``)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import importlib

    import deepspeed

    from torch.profiler import ProfilerActivity, profile, record_function

    from preflight._quiet import StderrFilter

    # Its shared-memory kernel serves only inference all-reduce, and its just-in-time build can leave a stale lock
    # that hangs later runs (benchmarks/deepspeed_trainers.py's PROLOGUE): training's collectives are gloo's.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    with StderrFilter(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function(f"{_CALL}build"):
            model, batch = distributed.build("gpt2")
        with record_function(f"{_CALL}initialize"):
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        for _ in range(2):
            with record_function(f"{_CALL}forward"):
                loss = engine(**batch).loss
            with record_function(f"{_CALL}backward"):
                engine.backward(loss)
            with record_function(f"{_CALL}step"):
                engine.step()
        del loss
        if then is not None:
            with record_function(f"{_CALL}then"):
                then(engine)
    gc.collect()
    alive = {obj.untyped_storage().data_ptr() for obj in gc.get_objects() if isinstance(obj, torch.Tensor)}
    del engine
    return prof, alive


def _worker(rank: int, world: int, port: int, config: dict, queue: object) -> None:
    from preflight._measure import lost_free_peaks

    prof, alive = profiled_run(rank, world, port, config)
    queue.put((rank, lost_free_peaks(prof, alive, _CALL)))


_CALL = "## "  # names the profiled calls (build, initialize, forward, backward, step)


def measure(config: dict, worker: Callable[..., None] = _worker, *args: Any) -> list[Any]:
    """Each rank's result of ``worker(rank, WORLD, port, config, *args, queue)`` in WORLD fresh processes on a free
    localhost port (each puts ``(rank, result)``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(WORLD, port, config, *args, queue), nprocs=WORLD, start_method="spawn")
    got = dict(queue.get() for _ in range(WORLD))
    return [got[r] for r in range(WORLD)]


def deepspeed_estimate(stage: int, model: torch.nn.Module) -> int | None:
    """DeepSpeed's own per-GPU model-states estimate for ``model`` on WORLD GPUs of one node, no offload (module
    docstring); None at stage 1, which it does not estimate."""
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params

        total, largest = model_to_params(model)
        return estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=WORLD, num_nodes=1,
                                                     cpu_offload=False, cpu_offload_params=False)[1]
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs, model_to_params

        return estimate_zero2_model_states_mem_needs(model_to_params(model), num_gpus_per_node=WORLD, num_nodes=1,
                                                     cpu_offload=False)[1]
    return None


def main() -> int:
    import deepspeed

    import preflight
    from preflight.parallel._deepspeed import zero_buffers_for
    from preflight._sharding import read_deepspeed_config

    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    mib = 1 << 20
    lines = [f"Real DeepSpeed {deepspeed.__version__} ZeRO on {WORLD} CPU processes (gloo), GPT-2 4 layers, hidden 256, "
             f"vocab {distributed.VOCAB}, batch {distributed.BATCH} x {distributed.SEQ}, fp32, AdamW, 2 steps; "
             f"{RUNS} runs per configuration. Command: `python benchmarks/deepspeed_cpu.py`. torch {torch.__version__}.",
             "", "| stage | reduce_bucket_size | overlap_comm | rank | repaired (MiB) | lost frees at call end (MiB) "
             "| lost frees dropped (MiB) | predicted (MiB) | buffers (MiB) | DeepSpeed's estimator (MiB) "
             "| error vs call-end max | error vs dropped max |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    worst = {"call end": 0.0, "dropped": 0.0, "repaired": 0.0}
    for stage, bucket, overlap in CONFIGS:
        config = ds_config(stage, bucket, overlap)
        runs = [measure(config) for _ in range(RUNS)]
        model, batch = distributed.build("gpt2")
        est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, run=preflight.Run(parallel=preflight.deepspeed_plan(config, world_size=WORLD)))
        predicted = est.peak_bytes
        buffers = zero_buffers_for(model, f"zero{stage}", read_deepspeed_config(config), None).nbytes
        theirs = deepspeed_estimate(stage, model)
        theirs_text = "n/a" if theirs is None else f"{theirs / mib:.2f}"
        for rank in range(WORLD):
            cells, errors = [], {}
            for k, name in enumerate(("repaired", "call end", "dropped")):
                values = [r[rank][k] for r in runs]
                cells.append(f"{min(values) / mib:.2f}-{max(values) / mib:.2f}")
                errors[name] = (predicted - max(values)) / max(values)
                worst[name] = max(worst[name], abs(errors[name]))
            lines.append(f"| ZeRO-{stage} | {bucket:,} | {'default' if overlap is None else overlap} | {rank} | "
                         f"{' | '.join(cells)} | {predicted / mib:.2f} | {buffers / mib:.1f} | {theirs_text} | "
                         f"{errors['call end']:+.1%} | {errors['dropped']:+.1%} |")
        print(f"  ZeRO-{stage} bucket {bucket} overlap {overlap}: measured {runs}, predicted {predicted}",
              file=sys.stderr)
    lines += ["", f"Largest error against a rank's largest measurement, lost frees at the end of their call: "
              f"{worst['call end']:.1%}; lost frees dropped: {worst['dropped']:.1%}; repaired only: "
              f"{worst['repaired']:.1%}."]
    lines += ["", f"({time.perf_counter() - start:.0f} s)"]
    distributed.write_results("\n".join(lines), RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
