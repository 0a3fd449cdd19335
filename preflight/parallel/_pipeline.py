"""One pipeline rank's training step under pipeline parallelism (``torch.distributed.pipelining``), traced on fake
tensors with a fake process group.

A `PPPlan` says how the model is cut into stages (the user's own ``split(model, stage, num_stages)``, the function
a torchtitan-style job builds each stage module with; `split_transformers`, a transformers decoder cut as
transformers' own pipeline parallelism cuts it; an ``nn.Sequential`` is cut into contiguous runs of its children by
default), which of torch's schedules runs them (GPipe and 1F1B with one stage per rank; interleaved
1F1B, looped BFS and the zero-bubble schedules with several, laid on ranks as torch lays them), how many
micro-batches a batch is cut into, and the last stage's loss. Each rank is traced as the job runs it: the fake copy
of the model is cut into this rank's stages, wrapped in torch's own ``PipelineStage`` and schedule, and the
schedule's ``step`` runs twice under the tracker with the optimizer's steps between, so the rank's peak comes out
of the schedule's own program: the micro-batches it holds in flight, the buffers it receives activations and
gradients into, and, in the first step, the forward and backward on empty tensors torch runs to learn the shapes
its neighbours send (its "dynamic" metadata inference).

A rank traced alone has no neighbours to talk to. Two exchanges carry values the schedule reads, and both are
answered from torch's own code run beforehand: the shapes each stage sends its neighbours come from running
torch's metadata inference over every stage at once in one fake process (`_stage_metas`, each stage's own
``_StageMeta``), and the warm-up vote on static or dynamic inference, which multiplies every stage's vote, is taken
from every stage's own ``InferenceMode.needs_dynamic``. The activations and gradients themselves go through the
fake process group, which moves no data; their buffers are allocated by the stage as in the job, and a pending
send holds its tensor as gloo's work does (`_HeldWork`).

With tensor parallelism beside it (torchtitan's 2-D and 3-D layouts), each stage module is laid out by DTensor's
``parallelize_module`` over the mesh's ``tp`` dim (the plan's module names matched in the stage, which keeps the
model's names; modules another stage holds are skipped), then wrapped by ``fully_shard`` over ``dp`` where FSDP2 is
given, then handed to its ``PipelineStage`` over the ``pp`` dim: the mesh is ``(pp, dp, tp)``, tensor-parallel
ranks innermost. The shapes the stages exchange come from torch's metadata inference run with the stages laid out
as tensor-parallel rank 0 lays them (sequence parallelism hands on a slice of the sequence). With context parallelism
beside it (a ``cp`` dim between ``dp`` and ``tp``), the rank's schedule steps run inside torch's ``context_parallel``
over ``cp``, which cuts the batch's sequence in place before the first stage cuts it into micro-batches, and every
attention of the stage goes through the ring; the stages exchange one place's slice of the sequence, and FSDP2
shards each stage over the ``dp`` and ``cp`` dims flattened.

A pipeline the job cut itself is read off its schedule (`read_pp`, `JobPipeline`): each rank holds only its own
stages, so each traces its own (`trace_pp_in_job`), after the ranks answered the shapes they exchange by running
torch's metadata inference on fake copies of their stages stage by stage over the job's own group
(`job_stage_metas`). Stages the job laid out by tensor parallelism on one named ``(pp, [dp,] tp)`` mesh are read
with their DTensor layout over the job's whole mesh (`preflight.parallel.read_tp`) and the mesh dim the pipeline's
group runs along; each rank's fake copy is laid out the same way in a fake world of the job's mesh, for the shape
inference (so each tensor-parallel rank answers its own shapes) and for the trace.

Known limitations: these exchanges use ``torch.distributed.pipelining``'s internals of torch 2.13 (another version
gives a labelled lower bound naming what is missing, planned or read off a job); pipeline parallelism combined with
DDP, FSDP1 or HSDP is refused (FSDP2 is traced); a pipeline cut inside a job is read off its schedule only where its
stages are plain modules, wrapped by ``fully_shard`` over the other dim of a ``(pp, dp)`` mesh, or laid out by
tensor parallelism on one named mesh of pipeline, tensor-parallel and fully_shard dims (`read_pp`: not beside
context parallelism or DDP, nor ``fully_shard`` over a flattened dim such as torchtitan's ``dp_shard_cp``); planned
under tensor parallelism, every tensor-parallel rank is assumed to exchange the shapes rank 0 does (an uneven cut of
the sequence by sequence parallelism would differ).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from preflight._checkpoint import Checkpoint
from preflight._loading import Loading
from preflight._steps import Loop, StepFn, autocast_for
from preflight.cuda import CudaTarget
from preflight.parallel._context import CPPlan, data_mesh, ring_of, sequence_tensors
from preflight.parallel._fake_group import fake_world, jobs_world
from preflight.parallel._fsdp2 import FSDP2Plan, apply_fully_shard
from preflight.parallel._rank import Engine, MetaTwins, default_units, fake_replica, fresh_dtensor_caches, trace_rank
from preflight.parallel._tensor import (TPPlan, WrappedTP, _matches, _read_engine, dtensor_watch, grouped_by_shards,
                                        laid_out_locals, lay_out, meshes_outside_modes, plan_styles, read_tp)
from preflight.trace import Sweep, TraceResult, swept
from preflight.trace._twin import clone_optimizer

__all__ = ["JobPipeline", "PPPlan", "SCHEDULES", "StageMetasError", "causal_lm_loss", "gather_over",
           "is_job_pipeline", "job_stage_metas", "read_pp", "refuse_job_pipeline", "split_sequential",
           "split_transformers", "stage_rank_groups", "trace_pp", "trace_pp_in_job"]

# The schedules traced, by the names users know them by (case-insensitive, "Schedule" and separators dropped):
# torch's class, and how stages map to ranks (None: one stage per rank; "loop": rank r holds r, r + ranks, ...;
# "v": rank r holds r and 2 * ranks - 1 - r, as torch's `generate_stage_to_rank_mapping` lays them out).
SCHEDULES = {"gpipe": ("ScheduleGPipe", None), "1f1b": ("Schedule1F1B", None),
             "interleaved1f1b": ("ScheduleInterleaved1F1B", "loop"), "loopedbfs": ("ScheduleLoopedBFS", "loop"),
             "interleavedzerobubble": ("ScheduleInterleavedZeroBubble", "loop"),
             "zbvzerobubble": ("ScheduleZBVZeroBubble", "v"), "dualpipev": ("ScheduleDualPipeV", "v")}


def _schedule_key(schedule: Any) -> str:
    return str(schedule).lower().replace("schedule", "").replace("_", "").replace("-", "")


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


class _Passed(nn.Module):
    """Stands for a module another stage holds, as transformers' own pipeline cut does (``PipelineIdentityLayer``):
    hands on the hidden states it is given."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values())))


