"""Pipeline parallelism (torch.distributed.pipelining): each stage rank traced through torch's own stage and schedule
under a fake process group, checked against real gloo runs."""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
import torch.distributed as dist
from conftest import call_end_peak, gloo_rank, spawned
from torch import nn

import preflight
from preflight.parallel import (CPPlan, ParallelPlan, PPPlan, TPPlan, causal_lm_loss, split_sequential,
                                split_transformers)

WIDTH, BATCH, SEQ = 128, 16, 32


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _blocks(n: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
                           for _ in range(n)])


def _batch(seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, seq, WIDTH, generator=g), torch.randn(BATCH, seq, WIDTH, generator=g)


def _run(plan: PPPlan) -> preflight.Run:
    return preflight.Run(parallel=ParallelPlan(plan.stages, None, pp=plan))


def test_plan_options_are_checked():
    with pytest.raises(ValueError, match="at least 2"):
        PPPlan(1, _mse)
    with pytest.raises(ValueError, match="one of 'GPipe', '1F1B', 'Interleaved1F1B'"):
        PPPlan(2, _mse, schedule="2F2B")
    with pytest.raises(ValueError, match="one stage per rank"):
        PPPlan(2, _mse, schedule="1F1B", virtual_stages=2)
    with pytest.raises(ValueError, match="two stages per rank in a V"):
        PPPlan(2, _mse, schedule="ZBVZeroBubble", virtual_stages=3)
    with pytest.raises(ValueError, match="positive int"):
        PPPlan(2, _mse, microbatches=0)
    with pytest.raises(TypeError, match="loss function"):
        PPPlan(2, "mse")
    assert PPPlan(2, _mse, schedule="gpipe").schedule_class.__name__ == "ScheduleGPipe"
    assert PPPlan(4, _mse).n_microbatches == 4  # as many as the stages by default
    with pytest.raises(ValueError, match="sharding='fsdp2', or world_size equal"):
        ParallelPlan(4, None, pp=PPPlan(2, _mse))
    with pytest.raises(ValueError, match="`sharding` should be 'fsdp2'"):
        ParallelPlan(2, "fsdp2", pp=PPPlan(2, _mse))  # no data-parallel ranks left to shard over
    with pytest.raises(ValueError, match="`sharding` should be 'fsdp2'"):
        ParallelPlan(6, "fsdp2", pp=PPPlan(4, _mse))  # not a multiple of the pipeline's ranks
    with pytest.raises(ValueError, match="not yet with offload"):
        ParallelPlan(4, None, offload_optimizer=True, pp=PPPlan(4, _mse))
    assert ParallelPlan(8, "fsdp2", pp=PPPlan(2, _mse)).pp.stages == 2
    # With tensor parallelism, one replica is the pipeline's ranks times the tensor-parallel degree.
    assert ParallelPlan(4, None, pp=PPPlan(2, _mse), tp=TPPlan(2)).tp.degree == 2
    assert ParallelPlan(8, "fsdp2", pp=PPPlan(2, _mse), tp=TPPlan(2)).world_size == 8
    with pytest.raises(ValueError, match="pipeline x 2 tensor-parallel ranks are 4 but the world size is 8"):
        ParallelPlan(8, None, pp=PPPlan(2, _mse), tp=TPPlan(2))
    with pytest.raises(ValueError, match="`sharding` should be 'fsdp2'"):
        ParallelPlan(6, "fsdp2", pp=PPPlan(2, _mse), tp=TPPlan(2))
    from preflight.parallel import FSDP2Plan

    with pytest.raises(ValueError, match="not yet with HSDP"):
        ParallelPlan(16, "fsdp2", pp=PPPlan(2, _mse), tp=TPPlan(2), fsdp=FSDP2Plan(replicate=2))
    # Inside a ring: one replica is the pipeline's ranks times the ring's (times the tensor-parallel degree).
    assert ParallelPlan(8, None, pp=PPPlan(2, _mse), cp=CPPlan(2), tp=TPPlan(2)).cp.degree == 2
    with pytest.raises(ValueError, match="pipeline x 2 context-parallel ranks are 4 but the world size is 2"):
        ParallelPlan(2, None, pp=PPPlan(2, _mse), cp=CPPlan(2))
    from preflight.parallel._pipeline import _mesh_shape

    assert _mesh_shape(PPPlan(2, _mse), FSDP2Plan(), 16, TPPlan(2), CPPlan(2)) == ((2, 2, 2, 2),
                                                                                  ("pp", "dp", "cp", "tp"))


def test_stages_are_laid_on_ranks_as_torchs_schedules_lay_them():
    looped = PPPlan(2, _mse, schedule="Interleaved1F1B")  # two stages per rank by default, looped
    assert looped.num_stages == 4 and [looped.stage_indices(r) for r in range(2)] == [[0, 2], [1, 3]]
    assert PPPlan(2, _mse, schedule="LoopedBFS", virtual_stages=3).stage_indices(1) == [1, 3, 5]
    v_shape = PPPlan(2, _mse, schedule="zbv_zero_bubble")  # a V: rank 0 holds the first and the last stage
    assert [v_shape.stage_indices(r) for r in range(2)] == [[0, 3], [1, 2]]
    assert PPPlan(4, _mse, schedule="1F1B").stage_indices(3) == [3]
    assert "2 stages per rank" in looped.label


def test_a_sequential_is_cut_into_contiguous_runs_that_keep_their_names():
    model = _blocks(5)
    first, second = split_sequential(model, 0, 2), split_sequential(model, 1, 2)
    assert list(first._modules) == ["0", "1", "2"] and list(second._modules) == ["3", "4"]
    assert first[0] is model[0]  # the model's own modules, not copies
    names = {n for n, _ in model.named_parameters()}
    assert {n for n, _ in second.named_parameters()} <= names
    with pytest.raises(ValueError, match="only with the plan's `split`"):
        split_sequential(nn.Linear(2, 2), 0, 2)


@pytest.mark.slow
def test_each_stage_is_traced_and_the_schedule_sets_the_micro_batches_in_flight():
    """GPipe runs every micro-batch's forward before any backward; 1F1B holds at most (stages - stage) in flight.
    With 8 micro-batches over 4 stages, GPipe's first stage holds twice the activations 1F1B's does, and under
    1F1B the first stage (4 in flight) holds more than the last (1)."""
    model, batch = _blocks(), _batch()
    optimizer = torch.optim.AdamW(model.parameters())
    figures = {}
    for schedule in ("GPipe", "1F1B"):
        est = preflight.estimate(model, optimizer, batch, _run(PPPlan(4, _mse, schedule=schedule, microbatches=8)))
        assert est.sharding == "pp4" and len(est.per_rank_peak_bytes) == 4, est.coverage.notes
        assert not est.coverage.lower_bound
        assert any("each rank's two steps traced through torch's own PipelineStage" in n
                   for n in est.coverage.notes)
        figures[schedule] = est.per_rank_peak_bytes
        activations = [b["activations"] for b in est.per_rank_breakdown]
        if schedule == "1F1B":  # fewer micro-batches in flight down the pipeline
            assert activations[0] >= activations[1] > activations[2] > activations[3]
        assert est.to_dict()["per_rank_breakdown"][0]["phase"].startswith("step")
        assert "rank 3:" in str(est) and "activations" in str(est).split("rank 3:")[1]
    one_block = sum(p.numel() * 4 for p in model[0].parameters())
    # A stage's parameters, gradients and AdamW's two moments are a quarter of the model's.
    assert figures["1F1B"][3] > 4 * one_block
    assert figures["1F1B"][0] > figures["1F1B"][3]
    assert figures["GPipe"][0] > figures["1F1B"][0]
    assert list(figures["1F1B"]) == sorted(figures["1F1B"], reverse=True)
    assert optimizer.state == {} and all(p.grad is None for p in model.parameters())  # the user's are untouched


def test_a_rank_holding_several_stages_holds_each_stages_parameters():
    model, batch = _blocks(), _batch()
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                             _run(PPPlan(2, _mse, schedule="Interleaved1F1B", microbatches=4)))
    assert len(est.per_rank_peak_bytes) == 2 and not est.coverage.lower_bound, est.coverage.notes
    one_block = sum(p.numel() * 4 for p in model[0].parameters())
    assert [b["parameters"] for b in est.per_rank_breakdown] == [2 * one_block, 2 * one_block]  # stages 0+2, 1+3
    # AdamW's two moments, and a 4-byte step count for each of the rank's 8 parameters.
    assert [b["optimizer_state"] for b in est.per_rank_breakdown] == [4 * one_block + 8 * 4] * 2


