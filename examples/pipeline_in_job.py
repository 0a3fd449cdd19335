"""Check a pipeline-parallel job from inside it: each rank hands preflight the schedule it built, before step one.

Starts 2 CPU processes (gloo) itself and runs in about ten seconds: python examples/pipeline_in_job.py. With
--tp 2, 4 processes on a (pp 2, tp 2) mesh, each stage laid out by tensor parallelism as torchtitan lays it out
(torch then warns at exit of "unwaited collective calls": the job's own, which it prints without preflight too).
Under torchrun, the body of `rank_main` is what each rank of your script runs.
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import preflight

STAGES = 2  # pipeline stages, one per pipeline rank
BLOCKS = 8  # MLP blocks in the whole model, cut in half
MICROBATCHES = 4  # the schedule cuts each batch into these


def mse(output, target):  # the last stage's loss, as the schedule takes it
    return ((output - target) ** 2).mean()


def rank_main(rank: int, port: int, tp: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world = STAGES * tp
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (STAGES, tp), mesh_dim_names=("pp", "tp")) if tp > 1 else None
    pp_rank = mesh["pp"].get_local_rank() if mesh is not None else rank
    # The job cuts the model itself: this rank keeps its half of the blocks.
    blocks = [nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(BLOCKS)]
    stage_module = nn.Sequential(*blocks[pp_rank * BLOCKS // STAGES:(pp_rank + 1) * BLOCKS // STAGES])
    if mesh is not None:  # each block's first projection column-wise, its second row-wise, over the tp dim
        parallelize_module(stage_module, mesh["tp"], {f"{i}.0": ColwiseParallel() for i in range(len(stage_module))}
                           | {f"{i}.2": RowwiseParallel() for i in range(len(stage_module))})
    group = mesh["pp"].get_group() if mesh is not None else None
    stage = PipelineStage(stage_module, pp_rank, STAGES, torch.device("cpu"), group=group)
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=mse)
    optimizer = torch.optim.AdamW(stage_module.parameters())
    inputs, target = torch.randn(16, 128, 256), torch.randn(16, 128, 256)  # every rank holds the batch

    # Every rank, at the same point: each traces its own stage after the ranks exchanged their stages' shapes.
    est = preflight.estimate(schedule, optimizer, (inputs, target))
    if rank == 0:
        figures = ", ".join(f"rank {r} {preflight.format_bytes(b)}" for r, b in enumerate(est.per_rank_peak_bytes))
        layout = f"{STAGES} stages x {tp} tensor-parallel ranks" if tp > 1 else f"{STAGES} ranks"
        print(f"1F1B over {layout}, {MICROBATCHES} micro-batches: {figures}; rank {est.peak_rank} peaks")
    # The verdict, agreed on by every rank (the largest decides); on_overflow="raise" would stop every rank here.
    report = preflight.check(schedule, optimizer, (inputs, target),
                             preflight.Run(target=preflight.Target(budget="128MiB")), on_overflow="warn")
    if rank == 0:
        print(f"verdict: {'fits' if report.fits else 'does not fit'} in 128 MiB per rank")
    for _ in range(2):  # the training preflight left as it was
        schedule.step(*((inputs,) if pp_rank == 0 else ()), **({"target": target} if pp_rank == STAGES - 1 else {}))
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage (default 1)")
    tensor_parallel = parser.parse_args().tp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.start_processes(rank_main, args=(free_port, tensor_parallel), nprocs=STAGES * tensor_parallel,
                       start_method="spawn")
