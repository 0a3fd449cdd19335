"""A checkpoint save under real DeepSpeed ZeRO-1/2/3 on CPU processes (gloo) against preflight's prediction of the
save, per rank.

The save is the HF Trainer's under DeepSpeed (transformers 5.24 ``Trainer.save_model`` and
``_save_optimizer_and_scheduler``, accelerate 1.15 ``Accelerator.get_state_dict``), run on the engine directly:

- ``full`` (what the Trainer saves): the model consolidated on every rank, then each rank's partitions. At stage 3
  with ``stage3_gather_16bit_weights_on_model_save``: ``engine._zero3_consolidated_16bit_state_dict()``; at stage
  3 without it, nothing (accelerate raises and the Trainer saves the partitions alone); at stages 1 and 2:
  ``clone_tensors_for_torch_save(model.state_dict())``. Rank 0 writes the consolidated state with ``torch.save``.
  Then ``engine.save_checkpoint(dir)`` on every rank.
- ``sharded`` (Lightning's ``DeepSpeedStrategy``, accelerate's ``save_state``): ``engine.save_checkpoint(dir)``
  alone.

For each configuration, 2 fresh processes build the GPT-2 of ``benchmarks/distributed.py`` (4 layers, hidden 256,
vocab 8192, tied embedding, batch 4 x 128, fp32), call ``deepspeed.initialize`` with AdamW (``torch_adam``,
``reduce_bucket_size`` 5,000,000), run two training steps and save, all inside one profiled session (as
``benchmarks/deepspeed_cpu.py``, whose reading of frees lost on gloo's threads this uses: lost frees at the end of
their call). ``save`` is the peak inside the save alone, everything alive when it began counted; ``run`` is the
whole session's. ``predicted`` is ``preflight.estimate(..., Run(parallel=deepspeed_plan(config, world_size=2),
checkpoint=Checkpoint(state_dict=...)))``: its ``"saving"`` phase per rank, and the larger of that and the
training peak for the run. Three runs per configuration.

Run: python benchmarks/deepspeed_save.py     (about 4 minutes on 2 CPU cores; ``--runs 1`` for a quick look)
Writes benchmarks/results/deepspeed_save.md and prints the same table.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
import tempfile
import time
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import distributed  # noqa: E402  (the same model and batch)

WORLD = 2
BUCKET = 5_000_000
# (stage, stage3_gather_16bit_weights_on_model_save, what is saved)
CONFIGS = ((3, True, "full"), (3, False, "full"), (3, True, "sharded"), (2, None, "full"), (1, None, "full"),
           (2, None, "sharded"))
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "deepspeed_save.md")
_CALL = "## "  # names the profiled calls (build, initialize, forward, backward, step, save)


def ds_config(stage: int, gather: bool | None) -> dict:
    """The DeepSpeed config of one configuration (the run's and the prediction's)."""
    zero = {"stage": stage, "reduce_bucket_size": BUCKET}
    if gather is not None:
        zero["stage3_gather_16bit_weights_on_model_save"] = gather
    return {"train_micro_batch_size_per_gpu": distributed.BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "zero_optimization": zero}


def _worker(rank: int, world: int, port: int, config: dict, saved: str, directory: str, queue: object) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import importlib

    import deepspeed
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from torch.profiler import ProfilerActivity, profile, record_function

    from preflight._measure import lost_free_peaks
    from preflight._quiet import StderrFilter

    # benchmarks/deepspeed_trainers.py's PROLOGUE says why: its shared-memory kernel serves inference only.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    stage = config["zero_optimization"]["stage"]
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
        with record_function(f"{_CALL}save"):
            if saved == "full":  # transformers' Trainer.save_model under DeepSpeed
                state = None
                if stage < 3:
                    state = clone_tensors_for_torch_save(engine.module.state_dict())
                elif engine.zero_gather_16bit_weights_on_model_save():
                    state = engine._zero3_consolidated_16bit_state_dict()
                if rank == 0 and state is not None:
                    torch.save(state, os.path.join(directory, "model.bin"))
                del state
            engine.save_checkpoint(directory)
    gc.collect()
    alive = {obj.untyped_storage().data_ptr() for obj in gc.get_objects() if isinstance(obj, torch.Tensor)}
    run = lost_free_peaks(prof, alive, _CALL)[1]
    save = lost_free_peaks(prof, alive, _CALL, within="save")[1]
    queue.put((rank, (save, run)))
    del engine


def measure(config: dict, saved: str) -> list[tuple[int, int]]:
    """Each rank's ``(save peak, whole run's peak)`` in one run of WORLD fresh processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as directory:
        mp.start_processes(_worker, args=(WORLD, port, config, saved, directory, queue), nprocs=WORLD,
                           start_method="spawn")
        got = dict(queue.get() for _ in range(WORLD))
    return [got[r] for r in range(WORLD)]