def test_pipeline_ranks_inside_fsdp2_hold_their_stages_shards():
    """PP 2 x FSDP2 2 on a (pp, dp) mesh: each stage's blocks and the stage itself wrapped by fully_shard over dp;
    the two data-parallel ranks of a stage hold half its parameters and trace alike."""
    from preflight.parallel import FSDP2Plan

    model, batch = _blocks(), _batch()
    run = preflight.Run(parallel=ParallelPlan(4, "fsdp2", fsdp=FSDP2Plan(units=("0", "1", "2", "3")),
                                              pp=PPPlan(2, _mse, microbatches=4)))
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, run)
    assert est.sharding == "pp2 x fsdp2 2" and not est.coverage.lower_bound, est.coverage.notes
    one_block = sum(p.numel() * 4 for p in model[0].parameters())
    assert [b["parameters"] for b in est.per_rank_breakdown] == [one_block] * 4  # two blocks, half of each
    figures = est.per_rank_peak_bytes
    assert figures[0] == figures[1] and figures[2] == figures[3] and figures[0] != figures[2]
    assert any("ranks with equal local shapes share a trace: 0-1; 2-3" in n for n in est.coverage.notes)


@pytest.mark.parametrize("world, stages, schedule", [(6, 2, "1F1B"), (8, 2, "Interleaved1F1B"), (4, 2, "GPipe")])
def test_ranks_sharing_a_trace_are_those_fully_shard_gives_equal_shards(world, stages, schedule):
    """The groups come from FSDP2's cut of each stage's parameters over the data-parallel ranks (one stage cut per
    pipeline rank); they are the groups that wrapping a meta copy as every rank of the fake world gives."""
    from preflight.parallel import FSDP2Plan, fake_replica, fake_world, stage_rank_groups
    from preflight.parallel._pipeline import _local_parameters, _mesh_shape, _stage_parts
    from preflight.parallel._rank import MetaTwins, fresh_dtensor_caches

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH - 5), nn.GELU(), nn.Linear(4 * WIDTH - 5, 5))
                            for _ in range(4)])  # dims 507 and 5: uneven over 2, 3 and 4 data-parallel ranks
    plan, fsdp = PPPlan(stages, _mse, schedule=schedule), FSDP2Plan(units=("0", "1", "2", "3"))
    by_wrapping: dict[tuple, list[int]] = {}
    for rank in range(world):
        with fresh_dtensor_caches(), fake_world(world, rank, mesh=_mesh_shape(plan, fsdp, world)) as mesh:
            parts = _stage_parts(plan, fsdp, fake_replica(model, MetaTwins()), mesh)
            key = (mesh["pp"].get_local_rank(), tuple(tuple(t.shape) for t in _local_parameters(parts)))
        by_wrapping.setdefault(key, []).append(rank)
    groups = stage_rank_groups(model, plan, fsdp, world)
    assert sorted(groups) == sorted(by_wrapping.values())
    assert len(groups) > stages  # the uneven shards split some pipeline ranks' data-parallel ranks


def test_a_users_split_that_raises_is_the_users_error():
    model, batch = _blocks(), _batch()

    def split(model, stage, stages):
        raise RuntimeError("no such layer")

    with pytest.raises(RuntimeError, match="no such layer"):  # the job's own split raises it too
        preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, _run(PPPlan(2, _mse, split=split)))


def test_pipelining_internals_of_another_torch_give_a_labelled_lower_bound(monkeypatch):
    """The neighbours' messages are answered through torch 2.13's pipelining internals; where they are missing the
    estimate is the labelled lower bound, naming what failed."""
    from torch.distributed.pipelining import schedules

    monkeypatch.delattr(schedules, "_split_tensor")
    model, batch = _blocks(), _batch()
    with pytest.warns(RuntimeWarning, match="lower bound"):
        est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, _run(PPPlan(2, _mse)))
    assert est.coverage.lower_bound and est.sharding == "pp2" and est.per_rank_peak_bytes is None
    assert any("a rank could not be traced" in n for n in est.coverage.notes)
    assert "_split_tensor" in str(est.coverage.failed_op) + " ".join(est.coverage.notes)


def test_the_schedule_runs_the_step_so_a_step_function_is_refused():
    model, batch = _blocks(), _batch()
    with pytest.raises(ValueError, match="the schedule runs the step"):
        preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, _run(PPPlan(2, _mse)),
                           step=lambda m, b: m(b[0]).sum())


# ---- a pipeline the job cut itself: read off its schedule -----------------------------------------------------------

def _job_schedule(schedule: str = "Interleaved1F1B", loss_fn=_mse, rank: int = 0):
    """Rank ``rank``'s schedule over 2 ranks of ``_blocks()`` cut into 4 stages, as a job builds it (in a fake world,
    which stands for the job's group here)."""
    from torch.distributed import pipelining

    from preflight.parallel._pipeline import SCHEDULES, _schedule_key

    cls, style = SCHEDULES[_schedule_key(schedule)]
    plan = PPPlan(2, _mse, schedule=schedule)
    model = _blocks()
    stages = [pipelining.PipelineStage(split_sequential(model, i, plan.num_stages), i, plan.num_stages,
                                       torch.device("cpu")) for i in plan.stage_indices(rank)]
    return getattr(pipelining, cls)(stages if style else stages[0], n_microbatches=4, loss_fn=loss_fn)


def test_a_schedule_of_the_job_is_read_as_its_plan():
    from preflight.parallel import fake_world
    from preflight.parallel._pipeline import read_pp

    with fake_world(2, 1):
        job = read_pp(_job_schedule(rank=1))
        assert (job.plan.stages, job.plan.num_stages, job.plan.n_microbatches, job.rank) == (2, 4, 4, 1)
        assert job.plan.schedule_class.__name__ == "ScheduleInterleaved1F1B" and job.indices == [1, 3]
        assert [id(m) for m in job.modules] == [id(s.submod) for s in job.stages]
        assert "holds stages 1, 3 of 4" in job.note()
        assert read_pp(_blocks()) is None
        with pytest.raises(ValueError, match="no `loss_fn`"):
            read_pp(_job_schedule("1F1B", loss_fn=None))
        renamed = _job_schedule("1F1B")
        renamed.__class__ = type("MySchedule", (type(renamed),), {})
        with pytest.raises(ValueError, match="MySchedule is not one of the schedules"):
            read_pp(renamed)


def test_the_traced_schedule_takes_the_users_options_its_class_takes():
    """Each class takes its own subset (LoopedBFS no chunk specs; the looped ones `defer_pp_recv`, which decides
    when receive buffers are made): the trace's schedule is built with the user's values of exactly those."""
    from torch.distributed import pipelining

    from preflight.parallel import fake_world
    from preflight.parallel._pipeline import _schedule_options

    with fake_world(2, 0):
        stages = [pipelining.PipelineStage(nn.Linear(2, 2), i, 4, torch.device("cpu")) for i in (0, 2)]
        looped = pipelining.ScheduleLoopedBFS(stages, n_microbatches=4, loss_fn=_mse, scale_grads=False)
        assert sorted(_schedule_options(looped)) == ["backward_requires_autograd", "defer_pp_recv", "loss_fn",
                                                     "n_microbatches", "output_merge_spec", "scale_grads"]
        assert _schedule_options(looped)["scale_grads"] is False
        deferred = pipelining.ScheduleInterleaved1F1B(stages, n_microbatches=4, loss_fn=_mse, defer_pp_recv=True)
        assert _schedule_options(deferred)["defer_pp_recv"] is True
        assert "defer_pp_recv" not in _schedule_options(_job_schedule("1F1B"))


def test_stages_the_job_wrapped_by_fully_shard_are_read_with_their_units_and_mesh():
    from torch.distributed import pipelining
    from torch.distributed.fsdp import fully_shard

    from preflight.parallel import fake_world
    from preflight.parallel._pipeline import read_pp

    with fake_world(4, 3, mesh=((2, 2), ("pp", "dp"))) as mesh:  # rank 3: pipeline rank 1, data-parallel rank 1
        part = split_sequential(_blocks(), 1, 2)
        for name in ("2", "3"):
            fully_shard(part.get_submodule(name), mesh=mesh["dp"])
        fully_shard(part, mesh=mesh["dp"])
        stage = pipelining.PipelineStage(part, 1, 2, torch.device("cpu"), group=mesh["pp"].get_group())
        job = read_pp(pipelining.Schedule1F1B(stage, n_microbatches=4, loss_fn=_mse))
        assert (job.rank, job.dp, job.global_rank, job.world_size) == (1, 2, 3, 4)
        assert job.fsdp[0].units == ("2", "3") and job.fsdp[0].root == ""
        assert "wrapped by fully_shard over 2 data-parallel ranks" in job.note()
        alone = split_sequential(_blocks(), 1, 2)  # its blocks wrapped, the stage module not
        for name in ("2", "3"):
            fully_shard(alone.get_submodule(name), mesh=mesh["dp"])
        stage = pipelining.PipelineStage(alone, 1, 2, torch.device("cpu"), group=mesh["pp"].get_group())
        with pytest.raises(ValueError, match="no wrapped module holding both|wrap the stage module too"):
            read_pp(pipelining.Schedule1F1B(stage, n_microbatches=4, loss_fn=_mse))