def split_transformers(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """Stage ``stage`` of ``stages`` of a transformers decoder (``*ForCausalLM``: a base model with ``embed_tokens``,
    ``layers`` and ``norm``, and an ``lm_head``), cut as transformers' own pipeline parallelism cuts it
    (``transformers.distributed.pipeline_parallel.apply_pipeline_parallelism``): a copy of the model whose layers
    outside the stage's contiguous run (the first ``layers % stages`` runs one longer), the embedding outside the
    first stage (kept on the last when tied to the head) and the final norm and head outside the last stage stand
    aside. The stage takes the token ids (first stage) or the hidden states its neighbour sent, and gives the hidden
    states, or the logits on the last stage. Every parameter keeps its name."""
    import copy

    # A peft model is cut inside: its LoRA layers sit in the decoder's modules, and its names are kept.
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    path = next(name for name, module in model.named_modules() if module is inner)
    base = getattr(inner, getattr(inner, "base_model_prefix", "model"), None)
    if not all(hasattr(base, name) for name in ("embed_tokens", "layers", "norm")) or \
            not isinstance(getattr(inner, "lm_head", None), nn.Module):
        raise ValueError(f"split_transformers cuts a transformers decoder (a base model with embed_tokens, layers and "
                         f"norm, and an lm_head); {type(inner).__name__} is not one: give the plan your own `split`")
    layers = len(base.layers)
    if layers < stages:
        raise ValueError(f"the model has {layers} layers, fewer than the {stages} pipeline stages")
    size, extra = divmod(layers, stages)
    start = stage * size + min(stage, extra)
    end = start + size + (1 if stage < extra else 0)
    first, last = stage == 0, stage == stages - 1
    whole = copy.deepcopy(model)
    cut = whole.get_submodule(path)
    cut_base = getattr(cut, cut.base_model_prefix)
    tied = bool(getattr(inner.config, "tie_word_embeddings", False))
    if not (first or (tied and last)):
        cut_base.embed_tokens = _Passed()
    for index in range(layers):
        if not start <= index < end:
            cut_base.layers[index] = _Passed()
    if not last:
        cut_base.norm = _Passed()
        cut.lm_head = _Passed()
    lm_forward = type(cut).forward

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        given = {"input_ids": hidden} if first else {"inputs_embeds": hidden}
        if last:
            return lm_forward(cut, **given, use_cache=False).logits
        return cut_base(**given, use_cache=False).last_hidden_state

    whole.forward = forward
    return whole


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The last stage's loss for `split_transformers`: transformers' own causal-LM loss (``ForCausalLMLoss``: the
    logits in fp32, the labels shifted by one) of a micro-batch's logits and labels."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, logits.shape[-1])


@dataclasses.dataclass(frozen=True)
class PPPlan:
    """Pipeline parallelism over ``stages`` ranks, as ``torch.distributed.pipelining`` runs it.

    The batch of a pipeline-parallel estimate is ``(inputs, target)``, held by every rank as a torchtitan-style loop
    holds it: the rank holding the first stage calls ``step(inputs)``, which cuts ``inputs`` (a tensor or a tuple of
    tensors) into micro-batches along dim 0, and the rank holding the last stage ``step(target=target)``, which
    computes ``loss_fn(output, target_chunk)`` for each.

    Attributes:
        stages: the pipeline's ranks (at least 2).
        loss_fn: the last stage's loss, ``loss_fn(stage_output, target) -> scalar``, as the schedule takes it.
        schedule: one of torch's schedules (`SCHEDULES`): ``"GPipe"``, ``"1F1B"`` (one stage per rank),
            ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"InterleavedZeroBubble"`` (``virtual_stages`` per rank, looped),
            ``"ZBVZeroBubble"``, ``"DualPipeV"`` (two per rank, in a V).
        microbatches: micro-batches per step; None: as many as there are ranks.
        split: ``split(model, stage, num_stages) -> module``: stage ``stage`` of ``num_stages`` (``stages *
            virtual_stages``), built from the model's own modules (parameter names kept, as torchtitan's cut keeps
            them); None: `split_sequential`.
        virtual_stages: stages per rank; None: 1 for the one-stage schedules, 2 for the others.
    """

    stages: int
    loss_fn: Callable[[Any, Any], torch.Tensor]
    schedule: str = "1F1B"
    microbatches: int | None = None
    split: Callable[[nn.Module, int, int], nn.Module] | None = None
    virtual_stages: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"`PPPlan.stages` should be an int of at least 2 (the pipeline's ranks), got "
                             f"{self.stages!r}.")
        if not callable(self.loss_fn):
            raise TypeError(f"`PPPlan.loss_fn` should be the last stage's loss function, got {self.loss_fn!r}.")
        if _schedule_key(self.schedule) not in SCHEDULES:
            names = ", ".join(repr(cls[len("Schedule"):]) for cls, _ in SCHEDULES.values())
            raise ValueError(f"`PPPlan.schedule` should be one of {names}, got {self.schedule!r}.")
        for name in ("microbatches", "virtual_stages"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"`PPPlan.{name}` should be a positive int or None, got {value!r}.")
        style = SCHEDULES[_schedule_key(self.schedule)][1]
        if style is None and self.virtual_stages not in (None, 1):
            raise ValueError(f"{self.schedule!r} runs one stage per rank: leave `virtual_stages` out (or use an "
                             "interleaved schedule).")
        if style == "v" and self.virtual_stages not in (None, 2):
            raise ValueError(f"{self.schedule!r} runs two stages per rank in a V: `virtual_stages` is 2.")
        if self.split is not None and not callable(self.split):
            raise TypeError(f"`PPPlan.split` should be split(model, stage, num_stages) -> module, got {self.split!r}.")

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or self.stages

    @property
    def schedule_class(self) -> type:
        from torch.distributed import pipelining

        return getattr(pipelining, SCHEDULES[_schedule_key(self.schedule)][0])

    @property
    def per_rank(self) -> int:
        """Stages per rank."""
        if self.virtual_stages is not None:
            return self.virtual_stages
        return 1 if SCHEDULES[_schedule_key(self.schedule)][1] is None else 2

    @property
    def num_stages(self) -> int:
        return self.stages * self.per_rank

    def stage_indices(self, rank: int) -> list[int]:
        """The stages rank ``rank`` holds, as torch's schedule maps them."""
        style = SCHEDULES[_schedule_key(self.schedule)][1]
        if style is None:
            return [rank]
        from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

        mapping = generate_stage_to_rank_mapping(self.stages, self.num_stages, style=style)
        return sorted(i for i, r in mapping.items() if r == rank)

    @property
    def label(self) -> str:
        per = f", {self.per_rank} stages per rank" if self.per_rank > 1 else ""
        return f"pp{self.stages} ({self.schedule_class.__name__}, {self.n_microbatches} micro-batches{per})"

    def stage_module(self, model: nn.Module, stage: int) -> nn.Module:
        return (self.split or split_sequential)(model, stage, self.num_stages)


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


def _fsdp_computes_in(part: nn.Module, fsdp: FSDP2Plan | None) -> None:
    """Cast ``part``'s floating parameters to the dtype FSDP2 computes in under ``fsdp``'s mixed-precision policy
    (``param_dtype``: torchtitan's bf16), as its forward runs on the gathered parameters, so that the shapes and
    dtypes inferred for the stages' exchanges are those of the job's steps; nothing without one."""
    policy = getattr(fsdp, "mp_policy", None)
    dtype = getattr(policy, "param_dtype", None)
    if dtype is None:
        return
    for p in part.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    if getattr(policy, "cast_forward_inputs", True):  # FSDP2 casts the wrapped module's floating inputs too
        part.register_forward_pre_hook(lambda module, args: tuple(
            a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args))


