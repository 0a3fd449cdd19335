"""One rank's training step under FSDP1 (``FullyShardedDataParallel``), traced on fake tensors with a fake group.

The fake copy of the model is wrapped as the plan says (the units by ``auto_wrap_policy``, then the root, with the
plan's sharding strategy, ``MixedPrecision``, prefetching and ``use_orig_params``), and the step runs as
`preflight.parallel._rank.trace_rank` describes. So one rank's peak comes out of FSDP1's own program: each unit's
flat parameter shard, padded to a multiple of the world size, the unsharded flat parameter of the unit in use and of
the prefetched ones (``backward_prefetch``, ``forward_prefetch``, ``limit_all_gathers``), the low-precision shard
under ``MixedPrecision``, the padded unsharded gradient and the reduce-scatter output, and the optimizer state over
this rank's views (``use_orig_params=True``: only the parameters' parts in this rank's shard, so the ranks holding
the padding hold less) or over the flat shards.

FSDP1 frees and re-allocates its unsharded flat parameters and low-precision shards by resizing their storages in
place (``torch.distributed.utils._alloc_storage`` / ``_free_storage``, imported by ``_flat_param``), which no
operator sees: they are wrapped to report each resize to the tracker, the new block in `Category.COMMUNICATION`.
What the gradient reduction allocates (``_runtime_utils._reduce_grad``: the padded unsharded gradient and the
reduce-scatter output) is in `Category.COMMUNICATION` until it is the flat parameter's sharded gradient, in
`Category.GRADIENTS`.

A hybrid strategy (``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2``, with ``ranks_per_node``) is wrapped over a fake 2-D
mesh ``(nodes, ranks_per_node)`` given as FSDP1's ``device_mesh``: the rank's flat shards are those of its index in
its node, and FSDP1's all-reduce of each gradient shard across nodes runs in the trace (in place, on the shard).

A model ``FullyShardedDataParallel`` already wrapped (inside Lightning's ``FSDPStrategy``, accelerate's FSDP1
plugin) has its plan read off it (`read_fsdp1`) and is traced the same way: the copy is made unwrapped, each
original parameter of its original shape (`preflight.parallel.fake_replica`), and wrapped again in the fake world.

Known limitations: ``CPUOffload``, ``torch.compile`` and communication libraries' own buffers (NCCL's) are not
traced here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from preflight._checkpoint import Checkpoint
from preflight._loading import Loading
from preflight._result import Category
from preflight._steps import Loop, StepFn
from preflight.cuda import CudaTarget
from preflight.parallel._fake_group import fake_world
from preflight.parallel._rank import Engine, ParamTwins, ScratchedDist, communicating, default_units, fake_replica
from preflight.parallel._rank import patched, reporting_resizes, trace_rank
from preflight.trace import Sweep, TraceResult, fake_region, isolated_rng, swept
from preflight.trace._tracker import StorageTracker
from preflight.trace._twin import TwinMaker, clone_optimizer

__all__ = ["FSDP1Plan", "WrappedFSDP1", "fsdp1_rank_groups", "read_fsdp1", "through_root_step", "trace_fsdp1"]

_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
# Each hybrid strategy and the strategy it applies inside a shard group (one node).
HYBRID = {"HYBRID_SHARD": "FULL_SHARD", "_HYBRID_SHARD_ZERO2": "SHARD_GRAD_OP"}


@dataclasses.dataclass(frozen=True)
class FSDP1Plan:
    """How ``FullyShardedDataParallel`` wraps the model, as the training script (or its strategy) wraps it.

    Attributes:
        units: qualified names of the submodules that become their own FSDP unit (the ``auto_wrap_policy``'s
            choice); the root is always one; ``()``: the root alone (no ``auto_wrap_policy``). None: every entry of
            the model's largest ``nn.ModuleList``, what a transformer-layer policy picks.
        unit_types: instead of ``units``, the module classes that become units (``ModuleWrapPolicy``, Lightning's
            ``auto_wrap_policy={Block}``, accelerate's ``transformer_cls_names_to_wrap``).
        sharding_strategy: ``"FULL_SHARD"``, ``"SHARD_GRAD_OP"``, ``"NO_SHARD"``, ``"HYBRID_SHARD"`` or
            ``"_HYBRID_SHARD_ZERO2"`` (a ``ShardingStrategy`` member or its name); None: the one `preflight.estimate`'s
            ``sharding`` names (``"fsdp-full"``: ``FULL_SHARD``, or ``HYBRID_SHARD`` with ``ranks_per_node``;
            ``"fsdp-grad-op"``: ``SHARD_GRAD_OP``, or ``_HYBRID_SHARD_ZERO2``).
        ranks_per_node: for a hybrid strategy, the ranks of one node: FSDP1 shards over them (its intra-node group)
            and all-reduces the gradient shards across nodes (its inter-node group), as a 2-D device mesh ``(nodes,
            ranks_per_node)`` gives it. Required with a hybrid strategy, refused with another; the world size must
            be a multiple.
        mixed_precision: ``torch.distributed.fsdp.MixedPrecision`` or None.
        use_orig_params: as FSDP's argument (True is Lightning's and the HF Trainer's default; accelerate's own
            plugin and FSDP1 itself default to False).
        backward_prefetch: ``"BACKWARD_PRE"`` (FSDP's default), ``"BACKWARD_POST"`` or None.
        forward_prefetch, limit_all_gathers: as FSDP's arguments.
    """

    units: tuple[str, ...] | None = None
    unit_types: tuple[type, ...] | None = None
    sharding_strategy: Any = None
    mixed_precision: Any = None
    use_orig_params: bool = True
    backward_prefetch: str | None = "BACKWARD_PRE"
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.units is not None:
            if isinstance(self.units, str) or not all(isinstance(u, str) for u in self.units):
                raise TypeError(f"`units` should be a tuple of module names (str), got {self.units!r}.")
            object.__setattr__(self, "units", tuple(self.units))
        if self.unit_types is not None:
            if self.units is not None:
                raise ValueError("Pass `units` (module names) or `unit_types` (module classes), not both.")
            types = tuple(self.unit_types)
            if not types or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
                raise TypeError(f"`unit_types` should be nn.Module subclasses, got {self.unit_types!r}.")
            object.__setattr__(self, "unit_types", types)
        strategy = self.sharding_strategy
        strategy = None if strategy is None else str(getattr(strategy, "name", strategy)).upper()
        strategy = "_HYBRID_SHARD_ZERO2" if strategy == "HYBRID_SHARD_ZERO2" else strategy  # the HF spelling
        if strategy is not None and strategy not in _STRATEGIES:
            raise ValueError(f"`sharding_strategy` should be one of {list(_STRATEGIES)}, got "
                             f"{self.sharding_strategy!r}.")
        object.__setattr__(self, "sharding_strategy", strategy)
        per_node = self.ranks_per_node
        if per_node is not None and (isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1):
            raise ValueError(f"`ranks_per_node` should be a positive int or None, got {per_node!r}.")
        if strategy in HYBRID and per_node is None:
            raise ValueError(f"`sharding_strategy={strategy!r}` shards over the ranks of one node: pass "
                             "`ranks_per_node` (e.g. LOCAL_WORLD_SIZE).")
        if per_node is not None and strategy not in (None, *HYBRID):
            raise ValueError(f"`ranks_per_node` is for hybrid strategies ({', '.join(HYBRID)}), but "
                             f"`sharding_strategy` is {strategy!r}: drop one of them.")
        prefetch = self.backward_prefetch
        prefetch = None if prefetch is None else str(getattr(prefetch, "name", prefetch)).upper()
        if prefetch not in (None, "BACKWARD_PRE", "BACKWARD_POST"):
            raise ValueError(f"`backward_prefetch` should be 'BACKWARD_PRE', 'BACKWARD_POST' or None, got "
                             f"{self.backward_prefetch!r}.")
        object.__setattr__(self, "backward_prefetch", prefetch)
        if self.mixed_precision is not None and type(self.mixed_precision).__name__ != "MixedPrecision":
            raise TypeError("`mixed_precision` should be a torch.distributed.fsdp.MixedPrecision or None, got "
                            f"{self.mixed_precision!r}.")
        for name in ("use_orig_params", "forward_prefetch", "limit_all_gathers"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` should be True or False, got {getattr(self, name)!r}.")

    @property
    def hybrid(self) -> bool:
        """Whether the plan shards over one node's ranks and replicates across nodes."""
        return self.ranks_per_node is not None

    def shard_size(self, world_size: int) -> int:
        """The ranks one rank's shards are cut among: one node's under a hybrid strategy, else ``world_size``; a
        ValueError where the nodes do not divide ``world_size``."""
        if not self.hybrid:
            return world_size
        if world_size % self.ranks_per_node:
            raise ValueError(f"`fsdp.ranks_per_node` ({self.ranks_per_node}) should divide the world size "
                             f"{world_size}: a hybrid strategy's nodes hold equally many ranks.")
        return self.ranks_per_node

    def replicate(self, world_size: int) -> int | None:
        """The nodes (the 2-D mesh's first dim) of a hybrid plan over ``world_size`` ranks; None otherwise."""
        return world_size // self.shard_size(world_size) if self.hybrid else None


@dataclasses.dataclass(frozen=True)
class WrappedFSDP1:
    """How ``FullyShardedDataParallel`` was applied to a model before preflight saw it (`read_fsdp1`): the plan to
    trace it with, the world it is sharded over, this process's rank in it, and ``root``: the outermost wrapper (the
    model itself, or the wrapper around it when the model given is the module a wrapper holds, as Lightning's
    ``LightningModule`` and accelerate's unwrapped model are), whose copy is traced."""

    plan: FSDP1Plan
    world_size: int
    rank: int
    root: nn.Module

    def note(self) -> str:
        units = len(self.plan.units or ())
        return (f"the model was already wrapped by FullyShardedDataParallel ({self.plan.sharding_strategy}, {units} "
                f"unit(s) and the root, over {self.world_size} rank(s); this process is rank {self.rank}): its plan "
                "was read from the model and each rank traced on an unsharded fake copy of it")

    @property
    def sharding(self) -> str:
        """`preflight.estimate`'s ``sharding`` for the read strategy."""
        grad_op = self.plan.sharding_strategy in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2")
        return "fsdp-grad-op" if grad_op else "fsdp-full"


def read_fsdp1(model: nn.Module) -> WrappedFSDP1 | None:
    """The plan ``FullyShardedDataParallel`` was applied to ``model`` with, or None where no module of it is one
    and no wrapper holds it.

    ``model`` may be the outermost wrapper, or the module it wraps (its submodules then are the inner wrappers): the
    wrapper around it is found among the objects the garbage collector tracks (``gc.get_objects``, once). The units
    are the inner wrappers' qualified names without FSDP1's ``_fsdp_wrapped_module.`` prefixes; the world size is
    the sharding group's size times, for a hybrid strategy, the inter-node group's (``ranks_per_node`` is the
    former).
    Reads only: nothing of the model, its FSDP state or the process group is changed, and no collective runs.

    Example (inside the job, after Lightning's ``FSDPStrategy`` wrapped the LightningModule's units)::

        wrapped = read_fsdp1(pl_module)  # FSDP1Plan(units=("layers.0", ...), sharding_strategy="FULL_SHARD", ...)
        est = preflight.estimate(pl_module, optimizer, batch)  # each rank traced from that plan

    Known limitations: the lookup of the wrapper around ``model`` walks every object the garbage collector tracks
    (a fraction of a second in a large process); a plan whose units are not all alike is refused rather than
    traced approximately (a communication hook too); ``sync_module_states`` and ``param_init_fn`` are not read
    (they act at construction, before preflight sees the model).

    Raises:
        ValueError: the wrapping is one the per-rank trace does not follow (no wrapper around the model whose
            submodules are wrapped, ``CPUOffload``, ``NO_SHARD``, units with different settings or groups, ignored
            parameters or modules, a communication hook): the message says which.
    """
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp._common_utils import clean_tensor_name
    except ImportError:  # a build of torch without distributed support cannot have wrapped it
        return None
    root = model if isinstance(model, FSDP) else _wrapper_of(model, FSDP)
    if root is None:
        if not any(isinstance(m, FSDP) for m in model.modules()):
            return None
        raise ValueError("the model's submodules are wrapped by FullyShardedDataParallel but no wrapper holds the "
                         "model itself (each top-level wrapper is then its own root): preflight traces a model whose "
                         "root is wrapped too, as the trainers and FSDP's auto_wrap_policy do")
    units = [(clean_tensor_name(name), m) for name, m in root.named_modules() if isinstance(m, FSDP)]
    first = units[0][1]
    for name, unit in units:
        for attr in _SAME:
            if repr(getattr(unit, attr)) != repr(getattr(first, attr)):
                raise ValueError(f"the model's FullyShardedDataParallel units differ in {attr} (unit {name!r}: "
                                 f"{getattr(unit, attr)!r}, the root: {getattr(first, attr)!r}); the per-rank trace "
                                 "follows one setting for all units")
        if unit.process_group.size() != first.process_group.size():
            raise ValueError("the model's FullyShardedDataParallel units shard over groups of different sizes; the "
                             "per-rank trace follows one group")
        if unit._comm_hook is not None:
            raise ValueError(f"unit {name!r} of the model has a communication hook ({unit._comm_hook!r}, "
                             "register_comm_hook); the per-rank trace follows FSDP1's own reduction")
        if unit._ignored_params or unit._ignored_modules:
            raise ValueError(f"unit {name!r} of the model ignores parameters or modules (ignored_states); the "
                             "per-rank trace does not follow them yet")
    if first.cpu_offload.offload_params:
        raise ValueError("the model was wrapped by FullyShardedDataParallel with CPUOffload(offload_params=True), "
                         "which the per-rank trace does not follow yet")
    strategy = first.sharding_strategy.name
    if strategy == "NO_SHARD":
        raise ValueError("the model was wrapped by FullyShardedDataParallel with NO_SHARD (or over one rank, where "
                         "FSDP1 uses it): replicated as DDP is; call preflight before wrapping, with "
                         "sharding='ddp', for its figure")
    shard, rank = first.process_group.size(), first.process_group.rank()
    nodes, per_node = 1, None
    if strategy in HYBRID:  # FSDP1's intra-node group shards, its inter-node group replicates
        inter = first._inter_node_pg
        nodes, per_node = inter.size(), shard
        rank = inter.rank() * shard + rank  # a 2-D mesh (nodes, ranks_per_node), row-major as init_device_mesh
    from torch.distributed.fsdp import MixedPrecision

    mixed = first.mixed_precision
    prefetch = first.backward_prefetch
    plan = FSDP1Plan(units=tuple(name for name, _ in units[1:]), sharding_strategy=strategy,
                     mixed_precision=None if mixed == MixedPrecision() else mixed,
                     use_orig_params=first._use_orig_params,
                     backward_prefetch=None if prefetch is None else prefetch.name,
                     forward_prefetch=first.forward_prefetch, limit_all_gathers=first.limit_all_gathers,
                     ranks_per_node=per_node)
    return WrappedFSDP1(plan=plan, world_size=shard * nodes, rank=rank, root=root)


# The wrapper settings every unit of a model must share for the per-rank trace (it wraps every unit alike).
_SAME = ("sharding_strategy", "mixed_precision", "_use_orig_params", "backward_prefetch", "forward_prefetch",
         "limit_all_gathers", "cpu_offload")


def _wrapper_of(module: nn.Module, wrapper_cls: type) -> nn.Module | None:
    """The outermost ``wrapper_cls`` instance around ``module`` (whose ``_fsdp_wrapped_module`` is ``module``, or a
    wrapper of it), found among the objects the garbage collector tracks (one pass); None where there is none."""
    import gc

    if not getattr(module, "_is_fsdp_managed_module", False):  # FSDP1 marks every module under a wrapper
        return None
    # By type, not isinstance: some objects' `__class__` is a property that warns (torch's deprecated `reduce_op`).
    wrappers = {id(w._fsdp_wrapped_module): w for w in gc.get_objects() if issubclass(type(w), wrapper_cls)}
    found = None
    while id(module) in wrappers:
        found = module = wrappers[id(module)]
    return found


def wrap_fsdp1(replica: nn.Module, plan: FSDP1Plan, mesh: Any, *, sync_module_states: bool = False) -> nn.Module:
    """``replica`` wrapped in ``FullyShardedDataParallel`` as ``plan`` says, in the default (fake) process group, or
    for a hybrid strategy over ``mesh`` (``(nodes, ranks_per_node)``: FSDP1 takes its second dim's group as the
    intra-node group and its first's as the inter-node one). ``sync_module_states``: as FSDP's argument (each unit's
    states broadcast from rank 0 as it is wrapped)."""
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, lambda_auto_wrap_policy

    if plan.unit_types is not None:
        policy = ModuleWrapPolicy(set(plan.unit_types))
    else:
        units = plan.units if plan.units is not None else default_units(replica)
        unit_ids = {id(replica.get_submodule(name)) for name in units}
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda module: id(module) in unit_ids)
    strategy = ShardingStrategy[plan.sharding_strategy or "FULL_SHARD"]
    hybrid = {"device_mesh": mesh} if plan.hybrid else {}
    return FSDP(replica, auto_wrap_policy=policy, sharding_strategy=strategy, **hybrid,
                mixed_precision=plan.mixed_precision, use_orig_params=plan.use_orig_params,
                backward_prefetch=None if plan.backward_prefetch is None else BackwardPrefetch[plan.backward_prefetch],
                forward_prefetch=plan.forward_prefetch, limit_all_gathers=plan.limit_all_gathers,
                sync_module_states=sync_module_states,
                device_id=torch.device("cpu"))  # FSDP1 asks for an accelerator unless told the device