def _laid_out_stage(mesh, stage: int, *, fsdp: bool, group=None):
    """Stage ``stage`` of 2 of ``_blocks()`` as torchtitan builds it on a (pp, dp, tp) mesh: each block's first
    projection column-wise and second row-wise over tp, then (``fsdp``) each block and the stage wrapped by
    fully_shard over dp; the stage talks over ``group`` (default: the mesh's pp dim)."""
    from torch.distributed import pipelining
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    part = split_sequential(_blocks(), stage, 2)
    names = [name for name, _ in part.named_children()]
    parallelize_module(part, mesh["tp"], {f"{n}.0": ColwiseParallel() for n in names}
                       | {f"{n}.2": RowwiseParallel() for n in names})
    if fsdp:
        for name in names:
            fully_shard(part.get_submodule(name), mesh=mesh["dp"])
        fully_shard(part, mesh=mesh["dp"])
    group = mesh["pp"].get_group() if group is None else group
    return pipelining.PipelineStage(part, stage, 2, torch.device("cpu"), group=group)


def test_stages_laid_out_by_tensor_parallelism_are_read_with_their_layout_and_pipeline_dim():
    """torchtitan's 3-D layout read off a rank's stage: its DTensor layout over the job's whole mesh, the mesh dim the
    pipeline's group runs along, fully_shard's dim beside it; a mesh dim none of the three uses (context
    parallelism beside the pipeline) and a pipeline group along no dim of the mesh are refused by name."""
    from torch.distributed import pipelining

    from preflight.parallel import fake_world
    from preflight.parallel._pipeline import read_pp
    from preflight.parallel._rank import fresh_dtensor_caches

    # rank 6: pipeline rank 1, data-parallel rank 1, tensor-parallel rank 0 (DTensor's caches hold meshes: each world
    # starts them empty, as a job's one mesh does)
    with fresh_dtensor_caches(), fake_world(8, 6, mesh=((2, 2, 2), ("pp", "dp", "tp"))) as mesh:
        job = read_pp(pipelining.Schedule1F1B(_laid_out_stage(mesh, 1, fsdp=True), n_microbatches=4, loss_fn=_mse))
        assert (job.rank, job.pp_dim, job.dp, job.tp, job.global_rank, job.world_size) == (1, "pp", 2, 2, 6, 8)
        assert job.mesh == ((2, 2, 2), ("pp", "dp", "tp")) and job.fsdp_dims == ("dp",)
        assert job.layout.layouts["0.2.0.weight"][0] == ("tp",) and job.fsdp[0].units == ("2", "3")
        assert "laid out by tensor parallelism over 2 ranks and wrapped by fully_shard over 2" in job.note()
    with fresh_dtensor_caches(), fake_world(4, 3, mesh=((2, 2), ("pp", "tp"))) as mesh:
        job = read_pp(pipelining.Schedule1F1B(_laid_out_stage(mesh, 1, fsdp=False), n_microbatches=4, loss_fn=_mse))
        assert (job.rank, job.dp, job.tp, job.fsdp, job.global_rank) == (1, 1, 2, None, 3)
        diagonal = _laid_out_stage(mesh, 1, fsdp=False, group=dist.new_group([0, 3]))  # ranks 0 and 3: no dim's
        with pytest.raises(ValueError, match="runs along no dim of the mesh"):
            read_pp(pipelining.Schedule1F1B(diagonal, n_microbatches=4, loss_fn=_mse))
    with fresh_dtensor_caches(), fake_world(8, 4, mesh=((2, 2, 2), ("pp", "cp", "tp"))) as mesh:
        with pytest.raises(ValueError, match=r"mesh dim\(s\) cp \(2\) are neither"):
            read_pp(pipelining.Schedule1F1B(_laid_out_stage(mesh, 1, fsdp=False), n_microbatches=4, loss_fn=_mse))


def test_a_schedule_of_the_job_is_its_own_plan_and_is_refused_where_ranks_would_decide_apart():
    from preflight.parallel import fake_world

    with fake_world(2, 0):
        schedule = _job_schedule("1F1B")
        optimizer = torch.optim.AdamW(schedule._stage.submod.parameters())
        with pytest.raises(ValueError, match="its own pipeline plan"):
            preflight.estimate(schedule, optimizer, _batch(), _run(PPPlan(2, _mse)))
        for call in (lambda: preflight.max_batch_size(schedule, optimizer, lambda b: _batch()),
                     lambda: preflight.advise(schedule, optimizer, _batch()),
                     lambda: preflight.estimate_eval(schedule, _batch()),
                     lambda: preflight.estimate_steps(schedule, optimizer, [_batch()])):
            with pytest.raises(ValueError, match="must run on every rank at once"):
                call()


def test_the_run_description_says_the_pipeline():
    parallel = _run(PPPlan(4, _mse, schedule="GPipe", microbatches=8)).to_dict()["parallel"]
    assert parallel["pp"] == {"stages": 4, "schedule": "ScheduleGPipe", "microbatches": 8}


# ---- a torchtitan-style model: the job builds each stage by deleting what other stages hold -------------------------

VOCAB = 512


