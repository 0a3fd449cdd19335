"""One rank's training step under FSDP2 (``fully_shard``), traced on fake tensors with a fake process group.

The user's model is copied (`fake_replica`: the module tree with fake twins for its parameters and buffers; the
user's tensors are only read), ``fully_shard`` is applied to the copy as the plan says, inside a fake process group
of the real world size (`preflight.parallel._fake_group`), and the real training step (forward, backward,
optimizer step, ``zero_grad``: `preflight._steps.run_steps`) runs on it under the same `StorageTracker` as a
single-device trace. So one rank's peak comes out of FSDP2's own program: the padded parameter shards, the
all-gather output of the unit in use and of the prefetched ones, the unsharded gradients and the reduce-scatter
input and output, and the optimizer state over the local shards, which for uneven shards differs between ranks.

FSDP2 frees and re-allocates its all-gather outputs by resizing their storages in place
(``_fsdp_param.alloc_storage`` / ``free_storage``), which no operator sees: those two functions are wrapped for
the trace to report each resize to the tracker. Storages made inside FSDP2's collectives (``foreach_all_gather``,
``foreach_all_gather_copy_out``, ``foreach_reduce``) and the unsharded parameters are in `Category.COMMUNICATION`;
the sharded gradient the reduce-scatter writes is in `Category.GRADIENTS` from the moment it is assigned.

Known limitations: ``CPUOffloadPolicy``, HSDP (2-D meshes), FSDP1, ``torch.compile`` of the sharded model and
optimizers that already hold state are not traced here (the caller rescales a single-device trace instead);
communication libraries' own buffers (NCCL's) are not tensors and are not counted.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from preflight._device import iter_tensors, named_tensors
from preflight._errors import StepWouldFailError
from preflight._quiet import handled_fake_tensor_errors
from preflight._result import Category
from preflight._steps import LossNotFoundError, Schedule, StepFn, run_steps
from preflight.cuda import CudaTarget, emulate_cuda
from preflight.parallel._fake_group import fake_world
from preflight.trace import TensorSpec, TraceResult, float_dtype_for, is_user_error, isolated_rng, mark_user_error
from preflight.trace import Sweep, swept
from preflight.trace._compat import real_run_paths
from preflight.trace._run import can_shadow, phase_bookkeeping, settled_frees
from preflight.trace._tracker import StorageTracker, failed_op_of
from preflight.trace._twin import TwinMaker, clone_optimizer

__all__ = ["FSDP2Plan", "default_units", "fake_replica", "rank_groups", "trace_fsdp2"]


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
        reshard_after_forward: as ``fully_shard``'s argument (True: parameters are freed after forward and gathered
            again in backward; False: kept gathered until backward; an int: resharded to that smaller world).
            The root always keeps its parameters (FSDP2 does that itself).
    """

    units: tuple[str, ...] | None = None
    mp_policy: Any = None
    reshard_after_forward: bool | int = True

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
        if not isinstance(flag, (bool, int)) or (not isinstance(flag, bool) and flag < 1):
            raise ValueError(f"`reshard_after_forward` should be True, False or a positive int, got {flag!r}.")


def default_units(model: nn.Module) -> tuple[str, ...]:
    """The qualified names of the entries of ``model``'s largest ``nn.ModuleList`` (by parameter count)."""
    best, best_size = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = name, size
    if best is None:
        return ()
    return tuple(f"{best}.{i}" if best else str(i) for i in range(len(model.get_submodule(best))))


def fake_replica(model: nn.Module, twins: TwinMaker) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are fake twins (tied ones stay tied); the user's
    tensors are read, never copied or changed."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(twins.tensor(p), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = twins.tensor(b, requires_grad=False)
    return copy.deepcopy(model, memo)


