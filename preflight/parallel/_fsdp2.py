"""One rank's training step under FSDP2 (``fully_shard``), traced on fake tensors with a fake process group.

``fully_shard`` is applied to a fake copy of the model as the plan says, and the step runs as
`preflight.parallel._rank.trace_rank` describes. So one rank's peak comes out of FSDP2's own program: the padded
parameter shards, the all-gather output of the unit in use and of the prefetched ones, the unsharded gradients and
the reduce-scatter input and output, and the optimizer state over the local shards, which for uneven shards
differs between ranks.

FSDP2 frees and re-allocates its all-gather outputs by resizing their storages in place
(``_fsdp_param.alloc_storage`` / ``free_storage``), which no operator sees: those two functions are wrapped for
the trace to report each resize to the tracker. Storages made inside FSDP2's collectives (``foreach_all_gather``,
``foreach_all_gather_copy_out``, ``foreach_reduce``) and the unsharded parameters are in `Category.COMMUNICATION`;
the sharded gradient the reduce-scatter writes is in `Category.GRADIENTS` from the moment it is assigned.

HSDP (``FSDP2Plan(replicate=R)``, or a model wrapped over a 2-D mesh) is traced over a fake 2-D mesh ``(R,
world_size // R)``: the rank's shards are those of its index in its shard group, and FSDP2's all-reduce of each
reduce-scatter output across the replicas runs in the trace. It is in place: with the gradients' own reduce dtype it
adds no buffer (a real 2 x 2 gloo run measured the same bytes as FSDP2 over one shard group); with another reduce
dtype FSDP2 keeps each unit's reduce-dtype output alive into the next unit's reduction (``_all_reduce_state``),
and so does the trace (on the tests' small model, 2 x 2 with bf16 reduction, the smaller of two real gloo runs
measured ranks 0 and 1 to the byte; rank 3 read one fp32 copy of a unit's shard more in both, which is not traced).

Known limitations: ``CPUOffloadPolicy``, meshes of more than two dims (tensor parallelism), ``torch.compile`` of the
sharded model and optimizers that already hold state are not traced here (the caller rescales a single-device trace
instead); communication libraries' own buffers (NCCL's) are not tensors and are not counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from preflight._checkpoint import Checkpoint
from preflight._loading import Loading
from preflight._result import Category
from preflight._steps import Loop, StepFn
from preflight.cuda import CudaTarget
from preflight.parallel._rank import Engine, ParamTwins, ScratchedDist, communicating, default_units, patched
from preflight.parallel._rank import reporting_resizes, trace_rank
from preflight.trace import Sweep, TraceResult, swept
from preflight.trace._tracker import StorageTracker
from preflight.trace._twin import clone_optimizer

__all__ = ["FSDP2Plan", "WrappedFSDP2", "apply_fully_shard", "held_by_fully_shard", "rank_groups", "read_fsdp2",
           "trace_fsdp2"]


def held_by_fully_shard(model: nn.Module) -> list[torch.Tensor]:
    """The tensors ``fully_shard`` holds for ``model``'s units besides the parameters the model shows: each
    parameter's shard, all-gather outputs and unsharded data, its resharded-after-forward copy, and each group's
    pending all-gather and partial reduce-scatter output (empty storages count nothing). Between steps the model
    shows the shards and the rest is freed; after an evaluation forward the root unit stays gathered (no backward
    reshards it): the model shows the unsharded parameters while FSDP2 keeps the shards, and the next training step
    starts with both alive. For the verification, which counts what is resident when a step begins."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build of torch without distributed support
        return []
    held: list[torch.Tensor] = []
    try:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                held.extend(_group_tensors(module._get_fsdp_state()._fsdp_param_group))
    except Exception:  # noqa: BLE001 - FSDP2's private state changed: the verification counts the parameters alone
        return []
    return held