class _Decoder(nn.Module):
    """Embedding, blocks in a ModuleDict, norm and head; a stage's copy has the parts it lacks set to None (as
    torchtitan's models are written for its pipeline split)."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleDict({str(i): nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0,
                                                                        batch_first=True) for i in range(layers)})
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


def _split_decoder(model: _Decoder, stage: int, stages: int) -> _Decoder:
    """torchtitan's cut: a deep copy of the model with the other stages' layers deleted."""
    part = copy.deepcopy(model)
    per = len(model.layers) // stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in list(part.layers):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.embed = None
    if stage != stages - 1:
        part.norm = part.head = None
    return part


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _decoder_setup(seq: int = SEQ) -> tuple[_Decoder, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = _Decoder()
    ids = torch.randint(0, VOCAB, (BATCH, seq + 1), generator=torch.Generator().manual_seed(2))
    return model, (ids[:, :-1], ids[:, 1:])


@pytest.mark.slow
def test_a_users_own_split_is_traced():
    model, batch = _decoder_setup()
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                             _run(PPPlan(2, _cross_entropy, split=_split_decoder)))
    assert len(est.per_rank_peak_bytes) == 2 and not est.coverage.lower_bound, est.coverage.notes


def test_stages_a_split_deep_copies_hold_their_own_buffers():
    """A rank holding two stages, each a deep copy of the model (torchtitan's cut), holds two copies of a buffer
    every stage keeps (a Llama's rotary frequencies, here a positions table), as in the job; torch's own fake copy
    handed both stages one (128 B under a real interleaved Llama job)."""
    model, batch = _decoder_setup()
    model.register_buffer("positions", torch.arange(4 * SEQ))
    plan = PPPlan(2, _cross_entropy, schedule="Interleaved1F1B", microbatches=4, split=_split_decoder)
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, _run(plan))
    assert not est.coverage.lower_bound, est.coverage.notes
    parts = [[_split_decoder(model, i, plan.num_stages) for i in plan.stage_indices(rank)] for rank in range(2)]
    real = [sum({b.untyped_storage().data_ptr(): b.untyped_storage().nbytes()  # each storage once
                 for part in held for b in part.buffers()}.values()) for held in parts]
    assert [b["buffers"] for b in est.per_rank_breakdown] == real == [2 * 4 * SEQ * 8] * 2


# ---- a transformers decoder, cut as transformers' own pipeline parallelism cuts it -----------------------------------

def _llama(layers: int = 4, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{"vocab_size": VOCAB, "hidden_size": WIDTH, "intermediate_size": 344,
                                           "num_hidden_layers": layers, "num_attention_heads": 4,
                                           "num_key_value_heads": 2, "max_position_embeddings": 256, **extra}))


def _llama_setup(seq: int = SEQ) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (BATCH // 2, seq * 4), generator=torch.Generator().manual_seed(2))
    return _llama(), (ids, ids)


_IN_WORKER = False  # set in the real runs' processes, which load the checkpoint their parent saved


def _qlora_setup(seq: int = SEQ, int8: bool = False) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """`_llama_setup`'s model saved, loaded in NF4 (``int8``: LLM.int8) by transformers and bitsandbytes, prepared
    by peft and given LoRA adapters on every linear layer, as a QLoRA user builds it (the checkpoint in a fixed
    temporary folder, so that the real runs' processes load the same). transformers hands the model back in eval
    mode, as a user gets it."""
    import tempfile
    from pathlib import Path

    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    model, batch = _llama_setup(seq)
    path = Path(tempfile.gettempdir()) / f"preflight-pp-qlora-{os.getppid() if _IN_WORKER else os.getpid()}"
    if not path.exists():
        model.save_pretrained(path)
    quantized = BitsAndBytesConfig(load_in_8bit=True) if int8 else BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32)
    model = LlamaForCausalLM.from_pretrained(path, quantization_config=quantized)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=8, target_modules="all-linear")), batch


def test_transformers_cut_keeps_names_and_hands_on_hidden_states():
    model = _llama(layers=5)
    names = dict(model.named_parameters())
    stages = [split_transformers(model, i, 3) for i in range(3)]
    held = [{n for n, p in s.named_parameters()} for s in stages]
    assert all(n in names for h in held for n in h)  # every name is the model's
    assert set().union(*held) == set(names) and sum(map(len, held)) == len(names)  # each parameter on one stage
    assert "model.embed_tokens.weight" in held[0] and "lm_head.weight" in held[2]
    assert {n.split(".")[2] for n in held[1] if ".layers." in n} == {"2", "3"}  # 5 layers: 2, 2, 1
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        hidden = stages[1](stages[0](ids))
        assert hidden.shape == (2, 8, WIDTH)
        assert torch.allclose(stages[2](hidden), model(ids).logits, atol=1e-5)  # the stages compose to the model
    tied = _llama(layers=2, tie_word_embeddings=True)
    last = split_transformers(tied, 1, 2)
    assert last.lm_head.weight is last.model.embed_tokens.weight  # kept on the last stage for the tied head
    with pytest.raises(ValueError, match="give the plan your own `split`"):
        split_transformers(_blocks(), 0, 2)


def test_tensor_parallel_stages_lay_out_their_own_modules_and_share_a_trace_per_stage():
    """Under PP x TP each stage is laid out by the model's own plan over the mesh's tp dim: the stage's projections
    and head are cut in two, the modules other stages hold (transformers' stand-ins) are skipped, and the ranks of one
    stage hold equal shards, so they share a trace (with FSDP2 over a third dim too)."""
    from preflight.parallel import FSDP2Plan, fake_replica, fake_world, plan_styles, stage_rank_groups
    from preflight.parallel._pipeline import _mesh_shape, _stage_parts
    from preflight.parallel._rank import MetaTwins, fresh_dtensor_caches

    model = _llama()
    plan, tp = PPPlan(2, causal_lm_loss, split=split_transformers), TPPlan(2)
    assert _mesh_shape(plan, FSDP2Plan(), 8, tp) == ((2, 2, 2), ("pp", "dp", "tp"))
    with fresh_dtensor_caches(), fake_world(4, 2, mesh=_mesh_shape(plan, None, 4, tp)) as mesh:
        parts = _stage_parts(plan, None, fake_replica(model, MetaTwins()), mesh, plan_styles(model, tp))
        local = {n: tuple(getattr(p, "_local_tensor", p).shape) for n, p in parts.named_parameters()}
    assert local["0.model.layers.2.self_attn.q_proj.weight"] == (WIDTH // 2, WIDTH)  # column-wise
    assert local["0.model.layers.3.mlp.down_proj.weight"] == (WIDTH, 344 // 2)  # row-wise
    assert local["0.lm_head.weight"] == (VOCAB // 2, WIDTH)
    assert local["0.model.norm.weight"] == (WIDTH,)  # not in the plan: whole on every rank
    assert not any(".layers.0." in n or "embed_tokens" in n for n in local)  # the first stage's
    assert stage_rank_groups(model, plan, None, 4, tp) == [[0, 1], [2, 3]]
    assert stage_rank_groups(model, plan, FSDP2Plan(), 8, tp) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # Inside a ring each place traces apart: (pp, dp, cp) coordinates (r // 4, r // 2 % 2, r % 2).
    assert stage_rank_groups(model, plan, None, 4, cp=CPPlan(2)) == [[0], [1], [2], [3]]
    assert stage_rank_groups(model, plan, FSDP2Plan(), 8, cp=CPPlan(2)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # Counted from one layout per (pp, tp) place and FSDP2's chunks: the groups that laying out and wrapping a meta
    # copy as every rank gives, by its pipeline rank, its tensor-parallel shapes (what FSDP2 gathers back) and its
    # shards, also where they are uneven (a vocabulary of 513 cut in 2, local dims cut over 3 data-parallel ranks).
    from preflight.parallel._pipeline import _engine
    from preflight.parallel._tensor import laid_out_locals

    uneven = _llama(vocab_size=VOCAB + 1)
    styles = plan_styles(uneven, tp)
    wrapped, laid = _engine(plan, None, FSDP2Plan(), 12, tp, styles), _engine(plan, None, None, 4, tp, styles)
    by_wrapping: dict[tuple, list[int]] = {}
    for rank in range(12):
        pp_rank, tp_rank = rank // 6, rank % 2  # on the (pp 2, dp 3, tp 2) mesh
        shards = tuple(tuple(t.shape) for t in laid_out_locals(uneven, wrapped, 12, rank))
        gathered = tuple(tuple(t.shape) for t in laid_out_locals(uneven, laid, 4, pp_rank * 2 + tp_rank))
        by_wrapping.setdefault((pp_rank, gathered, shards), []).append(rank)
    groups = stage_rank_groups(uneven, plan, FSDP2Plan(), 12, tp)
    assert sorted(groups) == sorted(by_wrapping.values()) and len(groups) > 4


@pytest.mark.slow
@pytest.mark.parametrize("precision", [None, "bf16-true", "bf16-mixed"])
def test_a_transformers_decoder_is_traced_per_stage(precision):
    """The stages exchange the hidden states in the dtype the step computes them in (parameters cast under
    bf16-true, autocast under bf16-mixed)."""
    model, batch = _llama_setup()
    plan = PPPlan(2, causal_lm_loss, microbatches=4, split=split_transformers)
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                             preflight.Run(precision=precision, parallel=ParallelPlan(2, None, pp=plan)))
    assert len(est.per_rank_peak_bytes) == 2 and not est.coverage.lower_bound, est.coverage.notes


def _moe_setup(seq: int = SEQ) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=256,
                                               moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                               num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                               head_dim=32, max_position_embeddings=256))
    ids = torch.randint(0, VOCAB, (BATCH // 2, seq * 4), generator=torch.Generator().manual_seed(2))
    return model, (ids, ids)


@pytest.mark.slow
def test_a_mixture_of_experts_decoder_is_cut_and_traced():
    """transformers 5's grouped experts run ``_grouped_mm`` in fp32 on CPU, which torch's meta function refuses:
    the stages' metadata inference runs the trace's own fake kernel for it."""
    model, batch = _moe_setup(8)
    plan = PPPlan(2, causal_lm_loss, split=split_transformers)
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                             preflight.Run(parallel=ParallelPlan(2, None, pp=plan)))
    assert len(est.per_rank_peak_bytes) == 2 and not est.coverage.lower_bound, est.coverage.notes


@pytest.mark.slow
def test_lora_adapters_over_a_cut_decoder_are_traced():
    """The optimizer holds only the adapters; the frozen base weights on each stage need no optimizer entry."""
    from peft import LoraConfig, get_peft_model

    model, batch = _llama_setup()
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    plan = PPPlan(2, causal_lm_loss, microbatches=4, split=split_transformers)
    trainable = [p for p in model.parameters() if p.requires_grad]
    est = preflight.estimate(model, torch.optim.AdamW(trainable), batch,
                             preflight.Run(parallel=ParallelPlan(2, None, pp=plan)))
    assert not est.coverage.lower_bound, est.coverage.notes
    # AdamW's two fp32 moments and 4-byte step count of each stage's adapters, nothing for the frozen weights.
    per_rank = [r["optimizer_state"] for r in est.per_rank_breakdown]
    assert sum(per_rank) == 2 * 4 * sum(p.numel() for p in trainable) + 4 * len(trainable)


# ---- real runs with gloo: each stage rank measured against its prediction -------------------------------------------

def _real_seq(dp: int) -> int:
    """The real runs' sequence length. Under FSDP2 the measurement swings from run to run by one unit's gathered
    parameters (526,848 B here; the prediction equals the lowest): a block freed on gloo's thread, whose moment the
    profiler does not record. At 8 times the sequence that block is under 2% of the figure; with 32 tokens, 8%."""
    return SEQ * 8 if dp > 1 else SEQ


def chunk_phases(schedule, on_phase) -> None:
    """Mark a phase boundary around every micro-batch's forward and backward each stage of ``schedule`` runs, so a
    free lost on gloo's threads (FSDP2's gathered parameters) is placed at the end of its micro-batch's chunk, not
    at the end of the whole pipeline step (`conftest.call_end_peak`)."""
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            def chunk(*args, _run=getattr(stage, name), **kwargs):
                on_phase(0, "pipeline")
                try:
                    return _run(*args, **kwargs)
                finally:
                    on_phase(0, "pipeline")

            setattr(stage, name, chunk)


def _setup(kind: str, seq: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], object, object]:
    """The model, batch, loss and split of each kind of pipeline the real runs train: blocks in an nn.Sequential,
    the torchtitan-style decoder, a transformers Llama cut as transformers cuts it."""
    if kind == "decoder":
        return (*_decoder_setup(seq), _cross_entropy, _split_decoder)
    if kind == "llama":
        return (*_llama_setup(seq), causal_lm_loss, split_transformers)
    if kind == "moe":
        return (*_moe_setup(seq), causal_lm_loss, split_transformers)
    if kind in ("qlora", "int8"):
        return (*_qlora_setup(seq, int8=kind == "int8"), causal_lm_loss, split_transformers)
    return _blocks(), _batch(seq), _mse, split_sequential


def _gloo_worker(rank: int, world: int, port: int, queue, schedule: str, microbatches: int, kind: str,
                 dp: int = 1, tp: int = 1, cp: int = 1, ring_fsdp: bool = False, in_job: bool = False,
                 bf16_compute: bool = False) -> None:
    """One pipeline rank as a torchtitan-style job runs it: its stages cut from the whole model, torch's
    PipelineStage and schedule, AdamW over its stages, two steps; every rank holds the batch. With ``dp``, ``cp`` or
    ``tp`` > 1, a ("pp", "dp", "cp", "tp") mesh (the dims of size 1 left out): each stage laid out by
    parallelize_module over tp (the plan `benchmarks/distributed.py` writes), its blocks and the stage wrapped by
    fully_shard over dp (and cp; with ``ring_fsdp`` and no dp, over cp alone), the steps inside torch's
    context_parallel over cp, the stages talking over pp.
    Measured: the bytes alive before (the rank's parameters or shards, the batch) plus the profiled rise, gloo's
    lost frees placed (`conftest.call_end_peak`). With ``in_job``, every rank first asks preflight about its own
    schedule, as a training script would before its first step, and puts ``(measured, (its peak_bytes, every
    rank's peak, the user's parameters before and after))``. With ``bf16_compute``, fully_shard computes in bf16
    (``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, torchtitan's default)."""
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from benchmarks.distributed import megatron_styles
    from preflight._device import held_tensors, live_storage_bytes
    from preflight.parallel._context import ring_of

    global _IN_WORKER
    _IN_WORKER = True
    with gloo_rank(rank, world, port):
        dims = [("pp", world // (dp * tp * cp))] + [(n, d) for n, d in (("dp", dp), ("cp", cp), ("tp", tp)) if d > 1]
        mesh = (init_device_mesh("cpu", tuple(d for _, d in dims), mesh_dim_names=tuple(n for n, _ in dims))
                if len(dims) > 1 else None)
        seq = _real_seq(dp)
        model, (x, y), loss_fn, split = _setup(kind, seq)
        plan = PPPlan(world // (dp * tp * cp), loss_fn, schedule=schedule, microbatches=microbatches)
        indices = plan.stage_indices(mesh["pp"].get_local_rank() if mesh is not None else rank)
        parts = [split(model, i, plan.num_stages).train() for i in indices]  # as a training loop sets them
        del model
        for part in parts if tp > 1 else ():
            parallelize_module(part, mesh["tp"], megatron_styles(part))
        shards = (mesh["dp", "cp"]._flatten("dp_cp") if cp > 1 else mesh["dp"]) if dp > 1 else \
            (mesh["cp"] if cp > 1 else None)
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16_compute else None)
        for part in parts if dp > 1 or ring_fsdp else ():
            if kind == "decoder":
                blocks = list(part.layers.values())
            elif kind == "llama":
                blocks = [layer for layer in part.model.layers if next(layer.parameters(), None) is not None]
            else:
                blocks = list(part)
            for block in blocks:
                fully_shard(block, mesh=shards, mp_policy=policy)
            fully_shard(part, mesh=shards, mp_policy=policy)
        group = mesh["pp"].get_group() if mesh is not None else None
        stages = [pipelining.PipelineStage(part, i, plan.num_stages, torch.device("cpu"), group=group)
                  for part, i in zip(parts, indices)]
        first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
        held = {"runner": plan.schedule_class(stages if plan.per_rank > 1 else stages[0],
                                              n_microbatches=microbatches, loss_fn=loss_fn)}
        del stages
        params = [p for part in parts for p in part.parameters()]
        optimizer = torch.optim.AdamW([p for p in params if p.requires_grad])
        local = [getattr(p, "_local_tensor", p) for p in params]
        quantization = [t for p in params for _, t in held_tensors(p)]  # a 4-bit weight's quant_state
        before = live_storage_bytes([local, quantization, [b for part in parts for b in part.buffers()], [x, y]],
                                    torch.device("cpu"))

        def steps(on_phase) -> None:
            chunk_phases(held["runner"], on_phase)
            with ring_of(mesh["cp"], (x, y), CPPlan(cp), cpu=True) if cp > 1 else contextlib.nullcontext():
                pipeline_steps(on_phase)

        def pipeline_steps(on_phase) -> None:
            for i in range(2):
                on_phase(i, "pipeline")
                inputs = (x,) if first else ()
                if last:
                    held["runner"].step(*inputs, target=y, losses=[])
                else:
                    held["runner"].step(*inputs)
                on_phase(i, "optimizer")
                optimizer.step()
                optimizer.zero_grad()

        asked = None
        if in_job:
            weights = [t.detach().clone() for t in local]
            est = preflight.estimate(held["runner"], optimizer, (x, y))
            # The verdict: every rank's figure agreed on, the largest over a budget every rank fits but one.
            budget = int(min(est.per_rank_peak_bytes) / 0.9) + 1
            with pytest.warns(RuntimeWarning, match="predicted not to fit|predicted to need") as caught:
                report = preflight.check(held["runner"], optimizer, (x, y),
                                         preflight.Run(target=preflight.Target(budget=budget)), on_overflow="warn")
            # The rank over its budget says how to have preflight choose: plan the pipeline on the whole model.
            remedy = any("plan the pipeline on the whole model" in str(w.message) for w in caught)
            verdict = (report.fits, report.predicted_peak_bytes, report.suggestions, report.step_predictor,
                       remedy == (est.peak_bytes > report.usable_bytes))
            asked = (est.peak_bytes, est.per_rank_peak_bytes,
                     all(torch.equal(a, t) for a, t in zip(weights, local)) and not optimizer.state, verdict)
        dist.barrier()
        # The schedule's stages keep the last step's zero-bubble weight-gradient graphs: alive at the end, not lost.
        measured = before + call_end_peak(steps, teardown=held.clear)
        queue.put((rank, measured if asked is None else (measured, asked)))


@pytest.mark.slow
@pytest.mark.parametrize("schedule, world, kind, dp", [("1F1B", 2, "decoder", 1), ("1F1B", 4, "blocks", 2),
                                                       ("1F1B", 2, "moe", 1), ("1F1B", 2, "qlora", 1),
                                                       ("1F1B", 2, "int8", 1)])
def test_real_gloo_pipeline_per_rank_peak_within_3_percent(schedule, world, kind, dp):
    """Each rank of a real gloo pipeline (dp 2: PP 2 x FSDP2 2 on a 2-D mesh) against its prediction: 1F1B on a
    decoder, under FSDP2, on a mixture-of-experts decoder, and on QLoRA and LLM.int8 + LoRA models as transformers
    loads them (in eval mode: the stages' shapes are inferred in train mode, as the steps run; before, the int8
    layers' eval path stopped the trace). GPipe, interleaved 1F1B, the zero-bubble schedules,
    4 stages, a transformers Llama and PP x FSDP2 on the decoders are measured, 3 runs each, by
    `benchmarks/pipeline_parallel.py` (docs/pipeline-parallel.md)."""
    model, batch, loss_fn, split = _setup(kind, _real_seq(dp))
    plan = PPPlan(world // dp, loss_fn, schedule=schedule, microbatches=8 if kind == "blocks" else 4, split=split)
    from preflight.parallel import FSDP2Plan

    if kind == "decoder":
        units = tuple(f"layers.{n}" for n in model.layers)
    elif kind == "blocks":
        units = tuple(str(i) for i in range(len(model)))
    elif kind not in ("qlora", "int8"):  # a transformers decoder
        units = tuple(f"model.layers.{i}" for i in range(len(model.model.layers)))
    parallel = (ParallelPlan(world, None, pp=plan) if dp == 1 else
                ParallelPlan(world, "fsdp2", fsdp=FSDP2Plan(units=units), pp=plan))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    est = preflight.estimate(model, optimizer, batch, preflight.Run(parallel=parallel))
    assert est.per_rank_peak_bytes is not None and not est.coverage.lower_bound, est.coverage.notes
    measured = spawned(_gloo_worker, world, schedule, plan.n_microbatches, kind, dp)
    for rank in range(world):
        error = (est.per_rank_peak_bytes[rank] - measured[rank]) / measured[rank]
        assert abs(error) <= 0.03, (rank, est.per_rank_peak_bytes, measured)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, kind, world, dp, tp", [("1F1B", "decoder", 2, 1, 1),
                                                          ("Interleaved1F1B", "blocks", 2, 1, 1),
                                                          ("1F1B", "blocks", 4, 2, 1), ("1F1B", "llama", 4, 1, 2)])
def test_a_pipeline_read_off_its_job_is_traced_on_each_rank(schedule, kind, world, dp, tp):
    """A job that cut its model into stages itself (with ``dp``, wrapped each stage's blocks and the stage by
    fully_shard over a (pp, dp) mesh; with ``tp``, laid each stage out by parallelize_module over a (pp, tp) mesh)
    hands preflight its schedule on every rank: each rank traces its own stages, after the ranks exchanged the
    stages' shapes as torch's first step does, and gets every rank's figure; each equals the figure planned from the
    whole model, and the measured peak within 3%. The user's weights and optimizer are untouched."""
    from benchmarks.distributed import megatron_styles
    from preflight.parallel import FSDP2Plan

    model, batch, loss_fn, split = _setup(kind, _real_seq(dp))
    plan = PPPlan(world // (dp * tp), loss_fn, schedule=schedule, microbatches=4, split=split)
    optimizer = torch.optim.AdamW(model.parameters())
    fsdp = None if dp == 1 else FSDP2Plan(units=tuple(str(i) for i in range(len(model))))
    parallel = ParallelPlan(world, None if dp == 1 else "fsdp2", pp=plan, fsdp=fsdp,
                            tp=None if tp == 1 else TPPlan(tp, megatron_styles(model)))
    planned = preflight.estimate(model, optimizer, batch, preflight.Run(parallel=parallel))
    results = spawned(_gloo_worker, world, schedule, 4, kind, dp, tp, 1, False, True)
    for rank in range(world):
        measured, (own, per_rank, untouched, verdict) = results[rank]
        assert untouched
        assert verdict == (False, max(planned.per_rank_peak_bytes), [], None, True)  # no suggestion, no re-prediction
        assert per_rank == planned.per_rank_peak_bytes
        assert own == planned.per_rank_peak_bytes[rank]
        assert abs(own - measured) / measured <= 0.03, (rank, own, measured)


_CALLS = {"forward": 0}


class _RaisesOnItsSecondCall(nn.Module):
    """A stage whose forward raises the user's own error from its second call on: torch's shape inference runs it
    once, the traced step again."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _CALLS["forward"] += 1
        if _CALLS["forward"] > 1:
            raise ValueError("the user's own bug in stage 1")
        return self.inner(x)


def _failing_stage_worker(rank: int, world: int, port: int, queue) -> None:
    """Rank 1's stage raises in its traced step; the group times out in a minute, should a rank be left waiting."""
    from torch.distributed import pipelining

    with gloo_rank(rank, world, port, timeout_s=60):
        part = split_sequential(_blocks(), rank, world)
        part = _RaisesOnItsSecondCall(part) if rank == 1 else part
        stage = pipelining.PipelineStage(part, rank, world, torch.device("cpu"))
        schedule = pipelining.Schedule1F1B(stage, n_microbatches=4, loss_fn=_mse)
        optimizer = torch.optim.AdamW(part.parameters())
        said = []
        try:  # rank 1's stage raises in the traced step (its second call)
            est = preflight.estimate(schedule, optimizer, _batch())
            said.append(("estimate", est.per_rank_peak_bytes, est.coverage.notes[-1]))
        except ValueError as err:
            said.append(("raised", str(err)))
        try:  # and now in torch's shape inference (its third), inside check, whose ranks then agree on a verdict
            report = preflight.check(schedule, optimizer, _batch(), preflight.Run(target=preflight.Target(
                budget="1GiB")))
            said.append(("report", report.fits, report.estimate.coverage.lower_bound))
        except ValueError as err:
            said.append(("raised", str(err)))
        queue.put((rank, said))


@pytest.mark.slow
def test_a_rank_whose_own_stage_raises_leaves_no_rank_waiting():
    """Every rank makes the same exchanges whatever happens on it: the rank whose own code raises re-raises its error
    after the last one, and the other rank gets its figure with a note that rank 1 has none; inside check, the
    raising rank joins the others' agreement on the verdict before it raises."""
    results = spawned(_failing_stage_worker, 2)
    for kind, message in results[1]:  # the traced step, then torch's shape inference inside check
        assert kind == "raised" and "the user's own bug in stage 1" in message
    (kind, per_rank, note), checked = results[0]
    assert kind == "estimate" and per_rank[0] > 0 and per_rank[1] == 0
    assert "rank(s) 1 raised in their own step" in note
    assert checked == ("report", None, True)  # its own figure a lower bound (the inference stopped): no verdict


@pytest.mark.slow
def test_real_gloo_pipeline_with_tensor_parallel_stages_per_rank_peak_within_3_percent():
    """PP 2 x TP 2 on a 2-D mesh (torchtitan's layout, tensor-parallel ranks innermost): a transformers Llama cut as
    transformers cuts it, each stage laid out by the model's own tensor-parallel plan, every rank against its
    prediction. With FSDP2 over a third dim: `benchmarks/pipeline_parallel.py`."""
    model, batch, loss_fn, split = _setup("llama", _real_seq(1))
    plan = PPPlan(2, loss_fn, microbatches=4, split=split)
    optimizer = torch.optim.AdamW(model.parameters())
    est = preflight.estimate(model, optimizer, batch, preflight.Run(parallel=ParallelPlan(4, None, tp=TPPlan(2),
                                                                                          pp=plan)))
    assert est.per_rank_peak_bytes is not None and not est.coverage.lower_bound, est.coverage.notes
    assert any("laid out by parallelize_module over the tp dim" in n for n in est.coverage.notes)
    # Tensor-parallel ranks of one stage hold equal shards; the two stages differ.
    assert est.per_rank_peak_bytes[0] == est.per_rank_peak_bytes[1] != est.per_rank_peak_bytes[2]
    measured = spawned(_gloo_worker, 4, "1F1B", 4, "llama", 1, 2)
    for rank in range(4):
        error = (est.per_rank_peak_bytes[rank] - measured[rank]) / measured[rank]
        assert abs(error) <= 0.03, (rank, est.per_rank_peak_bytes, measured)


@pytest.mark.slow
def test_real_gloo_pipeline_inside_a_ring_per_rank_peak_within_3_percent():
    """PP 2 x CP 2 on a (pp, cp) mesh: each rank's 1F1B steps inside torch's context_parallel over cp (the batch's
    sequence cut in place, then into micro-batches), every rank against its prediction (equal to the byte when
    written; PP 2 x FSDP2 2 x CP 2 on 8 processes too)."""
    model, batch, loss_fn, split = _setup("llama", _real_seq(1))
    plan = PPPlan(2, loss_fn, microbatches=4, split=split)
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                             preflight.Run(parallel=ParallelPlan(4, None, pp=plan, cp=CPPlan(2))))
    assert est.per_rank_peak_bytes is not None and not est.coverage.lower_bound, est.coverage.notes
    assert any("inside torch's context_parallel over the cp dim" in n for n in est.coverage.notes)
    measured = spawned(_gloo_worker, 4, "1F1B", 4, "llama", 1, 1, 2)
    for rank in range(4):
        error = (est.per_rank_peak_bytes[rank] - measured[rank]) / measured[rank]
        assert abs(error) <= 0.03, (rank, est.per_rank_peak_bytes, measured)


@pytest.mark.slow
def test_real_gloo_pipeline_sharded_over_its_ring_alone_per_rank_peak_within_3_percent():
    """PP 2 x CP 2 with FSDP2 over the ring alone (torchtitan's dp_shard_cp in a world of pp x cp: no data-parallel
    dim): each stage's blocks and the stage wrapped by fully_shard over cp, every rank against its prediction."""
    model, batch, loss_fn, split = _setup("llama", _real_seq(1))
    plan = PPPlan(2, loss_fn, microbatches=4, split=split)
    ring = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                              preflight.Run(parallel=ParallelPlan(4, None, pp=plan, cp=CPPlan(2))))
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                             preflight.Run(parallel=ParallelPlan(4, "fsdp2", pp=plan, cp=CPPlan(2))))
    assert est.per_rank_peak_bytes is not None and not est.coverage.lower_bound, est.coverage.notes
    # Sharded over the ring, each rank holds half its stage's parameters, gradients and optimizer state.
    assert all(s < r for s, r in zip(est.per_rank_peak_bytes, ring.per_rank_peak_bytes))
    measured = spawned(_gloo_worker, 4, "1F1B", 4, "llama", 1, 1, 2, True)
    for rank in range(4):
        error = (est.per_rank_peak_bytes[rank] - measured[rank]) / measured[rank]
        assert abs(error) <= 0.03, (rank, est.per_rank_peak_bytes, measured)


@pytest.mark.slow
def test_the_example_plans_each_schedule_per_stage():
    import re

    from conftest import example_output

    stdout = example_output("pipeline_parallel.py", timeout=300)
    lines = stdout.splitlines()
    single = float(re.search(r"one device: ([\d.]+) MiB", lines[0]).group(1))
    stages = [[float(x) for x in re.findall(r"([\d.]+) MiB", line.split("per stage", 1)[1].split("(")[0])]
              for line in lines[1:]]
    assert [len(s) for s in stages] == [4, 4, 2]
    assert all(b < single for figures in stages for b in figures)
    gpipe, one_f_one_b = stages[0], stages[1]
    assert max(one_f_one_b) < min(gpipe)  # 1F1B holds fewer micro-batches than GPipe on every stage


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_the_in_job_example_reads_each_ranks_stage_and_agrees_on_the_verdict(tp):
    """The example's pipeline (with --tp 2, each stage laid out by tensor parallelism over a (pp 2, tp 2) mesh): the
    first stage's ranks peak higher than the last's (more micro-batches in flight), tensor-parallel ranks of a stage
    alike, and every rank agrees on the verdict."""
    import re

    from conftest import example_output

    stdout = example_output("pipeline_in_job.py", timeout=300, args=("--tp", str(tp)))
    figures = [float(f) for f in re.findall(r"rank \d+ ([\d.]+) MiB", stdout)]
    stages = [figures[i * tp:(i + 1) * tp] for i in range(2)]
    assert len(figures) == 2 * tp and all(len(set(ranks)) == 1 for ranks in stages), stdout
    assert stages[0][0] > stages[1][0] and "; rank 0 peaks" in stdout, stdout
    assert "verdict: fits in 128 MiB per rank" in stdout


@pytest.mark.slow
def test_the_cli_plans_a_pipeline_per_rank(tmp_path, capsys):
    """``--pp 2`` cuts the model as transformers' own pipeline parallelism does and gives each stage rank the figure
    the Python API gives the same plan; combinations it does not trace are usage errors (exit 2)."""
    import json

    from preflight._cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": WIDTH, "intermediate_size": 344,
                                  "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": VOCAB, "max_position_embeddings": 256}))
    base = ["estimate", "--hf-config", str(config), "--batch", "2", "--seq", "64", "--pp", "2"]
    out = tmp_path / "pp.json"
    assert main([*base, "--microbatches", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["run"]["parallel"]["pp"] == {"stages": 2, "schedule": "Schedule1F1B", "microbatches": 4}
    assert "pipeline parallel degree 2 (1F1B, 4 micro-batches of 2)" in capsys.readouterr().out
    ids = torch.zeros(8, 64, dtype=torch.long)  # 4 micro-batches of 2 sequences
    plan = PPPlan(2, causal_lm_loss, microbatches=4, split=split_transformers)
    model = _llama()
    python = preflight.estimate(model, torch.optim.AdamW(model.parameters()), (ids, ids),
                                preflight.Run(parallel=ParallelPlan(2, None, pp=plan)))
    assert report["per_rank_peak_bytes"] == list(python.per_rank_peak_bytes)
    assert main([*base, "--budget", "1MiB", "--no-suggest"]) == 3
    gpt2 = tmp_path / "gpt2.json"  # not laid out as transformers' pipeline cut expects
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": VOCAB}))
    capsys.readouterr()
    assert main(["estimate", "--hf-config", str(gpt2), *base[3:]]) == 2
    assert "GPT2LMHeadModel is not one: plan it in Python with your own split" in capsys.readouterr().err
    assert main([*base[:-2], "--microbatches", "4"]) == 2  # without --pp
    assert "pass --pp N" in capsys.readouterr().err
    for extra, said in ((["--offload-optimizer"], "not with --offload-optimizer"),
                        (["--world-size", "4"], "--sharding fsdp2"), (["--tp", "2", "--world-size", "6"],
                                                                      "--sharding fsdp2"),
                        (["--accumulate", "2"], "--microbatches"), (["--schedule", "2F2B"], "'GPipe', '1F1B'")):
        capsys.readouterr()
        assert main([*base, *extra]) == 2, extra
        assert said in capsys.readouterr().err, extra
    # With --tp 2, each stage laid out by the model's own tensor-parallel plan: 4 ranks, as the Python API plans them.
    capsys.readouterr()
    both = tmp_path / "pp-tp.json"
    assert main([*base, "--tp", "2", "--microbatches", "4", "--json", str(both)]) == 0
    assert "4 rank(s), tensor parallel degree 2, pipeline parallel degree 2" in capsys.readouterr().out
    python = preflight.estimate(model, torch.optim.AdamW(model.parameters()), (ids, ids),
                                preflight.Run(parallel=ParallelPlan(4, None, tp=TPPlan(2), pp=plan)))
    report = json.loads(both.read_text())
    assert report["per_rank_peak_bytes"] == list(python.per_rank_peak_bytes)
    assert report["per_rank_peak_bytes"][0] < json.loads(out.read_text())["per_rank_peak_bytes"][0]
    # With --cp 2, each stage rank's steps inside a ring of 2: 4 ranks, each place traced.
    ring = tmp_path / "pp-cp.json"
    assert main([*base, "--cp", "2", "--microbatches", "4", "--json", str(ring)]) == 0
    python = preflight.estimate(model, torch.optim.AdamW(model.parameters()), (ids, ids),
                                preflight.Run(parallel=ParallelPlan(4, None, pp=plan, cp=CPPlan(2))))
    assert json.loads(ring.read_text())["per_rank_peak_bytes"] == list(python.per_rank_peak_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["nf4", "int8"])
def test_the_cli_cuts_a_model_it_quantizes_on_meta_as_the_loaded_model_is_cut(tmp_path, scheme):
    """``--pp 2 --quantize``: the stages of the model the command line builds on the meta device hold, to the byte,
    what the stages of the model transformers loads with the same quantization config hold (LoRA r=8 on every
    linear layer over it, as peft prepares it)."""
    import json

    from preflight._cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": WIDTH, "intermediate_size": 344,
                                  "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": VOCAB, "max_position_embeddings": 256}))
    out = tmp_path / "pp.json"
    assert main(["estimate", "--hf-config", str(config), "--batch", "2", "--seq", "64", "--pp", "2", "--quantize",
                 scheme, *(["--double-quant"] if scheme == "nf4" else []), "--lora-r", "8", "--no-suggest",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    model, _ = _qlora_setup(int8=scheme == "int8")
    ids = torch.zeros(4, 64, dtype=torch.long)  # 2 micro-batches (one per stage) of 2 sequences
    python = preflight.estimate(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]),
                                (ids, ids), _run(PPPlan(2, causal_lm_loss, split=split_transformers)))
    assert not python.coverage.lower_bound and not report["coverage"]["lower_bound"], python.coverage.reason
    assert report["per_rank_peak_bytes"] == list(python.per_rank_peak_bytes)


