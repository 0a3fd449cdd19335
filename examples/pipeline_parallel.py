"""Plan each stage of a pipeline-parallel job (torch.distributed.pipelining) before the job exists.

Runs on CPU in about ten seconds: python examples/pipeline_parallel.py (benchmarks/pipeline_parallel.py measures
such runs on real gloo processes against their predictions).
"""

import torch
from torch import nn

import preflight
from preflight.parallel import PPPlan

# Eight blocks of an MLP; the batch is (inputs, target): the first stage's input, the last stage's target.
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(8)])
batch = (torch.randn(32, 128, 256), torch.randn(32, 128, 256))
optimizer = torch.optim.AdamW(model.parameters())


def mse(output, target):  # the last stage's loss, as you pass it to the schedule
    return ((output - target) ** 2).mean()


single = preflight.estimate(model, optimizer, batch, step=lambda m, b: mse(m(b[0]), b[1]))
print(f"one device: {preflight.format_bytes(single.peak_bytes)}")
# An nn.Sequential is cut into contiguous runs of blocks; give `split=` the function your job cuts its model with.
for schedule, stages in (("GPipe", 4), ("1F1B", 4), ("1F1B", 2)):
    run = preflight.Run(parallel=preflight.ParallelPlan(stages, None, pp=PPPlan(stages, mse, schedule, microbatches=8)))
    est = preflight.estimate(model, optimizer, batch, run)
    ranks = ", ".join(preflight.format_bytes(b) for b in est.per_rank_peak_bytes)
    held = ", ".join(preflight.format_bytes(b["activations"]) for b in est.per_rank_breakdown)
    print(f"{schedule} over {stages} stages, 8 micro-batches: per stage {ranks} (activations {held})")
