"""Per-rank memory of data-parallel training, traced through the parallel engine's own program.

`trace_fsdp2` (FSDP2's ``fully_shard``, as an `FSDP2Plan` says) and `trace_fsdp1` (``FullyShardedDataParallel``, as
an `FSDP1Plan` says) copy the user's model onto fake tensors, wrap the copy inside a fake process group of the real
world size (`fake_world`), and run the real training step under the same storage tracker as a single-device trace
(`preflight.trace`; the shared part is `preflight.parallel._rank`), so one rank's events include the padded
parameter shards, the all-gather and reduce-scatter buffers and the sharded optimizer state. Hybrid sharding
(FSDP2's HSDP, FSDP1's ``HYBRID_SHARD``) is traced over a fake 2-D mesh of the same shape, both groups' collectives
in the program. `rank_groups` and `fsdp1_rank_groups` say which ranks hold the same shard shapes and so trace the
same; `read_fsdp2` and `read_fsdp1` read the plan off a model ``fully_shard`` or ``FullyShardedDataParallel``
already wrapped, whose copy is traced unwrapped and wrapped again in the fake world; `read_zero` reads a model and
optimizer DeepSpeed ZeRO has taken over back as the unpartitioned model and a torch optimizer, which a ZeRO plan
rescales; `stand_in` gives an FSDP-wrapped model's unwrapped meta copy and optimizer, for its evaluation step and
the suggestions. `trace_tp` traces a rank under tensor parallelism (DTensor's ``parallelize_module`` as a `TPPlan`
says, alone or with FSDP2 over the other dim of a 2-D mesh); `read_tp` reads the layout of a model already laid
out, whose copy is laid out the same over the fake mesh. `trace_pp` traces a stage rank under pipeline parallelism
(``torch.distributed.pipelining``'s own stage and schedule, as a `PPPlan` says); `trace_cp` a rank under context
parallelism (torch's ``context_parallel`` ring attention as a `CPPlan` says, alone or inside FSDP2;
`cpu_ring_attention` lets that ring run on CPU tensors); `trace_ep` a rank under expert parallelism
(transformers' own layout and token exchange as an `EPPlan` says).
`ParallelPlan` (`fsdp_plan`, `deepspeed_plan`, `accelerate_plan`) is the parallel section of a `preflight.Run`: it
turns a trainer's strategy settings, read by the integrations, into the plan a per-rank estimate follows; `read_ddp`
reads it off a ``DistributedDataParallel`` model. `_deepspeed` gives what DeepSpeed itself holds beside the traced
step (ZeRO's buffers, ZeRO-3's own terms, the fp32 state it steps), which the per-category rescale of ZeRO plans
(`preflight._target.shard_events`, formulas in `preflight._sharding`) adds. Which is used when: FSDP1 and FSDP2
plans are traced per rank here; DDP and ZeRO plans, and any rank that cannot be traced (offloading, a paged
optimizer), are one single-device trace rescaled per category, with a note saying so. Imports flow one way: this
package uses `preflight.trace`; `preflight._estimate` uses this package.
"""

from preflight.parallel._context import CPPlan, cp_rank_groups, cpu_ring_attention, trace_cp
from preflight.parallel._expert import EPPlan, ep_rank_groups, read_ep, trace_ep
from preflight.parallel._fake_group import ProcessGroupInUseError, fake_world
from preflight.parallel._fsdp1 import FSDP1Plan, WrappedFSDP1, fsdp1_rank_groups, read_fsdp1, trace_fsdp1
from preflight.parallel._fsdp2 import (FSDP2Plan, WrappedFSDP2, held_by_fully_shard, rank_groups, read_fsdp2,
                                      trace_fsdp2)
from preflight.parallel._pipeline import (PPPlan, causal_lm_loss, split_sequential, split_transformers,
                                         stage_rank_groups, trace_pp)
from preflight.parallel._rank import default_units, fake_replica
from preflight.parallel._strategies import (ParallelPlan, accelerate_checkpoint, accelerate_plan, already_sharded,
                                            deepspeed_plan, fsdp_plan, read_ddp)
from preflight.parallel._stand_in import stand_in
from preflight.parallel._tensor import (TPPlan, WrappedTP, laid_out_parameters, model_styles, plan_styles, read_tp,
                                        tp_rank_groups, trace_tp)
from preflight.parallel._zero import WrappedZero, deepspeed_optimizer, held_tensors, read_zero, zero_plan

__all__ = ["CPPlan", "EPPlan", "FSDP1Plan", "FSDP2Plan", "PPPlan", "ParallelPlan", "ProcessGroupInUseError", "TPPlan",
           "WrappedFSDP1", "WrappedFSDP2", "WrappedTP", "WrappedZero", "accelerate_checkpoint", "accelerate_plan",
           "already_sharded", "causal_lm_loss", "cp_rank_groups", "cpu_ring_attention", "deepspeed_optimizer",
           "deepspeed_plan", "default_units", "ep_rank_groups", "fake_replica", "fake_world", "fsdp1_rank_groups",
           "fsdp_plan", "held_by_fully_shard", "held_tensors", "laid_out_parameters", "model_styles", "plan_styles",
           "rank_groups",
           "read_ddp", "read_ep", "read_fsdp1", "read_fsdp2", "read_tp", "read_zero", "split_sequential",
           "split_transformers",
           "stage_rank_groups", "stand_in", "tp_rank_groups", "trace_cp", "trace_ep", "trace_fsdp1", "trace_fsdp2",
           "trace_pp", "trace_tp", "zero_plan"]
