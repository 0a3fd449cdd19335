"""Real DeepSpeed ZeRO-1/2/3 on CPU processes (gloo) against preflight's prediction from the same config, per rank.

DeepSpeed is not a dependency of preflight or of its tests; this measurement needs it installed
(``pip install deepspeed``; checked with 0.19.8, whose CPU accelerator talks gloo when oneCCL is absent). For each
stage, ``reduce_bucket_size`` (DeepSpeed's default 500,000,000 elements, and 50,000,000) and ``overlap_comm``, 2
fresh processes build the GPT-2 of ``benchmarks/distributed.py`` (4 layers, hidden 256, vocab 8192, batch 4 x 128,
fp32), call ``deepspeed.initialize`` with AdamW (``torch_adam``) and run two training steps. Each rank's peak is the
profiler's allocator events over ``initialize`` and the steps (`preflight._measure.cpu_profiled_peak`) plus the
model, buffers and batch alive before. Three runs per configuration; ``predicted`` is ``preflight.estimate(...,
world_size=2, deepspeed_config=<the same config>)``: the per-category rescale of one single-device trace plus
ZeRO's gradient reduction buffers sized from the config (the ``buffers`` column).

Run: python benchmarks/deepspeed_cpu.py     (about 8 minutes on 2 CPU cores)
Writes benchmarks/results/deepspeed_cpu.md and prints the same table.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import warnings

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


def _worker(rank: int, world: int, port: int, config: dict, queue: object) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import deepspeed

    from preflight._device import live_storage_bytes
    from preflight._measure import cpu_profiled_peak

    deepspeed.init_distributed(dist_backend="gloo")
    model, batch = distributed.build("gpt2")
    before = live_storage_bytes([list(model.parameters()), list(model.buffers()), batch], torch.device("cpu"))

    def run() -> None:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        for _ in range(2):
            engine.backward(engine(**batch).loss)
            engine.step()

    peak, _ = cpu_profiled_peak(run, repair_lost_frees=True)
    queue.put((rank, before + peak))


def measure(config: dict) -> list[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(WORLD, port, config, queue), nprocs=WORLD, start_method="spawn")
    got = dict(queue.get() for _ in range(WORLD))
    return [got[r] for r in range(WORLD)]


def main() -> int:
    import deepspeed

    import preflight

    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    mib = 1 << 20
    lines = [f"Real DeepSpeed {deepspeed.__version__} ZeRO on {WORLD} CPU processes (gloo), GPT-2 4 layers, hidden 256, "
             f"vocab {distributed.VOCAB}, batch {distributed.BATCH} x {distributed.SEQ}, fp32, AdamW, 2 steps; "
             f"{RUNS} runs per configuration. Command: `python benchmarks/deepspeed_cpu.py`. torch {torch.__version__}.",
             "", "| stage | reduce_bucket_size | overlap_comm | rank | measured min (MiB) | measured max (MiB) "
             "| predicted (MiB) | buffers (MiB) | error vs max | error vs min |", "|---|---|---|---|---|---|---|---|---|---|"]
    worst = 0.0
    for stage, bucket, overlap in CONFIGS:
        config = ds_config(stage, bucket, overlap)
        runs = [measure(config) for _ in range(RUNS)]
        model, batch = distributed.build("gpt2")
        est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, world_size=WORLD,
                                 deepspeed_config=config)
        predicted, buffers = est.peak_bytes, est.breakdown.get("communication", 0)
        for rank in range(WORLD):
            low, high = min(r[rank] for r in runs), max(r[rank] for r in runs)
            worst = max(worst, abs(predicted - high) / high)
            lines.append(f"| ZeRO-{stage} | {bucket:,} | {'default' if overlap is None else overlap} | {rank} | "
                         f"{low / mib:.2f} | {high / mib:.2f} | {predicted / mib:.2f} | {buffers / mib:.1f} | "
                         f"{(predicted - high) / high:+.1%} | {(predicted - low) / low:+.1%} |")
        print(f"  ZeRO-{stage} bucket {bucket} overlap {overlap}: measured {runs}, predicted {predicted}",
              file=sys.stderr)
    lines += ["", f"Largest error against a rank's largest measurement: {worst:.1%}."]
    lines += ["", f"({time.perf_counter() - start:.0f} s)"]
    text = "\n".join(lines)
    print(text)
    with open(RESULTS, "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