def _group_tensors(group: Any) -> list[torch.Tensor]:
    """`held_by_fully_shard`'s tensors of one FSDP2 parameter group (None: a unit without parameters)."""
    held: list[torch.Tensor] = []
    if group is not None:
        for fsdp_param in group.fsdp_params:
            held.extend(getattr(fsdp_param, "all_gather_outputs", None) or [])
            held.extend(getattr(fsdp_param, "_unsharded_inner_tensors", None) or [])
            for name in ("sharded_param", "_unsharded_param", "_sharded_post_forward_param_data"):
                value = getattr(fsdp_param, name, None)
                if isinstance(value, torch.Tensor):
                    held.append(value)
        pending = getattr(group, "_all_gather_result", None)
        if pending is not None and isinstance(getattr(pending, "all_gather_output", None), torch.Tensor):
            held.append(pending.all_gather_output)
        partial = getattr(group, "_partial_reduce_output", None)
        if isinstance(partial, torch.Tensor):
            held.append(partial)
    return held


@dataclasses.dataclass(frozen=True)
class FSDP2Plan:
    """How ``fully_shard`` is applied to the model, as the training script applies it.

    Attributes:
        units: qualified names of the submodules wrapped with ``fully_shard`` before the root (which is always
            wrapped last). None: every entry of the model's largest ``nn.ModuleList`` (a transformer's decoder
            layers), what torchtitan, Lightning's ``ModelParallelStrategy`` examples and accelerate's
            transformer-layer policy do.
        mp_policy: ``torch.distributed.fsdp.MixedPrecisionPolicy`` (param_dtype, reduce_dtype, ...); None: FSDP2's
            default (no casting).
        reshard_after_forward: as ``fully_shard``'s argument, given to every unit and the root (True: parameters
            are freed after forward and gathered again in backward; False: kept gathered until backward; an int:
            resharded to that smaller world). None: not given, ``fully_shard``'s own default: on torch 2.13 the
            units reshard and the root keeps its parameters gathered from forward to backward; an explicit True
            reshards the root too (accelerate passes its setting explicitly).
        replicate: HSDP's replicate degree: ``fully_shard`` gets the 2-D mesh ``(replicate, world_size //
            replicate)`` (dims ``("replicate", "shard")``, ``init_device_mesh``'s layout), so each rank holds the
            shards of the ``world_size // replicate`` ranks of its shard group and all-reduces its gradient shards
            with the ranks of equal shard index; 1: a 1-D mesh (plain FSDP). The world size must be a multiple.
        root: the qualified name of the module wrapped last, FSDP2's root ("": the model itself). A LightningModule
            whose ``configure_model`` wraps ``self.model`` has its root at ``"model"``: the training step calls that
            module, so its forward runs FSDP2's root hooks.
    """

    units: tuple[str, ...] | None = None
    mp_policy: Any = None
    reshard_after_forward: bool | int | None = None  # None: fully_shard's own default
    replicate: int = 1  # 1: plain FSDP over every rank
    root: str = ""  # the model itself

    def __post_init__(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.units is not None:
            if isinstance(self.units, str) or not all(isinstance(u, str) for u in self.units):
                raise TypeError(f"`units` should be a tuple of module names (str), got {self.units!r}.")
            object.__setattr__(self, "units", tuple(self.units))
        if self.mp_policy is not None and not isinstance(self.mp_policy, MixedPrecisionPolicy):
            raise TypeError("`mp_policy` should be a torch.distributed.fsdp.MixedPrecisionPolicy or None, got "
                            f"{self.mp_policy!r}.")
        flag = self.reshard_after_forward
        if flag is not None and (not isinstance(flag, (bool, int)) or (not isinstance(flag, bool) and flag < 1)):
            raise ValueError(f"`reshard_after_forward` should be True, False, a positive int or None (fully_shard's "
                             f"default), got {flag!r}.")
        if not isinstance(self.root, str):
            raise TypeError(f"`root` should be a module name (str; '' for the model itself), got {self.root!r}.")
        if isinstance(self.replicate, bool) or not isinstance(self.replicate, int) or self.replicate < 1:
            raise ValueError(f"`replicate` should be a positive int (HSDP's replicate degree), got {self.replicate!r}.")

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype FSDP2 casts the parameters it gathers to (``mp_policy.param_dtype``); None: not cast."""
        return getattr(self.mp_policy, "param_dtype", None)

    def gathering(self, dtype: torch.dtype) -> FSDP2Plan:
        """This plan with FSDP2 casting the parameters it gathers to ``dtype``, reducing gradients in fp32
        (``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)``, torchtitan's default)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return dataclasses.replace(self, mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))

    def shard_size(self, world_size: int) -> int:
        """The ranks one shard group holds (``world_size // replicate``); a ValueError where ``replicate`` does not
        divide ``world_size``."""
        if world_size % self.replicate:
            raise ValueError(f"`fsdp.replicate` ({self.replicate}) should divide the world size {world_size}: HSDP's "
                             "mesh is (replicate, world_size // replicate).")
        return world_size // self.replicate


@dataclasses.dataclass(frozen=True)
class WrappedFSDP2:
    """How ``fully_shard`` was applied to a model before preflight saw it (`read_fsdp2`): the plan to trace it
    with, the world it is sharded over and this process's rank in it."""

    plan: FSDP2Plan
    world_size: int
    rank: int

    def note(self) -> str:
        units = len(self.plan.units or ())
        mesh = (f"{self.world_size} rank(s)" if self.plan.replicate == 1 else
                f"an HSDP mesh of {self.plan.replicate} x {self.world_size // self.plan.replicate} ranks")
        return (f"the model was already wrapped by fully_shard ({units} unit(s) and the root, over {mesh}; this "
                f"process is rank {self.rank}): its plan was read from the model and each rank traced on an "
                "unsharded fake copy of it")


def read_fsdp2(model: nn.Module, *, tensor_parallel: bool = False) -> WrappedFSDP2 | None:
    """The plan ``fully_shard`` was applied to ``model`` with, or None where no module of it is an ``FSDPModule``.

    Raises:
        ValueError: the wrapping is one the per-rank trace does not follow (units under no common wrapped root, a
            mesh of more than two dims, units with different meshes, ``reshard_after_forward`` or ``mp_policy``, an
            ``OffloadPolicy`` that offloads, parameters sharded other than on dim 0): the message says which. The
            root is the outermost wrapped module (the model, or the submodule its step calls). A tensor-parallel
            parameter inside FSDP2 (TP x FSDP2) is one, unless ``tensor_parallel``: then its placements over the
            other dims are left to `preflight.parallel.read_tp`, and the plan read is FSDP2's over its own dims.
    """
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    except ImportError:  # a build of torch without distributed support cannot have wrapped it
        return None
    units = [(name, module) for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    if not units:
        return None
    root = units[0][0]  # the outermost wrapped module (named_modules goes outside in)
    outside = [name for name, _ in units[1:] if root and not name.startswith(root + ".")]
    if outside:
        raise ValueError(f"the model's fully_shard units {root!r} and {outside[0]!r} have no wrapped module holding "
                         "both: preflight traces a model whose FSDP2 units sit under one root (the model, or the "
                         "submodule its step calls), as FSDP2's examples and the trainers wrap it")
    groups = {}
    for name, module in units:
        group = module._get_fsdp_state()._fsdp_param_group
        if group is not None:
            groups[name] = group
    if not groups:
        raise ValueError("fully_shard wrapped the model, but no unit holds parameters")
    meshes = [g.mesh_info.mesh for g in groups.values()]  # each fully_shard call without a mesh makes its own
    mesh = meshes[0]
    if any(m.ndim != mesh.ndim or m.shape != mesh.shape or m.get_coordinate() != mesh.get_coordinate()
           for m in meshes):
        raise ValueError("the model's fully_shard units were wrapped over meshes of different shapes or ranks; the "
                         "per-rank trace follows one mesh")
    if mesh.ndim > 2:
        raise ValueError(f"the model was wrapped by fully_shard over a {mesh.ndim}-D mesh; the per-rank trace follows "
                         "a 1-D mesh (FSDP) or a 2-D one (HSDP: replicate, shard)")
    policies = {repr(g.mp_policy) for g in groups.values()}
    if len(policies) > 1:
        raise ValueError(f"the model's fully_shard units use different mixed-precision policies ({sorted(policies)}); "
                         "the per-rank trace follows one policy for all units")
    if any(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups.values()):
        raise ValueError("the model was wrapped by fully_shard with CPUOffloadPolicy, which the per-rank trace does "
                         "not follow yet")
    flags = {_reshard_flag(g) for name, g in groups.items() if name != root}
    if len(flags) > 1:
        raise ValueError("the model's fully_shard units differ in reshard_after_forward; the per-rank trace follows "
                         "one setting for all units")
    from torch.distributed.tensor import DTensor, Replicate, Shard

    expected = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))  # HSDP: replicated, then sharded
    for name, p in model.named_parameters():
        placements = p.placements if isinstance(p, DTensor) else None
        if placements is not None and len(p.device_mesh.shape) > mesh.ndim:
            if tensor_parallel:  # its tensor-parallel dims are `preflight.parallel.read_tp`'s
                continue
            raise ValueError(f"parameter {name!r} is placed as {placements} over FSDP2's mesh and another (tensor "
                             "parallelism inside FSDP2): read the model with preflight.parallel.read_tp, which "
                             "preflight.estimate does first")
        if placements is not None and placements != expected:
            raise ValueError(f"parameter {name!r} is placed as {placements}, not {expected} (a shard_placement_fn, "
                             "or tensor parallelism): the per-rank trace follows dim-0 shards")
    replicate, shard = (1, mesh.size()) if mesh.ndim == 1 else tuple(mesh.shape)
    coordinate = mesh.get_coordinate()  # this process's place in the mesh, which init_device_mesh lays out row-major
    rank = coordinate[-1] if mesh.ndim == 1 else coordinate[0] * shard + coordinate[1]
    flag = flags.pop() if flags else True
    root_state = model.get_submodule(root)._get_fsdp_state()
    if flag is True and getattr(root_state, "_auto_reshard_after_forward", False):
        flag = None  # wrapped without the argument: fully_shard's default (the root keeps its parameters)
    plan = FSDP2Plan(units=tuple(name for name, _ in units[1:]), mp_policy=next(iter(groups.values())).mp_policy,
                     reshard_after_forward=flag, replicate=replicate, root=root)
    return WrappedFSDP2(plan=plan, world_size=mesh.size(), rank=rank)


