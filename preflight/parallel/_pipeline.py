"""One stage rank's training step under pipeline parallelism (``torch.distributed.pipelining``), traced on fake
tensors with a fake process group.

A `PPPlan` says how the model is cut into stages (the user's own ``split(model, stage, stages)``, the function a
torchtitan-style job builds each rank's stage module with; an ``nn.Sequential`` is cut into contiguous runs of its
children by default), which of torch's schedules runs them (``GPipe``, ``1F1B``), how many micro-batches a batch
is cut into, and the last stage's loss. Each stage rank is traced as the job runs it: the fake copy of the model
is cut into this rank's stage, wrapped in torch's own ``PipelineStage`` and schedule, and the schedule's ``step``
runs twice under the tracker with the optimizer's steps between, so the rank's peak comes out of the schedule's
own program: the micro-batches it holds in flight (GPipe holds every one, 1F1B at most the stages after it), the
buffers it receives activations and gradients into, and, in the first step, the forward and backward on empty
tensors torch runs to learn the shapes its neighbours send (its "dynamic" metadata inference).

A rank traced alone has no neighbours to talk to. Two exchanges carry values the schedule reads, and both are
answered from torch's own code run beforehand: the shapes each stage sends its neighbours come from running
torch's metadata inference over every stage at once in one fake process (`_stage_metas`, each stage's own
``_StageMeta``), and the warm-up vote on static or dynamic inference, which multiplies every stage's vote, is taken
from every stage's own ``InferenceMode.needs_dynamic``. The activations and gradients themselves go through the
fake process group, which moves no data; their buffers are allocated by the stage as in the job.

Known limitations: these exchanges use ``torch.distributed.pipelining``'s internals of torch 2.13 (another version
gives a labelled lower bound naming what is missing); schedules with several stages per rank (interleaved 1F1B,
zero-bubble, looped) and pipeline parallelism combined with data or tensor parallelism are refused by name; a model
already cut into stages inside a job is not read (give the plan).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from preflight._steps import Loop, StepFn
from preflight.cuda import CudaTarget
from preflight.parallel._fake_group import fake_world
from preflight.parallel._rank import Engine, MetaTwins, fake_replica, trace_rank
from preflight.trace import Sweep, TraceResult, swept
from preflight.trace._twin import clone_optimizer

__all__ = ["PPPlan", "SCHEDULES", "split_sequential", "stage_rank_groups", "trace_pp"]

# The schedules traced, by the names users know them by (case-insensitive), and torch's classes for them: one
# stage per rank.
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
# torch's schedules with several stages per rank, refused by name.
_MULTI_STAGE = ("interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev")


def split_sequential(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """Stage ``stage`` of ``stages`` of an ``nn.Sequential``: a contiguous run of its children, the first
    ``len % stages`` runs one longer, under their own names (so each parameter keeps its name)."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"pipeline parallelism cuts a {type(model).__name__} only with the plan's `split` "
                         "(split(model, stage, stages) -> the stage's module, as the job builds it); only an "
                         "nn.Sequential is cut by default")
    children = list(model._modules.items())
    if len(children) < stages:
        raise ValueError(f"the nn.Sequential has {len(children)} children, fewer than the {stages} stages")
    size, extra = divmod(len(children), stages)
    start = stage * size + min(stage, extra)
    end = start + size + (1 if stage < extra else 0)
    return nn.Sequential(OrderedDict(children[start:end]))


