"""One rank's training step under expert parallelism (transformers' ``DistributedConfig(ep_size=...)``), traced on
fake tensors with a fake process group.

An `EPPlan` says over how many ranks a mixture-of-experts model's experts are spread (the ``ep`` dim) and which of
transformers' token exchanges runs them (``ep_implementation``: ``"auto"`` is an all-to-all of the tokens in
training). Expert parallelism in transformers comes with its FSDP2 over the job's ranks (``fsdp_size``), and may
come with its tensor parallelism of the dense layers (``tp_size``, the model's own ``base_model_tp_plan``; the
``ep`` dim then spans ``ep / tp`` FSDP ranks times the ``tp`` ranks, as transformers requires ``tp`` to divide
``ep``) and with replicas of all that (``dp_replicate_size``, HSDP: the ``ep`` dim lies inside one replica). The
plan is traced as transformers lays the model out: the fake copy of the model gets transformers' own
``maybe_distribute_model`` over fake device meshes of the job's shape (the dense ``("pp", "dp_replicate", "fsdp",
"tp")`` mesh and the experts' ``("pp", "dp_replicate", "efsdp", "ep")``, as ``initialize_distributed_mesh`` makes
them, on the CPU), as this rank, and the real step runs as `preflight.parallel._rank.trace_rank` describes. So the
rank's peak comes out of transformers' program: its experts (``num_experts / ep`` of each layer, sharded again over
``efsdp``), FSDP2's shards of the dense layers (of their tensor-parallel shards where ``tp`` > 1), the tokens it
sends and the tokens its experts receive, and both all-to-alls' buffers. ``from_pretrained`` loads each dense weight
whole on every rank and, where the rank's shard is one contiguous run of it, keeps the shard as a view into it
(measured, `_loaded_blocks`): those whole weights are held too.

Which tokens reach which rank depends on every rank's router, which a fake trace does not have. The trace routes
each rank's tokens by the run's routing assumption (`preflight.trace._routing`: ``"balanced"`` or ``"skewed"``), and
answers the exchange of token counts as if every rank routed its tokens as this rank does (the counts a rank
receives from each other rank are the ones it sends to itself): balanced, every rank receives ``top_k x tokens /
ep`` token slots from each rank; skewed (every token to the first ``top_k`` experts), the ranks holding those
experts receive every rank's tokens and the others none, the worst case for them.

Known limitations: the plan is traced for a transformers model (the engine is transformers'); pipeline parallelism
beside it is not (transformers refuses its token exchange beside pipeline parallelism). A model transformers already
laid out inside a job is read from the distributed config it records (`read_ep`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from preflight._checkpoint import Checkpoint
from preflight._loading import Loading
from preflight._steps import Evaluation, Loop, StepFn
from preflight.cuda import CudaTarget
from preflight.parallel._rank import Engine, local_parameters, named_optimizer, trace_rank
from preflight.parallel._tensor import dtensor_watch, meshes_outside_modes
from preflight.trace import Sweep, TraceResult, swept

__all__ = ["EPLayout", "EPPlan", "check_ep_model", "ep_rank_groups", "read_ep", "trace_ep"]

IMPLEMENTATIONS = ("auto", "all_to_all")


@dataclasses.dataclass(frozen=True)
class EPPlan:
    """How expert parallelism is applied, as ``DistributedConfig(fsdp_size=..., ep_size=degree,
    ep_implementation=...)`` applies it to a transformers mixture-of-experts model.

    Attributes:
        degree: the ranks one layer's experts are spread over (``ep_size``); it divides the world size, and the
            experts' count.
        implementation: transformers' ``ep_implementation``: ``"auto"`` (an all-to-all of the tokens in training)
            or ``"all_to_all"``.
    """

    degree: int
    implementation: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.degree, bool) or not isinstance(self.degree, int) or self.degree < 2:
            raise ValueError(f"`EPPlan.degree` should be an int of at least 2 (the ranks a layer's experts are spread "
                             f"over), got {self.degree!r}.")
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"`EPPlan.implementation` should be one of {IMPLEMENTATIONS} (transformers' "
                             f"ep_implementation in training), got {self.implementation!r}.")

    def config(self, world_size: int, tp: int = 1, replicate: int = 1) -> Any:
        """transformers' ``DistributedConfig`` of the plan over ``world_size`` ranks: FSDP2 over all of them, or
        over ``world_size / tp`` where the dense layers are laid out by tensor parallelism over ``tp`` ranks, in
        each of ``replicate`` replicas (HSDP's replicate dim, outermost)."""
        from transformers.distributed import DistributedConfig

        return DistributedConfig(dp_replicate_size=replicate, tp_size=tp, fsdp_size=world_size // (tp * replicate),
                                 ep_size=self.degree, ep_implementation=self.implementation)

    @property
    def label(self) -> str:
        return f"expert parallel degree {self.degree}, transformers' {self.implementation} exchange"


def check_ep_model(model: nn.Module, plan: EPPlan) -> None:
    """A ValueError where the model is not a transformers mixture-of-experts model transformers can lay out."""
    if not callable(getattr(type(model), "maybe_distribute_model", None)) or \
            not callable(getattr(model, "_resolve_parallel_plans", None)):
        raise ValueError(f"expert parallelism is traced through transformers' own engine (DistributedConfig(ep_size="
                         f"...)), which {type(model).__name__} does not have: give a transformers mixture-of-experts "
                         "model")
    if not getattr(model, "ep_plan", None):
        raise ValueError(f"{type(model).__name__} has no expert-parallel plan of its own (transformers' ep_plan): it "
                         "is not a mixture-of-experts model transformers spreads over ranks")


class EPLayout(NamedTuple):
    """How transformers laid a model out with expert parallelism (`read_ep`): the plan, the job's world size, the
    tensor-parallel degree of the dense layers and the replicas (HSDP's replicate dim); 1: none."""

    plan: EPPlan
    world_size: int
    tp: int = 1
    replicate: int = 1

    def config(self) -> Any:
        """transformers' ``DistributedConfig`` of the layout (`EPPlan.config`)."""
        return self.plan.config(self.world_size, self.tp, self.replicate)

    def describe(self) -> str:
        """For a message: the plan over the world, and what is beside it."""
        return (f"{self.plan.label} over {self.world_size} rank(s)"
                + (f", tensor parallel degree {self.tp}" if self.tp > 1 else "")
                + (f", {self.replicate} replicas" if self.replicate > 1 else ""))


def read_ep(model: nn.Module) -> EPLayout | None:
    """The layout of a model transformers already laid out with expert parallelism
    (``from_pretrained(distributed_config=DistributedConfig(ep_size=..., tp_size=..., dp_replicate_size=...))``:
    its experts modules are marked ``_is_expert_parallel`` and its config holds the distributed config), or None
    for any other model.

    Raises:
        ValueError: a layout the trace does not follow (pipeline parallelism beside it, plans of the user's own,
            FSDP2's offload or mixed precision).
    """
    if not any(getattr(m, "_is_expert_parallel", False) for m in model.modules()):
        return None
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    if config is None or getattr(config, "ep_size", 1) < 2:
        return None
    if config.pp_size != 1:
        raise ValueError("the model's experts are laid out by transformers' expert parallelism beside pipeline "
                         "parallelism (DistributedConfig(pp_size=...)), which preflight does not trace yet")
    # What an EPPlan does not say: the layout is traced as the plan lays it out, so these are refused, not ignored.
    own = [f"{name}={getattr(config, name)!r}" for name in ("tp_plan", "ep_plan", "fsdp_plan")
           if isinstance(getattr(config, name, None), dict)]
    own += [f"{name}=True" for name in ("fsdp_cpu_offload", "fsdp_mixed_precision") if getattr(config, name, False)]
    if own:
        raise ValueError(f"the model is laid out by transformers' expert parallelism with {', '.join(own)}, which "
                         "preflight does not follow yet (it lays the copy out with the model's own plans, FSDP2 "
                         "without offload or mixed precision): leave them out of the DistributedConfig, or plan "
                         "the run without them")
    plan = EPPlan(config.ep_size, getattr(config, "ep_implementation", "auto") or "auto")
    return EPLayout(plan, config.dp_replicate_size * config.fsdp_size * config.tp_size, config.tp_size,
                    config.dp_replicate_size)


def _as_before_layout(replica: nn.Module) -> None:
    """Undo on the fake copy of a laid-out model what transformers' layout changed besides its parameters (which
    `preflight.parallel.fake_replica` copies whole): each experts module's count of local experts back to the whole
    count (its parameters' dim 0), and every ``forward`` transformers installed on an instance removed, so that its
    own layout applies to the copy as to a model not yet laid out."""
    for module in replica.modules():
        if vars(module).pop("_is_expert_parallel", False):
            first = next(iter(module.parameters(recurse=False)), None)
            if first is not None and hasattr(module, "num_experts"):
                module.num_experts = first.shape[0]
        if vars(module).pop("_is_hooked", False):
            vars(module).pop("forward", None)


def _engine(layout: EPLayout, laid_out: bool = False) -> Engine:
    config = layout.config()

    def wrap(replica: nn.Module, mesh: Any) -> nn.Module:
        if laid_out:
            _as_before_layout(replica)
        from torch.distributed import init_device_mesh
        from torch.utils._python_dispatch import _disable_current_modes
        from transformers.distributed.utils import TransformersDeviceMesh

        # As initialize_distributed_mesh makes them, on the CPU: no device is bound in the user's process.
        with _disable_current_modes():
            dense = init_device_mesh("cpu", (config.pp_size, config.dp_replicate_size, config.fsdp_size,
                                             config.tp_size), mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
            experts = init_device_mesh("cpu", (config.pp_size, config.dp_replicate_size, config.efsdp_size,
                                               config.ep_size), mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
        # transformers records the config on the model's config object, which the copy shares with the user's
        # model (`fake_replica`): the copy gets its own.
        replica.config = copy.copy(replica.config)
        with meshes_outside_modes():
            spread = type(replica).maybe_distribute_model(replica, config, TransformersDeviceMesh(dense, experts))
        spread._preflight_loaded = _loaded_blocks(spread)
        return spread

    return Engine(name="transformers' expert parallelism", wrap=wrap, optimizer=named_optimizer("expert parallelism"),
                  parameters=_local_parameters, watch=dtensor_watch(True))


def _loaded_blocks(model: nn.Module) -> list[torch.Tensor]:
    """What ``from_pretrained(distributed_config=...)`` keeps beside each dense parameter's shard (FSDP2's, tensor
    parallelism's, or both). It reads every dense weight whole on each rank and cuts the rank's piece with
    ``DtensorShardOperation.shard_tensor`` (``transformers.distributed.sharding_utils``): a slice of the whole
    weight, then ``.contiguous()``. Where the piece is a contiguous run of the whole (rows: FSDP2's ``Shard(0)``, a
    column-wise ``Shard(0)`` beside it), the shard stays a view and the whole weight is kept; where it is not (a
    row-wise plan's ``Shard(1)``), or is cut from several ranges and concatenated (a ``_StridedShard`` whose piece
    is not one range), the shard is a copy of its own bytes. Measured on 2 and 4 gloo processes with transformers
    5.24: the local shard of ``q_proj.weight`` lives in a storage of the whole weight's bytes; under tensor
    parallelism 2 the row-wise ``o_proj.weight``'s in one of its own size; the experts' shards, laid out by the
    expert-parallel plan, in their own; without FSDP2 (``fsdp_size=1`` beside tensor parallelism) the column-wise
    shards keep their whole weights the same way. So transformers' own cut is run on a meta tensor of the whole
    weight, and the bytes its result keeps beyond the trace's shard are a block per parameter, made in the trace's
    fake mode and held as long as the model."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import _disable_current_modes
    from transformers.distributed.sharding_utils import DtensorShardOperation

    blocks = []
    for p in model.parameters():
        # The experts' weights (on the experts' mesh) are laid out by the expert-parallel plan, not cut this way.
        if not isinstance(p, DTensor) or {"ep", "efsdp"} & set(p.device_mesh.mesh_dim_names or ()):
            continue
        local = p.to_local()
        with _disable_current_modes():
            whole = torch.empty(p.shape, dtype=p.dtype, device="meta")
            kept = DtensorShardOperation(p).shard_tensor(whole).contiguous().untyped_storage().nbytes()
        extra = kept - local.untyped_storage().nbytes()
        if extra > 0:
            blocks.append(torch.empty(extra, dtype=torch.uint8, device=local.device))
    return blocks


def _local_parameters(wrapped: nn.Module) -> list[torch.Tensor]:
    """The rank's parameter storages (`local_parameters`), and what the loading keeps beside the dense shards
    (`_loaded_blocks`)."""
    return local_parameters(wrapped) + list(getattr(wrapped, "_preflight_loaded", ()))


def ep_rank_groups(plan: EPPlan, world_size: int) -> list[list[int]]:
    """Ranks grouped by their place on the ``ep`` dim (the experts they hold): each place is traced (the tokens a
    place receives depend on which experts it holds under a skewed routing). The ``ep`` dim is innermost, as is
    the ``tp`` dim of the dense layers, whose degree divides ``ep``'s: a place on it is also a place on ``tp``
    (replicas are outermost)."""
    if world_size % plan.degree:
        raise ValueError(f"`EPPlan.degree` ({plan.degree}) should divide the world size {world_size}.")
    return [[r for r in range(world_size) if r % plan.degree == place] for place in range(plan.degree)]


@swept
def trace_ep(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    *,
    layout: EPLayout,
    rank: int,
    laid_out: bool = False,
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
    evaluation: Evaluation | None = None,
) -> TraceResult:
    """Trace ``steps`` training steps of rank ``rank`` of ``layout.world_size`` under expert parallelism (module
    docstring) laid out as ``layout`` says (the plan, beside transformers' tensor parallelism and in replicas where
    it says so), and the trainer's evaluation after them where ``evaluation`` gives one (`trace_rank`); the other
    arguments are `preflight.parallel.trace_cp`'s. ``laid_out``: the model is one transformers already laid out
    (`read_ep`); its copy is put back as before the layout and laid out again over the fake meshes.

    Raises:
        ValueError: the model is not a transformers mixture-of-experts model.
        ProcessGroupInUseError: a fake process group cannot be made in this process.
        LossNotFoundError, StepWouldFailError: as for `preflight.trace.trace_steps`.
        Exception: the user's own exception from their step (`preflight.trace._blame`).
    """
    check_ep_model(model, layout.plan)
    return trace_rank(_engine(layout, laid_out), model, optimizer, batch, world_size=layout.world_size, rank=rank,
                      step=step, precision=precision, steps=steps, schedule=schedule, record_op=record_op,
                      routing=routing, cuda=cuda, sweep=sweep, checkpoint=checkpoint, loading=loading,
                      evaluation=evaluation)
