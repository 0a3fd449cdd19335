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
import os
import sys
import tempfile
import time
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepspeed_cpu  # noqa: E402  (its profiled run, and its reading of frees lost on gloo's threads)
import distributed  # noqa: E402  (the same model and batch)

BUCKET = 5_000_000
# (stage, stage3_gather_16bit_weights_on_model_save, what is saved)
CONFIGS = ((3, True, "full"), (3, False, "full"), (3, True, "sharded"), (2, None, "full"), (1, None, "full"),
           (2, None, "sharded"))
WORLD = deepspeed_cpu.WORLD
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "deepspeed_save.md")


def ds_config(stage: int, gather: bool | None) -> dict:
    """The DeepSpeed config of one configuration (the run's and the prediction's)."""
    zero = {"stage": stage, "reduce_bucket_size": BUCKET}
    if gather is not None:
        zero["stage3_gather_16bit_weights_on_model_save"] = gather
    return {"train_micro_batch_size_per_gpu": distributed.BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "zero_optimization": zero}


def _worker(rank: int, world: int, port: int, config: dict, saved: str, directory: str, queue: object) -> None:
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    from preflight._measure import lost_free_peaks

    def save(engine: object) -> None:
        if saved == "full":  # transformers' Trainer.save_model under DeepSpeed
            state = None
            if config["zero_optimization"]["stage"] < 3:
                state = clone_tensors_for_torch_save(engine.module.state_dict())
            elif engine.zero_gather_16bit_weights_on_model_save():
                state = engine._zero3_consolidated_16bit_state_dict()
            if rank == 0 and state is not None:
                torch.save(state, os.path.join(directory, "model.bin"))
            del state
        engine.save_checkpoint(directory)

    prof, alive = deepspeed_cpu.profiled_run(rank, world, port, config, then=save)
    queue.put((rank, (lost_free_peaks(prof, alive, deepspeed_cpu._CALL, within="then")[1],
                      lost_free_peaks(prof, alive, deepspeed_cpu._CALL)[1])))


def measure(config: dict, saved: str) -> list[tuple[int, int]]:
    """Each rank's ``(save peak, whole run's peak)`` in one run of WORLD fresh processes."""
    with tempfile.TemporaryDirectory() as directory:
        return deepspeed_cpu.measure(config, _worker, saved, directory)


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
    distributed.write_results("\n".join(lines), RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