@pytest.mark.slow
def test_advice_cuts_the_pipeline_batch_finer_and_its_command_fits(tmp_path, capsys, monkeypatch):
    """Over budget under a pipeline plan, the micro-batch suggestion keeps the step batch and cuts it into more
    micro-batches (the schedule's accumulation): its figure is the estimate of that plan, and the first fitting
    suggestion's command exits 0. Only the micro-batch option is traced (each option is a pipeline estimate;
    tests/advice/test_options.py traces every option)."""
    import json

    from conftest import only_options
    from preflight._cli import main

    only_options(monkeypatch, "micro-batch")

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": WIDTH, "intermediate_size": 344,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": 2048, "max_position_embeddings": 256}))
    flags = ["estimate", "--hf-config", str(config), "--seq", "128", "--pp", "2"]
    assert main([*flags, "--batch", "1", "--microbatches", "8", "--json", str(tmp_path / "finer.json")]) == 0
    finer = json.loads((tmp_path / "finer.json").read_text())["required_bytes"]
    over = tmp_path / "over.json"
    budget = int(finer / 0.9) + 1024  # 1 x 8 fits with the default 10% headroom; 2 x 4 does not
    assert main([*flags, "--batch", "2", "--microbatches", "4", "--budget", f"{budget}B", "--json", str(over)]) == 3
    suggestions = json.loads(over.read_text())["suggestions"]
    micro = next(s for s in suggestions if s["change"] == {"micro_batch_size": 1, "microbatches": 8})
    assert micro["fits"] and micro["predicted_peak_bytes"] == finer
    assert micro["command"][micro["command"].index("--microbatches") + 1] == "8"
    first = next(s for s in suggestions if s["fits"])
    capsys.readouterr()
    assert main(first["command"][1:]) == 0, first