def rank_groups(model: nn.Module, world_size: int) -> list[list[int]]:
    """Ranks grouped by the local shard sizes FSDP2 gives them (``torch.chunk`` of dim 0 into ``world_size``
    pieces): ranks of one group hold equal shapes everywhere and trace the same. Every dim 0 divisible by the world
    size gives one group."""
    signatures: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world_size):
        shapes = []
        for p in model.parameters():
            dim0 = p.shape[0] if p.dim() > 0 else 1
            chunk = -(-dim0 // world_size)
            shapes.append(max(0, min(chunk, dim0 - rank * chunk)))
        signatures.setdefault(tuple(shapes), []).append(rank)
    return list(signatures.values())


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
    schedule: Schedule = Schedule(),
    record_op: Callable[[Any, Any], bool] | None = None,
    routing: str = "balanced",
    cuda: CudaTarget | None = None,
    sweep: Sweep,
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
        ProcessGroupInUseError: a process group is already initialised in this process.
        LossNotFoundError, StepWouldFailError: as for `preflight.trace.trace_steps`.
        Exception: the user's own exception from their step (`preflight.trace._blame`).
    """
    from torch.distributed.fsdp import fully_shard

    start = time.perf_counter()
    device = torch.device("cpu")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    op_log: list[tuple[int, int, Any, Any, Any]] = []

    def on_op(index: int, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if record_op is not None and record_op(func, args):
            op_log.append((index, len(tracker.events), func, torch.utils._pytree.tree_map(TensorSpec.of, args),
                           torch.utils._pytree.tree_map(TensorSpec.of, kwargs)))

    tracker = StorageTracker(fake_mode, on_op=on_op, routing=routing, layouts=cuda is None)
    sweep.watch(tracker.tensors)
    twins = TwinMaker(fake_mode, device, cast_dtype=float_dtype_for(precision))
    notes: list[str] = []
    error = failed = user_error = None

    def result() -> TraceResult:
        tracker.detach()
        return TraceResult(events=settled_frees(tracker.events, tracker.categories), categories=tracker.categories,
                           num_ops=tracker.num_ops, seconds=time.perf_counter() - start, error=error,
                           failed_op=failed, op_log=op_log, notes=notes)

    with fake_world(world_size, rank) as mesh, isolated_rng():
        try:
            replica = fake_replica(model, twins)
            units = plan.units if plan.units is not None else default_units(replica)
            options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": plan.reshard_after_forward}
            if plan.mp_policy is not None:
                options["mp_policy"] = plan.mp_policy
            with fake_mode:
                for name in units:
                    fully_shard(replica.get_submodule(name), **options)
                fully_shard(replica, **options)  # FSDP2 itself keeps the root's parameters after forward
            params = dict(replica.named_parameters())
            fake_opt = clone_optimizer(optimizer, _ShardedParams(model, params), foreach=None)
        except Exception as err:  # noqa: BLE001 - a model FSDP2 cannot shard gets the rescaled estimate
            error, failed = err, f"fully_shard ({type(err).__name__})"
            return result()
        for name, p in params.items():
            tracker.register(p, Category.PARAMETERS)
        for name, b in replica.named_buffers():
            tracker.register(b, Category.BUFFERS)
        fake_batch = twins.batch(batch, cast=float_dtype_for(precision) is not None)
        for (path, real), fake in zip(named_tensors(batch), iter_tensors(fake_batch)):
            tracker.register(fake, Category.INPUTS)
            tracker.names[fake] = f"the batch{path}"
            if can_shadow(real):
                tracker.shadow(fake, real.detach().to("cpu", copy=True))
        on_phase = phase_bookkeeping(tracker, fake_opt)
        emulation = emulate_cuda(cuda) if cuda is not None else contextlib.nullcontext()
        # A CPU run's collectives are gloo's; NCCL's buffers (a CUDA target) are not tensors.
        watched = watched_fsdp2(tracker, gloo=cuda is None)
        with real_run_paths(notes, tracker.host_array), handled_fake_tensor_errors(), emulation as emulated, \
                fake_mode, tracker, watched:
            try:
                replica.train()
                run_steps(replica, fake_opt, fake_batch, step=step, precision=precision, device_type="cpu",
                          steps=steps, schedule=schedule, on_phase=on_phase, before_backward=tracker.watch_backward)
            except (LossNotFoundError, StepWouldFailError):
                raise
            except Exception as err:  # noqa: BLE001 - reported as where the trace stopped
                if is_user_error(err):
                    user_error = err
                else:
                    error, failed = err, failed_op_of(err)
            finally:
                if emulated is not None:
                    notes.append(emulated.note())
    if user_error is not None:
        raise mark_user_error(user_error)
    if tracker.layouts is not None and tracker.layouts.note():
        notes.append(tracker.layouts.note())
    notes.extend(tracker.random_notes())
    if tracker.routing.note():
        notes.append(tracker.routing.note())
    return result()


class _ShardedParams:
    """`clone_optimizer`'s twin maker for the sharded copy: the user's parameter -> the copy's DTensor parameter of
    the same name."""

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter]) -> None:
        self._by_id = {id(p): params[name] for name, p in model.named_parameters(remove_duplicate=True)
                       if name in params}

    def tensor(self, t: torch.Tensor, **_: Any) -> torch.Tensor:
        found = self._by_id.get(id(t))
        if found is None:
            raise ValueError("the optimizer holds a tensor that is not one of the model's parameters (existing "
                             "optimizer state, or parameters of another model); FSDP2's sharded state for it is "
                             "not traced")
        return found


class _GlooScratch:
    """gloo's working copy of a collective on CPU tensors. Measured with the profiler on 2 processes (torch 2.13):
    during the call, gloo's worker thread allocates a copy of the full buffer (``all_gather_into_tensor``: the size
    of its output; ``reduce_scatter_tensor``: the size of its input) and frees it before the call returns. The
    trace allocates the same block for the duration of each collective."""

    def wrap(self, collective: Callable[..., Any], size_of: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            buffer = kwargs[size_of] if size_of in kwargs else args[0 if size_of == "output" else 1]
            scratch = torch.empty(buffer.numel() * buffer.element_size(), dtype=torch.uint8, device=buffer.device)
            try:
                return collective(*args, **kwargs)
            finally:
                del scratch
        return run


class _Collectives:
    """``torch.distributed`` as FSDP2's collectives module sees it during the trace: the same, but for the two
    collectives whose backend scratch is modelled (`_GlooScratch`)."""

    def __init__(self, dist: Any, scratch: _GlooScratch) -> None:
        self._dist = dist
        self.all_gather_single = scratch.wrap(dist.all_gather_single, "output")
        self.reduce_scatter_single = scratch.wrap(dist.reduce_scatter_single, "input")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dist, name)


@contextlib.contextmanager
def watched_fsdp2(tracker: StorageTracker, *, gloo: bool) -> Iterator[None]:
    """For the block, report FSDP2's in-place storage resizes to ``tracker`` and put what its collectives allocate in
    `Category.COMMUNICATION` (module docstring); with ``gloo``, add gloo's working copy at each collective
    (`_GlooScratch`). Put back on exit."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param, _fsdp_param_group

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_storage(tensor: torch.Tensor) -> None:
        alloc(tensor)
        tracker.resized(tensor, Category.COMMUNICATION)

    def free_storage(tensor: torch.Tensor) -> None:
        free(tensor)
        tracker.resized(tensor)

    def communicating(fn: Callable[..., Any], *, grads: bool = False) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            before, tracker.phase_category = tracker.phase_category, Category.COMMUNICATION
            try:
                return fn(*args, **kwargs)
            finally:
                tracker.phase_category = before
                if grads:  # foreach_reduce(fsdp_params, ...) assigned each parameter's sharded gradient
                    for fsdp_param in args[0]:
                        grad = fsdp_param.sharded_param.grad
                        if grad is not None:
                            tracker.label(grad, Category.GRADIENTS)
        return run

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
        patches.append((_fsdp_param_group, name,
                        communicating(getattr(_fsdp_param_group, name), grads=name == "foreach_reduce")))
    scratch = _GlooScratch()
    if gloo:
        patches.append((_fsdp_collectives, "dist", _Collectives(_fsdp_collectives.dist, scratch)))
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, fn in patches:
            setattr(module, name, fn)
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