def _stage_metas(model: nn.Module, plan: PPPlan, batch: Any, precision: str | None,
                 tp: TPPlan | None = None, cp: CPPlan | None = None,
                 fsdp: FSDP2Plan | None = None) -> tuple[list[Any], bool]:
    """Every stage's ``_StageMeta`` (the shapes and dtypes it receives, sends and gets gradients of) and whether
    every stage votes STATIC, from torch's own metadata inference run over all the stages at once: in a fake process
    group where the pipeline has one rank every stage is on the same rank, so torch passes the metadata from stage to
    stage as arguments. Under ``precision`` as the ranks' steps run: parameters cast (``*-true``), the forward under
    autocast (``*-mixed``); with ``tp``, each stage laid out as tensor-parallel rank 0 lays it out, in a fake
    ``(pp 1, tp degree)`` world; with ``cp``, on one place's slice of the sequence (`_ring_slice`); with ``fsdp``,
    in the dtype its mixed-precision policy computes in (`_fsdp_computes_in`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.schedules import _TARGET_CHUNK_SPEC, _split_tensor

    from preflight.trace._fake_kernels import FakeKernelsMode
    from preflight.trace._twin import TwinMaker, float_dtype_for

    args, target = _parts(batch if cp is None else _ring_slice(batch, cp))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    twins = TwinMaker(fake_mode, torch.device("cpu"), cast_dtype=float_dtype_for(precision))
    degree = 1 if tp is None else tp.degree
    layout = None if tp is None else ((1, degree), ("pp", "tp"))
    styles = None if tp is None else plan_styles(model, tp)
    with fresh_dtensor_caches(), fake_world(degree, 0, mesh=layout) as mesh, fake_mode, FakeKernelsMode(), \
            autocast_for(precision, "cpu"):
        replica = fake_replica(model, twins)
        parts = [_cut(plan, replica, i).train() for i in range(plan.num_stages)]  # as the ranks' steps run them
        group = None
        if tp is not None:
            with meshes_outside_modes():
                for part in parts:
                    _lay_out(part, mesh["tp"], styles)
                group = mesh["pp"].get_group()
        for part in parts:
            _fsdp_computes_in(part, fsdp)
        stages = [PipelineStage(part, i, plan.num_stages, torch.device("cpu"), group=group)
                  for i, part in enumerate(parts)]
        all_static = all(not InferenceMode.needs_dynamic(s._user_meta, True) for s in stages)
        # Any schedule runs the inference over a list of stages; GPipe over the first is the plainest vehicle.
        schedule = ScheduleGPipe(stages[0], n_microbatches=plan.n_microbatches, loss_fn=plan.loss_fn)
        schedule._warmup_p2p = _vote(all_static)
        fake_args = tuple(twins.batch(list(args), cast=False))
        arg_mbs, kwarg_mbs = schedule._split_inputs(fake_args, {})
        target_mbs = list(_split_tensor(twins.batch(target, cast=False), _TARGET_CHUNK_SPEC, plan.n_microbatches))
        with torch.enable_grad():
            schedule._initialize_pp_stages(stages, arg_mbs[0], kwarg_mbs[0], target_mbs[0], False, False)
    return [s._stage_meta for s in stages], all_static


def _fresh_copy_mode(mode: Any) -> Any:
    """Torch's ``FakeCopyMode`` over ``mode``, but whose deep copy of a tensor is a new storage each time, as a real
    deep copy's is. Torch's returns the fake mode's memoized twin of its source (``from_tensor``), so two deep copies
    of one model (two stages a rank holds, each cut by a split that deep-copies) shared their buffers: a Llama's
    rotary ``inv_freq`` counted once for two stages, 128 B under the real job. Views of one storage within one
    copy keep sharing their new storage, as a real deep copy's do."""
    from torch._subclasses.fake_tensor import FakeCopyMode

    class FreshCopyMode(FakeCopyMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is not torch.Tensor.__deepcopy__:
                return super().__torch_function__(func, types, args, kwargs)
            tensor, memo = args
            if id(tensor) in memo:
                return memo[id(tensor)]
            twin = self.fake_mode.from_tensor(tensor, static_shapes=True)
            key = ("preflight: fresh storage", tensor.untyped_storage()._cdata)  # the source lives through the copy
            if key not in memo:
                memo[key] = twin.new_empty((twin.untyped_storage().nbytes(),), dtype=torch.uint8).untyped_storage()
            out = twin.new_empty((0,)).set_(memo[key], twin.storage_offset(), twin.shape, twin.stride())
            if isinstance(twin, nn.Parameter):  # a fake parameter, as torch's copy makes it
                out = nn.Parameter(out, requires_grad=twin.requires_grad)
            elif twin.requires_grad:  # a leaf that asks for its gradient keeps asking, as a real deep copy's does
                out.requires_grad_(True)
            memo[id(tensor)] = out
            return out

    return FreshCopyMode(mode)


def _cut(plan: PPPlan, replica: nn.Module, stage: int) -> nn.Module:
    """The stage's module cut from the fake copy. A split that deep-copies (torchtitan's does) copies under a
    ``FakeCopyMode`` (`_fresh_copy_mode`), so the copies are fake tensors of the trace's own fake mode (a plain deep
    copy of a fake tensor makes one of a new mode, whose views the trace would see as new storages)."""
    from torch._subclasses.fake_tensor import FakeTensor

    mode = next((t.fake_mode for t in (*replica.parameters(), *replica.buffers()) if isinstance(t, FakeTensor)), None)
    with _fresh_copy_mode(mode) if mode is not None else contextlib.nullcontext(), warnings.catch_warnings():
        # Copying a fake tensor reads its data pointer, which torch warns about; nothing is read.
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        part = plan.stage_module(replica, stage)
    # A deep copy under FakeCopyMode makes plain fake parameters: what a parameter subclass held (a 4-bit weight's
    # quant_state, which the replica's parameter carries) goes back on the stage's parameter of the same name.
    held = {name: vars(p) for name, p in replica.named_parameters() if vars(p)}
    for name, p in part.named_parameters():
        for attribute, value in held.get(name, {}).items():
            if not hasattr(p, attribute):
                setattr(p, attribute, value)
    return part


def _engine(plan: PPPlan, stage_metas: tuple[list[Any], bool] | None, fsdp: FSDP2Plan | None = None,
            world_size: int | None = None, tp: TPPlan | None = None,
            styles: dict[str, Any] | None = None, cp: CPPlan | None = None) -> Engine:
    """The pipeline engine over ``stage_metas`` (`_stage_metas`; None: an engine that only wraps); each stage laid
    out by ``parallelize_module`` with ``styles`` over the ``tp`` dim where ``tp`` is given, then wrapped by
    ``fully_shard`` over the ``dp`` dim where ``fsdp`` is (torchtitan's PP x FSDP2, PP x TP and PP x FSDP2 x TP on a
    ``(pp, dp, tp)`` mesh of ``world_size`` ranks, `_mesh_shape`), the stages talking over the ``pp`` dim; with
    ``cp``, the steps inside torch's ring over a ``cp`` dim."""
    mesh_shape = _mesh_shape(plan, fsdp, world_size, tp, cp)

    def drive(parts: nn.Module, mesh: Any) -> Callable[[Any], None]:
        metas, all_static = stage_metas
        stages = _answered_stages(parts, plan.stage_indices(_pp_rank(mesh)), plan.num_stages, mesh, metas)
        one = plan.per_rank == 1 and SCHEDULES[_schedule_key(plan.schedule)][1] is None
        schedule = plan.schedule_class(stages[0] if one else stages, n_microbatches=plan.n_microbatches,
                                       loss_fn=plan.loss_fn)
        return _stepper(schedule, stages, all_static)

    def wrap(replica: nn.Module, mesh: Any) -> nn.Module:
        return _stage_parts(plan, fsdp, replica, mesh, styles if tp is not None else None)

    def around(mesh: Any, batch: Any, *, cpu: bool) -> contextlib.AbstractContextManager[None]:
        return ring_of(mesh["cp"], batch, cp, cpu=cpu)

    name = (f"torch.distributed.pipelining {plan.schedule_class.__name__}" + (" + parallelize_module" if tp else "")
            + (" + fully_shard" if fsdp else "") + (" + context_parallel" if cp else ""))
    return Engine(name=name, wrap=wrap, optimizer=stage_optimizer, parameters=_local_parameters,
                  watch=_watch(fsdp is not None), drive=drive, mesh=mesh_shape,
                  around=around if cp is not None else None)


def _watch(sharded: bool) -> Callable[..., contextlib.AbstractContextManager[None]]:
    """A pipeline engine's watch: DTensor's (`dtensor_watch`: FSDP2's own where ``sharded``, meshes built outside the
    fake mode), and each pending send holding its tensor (`_held_p2p`)."""
    inner = dtensor_watch(sharded)

    @contextlib.contextmanager
    def watch(tracker: Any, *, gloo: bool) -> Iterator[None]:
        with inner(tracker, gloo=gloo), _held_p2p(tracker, gloo=gloo):
            yield

    return watch


def _answered_stages(parts: nn.Module, indices: list[int], num_stages: int, mesh: Any,
                     metas: dict[int, Any] | list[Any], dim: str = "pp") -> list[Any]:
    """Torch's ``PipelineStage`` over each of the rank's stage modules, at ``indices`` of ``num_stages``, talking over
    the fake mesh's pipeline dim ``dim`` (the whole fake world on a 1-D mesh), whose neighbours' metadata is answered
    from ``metas`` (`_received`, by stage index) and whose own is sent nowhere: a rank traced alone has no
    neighbours."""
    from torch.distributed.pipelining import PipelineStage

    group = mesh[dim].get_group() if mesh.ndim > 1 else None
    stages = [PipelineStage(part, i, num_stages, torch.device("cpu"), group=group) for part, i in zip(parts, indices)]
    for stage in stages:
        stage._recv_meta = functools.partial(_received, metas, stage.stage_index)
        stage._send_meta = lambda meta, dst: None
    return stages


def _stepper(schedule: Any, stages: list[Any], all_static: bool) -> Callable[[Any], None]:
    """``run(batch)``: one step of ``schedule`` over the rank's ``stages`` as torchtitan's loop calls it on each rank
    (the first stage's rank passes the inputs, the last stage's the target), the warm-up vote answered by
    ``all_static`` (`_vote`)."""
    schedule._warmup_p2p = _vote(all_static)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)

    def run(batch: Any) -> None:
        args, target = _parts(batch)
        if last:
            schedule.step(*(args if first else ()), target=target, losses=[])
        else:
            schedule.step(*(args if first else ()))

    return run


