"""Check a pipeline-parallel job from inside it: each rank hands preflight the schedule it built, before step one.

Starts 2 CPU processes (gloo) itself and runs in about ten seconds: python examples/pipeline_in_job.py. Under
torchrun, the body of `rank_main` is what each rank of your script runs.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import preflight

WORLD = 2  # processes, one pipeline stage each
BLOCKS = 8  # MLP blocks in the whole model, cut in half
MICROBATCHES = 4  # the schedule cuts each batch into these


def mse(output, target):  # the last stage's loss, as the schedule takes it
    return ((output - target) ** 2).mean()


def rank_main(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    # The job cuts the model itself: this rank keeps its half of the blocks.
    blocks = [nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(BLOCKS)]
    stage_module = nn.Sequential(*blocks[rank * BLOCKS // WORLD:(rank + 1) * BLOCKS // WORLD])
    stage = PipelineStage(stage_module, rank, WORLD, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=mse)
    optimizer = torch.optim.AdamW(stage_module.parameters())
    inputs, target = torch.randn(16, 128, 256), torch.randn(16, 128, 256)  # every rank holds the batch

    # Every rank, at the same point: each traces its own stage after the ranks exchanged their stages' shapes.
    est = preflight.estimate(schedule, optimizer, (inputs, target))
    if rank == 0:
        figures = ", ".join(f"rank {r} {preflight.format_bytes(b)}" for r, b in enumerate(est.per_rank_peak_bytes))
        print(f"1F1B over {WORLD} ranks, {MICROBATCHES} micro-batches: {figures}; rank {est.peak_rank} peaks")
    # The verdict, agreed on by every rank (the largest decides); on_overflow="raise" would stop every rank here.
    report = preflight.check(schedule, optimizer, (inputs, target),
                             preflight.Run(target=preflight.Target(budget="128MiB")), on_overflow="warn")
    if rank == 0:
        print(f"verdict: {'fits' if report.fits else 'does not fit'} in 128 MiB per rank")
    for _ in range(2):  # the training preflight left as it was
        schedule.step(*((inputs,) if rank == 0 else ()), **({"target": target} if rank == WORLD - 1 else {}))
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.start_processes(rank_main, args=(free_port,), nprocs=WORLD, start_method="spawn")