def predict(config: dict, saved: str) -> tuple[list[int], int, str]:
    """Each rank's predicted save peak, the predicted training peak, and the save's note."""
    import preflight

    model, batch = distributed.build("gpt2")
    run = preflight.Run(parallel=preflight.deepspeed_plan(config, world_size=WORLD),
                        checkpoint=preflight.Checkpoint(state_dict=saved))
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, run=run)
    saving = next(p for p in est.phases if p.name == "saving")
    per_rank = list(saving.per_rank_peak_bytes or (saving.peak_bytes,) * WORLD)
    note = next((n for n in est.coverage.notes if n.startswith("the checkpoint save under DeepSpeed")), "")
    return per_rank, est.peak_bytes, note


def main() -> int:
    import deepspeed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh runs per configuration (default 3)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    mib = 1 << 20
    lines = [f"A checkpoint save in real DeepSpeed {deepspeed.__version__} ZeRO runs on {WORLD} CPU processes (gloo), "
             f"GPT-2 4 layers, hidden 256, vocab {distributed.VOCAB}, batch {distributed.BATCH} x {distributed.SEQ}, "
             f"fp32, AdamW, reduce_bucket_size {BUCKET:,}, 2 steps then the save; {args.runs} runs per "
             f"configuration. Command: `python benchmarks/deepspeed_save.py`. torch {torch.__version__}.", "",
             "| stage | gather 16-bit on save | saved | rank | save measured (MiB) | save predicted (MiB) | error "
             "| run measured (MiB) | run predicted (MiB) | error |", "|---|---|---|---|---|---|---|---|---|---|"]
    worst = 0.0
    for stage, gather, saved in CONFIGS:
        config = ds_config(stage, gather)
        runs = [measure(config, saved) for _ in range(args.runs)]
        per_rank, train, note = predict(config, saved)
        for rank in range(WORLD):
            save = [r[rank][0] for r in runs]
            whole = [r[rank][1] for r in runs]
            run_predicted = max(train, per_rank[rank])
            errors = ((per_rank[rank] - max(save)) / max(save), (run_predicted - max(whole)) / max(whole))
            worst = max(worst, *map(abs, errors))
            lines.append(f"| ZeRO-{stage} | {'n/a' if gather is None else gather} | {saved} | {rank} | "
                         f"{min(save) / mib:.2f}-{max(save) / mib:.2f} | {per_rank[rank] / mib:.2f} | "
                         f"{errors[0]:+.2%} | {min(whole) / mib:.2f}-{max(whole) / mib:.2f} | "
                         f"{run_predicted / mib:.2f} | {errors[1]:+.2%} |")
        print(f"  ZeRO-{stage} gather {gather} {saved}: measured {runs}, predicted {per_rank} (training {train}); "
              f"{note}", file=sys.stderr)
    lines += ["", f"Largest |error| against a rank's largest measurement: {worst:.2%}.",
              "", f"({time.perf_counter() - start:.0f} s)"]
    text = "\n".join(lines)
    print(text)
    with open(RESULTS, "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