def _mesh_shape(plan: PPPlan, fsdp: FSDP2Plan | None, world_size: int | None, tp: TPPlan | None = None,
                cp: CPPlan | None = None) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
    """The fake mesh: ``("pp", "dp")`` for PP x FSDP2, ``("pp", "tp")`` for PP x TP, ``("pp", "dp", "tp")`` for the
    three, a ``cp`` dim before ``tp`` with context parallelism: pipeline ranks outermost and tensor-parallel ranks
    innermost as torchtitan orders them; None for pipeline parallelism alone (a 1-D world of ``plan.stages``
    ranks)."""
    if fsdp is None and tp is None and cp is None:
        return None
    shape, names = [plan.stages], ["pp"]
    if fsdp is not None:
        ranks = plan.stages * (tp.degree if tp is not None else 1) * (cp.degree if cp is not None else 1)
        if world_size is None or world_size % ranks:
            raise ValueError(f"PP x FSDP2 needs a world size that is a multiple of the {ranks} pipeline (x tensor-"
                             f"parallel) ranks, got {world_size!r}")
        shape.append(world_size // ranks)
        names.append("dp")
    if cp is not None:
        shape.append(cp.degree)
        names.append("cp")
    if tp is not None:
        shape.append(tp.degree)
        names.append("tp")
    return tuple(shape), tuple(names)


def _stage_parts(plan: PPPlan, fsdp: FSDP2Plan | None, replica: nn.Module, mesh: Any,
                 styles: dict[str, Any] | None = None) -> nn.ModuleList:
    """The rank's stages cut from ``replica`` (torchtitan's model parts); with ``styles``, each laid out by
    ``parallelize_module`` over the mesh's ``tp`` dim (`_lay_out`); with ``fsdp``, each then wrapped by
    ``fully_shard`` over the mesh's ``dp`` dim: the plan's units (default: the model's largest ``nn.ModuleList``'s
    entries) where the stage has them, then the stage itself."""
    parts = nn.ModuleList([_cut(plan, replica, i) for i in plan.stage_indices(_pp_rank(mesh))])
    whole = None if fsdp is None else fsdp.units if fsdp.units is not None else default_units(replica)
    with meshes_outside_modes():
        for part in parts:
            if styles is not None:
                _lay_out(part, mesh["tp"], styles)
            if fsdp is not None:
                units = tuple(u for u in whole if _has(part, u))
                apply_fully_shard(part, data_mesh(mesh), dataclasses.replace(fsdp, units=units, root=""))
    return parts


def _ring_slice(batch: Any, cp: CPPlan) -> Any:
    """The batch with each of its sequence tensors (`preflight.parallel._context.sequence_tensors`) cut to one place's
    slice of the ring: the shapes a rank's stages exchange once torch's ring has cut the batch."""
    cut = {id(t): dim for t, dim in sequence_tensors(batch, cp)}

    def local(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and id(value) in cut:
            dim = cut[id(value)]
            return value.narrow(dim, 0, value.shape[dim] // cp.degree)
        if isinstance(value, (tuple, list)):
            return type(value)(local(v) for v in value)
        return value

    return local(batch)


def _lay_out(part: nn.Module, mesh: Any, styles: dict[str, Any]) -> None:
    """``parallelize_module`` over ``mesh`` on a stage module, with the plan's entries that name a module the stage
    holds with parameters: a stage keeps the model's names, and the modules other stages hold are gone or stand-ins
    (a style on a stand-in would raise, as on no nn.Linear)."""
    here: dict[str, Any] = {}
    for key, style in styles.items():
        for name, module in part.named_modules():
            if name and _matches(name.split("."), key.split(".")) and next(module.parameters(), None) is not None:
                here[name] = style
    if here:
        lay_out(part, mesh, here)


def _pp_rank(mesh: Any) -> int:
    """This rank's place in the pipeline: its coordinate on the ``pp`` dim, or its rank when the pipeline is the
    whole world."""
    return mesh["pp"].get_local_rank() if mesh.ndim > 1 else mesh.get_rank()


def _local_parameters(parts: nn.Module) -> list[torch.Tensor]:
    """The rank's own parameter storages: an FSDP2 parameter's local shard."""
    return [getattr(p, "_local_tensor", p) for p in parts.parameters()]


def _has(module: nn.Module, name: str) -> bool:
    """Whether the stage holds the unit ``name`` with its parameters (a stage cut as transformers cuts it keeps
    the other stages' layers' names on parameterless stand-ins)."""
    try:
        unit = module.get_submodule(name)
    except AttributeError:
        return False
    return next(unit.parameters(), None) is not None


def _received(metas: list[Any], stage: int, src: int) -> Any:
    """What neighbour ``src`` would send stage ``stage``: its own metadata, from `_stage_metas`."""
    from torch.distributed.pipelining.stage import _StageBackwardMeta, _StageForwardMeta

    if src == stage - 1:
        return _StageForwardMeta(forward_metas=metas[src].outputs)
    return _StageBackwardMeta(backward_metas=metas[src].input_grads)


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


def stage_optimizer(user: torch.optim.Optimizer, model: nn.Module, parts: nn.Module) -> torch.optim.Optimizer:
    """The user's optimizer rebuilt over one rank's stages' parameters (``parts``, an ``nn.ModuleList`` of stage
    modules; matched by name; each group keeps its hyperparameters, groups with no parameter here are left out), as
    each pipeline rank builds its own."""
    names = {id(p): name for name, p in model.named_parameters()}
    here = {name: p for part in parts for name, p in part.named_parameters()}
    groups, seen = [], set()
    for index, group in enumerate(user.param_groups):
        params = [here[names[id(p)]] for p in group["params"] if names.get(id(p)) in here]
        seen.update(names[id(p)] for p in group["params"] if names.get(id(p)) in here)
        if params:
            groups.append((index, params))
    missing = [name for name, p in here.items() if p.requires_grad and name not in seen]
    if missing:
        raise ValueError(f"{len(missing)} of the stage's trainable parameters (e.g. {missing[0]}) are not in the "
                         "optimizer under the model's names (a split that renames them, or an optimizer over "
                         "another model)")
    if user.state:
        raise ValueError("the optimizer already has state (a resumed run); its share on each stage is not traced")
    return clone_optimizer(user, None, foreach=None, param_groups=groups, keep_state=False)


def stage_rank_groups(model: nn.Module, plan: PPPlan, fsdp: FSDP2Plan | None = None,
                      world_size: int | None = None, tp: TPPlan | None = None,
                      cp: CPPlan | None = None) -> list[list[int]]:
    """Ranks that run the same program: every pipeline rank on its own (ranks hold different stages and different
    micro-batches in flight), and every place in a ring (`preflight.parallel.cp_rank_groups`); within those, the ranks
    whose parameters have the same local shapes (tensor parallelism's) and the same FSDP2 shards. The shapes come
    from one cut of each pipeline rank's stages from a meta copy, laid out once per tensor-parallel rank in a fake
    world of the (pipeline, tensor-parallel) ranks where ``tp`` is given; FSDP2's cut of every local tensor over the
    ranks it shards over (`shard_rows`, the ``dp`` and ``cp`` dims; ``fully_shard`` covers the whole stage) is
    counted (`grouped_by_shards`), so a world of thousands of ranks costs one cut per such place. (A split that
    fails on a meta copy raises here, before any trace.)"""
    degree, ring = (tp.degree if tp is not None else 1), (cp.degree if cp is not None else 1)
    ranks = plan.stages * degree
    if tp is not None:
        engine = _engine(plan, None, None, ranks, tp, plan_styles(model, tp))
        places = [laid_out_locals(model, engine, ranks, rank) for rank in range(ranks)]
    else:  # a fresh copy per stage: a split may take what it keeps out of the model it is given
        cuts = [plan.stage_module(fake_replica(model, MetaTwins()), stage) for stage in range(plan.num_stages)]
        places = [list(nn.ModuleList([cuts[i] for i in plan.stage_indices(pp_rank)]).parameters())
                  for pp_rank in range(plan.stages)]
    size = world_size if fsdp is not None else ranks * ring
    dp = size // (ranks * ring)

    def coordinates(rank: int) -> tuple[int, int, int, int]:  # rank on the (pp, dp, cp, tp) mesh, row-major
        return rank // (dp * ring * degree), rank // (ring * degree) % dp, rank // degree % ring, rank % degree

    def place(rank: int) -> tuple[list[torch.Tensor], int]:
        pp_rank, dp_rank, cp_rank, tp_rank = coordinates(rank)
        return places[pp_rank * degree + tp_rank], dp_rank * ring + cp_rank  # FSDP2 over dp and cp flattened

    shard = dp * ring if fsdp is not None else 1
    return grouped_by_shards(size, place, shard, key=lambda rank: coordinates(rank)[::2])


@swept
def trace_pp(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    *,
    rank: int,
    plan: PPPlan,
    fsdp: FSDP2Plan | None = None,
    world_size: int | None = None,
    tp: TPPlan | None = None,
    cp: CPPlan | None = None,
    step: StepFn | None,
    precision: str | None,
    steps: int,
    schedule: Loop = Loop(),
    record_op: Callable[[Any, Any], bool] | None = None,
    routing: str = "balanced",
    cuda: CudaTarget | None = None,
    shared: dict[str, Any] | None = None,
    sweep: Sweep,
    checkpoint: Checkpoint | None = None,
    loading: Loading | None = None,
) -> TraceResult:
    """Trace ``steps`` training steps of stage rank ``rank`` of ``plan`` (module docstring).

    Args:
        model, optimizer, batch: the user's; only read. ``batch`` is ``(inputs, target)`` (`PPPlan`). The optimizer
            is rebuilt (same class and hyperparameters) over the stage's parameters.
        fsdp, world_size: FSDP2 over the data-parallel dim of a ``("pp", "dp")`` mesh of ``world_size`` ranks
            (None: pipeline parallelism alone over ``plan.stages`` ranks, times ``tp``'s degree where given).
        tp: tensor parallelism inside each stage, over the mesh's innermost ``tp`` dim (`_mesh_shape`).
        cp: context parallelism: the steps inside torch's ring over a ``cp`` dim, the batch's sequence cut in place.
        step: must be None: the schedule runs the forward, the loss and the backward.
        record_op, routing, cuda: as for `preflight.trace.trace_steps`.
        shared: one dict passed to every rank's call of one plan: torch's metadata inference over all the stages
            runs in the first call (under its sweep) and is reused; None: run in this call.

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
    shared = {} if shared is None else shared
    if cp is not None:
        sequence_tensors(batch, cp)  # a ValueError naming what the ring asks of the batch, before any trace
    if "stage_metas" not in shared:
        shared["stage_metas"] = _stage_metas(model, plan, batch, precision, tp, cp, fsdp)
    styles = None if tp is None else plan_styles(model, tp)
    engine = _engine(plan, shared["stage_metas"], fsdp, world_size, tp, styles, cp)
    ranks = world_size or plan.stages * (1 if tp is None else tp.degree) * (1 if cp is None else cp.degree)
    return trace_rank(engine, model, optimizer, batch, world_size=ranks, rank=rank, step=None,
                      precision=precision, steps=steps, schedule=schedule, record_op=record_op, routing=routing,
                      cuda=cuda, sweep=sweep, checkpoint=checkpoint, loading=loading)


# ---- a pipeline already cut into stages inside a running job ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class JobPipeline:
    """A pipeline cut into stages inside a running job, read off this rank's schedule (`read_pp`).

    Attributes:
        schedule: the user's schedule object (only read).
        stages: its ``PipelineStage`` objects on this rank, in stage order.
        modules: their modules, as one ``nn.ModuleList`` in the same order (the model this rank traces).
        plan: the `PPPlan` the schedule runs (ranks, schedule, micro-batches, loss).
        rank: this rank's place in the pipeline's group.
        group: the pipeline's process group (None: the default group).
        fsdp: the FSDP2 plan each of the rank's stage modules was wrapped with, read off it (None: not wrapped).
        dp: the data-parallel ranks each stage is sharded over (1 without FSDP2).
        global_rank: this process's rank in the job, on its row-major mesh.
        layout: where the stages are laid out by tensor parallelism, their DTensor layout read off them
            (`preflight.parallel.read_tp`, over the job's whole mesh, whose dims it names); None: plain stages.
        pp_dim: the name of the mesh dim the pipeline's group runs along (with ``layout``).
    """

    schedule: Any
    stages: tuple[Any, ...]
    modules: nn.ModuleList
    plan: PPPlan
    rank: int
    group: Any
    fsdp: tuple[FSDP2Plan, ...] | None = None
    dp: int = 1
    global_rank: int = 0
    layout: WrappedTP | None = None
    pp_dim: str = "pp"

    @property
    def indices(self) -> list[int]:
        return [stage.stage_index for stage in self.stages]

    @property
    def world_size(self) -> int:
        return self.layout.world_size if self.layout is not None else self.plan.stages * self.dp

    @property
    def mesh(self) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
        """The job's mesh as ``(shape, dim names)``, which the trace's fake world copies (None: 1-D)."""
        if self.layout is not None:
            return self.layout.mesh  # named: `read_pp` refuses a mesh without names
        return ((self.plan.stages, self.dp), ("pp", "dp")) if self.fsdp is not None else None

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        """The mesh dims ``fully_shard`` shards each stage over."""
        return self.layout.fsdp_dims if self.layout is not None and self.layout.fsdp_dims else ("dp",)

    @property
    def tp(self) -> int:
        """The tensor-parallel ranks each stage is laid out over (1 without tensor parallelism)."""
        if self.layout is None:
            return 1
        shape, names = self.layout.mesh
        return math.prod(size for size, name in zip(shape, names)
                         if name != self.pp_dim and name not in (self.layout.fsdp_dims or ()))

    def note(self) -> str:
        held = ", ".join(map(str, self.indices))
        where = ""
        if self.layout is not None:
            shape, names = self.layout.mesh
            mesh = " x ".join(f"{name} {size}" for name, size in zip(names, shape))
            where = (f", each stage laid out by tensor parallelism over {self.tp} ranks"
                     + (f" and wrapped by fully_shard over {self.dp}" if self.fsdp is not None else "")
                     + f" (read off it; this process is rank {self.global_rank} of a ({mesh}) mesh)")
        elif self.fsdp is not None:
            where = (f", each stage wrapped by fully_shard over {self.dp} data-parallel ranks (its units read off it; "
                     f"this process is rank {self.global_rank} of a (pp {self.plan.stages} x dp {self.dp}) mesh)")
        return (f"pipeline read off the job: {type(self.schedule).__name__} over {self.plan.stages} ranks, "
                f"{self.plan.n_microbatches} micro-batches; this process is pipeline rank {self.rank} and holds "
                f"stage{'s' if len(self.stages) > 1 else ''} {held} of {self.plan.num_stages}{where}")


def read_pp(obj: Any) -> JobPipeline | None:
    """The pipeline ``obj`` runs, where ``obj`` is one of torch's pipeline schedules (``Schedule1F1B(stage, ...)``,
    ``ScheduleInterleaved1F1B(stages, ...)``, ...) built inside a job over ``PipelineStage`` objects; None for
    anything else. Each rank holds only its own stages, so each traces its own (`trace_pp_in_job`).

    Raises:
        ValueError: a schedule that is not read (one preflight does not trace, stages torch's tracer built, a
            schedule without a loss, HSDP, stages laid out by DTensor over a mesh without dim names, ranks beyond
            the pipeline's, tensor-parallel and fully_shard dims (context parallelism, DDP), a layout other than
            row-major, a placement of stages on ranks other than torch's own for the schedule), saying what to do
            instead.
    """
    if not is_job_pipeline(obj):
        return None
    try:
        job, error = _read_job(obj), None
    except ValueError as err:
        job, error = None, err
    _agree_on_reading(job, error)
    assert job is not None
    return job


def _agree_on_reading(job: JobPipeline | None, error: ValueError | None) -> None:
    """Every rank of a job learns whether every other rank could read its own schedule, so that none goes on to
    exchange shapes with a rank that stopped (it would wait for it until the backend's timeout): the ranks' outcomes
    are gathered over the job's default group (one ``all_gather_object`` of a few bytes each), and where any rank
    could not read its schedule, or the ranks read different kinds of stages, every rank raises a ValueError (a
    rank that could not read its own, its own). No exchange outside a job or in a fake process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == "fake":
        if error is not None:
            raise error
        return
    mine = (f"{type(error).__name__}: {error}".splitlines()[0][:300] if error is not None else None,
            None if job is None else job.layout is not None)
    said: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(said, mine)
    if error is not None:
        raise error
    failed = [rank for rank, (text, _) in enumerate(said) if text is not None]
    if failed:
        raise ValueError(f"rank(s) {', '.join(map(str, failed))} of the job could not read their pipeline schedule "
                         f"({said[failed[0]][0]}); every rank stops here rather than wait for them.")
    if len({laid for _, laid in said}) > 1:
        laid = [rank for rank, (_, on) in enumerate(said) if on]
        raise ValueError(f"the stages of rank(s) {', '.join(map(str, laid))} are laid out by tensor parallelism and "
                         "the others' are not (a stage the plan's entries name nothing of): the per-rank trace reads "
                         "one layout for the whole job. Give every stage a module the plan lays out, or plan the run "
                         "on the whole model with `ParallelPlan(world, ..., pp=PPPlan(...), tp=TPPlan(...))`.")


def _read_job(obj: Any) -> JobPipeline:
    """`read_pp`'s reading of one rank's schedule, before the ranks agree on it."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor import DTensor

    name = type(obj).__name__
    stages = tuple(getattr(obj, "_stages", None) or [getattr(obj, "_stage", None)])
    key = _schedule_key(name)
    if key not in SCHEDULES:
        names = ", ".join(cls for cls, _ in SCHEDULES.values())
        raise ValueError(f"{name} is not one of the schedules preflight traces ({names}); plan the run with "
                         "`ParallelPlan(..., pp=PPPlan(...))` on the whole model and the nearest schedule instead.")
    if any(not isinstance(stage, PipelineStage) for stage in stages):
        raise ValueError(f"{name} runs stages built by torch's tracer (`pipeline()` / `build_stage`), which are not "
                         "read inside a job; build them with `PipelineStage(module, ...)`, or plan the run with "
                         "`ParallelPlan(..., pp=PPPlan(...))` on the whole model.")
    if obj._loss_fn is None:
        raise ValueError(f"the {name} has no `loss_fn`: it runs forwards only, and preflight plans training steps. "
                         "Pass the schedule the training loop steps.")
    size, rank = stages[0].group_size, stages[0].group_rank
    modules = nn.ModuleList([stage.submod for stage in stages])
    layout = read_tp(modules)
    wrapped = [_read_stage_fsdp2(stage, tensor_parallel=layout is not None) for stage in stages]
    for stage, read in zip(stages, wrapped):
        if layout is None and read is None and any(isinstance(p, DTensor) for p in stage.submod.parameters()):
            raise ValueError(f"stage {stage.stage_index}'s module holds DTensor parameters of a layout that is not "
                             "read (over a device mesh without dim names, or FSDP2 over one): build the job's mesh "
                             "with init_device_mesh(..., mesh_dim_names=(...)), or call preflight before the job "
                             "cuts the model, with `ParallelPlan(world, ..., pp=PPPlan(...), tp=TPPlan(...))`.")
    dp, dp_rank = (1, 0) if wrapped[0] is None else (wrapped[0].world_size, wrapped[0].rank)
    if any((w is None) != (wrapped[0] is None) or (w is not None and (w.world_size, w.rank) != (dp, dp_rank))
           for w in wrapped):
        raise ValueError("this rank's stages are wrapped by fully_shard differently (some not, or over other "
                         "meshes): the per-rank trace follows one data-parallel mesh for all of a rank's stages")
    world = dist.get_world_size() if dist.is_initialized() else size * dp
    if layout is not None:
        pp_dim = _read_pp_dim(stages[0], layout, modules, world)
        global_rank = layout.rank
    else:
        pp_dim = "pp"
        global_rank = dist.get_rank() if dist.is_initialized() else rank * dp + dp_rank
        beside = "fully_shard's" if wrapped[0] is not None else "no other"
        if world != size * dp:
            raise ValueError(f"the pipeline's {size} ranks with {beside} data-parallel dim ({dp}) make {size * dp} "
                             f"of the job's {world} ranks: a pipeline beside context parallelism or DDP inside a job "
                             "is not read yet. Call preflight before the job cuts the model, with a "
                             "`ParallelPlan(world, ..., pp=PPPlan(...))`.")
        if dist.is_initialized():
            pp_ranks = (dist.get_process_group_ranks(stages[0].group) if stages[0].group is not None
                        else list(range(world)))
            if global_rank != rank * dp + dp_rank or pp_ranks != [i * dp + dp_rank for i in range(size)]:
                raise ValueError(f"rank {global_rank} is pipeline rank {rank} and data-parallel rank {dp_rank}, not "
                                 f"laid out as a (pp {size}, dp {dp}) mesh lays them (pipeline ranks outermost, as "
                                 "torchtitan and init_device_mesh lay them): another layout is not read.")
    if size < 2:
        raise ValueError("the pipeline has one rank: estimate its stage's module itself (`stage.submod`).")
    style = SCHEDULES[key][1]
    plan = PPPlan(size, obj._loss_fn, schedule=key, microbatches=obj._n_microbatches,
                  virtual_stages=len(stages) if style is not None else None)
    indices = [stage.stage_index for stage in stages]
    if stages[0].num_stages != plan.num_stages or indices != plan.stage_indices(rank):
        raise ValueError(f"pipeline rank {rank} holds stage(s) {indices} of {stages[0].num_stages}, where {name} "
                         f"over {size} ranks lays out {plan.stage_indices(rank)} of {plan.num_stages}: another "
                         "placement is not read.")
    fsdp = None if wrapped[0] is None else tuple(w.plan for w in wrapped)
    return JobPipeline(schedule=obj, stages=stages, modules=modules, plan=plan, rank=rank, group=stages[0].group,
                       fsdp=fsdp, dp=dp, global_rank=global_rank, layout=layout, pp_dim=pp_dim)


def _read_pp_dim(stage: Any, layout: WrappedTP, modules: nn.Module, world: int) -> str:
    """The dim of the job's mesh (the root of the stages' DTensors' meshes, `read_tp`) that the pipeline's group
    runs along: the stages talk to the ranks that differ from this one on that dim alone. Raises a ValueError where
    the mesh has no dim names, is not the job's whole world laid out row-major (``init_device_mesh``), has no such
    dim, or has a dim other than the pipeline's, tensor parallelism's and fully_shard's with more than one rank
    (context parallelism or DDP beside the pipeline, not read yet)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    shape, names = layout.mesh
    laid = "the stages are laid out by tensor parallelism over a device mesh"
    if names is None:
        raise ValueError(f"{laid} without dim names: build it with init_device_mesh(..., mesh_dim_names=('pp', ..., "
                         "'tp')) as torchtitan does, so the pipeline's dim can be told from the others.")
    root = next(t.device_mesh._get_root_mesh() for t in (*modules.parameters(), *modules.buffers())
                if isinstance(t, DTensor))
    if math.prod(shape) != world or root.mesh.flatten().tolist() != list(range(world)):
        raise ValueError(f"{laid} of {math.prod(shape)} ranks ({root.mesh.tolist()}) that is not the job's {world} "
                         "ranks laid out row-major (as init_device_mesh lays them): another layout is not read.")
    ranks = (dist.get_process_group_ranks(stage.group) if stage.group is not None else list(range(world)))
    coordinate = root.get_coordinate()
    pp_dim = None
    for d, name in enumerate(names):
        along = [int(root.mesh[(*coordinate[:d], i, *coordinate[d + 1:])]) for i in range(shape[d])]
        if along == ranks:
            pp_dim = name
    if pp_dim is None:
        raise ValueError(f"the pipeline's group (ranks {ranks}) runs along no dim of the mesh "
                         f"{dict(zip(names, shape))} the stages are laid out over: build the pipeline's group as the "
                         "mesh's pp dim (`mesh['pp'].get_group()`), as torchtitan does.")
    flattened = [d for d in layout.fsdp_dims or () if d not in names]
    if flattened:
        raise ValueError(f"the stages are wrapped by fully_shard over a flattened mesh dim ({flattened[0]!r}, as "
                         "torchtitan's dp_shard_cp is), which is not read inside a job yet: wrap them over a dim of "
                         "the job's mesh (`mesh['dp']`), or plan the run on the whole model with `ParallelPlan(world, "
                         "'fsdp2', pp=PPPlan(...), tp=TPPlan(...))`.")
    tp_dims = {d for dims, _ in layout.layouts.values() for d in dims or ()}
    if pp_dim in tp_dims or pp_dim in (layout.fsdp_dims or ()):
        raise ValueError(f"the pipeline's group runs along the mesh dim {pp_dim!r}, which the stages are also laid "
                         "out or sharded over: build the pipeline's group as a dim of its own (`mesh['pp']`).")
    used = {pp_dim, *(layout.fsdp_dims or ()), *tp_dims}
    other = [f"{name} ({size})" for name, size in zip(names, shape) if name not in used and size > 1]
    if other:
        raise ValueError(f"the mesh dim(s) {', '.join(other)} are neither the pipeline's, tensor parallelism's nor "
                         "fully_shard's: a pipeline beside context parallelism or DDP inside a job is not read yet. "
                         "Call preflight before the job cuts the model, with `ParallelPlan(world, ..., "
                         "pp=PPPlan(...), tp=TPPlan(...), cp=CPPlan(...))`.")
    return pp_dim


def _read_stage_fsdp2(stage: Any, *, tensor_parallel: bool = False) -> Any:
    """The FSDP2 plan a stage's module was wrapped with (`read_fsdp2`; ``tensor_parallel``: its parameters are laid
    out by tensor parallelism too, over other dims), or None; a wrapping the per-rank trace does not follow (HSDP
    beside a pipeline, units under no wrapped stage module) is a ValueError saying so."""
    from preflight.parallel._fsdp2 import read_fsdp2

    read = read_fsdp2(stage.submod, tensor_parallel=tensor_parallel)
    if read is None:
        return None
    if read.plan.replicate != 1:
        raise ValueError(f"stage {stage.stage_index}'s module is wrapped by fully_shard over an HSDP mesh: pipeline "
                         "parallelism is traced with FSDP2 over one data-parallel dim")
    if read.plan.root:
        raise ValueError(f"stage {stage.stage_index}'s module is not itself wrapped by fully_shard (its units are, "
                         f"under {read.plan.root!r}): wrap the stage module too, as torchtitan does")
    return read


class StageMetasError(RuntimeError):
    """Torch's metadata inference over a job's stages failed on a rank (`job_stage_metas`); raised on every rank."""


def gather_over(job: JobPipeline, value: Any, *, world: bool = False) -> list[Any]:
    """Every pipeline rank's ``value``, in rank order, over the pipeline's own group (``world``: every rank's, over
    the job's default group) with ``all_gather_object``: every rank must call it at the same point, as every rank
    calls the schedule's first step."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * (job.world_size if world else job.plan.stages)
    dist.all_gather_object(gathered, value, group=None if world else job.group)
    return gathered


def job_stage_metas(job: JobPipeline, batch: Any, precision: str | None) -> tuple[dict[int, Any], bool]:
    """Every stage's metadata (what it receives, sends and gets gradients of) and whether every stage votes STATIC,
    as torch's first step infers them, stage by stage over the job's ranks: each rank runs torch's own forward
    inference (stage 0 to the last) and backward inference (back) on a fake copy of its stages, and every stage's
    result is gathered over the job's group before the next stage's turn, the exchange the schedule's first step
    makes with its neighbours. The user's stages are only read.

    Raises:
        StageMetasError: a rank's inference failed (raised on every rank at the same turn, so none is left waiting).
        Exception: on the rank whose own stage raised its user's error (`preflight.trace.is_user_error`), that error,
            at the same turn (every other rank raises a `StageMetasError`).
        ImportError, AttributeError: this torch lacks the internals used (on every rank alike, at the same
            point)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.schedules import _TARGET_CHUNK_SPEC, _split_tensor

    from preflight.trace import is_user_error
    from preflight.trace._twin import TwinMaker, float_dtype_for

    plan = job.plan
    votes = gather_over(job, all(not InferenceMode.needs_dynamic(s._user_meta, True) for s in job.stages))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    twins = TwinMaker(fake_mode, torch.device("cpu"), cast_dtype=float_dtype_for(precision))
    stages: dict[int, Any] = {}
    failure, own_error = None, None
    first_args = target_chunk = None
    with contextlib.ExitStack() as world:
        try:
            args, target = _parts(batch)
            # Plain stages: every stage of the rank in a fake world of one rank, the metadata passed as arguments.
            # Stages laid out by tensor parallelism: in a fake world of the job's mesh as this rank, laid out as the
            # job laid them (so sequence parallelism's slices are this rank's), kept alive for every turn.
            world.enter_context(fresh_dtensor_caches())
            mesh = world.enter_context(fake_world(job.world_size, job.global_rank, mesh=job.mesh)
                                       if job.layout is not None else fake_world(1, 0))
            with fake_mode:
                replica = fake_replica(job.modules, twins)
                group = None
                if job.layout is not None:
                    replica = _read_engine(job.layout).wrap(replica, mesh)
                    group = mesh[job.pp_dim].get_group()
                for part, fsdp in zip(replica, job.fsdp or [None] * len(replica)):
                    _fsdp_computes_in(part, fsdp)
                for index, part in zip(job.indices, replica):
                    stages[index] = PipelineStage(part.train(), index, plan.num_stages, torch.device("cpu"),
                                                  group=group)
                    # Its neighbours' metadata comes as arguments and its own is returned, as between stages of
                    # one rank: the exchanges are the turns' gathers, not the stage's messages.
                    stages[index]._is_same_rank = lambda other: True
                if 0 in stages:
                    fake_args = tuple(twins.batch(list(args), cast=False))
                    first_args = job.schedule._split_inputs(fake_args, {})[0][0]
                if plan.num_stages - 1 in stages:
                    target_chunk = next(iter(_split_tensor(twins.batch(target, cast=False), _TARGET_CHUNK_SPEC,
                                                           plan.n_microbatches)))
        except Exception as err:  # noqa: BLE001 - said on every rank at this rank's first turn
            failure = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            own_error = err if is_user_error(err) else None
        return _metas_by_turns(job, stages, first_args, target_chunk, fake_mode, precision, failure, own_error,
                               votes)


def _metas_by_turns(job: JobPipeline, stages: dict[int, Any], first_args: Any, target_chunk: Any, fake_mode: Any,
                    precision: str | None, failure: str | None, own_error: BaseException | None,
                    votes: list[bool]) -> tuple[dict[int, Any], bool]:
    """`job_stage_metas`' turns: each stage's forward inference in stage order, then its backward inference in
    reverse, on the rank holding it (``stages``, the rank's fake ones), each result gathered over the pipeline's
    group in the job's own world (`jobs_world`)."""
    import pickle
    import types

    from torch.distributed.pipelining.stage import _StageBackwardMeta, _StageForwardMeta

    from preflight.trace import is_user_error, mark_user_error
    from preflight.trace._fake_kernels import FakeKernelsMode

    plan = job.plan

    def turn(index: int, infer: Callable[[Any], Any]) -> Any:
        nonlocal failure, own_error
        mine = None
        if index in stages and failure is None:
            try:
                with fake_mode, FakeKernelsMode(), autocast_for(precision, "cpu"), torch.enable_grad():
                    mine = ("ok", infer(stages[index]))
                pickle.dumps(mine)  # what cannot be sent fails here, on this rank's turn, not inside the exchange
            except Exception as err:  # noqa: BLE001 - said on every rank below
                failure = f"{type(err).__name__}: {err}".splitlines()[0][:300]
                own_error = err if is_user_error(err) else None
                mine = None
        if index in job.indices and mine is None:
            mine = ("failed", f"pipeline rank {job.rank}, stage {index}: {failure}")
        with jobs_world():
            said = [m for m in gather_over(job, mine) if m is not None]
        if not said or said[0][0] != "ok":
            if own_error is not None and index in job.indices:
                raise mark_user_error(own_error)
            failure = said[0][1] if said else f"no rank holds stage {index}"
            raise StageMetasError(f"torch's metadata inference over the job's stages failed ({failure})")
        return said[0][1]

    outputs: dict[int, Any] = {}
    input_grads: dict[int, Any] = {}
    for index in range(plan.num_stages):
        received = first_args if index == 0 else _StageForwardMeta(forward_metas=outputs[index - 1])
        outputs[index] = turn(index, lambda stage: stage._forward_metadata_inference(
            received, {}, has_backward=True).forward_metas)
    for index in reversed(range(plan.num_stages)):
        if index == plan.num_stages - 1:
            input_grads[index] = turn(index, lambda stage: stage._backward_metadata_inference(
                plan.loss_fn, target_chunk).backward_metas)
        else:
            grads = _StageBackwardMeta(backward_metas=input_grads[index + 1])
            input_grads[index] = turn(index, lambda stage: stage._backward_metadata_inference(
                received_grad_meta=grads).backward_metas)
    metas = {i: types.SimpleNamespace(outputs=outputs[i], input_grads=input_grads[i]) for i in outputs}
    return metas, all(votes)


def _job_engine(job: JobPipeline, stage_metas: tuple[dict[int, Any], bool]) -> Engine:
    """The engine of a pipeline read off a job: the fake copy of the rank's stage modules is the model the step runs
    on (nothing to cut), handed to torch's ``PipelineStage`` at the user's stage indices (each keeping the user's
    stage's given metadata, so a static pipeline stays static) and to a schedule of the user's class built with the
    user's options its class takes (`_schedule_options`); the neighbours' metadata comes from `job_stage_metas`."""
    from preflight.parallel._rank import named_optimizer

    plan, user = job.plan, job.schedule

    def wrap(replica: nn.Module, mesh: Any) -> nn.Module:
        if job.layout is not None:  # each tensor laid out as the job laid it, the styles' hooks over the fake mesh
            replica = _read_engine(job.layout).wrap(replica, mesh)
        if job.fsdp is not None:  # each stage wrapped again as it was: its units, then the stage
            with meshes_outside_modes():
                for part, fsdp in zip(replica, job.fsdp):
                    apply_fully_shard(part, mesh[job.fsdp_dims], fsdp)
        return replica

    def drive(parts: nn.Module, mesh: Any) -> Callable[[Any], None]:
        metas, all_static = stage_metas
        stages = _answered_stages(parts, job.indices, plan.num_stages, mesh, metas, job.pp_dim)
        for stage, theirs in zip(stages, job.stages):
            stage._user_meta = theirs._user_meta
        schedule = type(user)(stages if hasattr(user, "_stages") else stages[0], **_schedule_options(user))
        return _stepper(schedule, stages, all_static)

    return Engine(name=f"torch.distributed.pipelining {type(user).__name__} (read off the job)"
                       + (" + its DTensor layout" if job.layout is not None else "")
                       + (" + fully_shard" if job.fsdp is not None else ""),
                  wrap=wrap, optimizer=named_optimizer("the pipeline"), parameters=_local_parameters,
                  watch=_watch(job.fsdp is not None), drive=drive, mesh=job.mesh)


# A schedule's constructor arguments -> where the schedule keeps each (torch 2.13; classes take different subsets).
_SCHEDULE_OPTIONS = {"n_microbatches": "_n_microbatches", "loss_fn": "_loss_fn", "args_chunk_spec": "_args_chunk_spec",
                     "kwargs_chunk_spec": "_kwargs_chunk_spec", "output_merge_spec": "_output_merge_spec",
                     "scale_grads": "scale_grads", "backward_requires_autograd": "_backward_requires_autograd",
                     "defer_pp_recv": "_defer_pp_recv"}


def _schedule_options(user: Any) -> dict[str, Any]:
    """The options the user's schedule was built with, for another of its class: each argument its class's
    constructor takes, read where the schedule keeps it (`_SCHEDULE_OPTIONS`)."""
    import inspect

    taken = inspect.signature(type(user).__init__).parameters
    return {name: getattr(user, kept) for name, kept in _SCHEDULE_OPTIONS.items()
            if name in taken and hasattr(user, kept)}


@swept
def trace_pp_in_job(
    job: JobPipeline,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    *,
    stage_metas: tuple[dict[int, Any], bool],
    step: StepFn | None,
    precision: str | None,
    steps: int,
    schedule: Loop = Loop(),
    record_op: Callable[[Any, Any], bool] | None = None,
    routing: str = "balanced",
    cuda: CudaTarget | None = None,
    sweep: Sweep,
    checkpoint: Checkpoint | None = None,
    loading: Loading | None = None,
) -> TraceResult:
    """Trace ``steps`` training steps of this process's pipeline rank of ``job`` (`read_pp`): its own stages, in a fake
    process group of the pipeline's ranks, as `trace_pp` traces a planned rank; ``stage_metas`` from
    `job_stage_metas`. The other arguments are `trace_pp`'s; ``loading`` is ignored (the model is loaded already)."""
    if step is not None:
        raise ValueError("under pipeline parallelism the schedule runs the step: the last stage's loss is the "
                         "schedule's `loss_fn`; leave `step` out")
    return trace_rank(_job_engine(job, stage_metas), job.modules, optimizer, batch, world_size=job.world_size,
                      rank=job.global_rank, step=None, precision=precision, steps=steps, schedule=schedule,
                      record_op=record_op, routing=routing, cuda=cuda, sweep=sweep, checkpoint=checkpoint)


def is_job_pipeline(obj: Any) -> bool:
    """Whether ``obj`` is one of torch's pipeline schedules (a pipeline a job built, `read_pp`)."""
    try:
        from torch.distributed.pipelining.schedules import _PipelineSchedule
    except ImportError:  # a build of torch without distributed support
        return False
    return isinstance(obj, _PipelineSchedule)


def refuse_job_pipeline(obj: Any, what: str) -> None:
    """Raise a ValueError when ``obj`` is a pipeline schedule of a running job handed to ``what``, an entry point that
    predicts several times with decisions of its own: under a pipeline read off a job each prediction exchanges
    shapes with every rank (`job_stage_metas`), so ranks that decided differently would wait on each other."""
    if is_job_pipeline(obj):
        raise ValueError(f"`{what}` is given a pipeline schedule running in this job: it predicts several times, and "
                         "under a pipeline read off a job each prediction must run on every rank at once. Pass the "
                         "schedule to `preflight.estimate` or `preflight.check`, or plan the pipeline on the whole "
                         "model with `ParallelPlan(..., pp=PPPlan(...))`.")