@pytest.mark.slow  # every schedule traced beside tensor parallelism: about 60 s on 2 cores
def test_beside_pp_x_tp_the_closed_form_of_the_first_stage_is_megatrons():
    """Megatron's theoretical memory report for 1F1B: Korthikanti et al.'s activations of one micro-batch per layer,
    for the first stage's layers times the micro-batches in flight there (as many as stages, so the whole model's
    layers), times min(1, micro-batches / stages); an interleaved schedule's penalty 1 + (p - 1) / (p * v) instead.
    GPipe is not in the report: no closed form."""
    from preflight._units import format_bytes
    from preflight.parallel._tensor import closed_form_activations

    model, batch, loss_fn, split = _setup("llama", _real_seq(1))
    # (torch's 1F1B needs at least as many micro-batches as stages: the min(1, ...) factor is 1 there)
    for schedule, microbatches, per_rank, factor in (("1F1B", 4, 1, 1.0), ("Interleaved1F1B", 4, 2, 1 + 1 / 4),
                                                     ("GPipe", 4, 1, None)):
        plan = PPPlan(2, loss_fn, schedule=schedule, microbatches=microbatches, split=split,
                      virtual_stages=per_rank if per_rank > 1 else None)
        micro = {"input_ids": batch[0][:max(1, batch[0].shape[0] // microbatches)]}
        per_micro = closed_form_activations(model, micro, 2, False)
        est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                                 preflight.Run(parallel=ParallelPlan(4, None, pp=plan, tp=TPPlan(2))))
        [note] = [n for n in est.coverage.notes if n.startswith("pipeline parallelism")]
        if factor is None:
            assert "closed form" not in note
        else:
            assert f"gives {format_bytes(int(per_micro * factor))} of activations" in note, (schedule, note)


def test_stages_under_fsdp2_mixed_precision_exchange_the_dtype_it_computes_in():
    """FSDP2's MixedPrecisionPolicy(param_dtype=bf16), as torchtitan wraps its stages: the stages compute in bf16,
    so what they send each other is bf16 (inferred in fp32 before, the receive buffers twice their size)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from preflight.parallel import FSDP2Plan
    from preflight.parallel._pipeline import _stage_metas

    plan = PPPlan(2, _mse, microbatches=4)
    fsdp = FSDP2Plan(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    plain, _ = _stage_metas(_blocks(), plan, _batch(), None)
    mixed, _ = _stage_metas(_blocks(), plan, _batch(), None, fsdp=fsdp)
    assert plain[0].outputs[0].dtype == torch.float32 and mixed[0].outputs[0].dtype == torch.bfloat16
    assert mixed[0].outputs[0].shape == plain[0].outputs[0].shape


@pytest.mark.slow
def test_real_gloo_pipeline_inside_fsdp2_computing_in_bf16_per_rank_peak_within_3_percent():
    """PP 2 x FSDP2 2 whose fully_shard computes in bf16 (torchtitan's mixed precision): planned, and read off the
    job on every rank, each rank against its measurement; the stages exchange bf16 (inferred in fp32 before: the
    plan 7% over). Read off the job, each rank equalled its measurement when written; the plan, 0.34% over on the
    first stage's ranks (66,176 B, not located)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from preflight.parallel import FSDP2Plan

    model, batch, loss_fn, split = _setup("blocks", _real_seq(2))
    plan = PPPlan(2, loss_fn, microbatches=4, split=split)
    fsdp = FSDP2Plan(units=tuple(str(i) for i in range(len(model))),
                     mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    planned = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                                 preflight.Run(parallel=ParallelPlan(4, "fsdp2", pp=plan, fsdp=fsdp)))
    assert not planned.coverage.lower_bound, planned.coverage.notes
    results = spawned(_gloo_worker, 4, "1F1B", 4, "blocks", 2, 1, 1, False, True, True)
    for rank in range(4):
        measured, (own, per_rank, untouched, _) = results[rank]
        assert untouched and own == per_rank[rank]
        assert abs(own - measured) / measured <= 0.03, (rank, own, measured)
        assert abs(planned.per_rank_peak_bytes[rank] - measured) / measured <= 0.03, (rank, planned, measured)


def _unreadable_rank_worker(rank: int, world: int, port: int, queue) -> None:
    """Rank 1's schedule has no loss (it cannot be read); the group times out in a minute, should rank 0 wait."""
    from torch.distributed import pipelining

    with gloo_rank(rank, world, port, timeout_s=60):
        part = split_sequential(_blocks(), rank, world)
        stage = pipelining.PipelineStage(part, rank, world, torch.device("cpu"))
        schedule = pipelining.Schedule1F1B(stage, n_microbatches=4, loss_fn=_mse if rank == 0 else None)
        try:
            preflight.estimate(schedule, torch.optim.AdamW(part.parameters()), _batch())
            queue.put((rank, "returned"))
        except ValueError as err:
            queue.put((rank, str(err)))


@pytest.mark.slow
def test_a_rank_that_cannot_read_its_schedule_stops_every_rank():
    """The ranks agree on their readings before any shape exchange: rank 1 raises why its schedule is not read,
    rank 0 that rank 1 could not read its own, and neither waits for the other."""
    said = spawned(_unreadable_rank_worker, 2)
    assert "no `loss_fn`" in said[1]
    assert said[0].startswith("rank(s) 1 of the job could not read their pipeline schedule") and "loss_fn" in said[0]


def test_a_rank_that_cannot_be_traced_counts_its_own_shards_only():
    """The lower bound of a rank whose stages could not be traced: its parameters', gradients' and optimizer state's
    share of its stages as its local shards hold them (here a column-wise layer's half), nothing gathered added."""
    import types

    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from preflight._estimate import _fallback, _own_share
    from preflight.parallel import fake_world
    from preflight.parallel._rank import fresh_dtensor_caches

    failure = types.SimpleNamespace(error=RuntimeError("stopped"), failed_op="op", seconds=0.0, num_ops=0)
    with fresh_dtensor_caches(), fake_world(2, 0) as mesh, pytest.warns(RuntimeWarning, match="lower bound"):
        stage = nn.Sequential(nn.Linear(64, 256, bias=False), nn.Linear(256, 64, bias=False))
        parallelize_module(stage, mesh, {"0": ColwiseParallel()})
        optimizer = torch.optim.AdamW(stage.parameters())
        whole = _fallback(stage, optimizer, torch.zeros(4, 64), torch.device("cpu"), None, 2, failure, [], gpu=None,
                          world_size=1, shard_ranks=1, sharding=None,
                          offload={"offload_optimizer": False, "offload_params": False}, ds=None)
        own = _own_share(whole, stage)
    share = (64 * 256 // 2 + 256 * 64) / (64 * 256 + 256 * 64)
    for key in ("parameters", "gradients", "optimizer_state"):
        assert own.breakdown[key] == int(whole.breakdown[key] * share)
    assert own.breakdown["temporaries"] == whole.breakdown["temporaries"] == 0
    assert own.peak_bytes == sum(own.breakdown.values()) < whole.peak_bytes