def fsdp1_rank_groups(model: nn.Module, plan: FSDP1Plan, world_size: int, *, block: int = 1) -> list[list[int]]:
    """Ranks grouped by what they hold under FSDP1: every rank's flat shards have the same (padded) size, but with
    ``use_orig_params`` the optimizer state covers only the parameters' parts in the rank's shard, so a rank whose
    shard holds padding holds less. Read off a fake copy wrapped once (no step runs). Ranks of one group hold the
    same bytes of parameter parts, in the same number of parts, in every unit, and trace the same; where the parts
    are cut elsewhere, a CUDA target's 512-byte rounding of each part's state can differ by less than a block per
    part cut. The group holding the most comes first: by the bytes of its parts, each rounded up to ``block`` (the
    allocator's, 512 on CUDA), then by their number."""
    shard = plan.shard_size(world_size)  # under a hybrid strategy a rank's shard is its index in its node
    if plan.sharding_strategy == "NO_SHARD" or not plan.use_orig_params or shard == 1:
        return [list(range(world_size))]
    with fake_region(), isolated_rng():
        layouts = _flat_layouts(model, plan, world_size)
    signatures: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world_size):
        held = []
        for numels, padding, itemsize in layouts:
            chunk = -(-sum(numels) // shard)
            index = rank % shard
            low, high, offset, parts = index * chunk, (index + 1) * chunk, 0, []
            for numel, is_padding in zip(numels, padding):
                if not is_padding:
                    parts.append(max(0, min(high, offset + numel) - max(low, offset)))
                offset += numel
            held.append((sum(-(-part * itemsize // block) * block for part in parts), sum(1 for p in parts if p)))
        signatures.setdefault(tuple(held), []).append(rank)
    # The group holding the most first (parameter-part bytes, then parts: each part has its own state tensors).
    order = sorted(signatures, key=lambda held: (sum(b for b, _ in held), sum(n for _, n in held)), reverse=True)
    return [signatures[held] for held in order]


def _flat_layouts(model: nn.Module, plan: FSDP1Plan, world_size: int) -> list[tuple[Any, Any, int]]:
    """Each unit's flat parameter layout (numels with padding, padding mask, element size), from a fake copy."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_world(world_size, 0, plan.replicate(world_size)) as mesh:
        replica = fake_replica(model, TwinMaker(fake_mode, torch.device("cpu")))
        with fake_mode:
            wrapped = wrap_fsdp1(replica, plan, mesh)
        return [(m._handle.flat_param._numels_with_padding, m._handle.flat_param._is_padding_mask,
                 m._handle.flat_param.element_size()) for m in FSDP.fsdp_modules(wrapped) if m._handle is not None]


@swept
def trace_fsdp1(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    *,
    world_size: int,
    rank: int,
    plan: FSDP1Plan,
    step: StepFn | None,
    precision: str | None,
    steps: int,
    schedule: Loop = Loop(),
    record_op: Any = None,
    routing: str = "balanced",
    cuda: CudaTarget | None = None,
    through_root: bool = False,
    sweep: Sweep,
    checkpoint: Checkpoint | None = None,
    loading: Loading | None = None,
) -> TraceResult:
    """Trace ``steps`` training steps of rank ``rank`` of ``world_size`` under FSDP1 (module docstring); the
    arguments, result and exceptions are `preflight.parallel.trace_fsdp2`'s, with an `FSDP1Plan`. With
    ``through_root``, each step runs inside the root wrapper's forward on the module it holds (`through_root_step`)."""
    if through_root:
        step = through_root_step(step)
    return trace_rank(_engine(plan, world_size), model, optimizer, batch, world_size=world_size, rank=rank, step=step,
                      precision=precision, steps=steps, schedule=schedule, record_op=record_op, routing=routing,
                      cuda=cuda, sweep=sweep, checkpoint=checkpoint, loading=loading)


def through_root_step(step: StepFn | None) -> StepFn:
    """``step`` as a trainer runs it on a model whose root ``FullyShardedDataParallel`` wraps the module the trainer
    hands its step: inside the root wrapper's forward, the batch passing through it (so FSDP1's root pre- and
    post-forward run, its input casting included), on the module it holds. That is Lightning's ``FSDPStrategy``
    (its ``_ForwardRedirection`` runs ``training_step`` as the root's forward) and the HF Trainer / accelerate (they
    call the root wrapper; the callbacks step the module it holds). Without it the root's own work, which gathers
    and frees the units, would not run and the first unit would become FSDP1's root instead."""
    def redirected(wrapped: nn.Module, batch: Any) -> Any:
        inner = wrapped.module
        table = vars(inner)
        saved = table.get("forward", _ABSENT)  # a forward set on the instance (Lightning leaves one after a step)

        def restore() -> None:
            if saved is _ABSENT:
                table.pop("forward", None)
            else:
                table["forward"] = saved

        def forward(passed: Any) -> Any:
            restore()  # the step's own calls of the module run its real forward
            if step is not None:
                return step(inner, passed)
            return inner(**passed) if isinstance(passed, dict) else inner(passed)

        table["forward"] = forward
        try:
            return wrapped(batch)
        finally:
            restore()

    return redirected


_ABSENT = object()


def _engine(plan: FSDP1Plan, world_size: int) -> Engine:
    def optimizer(user: torch.optim.Optimizer, model: nn.Module, wrapped: nn.Module) -> torch.optim.Optimizer:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp._common_utils import clean_tensor_name

        by_name = {clean_tensor_name(name): p for name, p in wrapped.named_parameters()}
        if plan.use_orig_params or any(isinstance(m, FSDP) for m in model.modules()):
            # The original parameters, or a wrapped user model's flat ones: each the copy's of the same name, both
            # named without FSDP1's wrapper prefixes ("layers.0._flat_param").
            return clone_optimizer(user, ParamTwins(model, by_name, "FSDP1", rename=clean_tensor_name), foreach=None)
        # Flat parameters: the optimizer is built over them, one group (FSDP1 cannot split a flat parameter).
        return clone_optimizer(user, ParamTwins(model, {}, "FSDP1"), foreach=None,
                               param_groups=[(0, list(wrapped.parameters()))])

    def parameters(wrapped: nn.Module) -> list[torch.Tensor]:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return [m._handle.flat_param for m in FSDP.fsdp_modules(wrapped) if m._handle is not None]

    return Engine(name="FullyShardedDataParallel", wrap=lambda replica, mesh: wrap_fsdp1(replica, plan, mesh),
                  optimizer=optimizer, parameters=parameters, watch=watched_fsdp1,
                  replicate=plan.replicate(world_size), moves_from_host=True, materialises_units=True,
                  wrap_from_rank0=lambda replica, mesh: _synced(replica, plan, mesh))


def _synced(replica: nn.Module, plan: FSDP1Plan, mesh: Any) -> nn.Module:
    """``replica`` wrapped with ``sync_module_states=True``: FSDP1 broadcasts each unit's parameters and buffers from
    rank 0 as it wraps the unit (``_init_utils._sync_module_params_and_buffers``: torch's ``_broadcast_coalesced``
    flattens them into buckets of ``PARAM_BROADCAST_BUCKET_SIZE``, 250 MB, two in flight, and copies them back on the
    other ranks), traced as torch runs it. FSDP1 refuses states on the CPU there (NCCL cannot broadcast them); the
    trace's copy is on the CPU whatever the target, so that check is skipped: on the CPU a real job cannot do this."""
    from torch.distributed.fsdp import _init_utils

    with patched([(_init_utils, "_check_module_states_for_sync_module_states", lambda states: None)]):
        return wrap_fsdp1(replica, plan, mesh, sync_module_states=True)


@contextlib.contextmanager
def watched_fsdp1(tracker: StorageTracker, *, gloo: bool) -> Iterator[None]:
    """For the block, report FSDP1's in-place storage resizes to ``tracker`` and put what its gradient reduction
    allocates in `Category.COMMUNICATION` (module docstring); with ``gloo``, add gloo's working copy at each
    collective. Put back on exit."""
    from torch.distributed.fsdp import _flat_param, _optim_utils, _runtime_utils

    alloc_storage, free_storage = reporting_resizes(tracker, _flat_param._alloc_storage, _flat_param._free_storage)

    def sharded_grad(state: Any, handle: Any, *args: Any, **kwargs: Any) -> None:
        flat_param = handle.flat_param  # the reduce-scatter output became the shard's gradient
        for grad in (getattr(flat_param, "_saved_grad_shard", None), flat_param.grad):
            if grad is not None:
                tracker.label(grad, Category.GRADIENTS)

    def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
        a, b = getattr(a, "_local_tensor", a), getattr(b, "_local_tensor", b)  # DTensors, as FSDP1 unwraps them
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata

    def data_ptr_allocated(tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().nbytes() > 0

    def catch_all_reshard(state: Any) -> None:
        handle = state._handle  # `_runtime_utils._catch_all_reshard`, its already-resharded test made as below
        if not handle:
            return
        flat_param, shard = handle.flat_param, handle.flat_param._local_shard
        if (flat_param.untyped_storage()._cdata == shard.untyped_storage()._cdata
                and flat_param.storage_offset() == shard.storage_offset() and not handle._skipped_use_sharded_views):
            return
        _runtime_utils._reshard(state, handle, _runtime_utils._should_free_in_backward(state, handle))

    # FSDP1 tells storages apart by `data_ptr()`, which a fake storage does not have: the same checks, made on
    # storage identity and size (a fake allocated storage has its bytes, a freed one has none).
    patches = [(_flat_param, "_same_storage", same_storage), (_flat_param, "_data_ptr_allocated", data_ptr_allocated),
               (_runtime_utils, "_catch_all_reshard", catch_all_reshard),
               (_flat_param, "_alloc_storage", alloc_storage), (_flat_param, "_free_storage", free_storage),
               (_runtime_utils, "_reduce_grad", communicating(tracker, _runtime_utils._reduce_grad, sharded_grad)),
               (_runtime_utils, "_reduce_grad_no_shard",
                communicating(tracker, _runtime_utils._reduce_grad_no_shard, sharded_grad))]
    if gloo:
        patches += [(_flat_param, "dist", ScratchedDist(_flat_param.dist)),
                    (_runtime_utils, "dist", ScratchedDist(_runtime_utils.dist)),
                    (_optim_utils, "dist", ScratchedDist(_optim_utils.dist))]  # a checkpoint's optimizer state
    with patched(patches):
        yield
