"""Per-rank memory of data-parallel training, traced through the parallel engine's own program.

`trace_fsdp2` copies the user's model onto fake tensors, applies FSDP2's ``fully_shard`` as an `FSDP2Plan` says,
inside a fake process group of the real world size (`fake_world`), and runs the real training step under the
same storage tracker as a single-device trace (`preflight.trace`), so one rank's events include the padded
parameter shards, the all-gather and reduce-scatter buffers and the sharded optimizer state. `rank_groups` says
which ranks hold the same shard shapes and so trace the same. `ParallelPlan` (`fsdp_plan`, `deepspeed_plan`) turns
a trainer's strategy settings, read by the integrations, into the arguments a per-rank estimate takes. Imports flow
one way: this package uses
`preflight.trace`; `preflight._estimate` uses this package.
"""

from preflight.parallel._fake_group import ProcessGroupInUseError, fake_world
from preflight.parallel._fsdp2 import FSDP2Plan, default_units, fake_replica, rank_groups, trace_fsdp2
from preflight.parallel._strategies import (ParallelPlan, accelerate_plan, already_sharded, deepspeed_plan,
                                            fsdp_plan)

__all__ = ["FSDP2Plan", "ParallelPlan", "ProcessGroupInUseError", "accelerate_plan", "already_sharded",
           "deepspeed_plan", "default_units", "fake_replica", "fake_world", "fsdp_plan", "rank_groups", "trace_fsdp2"]