@dataclasses.dataclass(frozen=True)
class PPPlan:
    """Pipeline parallelism over ``stages`` ranks, one stage each, as ``torch.distributed.pipelining`` runs it.

    The batch of a pipeline-parallel estimate is ``(inputs, target)``, held by every rank as a torchtitan-style loop
    holds it: the first stage's ``step(inputs)`` cuts ``inputs`` (a tensor or a tuple of tensors) into micro-batches
    along dim 0, and the last stage's ``step(target=target)`` computes ``loss_fn(output, target_chunk)`` for each.

    Attributes:
        stages: the number of stages, one per rank (at least 2).
        loss_fn: the last stage's loss, ``loss_fn(stage_output, target) -> scalar``, as the schedule takes it.
        schedule: ``"GPipe"`` or ``"1F1B"`` (`SCHEDULES`).
        microbatches: micro-batches per step; None: as many as there are stages.
        split: ``split(model, stage, stages) -> module``: the stage's module, built from the model's own modules
            (parameter names kept, as torchtitan's cut keeps them); None: `split_sequential`.
    """

    stages: int
    loss_fn: Callable[[Any, Any], torch.Tensor]
    schedule: str = "1F1B"
    microbatches: int | None = None
    split: Callable[[nn.Module, int, int], nn.Module] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"`PPPlan.stages` should be an int of at least 2, got {self.stages!r}.")
        if not callable(self.loss_fn):
            raise TypeError(f"`PPPlan.loss_fn` should be the last stage's loss function, got {self.loss_fn!r}.")
        name = str(self.schedule).lower().replace("schedule", "").replace("_", "").replace("-", "")
        if name in _MULTI_STAGE:
            raise ValueError(f"the schedule {self.schedule!r} runs several stages per rank, which preflight does not "
                             f"trace yet; traced: {', '.join(('GPipe', '1F1B'))}.")
        if name not in SCHEDULES:
            raise ValueError(f"`PPPlan.schedule` should be one of 'GPipe', '1F1B', got {self.schedule!r}.")
        if self.microbatches is not None and (isinstance(self.microbatches, bool)
                                              or not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise ValueError(f"`PPPlan.microbatches` should be a positive int or None, got {self.microbatches!r}.")
        if self.split is not None and not callable(self.split):
            raise TypeError(f"`PPPlan.split` should be split(model, stage, stages) -> module, got {self.split!r}.")

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or self.stages

    @property
    def schedule_class(self) -> type:
        from torch.distributed import pipelining

        name = str(self.schedule).lower().replace("schedule", "").replace("_", "").replace("-", "")
        return getattr(pipelining, SCHEDULES[name])

    @property
    def label(self) -> str:
        return f"pp{self.stages} ({self.schedule_class.__name__}, {self.n_microbatches} micro-batches)"

    def stage_module(self, model: nn.Module, stage: int) -> nn.Module:
        return (self.split or split_sequential)(model, stage, self.stages)


def _parts(batch: Any) -> tuple[tuple[Any, ...], Any]:
    """A pipeline batch's inputs (as positional arguments) and target."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ValueError("a pipeline-parallel batch should be (inputs, target): the first stage's inputs and the "
                         f"last stage's target; got a {type(batch).__name__}")
    inputs, target = batch
    return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), target


def _vote(all_static: bool) -> Callable[..., None]:
    """The schedule's warm-up vote, answered without messages: STATIC where every stage votes STATIC (torch's rule:
    the product of the votes), else DYNAMIC."""
    from torch.distributed.pipelining._utils import InferenceMode

    def warmup_p2p(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC if all_static else InferenceMode.DYNAMIC

    return warmup_p2p


def _stage_metas(model: nn.Module, plan: PPPlan, batch: Any) -> tuple[list[Any], bool]:
    """Every stage's ``_StageMeta`` (the shapes it receives, sends and gets gradients of) and whether every stage
    votes STATIC, from torch's own metadata inference run over all the stages at once: in a fake process group of
    one rank every stage is on the same rank, so torch passes the metadata from stage to stage as arguments."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.schedules import _TARGET_CHUNK_SPEC, _split_tensor

    from preflight.trace._twin import TwinMaker

    args, target = _parts(batch)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    twins = TwinMaker(fake_mode, torch.device("cpu"))
    with fake_world(1, 0), fake_mode:
        replica = fake_replica(model, twins)
        stages = [PipelineStage(_cut(plan, replica, i), i, plan.stages, torch.device("cpu"))
                  for i in range(plan.stages)]
        all_static = all(not InferenceMode.needs_dynamic(s._user_meta, True) for s in stages)
        schedule = plan.schedule_class(stages[0], n_microbatches=plan.n_microbatches, loss_fn=plan.loss_fn)
        schedule._warmup_p2p = _vote(all_static)
        fake_args = tuple(twins.batch(list(args), cast=False))
        arg_mbs, kwarg_mbs = schedule._split_inputs(fake_args, {})
        target_mbs = list(_split_tensor(twins.batch(target, cast=False), _TARGET_CHUNK_SPEC, plan.n_microbatches))
        with torch.enable_grad():
            schedule._initialize_pp_stages(stages, arg_mbs[0], kwarg_mbs[0], target_mbs[0], False, False)
    return [s._stage_meta for s in stages], all_static


def _cut(plan: PPPlan, replica: nn.Module, stage: int) -> nn.Module:
    """The stage's module cut from the fake copy. A split that deep-copies (torchtitan's does) copies under torch's
    ``FakeCopyMode``, so the copies are fake tensors of the trace's own fake mode (a plain deep copy of a fake tensor
    makes one of a new mode, whose views the trace would see as new storages)."""
    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensor

    mode = next((t.fake_mode for t in (*replica.parameters(), *replica.buffers()) if isinstance(t, FakeTensor)), None)
    with FakeCopyMode(mode) if mode is not None else contextlib.nullcontext(), warnings.catch_warnings():
        # Copying a fake tensor reads its data pointer, which torch warns about; nothing is read.
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        return plan.stage_module(replica, stage)