def _reshard_flag(group: Any) -> bool | int:
    """``reshard_after_forward`` as FSDP2 stored it on a parameter group (`_fsdp_init._get_post_forward_mesh_info`)."""
    after = group.post_forward_mesh_info
    if after is None:
        return False
    if after.shard_mesh_size == group.mesh_info.shard_mesh_size:
        return True
    return int(after.shard_mesh_size)


def rank_groups(model: nn.Module, world_size: int, replicate: int = 1) -> list[list[int]]:
    """Ranks grouped by the local shard sizes FSDP2 gives them (``torch.chunk`` of dim 0 into as many pieces as a
    shard group has ranks, ``world_size // replicate``; under HSDP a rank's shard is its index in its shard group):
    ranks of one group hold equal shapes everywhere and trace the same. Every dim 0 divisible by the shard group's
    size gives one group."""
    shard = world_size // replicate
    params = list(model.parameters())
    signatures: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world_size):
        signatures.setdefault(shard_rows(params, shard, rank % shard), []).append(rank)
    return list(signatures.values())


def shard_rows(tensors: list[torch.Tensor], shard: int, index: int) -> tuple[int, ...]:
    """The dim-0 sizes of each tensor's shard at ``index`` of ``shard`` ranks, as FSDP2 cuts it (``torch.chunk``:
    pieces of ``ceil(dim0 / shard)`` rows, the last ones shorter or empty; a 0-d tensor has one row)."""
    rows = []
    for t in tensors:
        dim0 = t.shape[0] if t.dim() > 0 else 1
        chunk = -(-dim0 // shard)
        rows.append(max(0, min(chunk, dim0 - index * chunk)))
    return tuple(rows)


@swept
def trace_fsdp2(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    *,
    world_size: int,
    rank: int,
    plan: FSDP2Plan,
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
    """Trace ``steps`` training steps of rank ``rank`` of ``world_size`` under FSDP2 (module docstring).

    Args:
        model, optimizer, batch: the user's; only read. The optimizer is rebuilt (same class and hyperparameters)
            over the sharded copy's parameters.
        plan: where ``fully_shard`` goes and its options.
        record_op, routing, cuda: as for `preflight.trace.trace_steps`.

    Returns:
        A `TraceResult` whose events are this rank's. ``error`` is set when the trace stopped (or the program
        could not be sharded); the caller then rescales a single-device trace.

    Raises:
        ProcessGroupInUseError: a fake process group cannot be made in this process (`fake_world`).
        LossNotFoundError, StepWouldFailError: as for `preflight.trace.trace_steps`.
        Exception: the user's own exception from their step (`preflight.trace._blame`).
    """
    return trace_rank(_engine(plan), model, optimizer, batch, world_size=world_size, rank=rank, step=step,
                      precision=precision, steps=steps, schedule=schedule, record_op=record_op, routing=routing,
                      cuda=cuda, sweep=sweep, checkpoint=checkpoint, loading=loading)


def apply_fully_shard(replica: nn.Module, mesh: Any, plan: FSDP2Plan) -> nn.Module:
    """``fully_shard`` over ``mesh`` on the plan's units (default: the entries of the largest ``nn.ModuleList``),
    then on its root, with its options; ``replica`` back."""
    from torch.distributed.fsdp import fully_shard

    units = plan.units if plan.units is not None else default_units(replica)
    options: dict[str, Any] = {"mesh": mesh}
    if plan.reshard_after_forward is not None:  # None: fully_shard's default, as a call without the argument has
        options["reshard_after_forward"] = plan.reshard_after_forward
    if plan.mp_policy is not None:
        options["mp_policy"] = plan.mp_policy
    for name in units:
        fully_shard(replica.get_submodule(name), **options)
    fully_shard(replica.get_submodule(plan.root), **options)  # FSDP2 itself keeps the root's parameters
    return replica


def _engine(plan: FSDP2Plan) -> Engine:
    def wrap(replica: nn.Module, mesh: Any) -> nn.Module:
        return apply_fully_shard(replica, mesh, plan)

    def optimizer(user: torch.optim.Optimizer, model: nn.Module, wrapped: nn.Module) -> torch.optim.Optimizer:
        return clone_optimizer(user, ParamTwins(model, dict(wrapped.named_parameters()), "FSDP2"), foreach=None)

    return Engine(name="fully_shard", moves_from_host=True, wrap=wrap, optimizer=optimizer,
                  parameters=lambda wrapped: list(wrapped.parameters()), watch=watched_fsdp2,
                  replicate=plan.replicate if plan.replicate > 1 else None)


@contextlib.contextmanager
def watched_fsdp2(tracker: StorageTracker, *, gloo: bool) -> Iterator[None]:
    """For the block, report FSDP2's in-place storage resizes to ``tracker`` and put what its collectives allocate in
    `Category.COMMUNICATION` (module docstring); with ``gloo``, add gloo's working copy at each collective
    (`preflight.parallel._rank.gloo_scratch`). Put back on exit."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param, _fsdp_param_group

    alloc_storage, free_storage = reporting_resizes(tracker, _fsdp_param.alloc_storage, _fsdp_param.free_storage)

    def sharded_grads(fsdp_params: Any, *args: Any, **kwargs: Any) -> None:
        for fsdp_param in fsdp_params:  # foreach_reduce(fsdp_params, ...) assigned each one's sharded gradient
            grad = fsdp_param.sharded_param.grad
            if grad is not None:
                tracker.label(grad, Category.GRADIENTS)

    reset = _fsdp_param.FSDPParam.reset_sharded_param

    def reset_sharded_param(self: Any) -> None:
        # At lazy init FSDP2 re-pads a local shard unless it still is its padded storage, which it checks with
        # `type(...) is torch.Tensor` and `data_ptr()`: false for a fake tensor, and the re-padding would be a copy of
        # the uneven ranks' parameters that the real run does not make. Same check, made on storage identity.
        module_info = self._module_info
        param = getattr(module_info.module, module_info.param_name)
        local = getattr(param, "_local_tensor", None)
        if (param is self.sharded_param and local is not None
                and local.untyped_storage()._cdata == self._sharded_param_data.untyped_storage()._cdata):
            self._sharding_spec = self.sharded_param._spec
            return
        reset(self)

    patches = [(_fsdp_param, "alloc_storage", alloc_storage), (_fsdp_param, "free_storage", free_storage),
               (_fsdp_param_group, "alloc_storage", alloc_storage),
               (_fsdp_param.FSDPParam, "reset_sharded_param", reset_sharded_param)]
    for name in ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce"):
        after = sharded_grads if name == "foreach_reduce" else None
        patches.append((_fsdp_param_group, name, communicating(tracker, getattr(_fsdp_param_group, name), after)))
    if gloo:
        patches.append((_fsdp_collectives, "dist", ScratchedDist(_fsdp_collectives.dist)))
    with patched(patches):
        yield