def _engine(model: nn.Module, plan: PPPlan, batch: Any) -> Engine:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.stage import _StageBackwardMeta, _StageForwardMeta

    metas, all_static = _stage_metas(model, plan, batch)

    def wrap(replica: nn.Module, mesh: Any) -> nn.Module:
        return _cut(plan, replica, mesh.get_rank())

    def drive(stage_module: nn.Module) -> Callable[[Any], None]:
        import torch.distributed as dist

        rank = dist.get_rank()
        stage = PipelineStage(stage_module, rank, plan.stages, torch.device("cpu"))

        def received(src: int) -> Any:  # what the neighbour would send: its own metadata, from `_stage_metas`
            if src == rank - 1:
                return _StageForwardMeta(forward_metas=metas[src].outputs)
            return _StageBackwardMeta(backward_metas=metas[src].input_grads)

        stage._recv_meta = received
        stage._send_meta = lambda meta, dst: None
        schedule = plan.schedule_class(stage, n_microbatches=plan.n_microbatches, loss_fn=plan.loss_fn)
        schedule._warmup_p2p = _vote(all_static)

        def run(batch: Any) -> None:
            args, target = _parts(batch)
            if stage.is_first:
                schedule.step(*args)
            elif stage.is_last:
                losses: list[torch.Tensor] = []
                schedule.step(target=target, losses=losses)
            else:
                schedule.step()

        return run

    def optimizer(user: torch.optim.Optimizer, model_: nn.Module, stage_module: nn.Module) -> torch.optim.Optimizer:
        return stage_optimizer(user, model_, stage_module)

    return Engine(name=f"torch.distributed.pipelining {plan.schedule_class.__name__}", wrap=wrap, optimizer=optimizer,
                  parameters=lambda stage_module: list(stage_module.parameters()), watch=_held_p2p, drive=drive)


class _HeldWork:
    """A point-to-point work that holds its tensors until it is dropped, as gloo's send and receive works do (the
    fake process group's work holds none). 1F1B keeps its last warm-up send's work through the whole 1B1F phase,
    so the activation it sent outlives its micro-batch's backward by that long."""

    def __init__(self, work: Any, tensors: list[torch.Tensor]) -> None:
        self._work, self._tensors = work, tensors

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextlib.contextmanager
def _held_p2p(tracker: Any, *, gloo: bool) -> Iterator[None]:
    """For the block, the schedules' point-to-point works hold their tensors (`_HeldWork`)."""
    from torch.distributed.pipelining import schedules

    batch_p2p = schedules._batch_p2p

    def held(p2p_ops: list[Any], desc: str | None = None) -> list[Any]:
        works = batch_p2p(p2p_ops, desc=desc)
        tensors = [op.tensor for op in p2p_ops]
        return [_HeldWork(work, tensors) for work in works]

    schedules._batch_p2p = held
    try:
        yield
    finally:
        schedules._batch_p2p = batch_p2p


def stage_optimizer(user: torch.optim.Optimizer, model: nn.Module, stage_module: nn.Module) -> torch.optim.Optimizer:
    """The user's optimizer rebuilt over one stage's parameters (matched by name; each group keeps its
    hyperparameters, groups with no parameter on the stage are left out), as each stage rank builds its own."""
    names = {id(p): name for name, p in model.named_parameters()}
    on_stage = dict(stage_module.named_parameters())
    groups, seen = [], 0
    for index, group in enumerate(user.param_groups):
        params = [on_stage[names[id(p)]] for p in group["params"] if names.get(id(p)) in on_stage]
        seen += len(params)
        if params:
            groups.append((index, params))
    if seen != len(on_stage):
        raise ValueError(f"{len(on_stage) - seen} of the stage's parameters are not found under the model's names "
                         "(a split that renames them, or an optimizer over another model)")
    if user.state:
        raise ValueError("the optimizer already has state (a resumed run); its share on each stage is not traced")
    return clone_optimizer(user, None, foreach=None, param_groups=groups, keep_state=False)


def stage_rank_groups(model: nn.Module, plan: PPPlan) -> list[list[int]]:
    """Every stage rank on its own: stages hold different modules and different micro-batches in flight. (A split
    that fails on a meta copy raises here, before any trace.)"""
    for stage in range(plan.stages):
        plan.stage_module(fake_replica(model, MetaTwins()), stage)
    return [[rank] for rank in range(plan.stages)]


@swept
def trace_pp(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    *,
    rank: int,
    plan: PPPlan,
    step: StepFn | None,
    precision: str | None,
    steps: int,
    schedule: Loop = Loop(),
    record_op: Callable[[Any, Any], bool] | None = None,
    routing: str = "balanced",
    cuda: CudaTarget | None = None,
    sweep: Sweep,
) -> TraceResult:
    """Trace ``steps`` training steps of stage rank ``rank`` of ``plan`` (module docstring).

    Args:
        model, optimizer, batch: the user's; only read. ``batch`` is ``(inputs, target)`` (`PPPlan`). The optimizer
            is rebuilt (same class and hyperparameters) over the stage's parameters.
        step: must be None: the schedule runs the forward, the loss and the backward.
        record_op, routing, cuda: as for `preflight.trace.trace_steps`.

    Returns:
        A `TraceResult` whose events are this rank's; ``error`` is set when the trace stopped or the stage could not
        be built.

    Raises:
        ValueError: a ``step`` was given.
        ProcessGroupInUseError: a fake process group cannot be made in this process.
    """
    if step is not None:
        raise ValueError("under pipeline parallelism the schedule runs the step: the last stage's loss is the plan's "
                         "`loss_fn`; leave `step` out")
    engine = _engine(model, plan, batch)
    return trace_rank(engine, model, optimizer, batch, world_size=plan.stages, rank=rank, step=None,
                      precision=precision, steps=steps, schedule=schedule, record_op=record_op, routing=routing,
                      cuda=cuda, sweep=sweep)
