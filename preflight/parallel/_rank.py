"""One rank's training step under a data-parallel engine, traced on fake tensors with a fake process group.

`trace_rank` is what the FSDP2 and FSDP1 traces share: the user's model is copied onto fake tensors
(`fake_replica`), the engine's wrapper is applied to the copy inside a fake process group of the real world size
(`preflight.parallel._fake_group`) as this rank, the optimizer is rebuilt over the wrapped copy's parameters, and the
real training step (`preflight._steps.run_steps`) runs under the same `StorageTracker` as a single-device trace,
inside the engine's own watch (its in-place storage resizes, its collectives' buffers). What differs between
engines is an `Engine`: how to wrap, how to rebuild the optimizer, what to watch.

gloo's collectives on CPU tensors allocate a working copy of the full buffer on the worker thread for the duration
of the call (measured with the profiler on 2 processes, torch 2.13: ``all_gather_single``, the size of its output;
``reduce_scatter_single``, the size of its input); `gloo_scratch` allocates the same block in the trace. FSDP1
gathers CPU tensors with the list ``all_gather`` instead, for which no copy is added: the real gloo runs of
``benchmarks/distributed.py`` measured the traced bytes without one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from preflight._checkpoint import Checkpoint
from preflight._device import held_tensors, iter_tensors, map_held_tensors, named_tensors
from preflight._errors import StepWouldFailError
from preflight._loading import LOAD_PHASE, Loading
from preflight._quiet import handled_fake_tensor_errors
from preflight._result import Category
from preflight._steps import (Evaluation, LossNotFoundError, Loop, StepFn, autocast_for, enter_training, evaluating,
                              run_steps)
from preflight.cuda import CudaTarget, emulate_cuda
from preflight.parallel._fake_group import fake_world
from preflight.trace import (TraceResult, float_dtype_for, is_user_error, isolated_process, isolated_rng,
                             mark_user_error)
from preflight.trace import Sweep
from preflight.trace._compat import real_run_paths
from preflight.trace._library_kernels import cuda_training_paths, layer_notes
from preflight.trace._run import (EVAL_NOT_TRACED, EVAL_PHASE, SAVE_NOT_TRACED, SAVE_PHASE, checkpoint_saver,
                                  counted_rng_snapshots, op_logger, phase_bookkeeping, settled_frees, shadow_value)
from preflight.trace._tracker import StorageTracker, failed_op_of
from preflight.trace._step_checks import mixed_dtensor_failure
from preflight.trace._twin import TwinMaker, cuda_capturable_off, cuda_default_impl

__all__ = ["GLOO_COPIES", "Engine", "MetaTwins", "ParamTwins", "ScratchedDist", "communicating", "default_units",
           "fake_replica", "fresh_dtensor_caches", "gloo_scratch", "local_parameters", "named_optimizer", "patched",
           "rebound", "reporting_resizes", "trace_rank", "with_cells"]


@dataclasses.dataclass(frozen=True)
class Engine:
    """What one data-parallel engine does to the fake copy of the model.

    Attributes:
        name: for notes and errors (``"fsdp2"``).
        wrap: ``wrap(replica, mesh) -> module``: apply the engine to ``replica`` (inside fake mode, in the fake
            group) and return the module the step runs on.
        optimizer: ``optimizer(user_optimizer, user_model, wrapped) -> optimizer`` over the wrapped parameters.
        parameters: ``parameters(wrapped) -> tensors``: the rank's resident parameter storages, to register.
        watch: ``watch(tracker, gloo=...)``: a context manager in force while the step runs.
        replicate: the replicate degree of hybrid sharding (HSDP): ``wrap`` gets the 2-D fake mesh
            ``(replicate, world_size // replicate)`` (`preflight.parallel.fake_world`); None: a 1-D mesh.
        mesh: ``(shape, dim names)`` of another fake mesh ``wrap`` gets (tensor parallelism's); it replaces
            ``replicate``.
        drive: ``drive(wrapped, mesh) -> run(batch)``, made inside the fake mode after ``wrap``: a step whose
            forward and backward the engine's own schedule runs (pipeline parallelism; `preflight._steps.run_steps`'s
            ``drive``); None: the user's step and ``loss.backward()``.
        around: ``around(mesh, batch, cpu=...) -> context``, entered inside the fake mode and the tracker around
            all the steps with the rank's fake batch (context parallelism shards the batch's sequence tensors in
            place and sends attention through its ring; ``cpu``: the trace's target is the CPU); None: nothing.
        moves_from_host: the engine moves a model on the host to the device itself as it wraps it (FSDP1 and
            FSDP2: `moved_by_engine`); a `preflight.Loading` on the host is otherwise traced as on the device.
        materialises_units: the engine materialises a model built on meta unit by unit, each unit whole on the
            device before it cuts it (FSDP1: ``reset_parameters`` or ``param_init_fn``, then its move to the
            device); a `preflight.Loading` on meta is then traced as one from the host. Otherwise a rank built on
            meta materialises its own shards only (FSDP2's ``to_empty``).
        wrap_from_rank0: ``wrap`` as the engine does when rank 0 broadcasts its model's states to the other ranks
            while it wraps them (FSDP1's ``sync_module_states``: accelerate's ``cpu_ram_efficient_loading``, where
            rank 0 loads the checkpoint and every other rank builds on meta); None: the engine has no such wrap.
    """

    name: str
    wrap: Callable[[nn.Module, Any], nn.Module]
    optimizer: Callable[[torch.optim.Optimizer, nn.Module, nn.Module], torch.optim.Optimizer]
    parameters: Callable[[nn.Module], list[torch.Tensor]]
    watch: Callable[..., contextlib.AbstractContextManager[Any]]
    replicate: int | None = None
    mesh: tuple[tuple[int, ...], tuple[str, ...]] | None = None
    drive: Callable[[nn.Module, Any], Callable[[Any], None]] | None = None
    around: Callable[..., contextlib.AbstractContextManager[Any]] | None = None
    moves_from_host: bool = False
    materialises_units: bool = False
    wrap_from_rank0: Callable[[nn.Module, Any], nn.Module] | None = None


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


def fake_replica(model: nn.Module, twins: TwinMaker | MetaTwins, *, keep_buffers: bool = False,
                 params: dict[int, nn.Parameter] | None = None) -> nn.Module:
    """A structural copy of ``model`` whose parameters and buffers are fake twins (tied ones stay tied); the user's
    tensors are read, never copied or changed. ``keep_buffers``: the copy holds the model's own buffers;
    ``params``: filled with each of the model's parameters (by id) and its copy's.

    Every module is copied as ``nn.Module``'s own data-parallel replication copies it
    (``Module._replicate_for_data_parallel``): its own ``__dict__``, parameter, buffer, child and hook tables, and
    its other attributes shared, not deep-copied (a LightningModule's trainer, a DeviceMesh of the job's process
    group and a model's config are read, not duplicated; what the trace writes goes to the copy, and what it leaves
    in a shared object is found by the sweep). A model ``fully_shard`` already wrapped is copied unwrapped: each
    DTensor parameter becomes a fake twin of its global shape, and the copy has none of FSDP2's classes, hooks or
    state, ready to be wrapped again in the fake world. So is a model ``FullyShardedDataParallel`` (FSDP1) wrapped:
    each wrapper is replaced by the copy of the module it wraps, and each original parameter, which FSDP1 turned
    into a view of this rank's part of its unit's flat parameter (``use_orig_params=True``) or into a plain tensor
    attribute beside the flat parameter (``False``), becomes a fake twin of its original shape, dtype and
    ``requires_grad``, read off the flat parameter (``_param_infos``, ``_shared_param_infos``, ``_shapes``; tied
    parameters stay tied); the flat parameters are not copied.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build of torch without distributed support: nothing can be wrapped
        FSDPModule = ()  # noqa: N806
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    except ImportError:
        FSDP1 = ()  # noqa: N806
    copies: dict[int, nn.Module] = {}
    params = {} if params is None else params
    originals, shapes = _fsdp1_originals(model)
    restored: dict[Any, nn.Parameter] = {}

    def original_param(key: Any) -> nn.Parameter:
        if key not in restored:
            meta, requires_grad = shapes[key]
            restored[key] = nn.Parameter(twins.tensor(meta, requires_grad=requires_grad), requires_grad=requires_grad)
        return restored[key]

    def twin_param(p: nn.Parameter) -> nn.Parameter:
        if id(p) not in params:
            # DeepSpeed ZeRO-3 empties a parameter's tensor and keeps its shape as `ds_shape`.
            whole = torch.empty(p.ds_shape, dtype=p.dtype, device="meta") if hasattr(p, "ds_shape") else p
            twin = twins.tensor(whole, requires_grad=p.requires_grad)
            param = nn.Parameter(twin, requires_grad=p.requires_grad)
            # What a parameter subclass holds (a 4-bit weight's quant_state), which the twin carries
            # (`TwinMaker.tensor`): the new Parameter is another object, so it gets the twin's attributes.
            for name in map_held_tensors(p, lambda path, x: x):
                if hasattr(twin, name):
                    setattr(param, name, getattr(twin, name))
            params[id(p)] = param
        return params[id(p)]

    def replicate(module: nn.Module) -> nn.Module:
        if id(module) in copies:
            return copies[id(module)]
        if FSDP1 and isinstance(module, FSDP1):  # an FSDP1 wrapper: the copy of what it wraps stands for it
            copies[id(module)] = replicate(module._fsdp_wrapped_module)
            return copies[id(module)]
        cls = type(module)
        if FSDPModule and isinstance(module, FSDPModule):  # the class fully_shard derived from
            cls = next(b for b in cls.__bases__ if not issubclass(b, FSDPModule))
        copy_ = cls.__new__(cls)
        copies[id(module)] = copy_
        flat = originals.get(id(module), [])  # FSDP1's original parameters of this module, in flat order
        dropped = {name for name, _ in flat} | {_FLAT_PARAM}
        state = {k: v for k, v in vars(module).items()
                 if not k.startswith(_COMPOSABLE) and k not in _FSDP2_FLAGS and k not in dropped}
        for name in _MODULE_TABLES:
            if isinstance(state.get(name), (dict, set)):
                state[name] = type(state[name])(state[name])
        state["_parameters"] = {k: None if p is None else twin_param(p) for k, p in module._parameters.items()
                                if k not in dropped}
        state["_parameters"].update((name, original_param(key)) for name, key in flat)
        state["_buffers"] = {k: b if b is None or keep_buffers else twins.tensor(b, requires_grad=False)
                             for k, b in module._buffers.items()}
        state["_modules"] = {k: None if c is None else replicate(c) for k, c in module._modules.items()}
        vars(copy_).update(state)
        return copy_

    replica = replicate(model)
    # FSDP2's and DeepSpeed's hooks go; hooks bound to a user module are bound to its copy (an FSDP1 wrapper's copy
    # is its module's).
    for copy_ in {id(c): c for c in copies.values()}.values():
        tables = vars(copy_)
        for key, value in tables.items():  # a plain list, tuple or dict of the model's modules: of their copies
            if key not in _MODULE_TABLES and isinstance(value, (list, tuple, dict)):
                tables[key] = _of_copies(value, copies)
            elif isinstance(value, (types.MethodType, types.FunctionType)):
                # A method of a model's module kept on an instance (Lightning's forward redirection leaves
                # `module.forward` set to the bound method after each step), or a function closing over the model's
                # modules (transformers' tensor parallelism replaces `module.forward` by a closure over the module
                # and its original bound forward): bound to the copies, never the originals.
                tables[key] = rebound(value, copies)
        gone = set()
        for name in _HOOKS:
            hooks = tables.get(name) or {}
            for handle, fn in list(hooks.items()):
                owner = getattr(fn, "__self__", None)
                if type(owner).__module__.startswith("torch.distributed.fsdp") or _fsdps(fn) or _deepspeeds(fn):
                    del hooks[handle]
                    gone.add(handle)
                elif isinstance(owner, nn.Module) and id(owner) in copies:
                    hooks[handle] = types.MethodType(fn.__func__, copies[id(owner)])
        for name in _HOOK_FLAGS:
            for handle in gone & set(tables.get(name) or ()):
                del tables[name][handle]
    return replica


class MetaTwins:
    """`fake_replica`'s tensor maker for a stand-in outside any fake mode: meta tensors of the same shape, dtype and
    ``requires_grad`` (a model built on the meta device, which `preflight.estimate` traces)."""

    def tensor(self, t: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        return meta.requires_grad_(requires_grad and (meta.is_floating_point() or meta.is_complex()))


def rebound(fn: Any, copies: dict[int, nn.Module], depth: int = 0) -> Any:
    """``fn`` with what it holds of the model's modules replaced by their copies: a method bound to a copied module
    is bound to its copy, and a function's closure cells holding a copied module, such a method or such a function
    (nested closures, a few levels) are made again holding the copies. ``fn`` itself where it holds none."""
    if isinstance(fn, types.MethodType):
        owner = fn.__self__
        return types.MethodType(fn.__func__, copies[id(owner)]) if id(owner) in copies else fn
    if depth > 3:
        return fn
    return with_cells(fn, lambda v: copies.get(id(v), v) if isinstance(v, nn.Module)
                      else rebound(v, copies, depth + 1) if isinstance(v, (types.MethodType, types.FunctionType))
                      else v)


def with_cells(fn: Any, swap: Callable[[Any], Any]) -> Any:
    """``fn`` (a plain function) made again with each filled closure cell's value ``v`` replaced by ``swap(v)``;
    ``fn`` itself where ``swap`` changes none, or ``fn`` is not a function with a closure."""
    cells = fn.__closure__ if isinstance(fn, types.FunctionType) else None
    if not cells:
        return fn
    changed = False
    closure = []
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell (a variable not yet bound)
            closure.append(cell)
            continue
        new = swap(value)
        changed = changed or new is not value
        closure.append(cell if new is value else types.CellType(new))
    if not changed:
        return fn
    made = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(closure))
    made.__kwdefaults__, made.__dict__ = fn.__kwdefaults__, dict(fn.__dict__)
    return made


def _fsdps(fn: Any) -> bool:
    """Whether the hook ``fn`` is a function of FSDP2's own (``fully_shard`` over several modules at once registers
    closures over its state, `_register_group_forward_hooks`, not bound methods of it)."""
    fn = getattr(fn, "func", fn)
    return str(getattr(fn, "__module__", "") or "").startswith("torch.distributed.fsdp")


def _deepspeeds(fn: Any) -> bool:
    """Whether the hook ``fn`` is DeepSpeed's (a function, a bound method or a partial of its modules)."""
    fn = getattr(fn, "func", fn)
    owner = getattr(fn, "__self__", None)
    return any(str(getattr(x, "__module__", "") or "").startswith("deepspeed.")
               for x in (fn, type(owner) if owner is not None else None) if x is not None)


def _fsdp1_originals(
        model: nn.Module) -> tuple[dict[int, list[tuple[str, Any]]], dict[Any, tuple[torch.Tensor, bool]]]:
    """The original parameters FSDP1 flattened in ``model``: for each module (by id), its ``(name, key)`` pairs in
    flat order (a tied parameter has its primary's key), and for each key a meta tensor of the parameter's shape
    and dtype and its ``requires_grad`` (the original ``nn.Parameter``'s with ``use_orig_params=True``, else the
    flat parameter's, which FSDP1 then requires to be uniform)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    except ImportError:
        return {}, {}
    by_module: dict[int, list[tuple[str, Any]]] = {}
    shapes: dict[Any, tuple[torch.Tensor, bool]] = {}
    for unit in model.modules():
        handle = unit._handle if isinstance(unit, FSDP1) else None
        if handle is None:
            continue
        flat = handle.flat_param
        views = getattr(flat, "_params", None)  # use_orig_params: the original nn.Parameter objects
        index = {}
        for i, (info, shape) in enumerate(zip(flat._param_infos, flat._shapes)):
            key = (id(flat), i)
            grad = views[i].requires_grad if views is not None else flat.requires_grad
            shapes[key] = (torch.empty(shape, dtype=flat.dtype, device="meta"), grad)
            index[(id(info.module), info.param_name)] = key
            by_module.setdefault(id(info.module), []).append((info.param_name, key))
        for info in flat._shared_param_infos:
            key = index[(id(info.prim_module), info.prim_param_name)]
            by_module.setdefault(id(info.module), []).append((info.param_name, key))
    return by_module, shapes


def _of_copies(value: Any, copies: dict[int, nn.Module]) -> Any:
    """``value`` (a list, tuple or dict), with its items that are copied modules replaced by their copies; itself
    when it holds none."""
    items = value.values() if isinstance(value, dict) else value
    if not any(isinstance(v, nn.Module) and id(v) in copies for v in items):
        return value
    swap = lambda v: copies.get(id(v), v) if isinstance(v, nn.Module) else v  # noqa: E731
    if isinstance(value, dict):
        return type(value)((k, swap(v)) for k, v in value.items())
    return type(value)(swap(v) for v in value) if not hasattr(value, "_fields") else type(value)(*map(swap, value))


# What `fully_shard` adds to every module it manages, besides its class and hooks.
_FSDP2_FLAGS = ("_fsdp_use_orig_params", "_is_fsdp_managed_module")
_COMPOSABLE = "__composable_api_state_key"
_FLAT_PARAM = "_flat_param"  # a unit's flat parameter's name (FSDP1's `fully_sharded_data_parallel.FLAT_PARAM`)
# nn.Module's own tables (hooks, parameters, buffers, children), which every copy gets its own of.
_MODULE_TABLES = tuple(k for k, v in vars(nn.Module()).items() if isinstance(v, (dict, set)))
_HOOKS = tuple(k for k in _MODULE_TABLES if k.endswith("_hooks"))
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def trace_rank(
    engine: Engine,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    *,
    world_size: int,
    rank: int,
    step: StepFn | None,
    precision: str | None,
    steps: int,
    schedule: Loop,
    record_op: Callable[[Any, Any], bool] | None,
    routing: str,
    cuda: CudaTarget | None,
    sweep: Sweep,
    checkpoint: Checkpoint | None = None,
    evaluation: Evaluation | None = None,
    loading: Loading | None = None,
) -> TraceResult:
    """Trace ``steps`` training steps of rank ``rank`` of ``world_size`` under ``engine`` (module docstring), the
    evaluation a trainer runs after them where ``evaluation`` gives one (in the phase `EVAL_PHASE`; not under an
    engine that drives its own schedule), and a checkpoint save after that where ``checkpoint`` says the run saves;
    where ``loading`` places the model on the device or the host, the rank's loading is traced first, apart
    (`trace_loading`, the result's ``loading``); the arguments are
    `preflight.parallel.trace_fsdp2`'s. ``error`` in the result is set when the trace stopped or the
    engine could not wrap the copy; the caller then rescales a single-device trace."""
    start = time.perf_counter()
    device = torch.device("cpu")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    op_log: list[tuple[int, int, Any, Any, Any]] = []
    tracker = StorageTracker(fake_mode, on_op=op_logger(record_op, op_log, lambda: len(tracker.events)),
                             routing=routing, layouts=cuda is None, cuda=cuda is not None)
    sweep.watch(tracker.tensors)
    tracker.on_adopt = sweep.remember
    twins = TwinMaker(fake_mode, device, cast_dtype=float_dtype_for(precision))
    tracker.twin_of = twins.existing
    notes: list[str] = []

    def result(error: BaseException | None = None, failed: str | None = None) -> TraceResult:
        tracker.detach()
        return TraceResult(events=settled_frees(tracker.events), categories=tracker.categories,
                           num_ops=tracker.num_ops, seconds=time.perf_counter() - start, error=error,
                           failed_op=failed, op_log=op_log, notes=notes, outside_bytes=tracker.outside_bytes())

    loaded = None
    # A model built on meta that materialises only its own shards and reads them in place holds what its steps
    # start with: nothing to trace apart (`preflight._estimate` counts it).
    if loading is not None and (loading.placement != "meta" or loading.from_rank0 or engine.materialises_units):
        placement, said, bounded = _traced_placement(loading, engine, cpu=cuda is None)
        broadcast = loading.from_rank0 and engine.wrap_from_rank0 is not None and placement == "host"
        if broadcast and rank == 0 and cuda is None:  # rank 0's model, loaded on its host, is on the CPU target
            placement = "device"
        loaded = trace_loading(engine, model, world_size=world_size, rank=rank, placement=placement,
                               precision=precision, sweep=sweep, host_is_device=cuda is None, broadcast=broadcast)
        loaded.notes.extend(said if loaded.error is None else said[:-1])  # the last one says how it was traced
        loaded.upper_bound = said[0] if bounded else None
    try:
        traced = _run_rank(engine, model, optimizer, batch, world_size=world_size, rank=rank, step=step,
                           precision=precision, steps=steps, schedule=schedule, cuda=cuda, tracker=tracker,
                           twins=twins, notes=notes, result=result, checkpoint=checkpoint, evaluation=evaluation)
    except BaseException:
        tracker.detach()  # the tracker lets go of its callbacks on every way out (`StorageTracker.detach`)
        raise
    return dataclasses.replace(traced, loading=loaded)


def _traced_placement(loading: Loading, engine: Engine, *, cpu: bool) -> tuple[str, list[str], bool]:
    """How `trace_loading` traces ``loading`` under ``engine``: the placement it is traced as, the notes that say so
    (the last: how the trace ran), and whether the figure is an upper bound. ``cpu``: the target is the CPU, where
    the host is the device."""
    whole = "loading: traced as the engine wraps the rank's copy of the whole model"
    moved = f"{whole}, each tensor counted from the moment the engine moves it from the host"
    if loading.placement == "meta" and engine.materialises_units and loading.from_rank0 and \
            engine.wrap_from_rank0 is not None:
        return "host", [f"loading (meta, from rank 0): rank 0 holds the model on its host and {engine.name} moves "
                        "each of its units to the device; every other rank materialises each unit whole on the "
                        "device before it cuts it; rank 0 broadcasts each unit's states as it is wrapped "
                        "(sync_module_states: torch's _broadcast_coalesced, the unit's tensors flattened into buckets "
                        "of up to 250 MB, two in flight)" + (" (on a CPU target rank 0's whole model is counted from "
                                                             "the start)" if cpu else ""), moved], False
    if loading.placement == "meta" and engine.materialises_units:
        return "host", [f"loading (meta): {engine.name} materialises each unit whole on the device before it cuts it: "
                        "each counted from its materialisation" + (" (rank 0's broadcast not traced)"
                                                                   if loading.from_rank0 else ""), moved], False
    if loading.placement == "meta":  # filled from rank 0
        return "rank0", ["loading: traced as the engine wraps the rank's copy built on meta (its shards "
                         "materialised) and torch's set_model_state_dict(broadcast_from_rank0=True) fills them from "
                         "rank 0's full state dict, one tensor at a time"], False
    on_device = f"{whole}, every parameter and buffer on the device before it"
    if loading.placement == "host" and cpu:
        return "device", ["loading (host): on a CPU target the host is the device: the whole model is there before "
                          "the engine wraps it", on_device], False
    if loading.placement == "host" and not engine.moves_from_host:
        return "device", [f"loading (host): {engine.name} does not move the model from the host itself; the whole "
                          "model is counted on the device before it wraps it, an upper bound", on_device], True
    return loading.placement, [moved if loading.placement == "host" else on_device], False


def trace_loading(engine: Engine, model: nn.Module, *, world_size: int, rank: int, placement: str,
                  precision: str | None, sweep: Sweep, host_is_device: bool = True,
                  broadcast: bool = False) -> TraceResult:
    """Rank ``rank``'s loading under ``engine``: its fake copy of the whole model wrapped as the engine wraps it,
    in the phase `LOAD_PHASE` (`preflight._loading` says what each placement means). ``"device"``: every parameter
    and buffer (and a quantised weight's state) counted before the wrap, the full tensors the engine replaces freed
    as it drops them; ``"host"``: each counted from the moment the engine moves it to the device (`moved_by_engine`);
    ``"rank0"``: built on meta, the engine's shards counted as it makes them (as ``to_empty`` materialises them),
    then filled from rank 0's full state dict through torch's ``set_model_state_dict`` (`filled_from_rank0`; with
    ``host_is_device``, rank 0's state dict is counted from the start). With ``broadcast``, the engine wraps as it
    does when rank 0 broadcasts its states meanwhile (`Engine.wrap_from_rank0`). The engine's own copies (FSDP2's
    padded shards, FSDP1's flat parameters, the broadcast's buckets) are counted as it makes them. ``error`` in the
    result is set where the copy could not be wrapped or filled (a note says why)."""
    start = time.perf_counter()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracker = StorageTracker(fake_mode, layouts=False)
    sweep.watch(tracker.tensors)
    tracker.on_adopt = sweep.remember
    twins = TwinMaker(fake_mode, torch.device("cpu"), cast_dtype=float_dtype_for(precision))
    tracker.twin_of = twins.existing
    notes: list[str] = []
    error = failed = kept = None
    try:
        with fresh_dtensor_caches(), fake_world(world_size, rank, engine.replicate, mesh=engine.mesh) as mesh, \
                isolated_process(notes), isolated_rng(notes):
            made: dict[int, nn.Parameter] = {}
            # Built on meta (plain meta tensors, which hold nothing and which the tracker leaves alone), or whole.
            replica = fake_replica(model, MetaTwins() if placement == "rank0" else twins, params=made)
            tracker.phase, tracker.phase_category = LOAD_PHASE, Category.PARAMETERS
            if placement == "device":  # (no loop variable may hold a tensor past the loop: it would never free)
                _register_all([*replica.parameters(), *(held for _, held in twins.carried)], tracker,
                              Category.PARAMETERS)
                _register_all(list(replica.buffers()), tracker, Category.BUFFERS)
            # The copy alone holds its twins now (`fake_replica`'s closures, a reference cycle, keep its table of
            # them): a full tensor the engine replaces is freed when it drops it, as the real one is.
            made.clear()
            twins.forget([*model.parameters(), *model.buffers()])
            full = shapes = None
            if placement == "rank0":
                shapes = {name: (tuple(t.shape), t.dtype) for name, t in replica.state_dict().items()}
            if placement == "rank0" and rank == 0:  # the "checkpoint" rank 0 loaded on its host
                with fake_mode:
                    full = {name: torch.empty(shape, dtype=dtype, device="cpu" if host_is_device else "meta")
                            for name, (shape, dtype) in shapes.items()}
                _register_all(list(full.values()), tracker, Category.PARAMETERS)
                if not host_is_device:  # rank 0's host memory: each tensor counted once it is moved to the device
                    for t in full.values():
                        tracker.to_host(t)
            if placement == "rank0":  # wrapped on meta (nothing held), its shards materialised, then filled
                with handled_fake_tensor_errors(), fake_mode:
                    kept = engine.wrap(replica, mesh)
                with handled_fake_tensor_errors(), fake_mode, tracker:
                    kept.to_empty(device="cpu")
                    filled_from_rank0(kept, full, shapes)
            else:
                with handled_fake_tensor_errors(), fake_mode, tracker, \
                        moved_by_engine(tracker, count=placement == "host"):
                    wrap = engine.wrap_from_rank0 if broadcast and engine.wrap_from_rank0 else engine.wrap
                    kept = wrap(replica, mesh)  # the rank keeps it: it lives on past `detach`
                    gc.collect()  # what the last unit dropped
    except Exception as err:  # noqa: BLE001 - the phase is then the rank's resident state, labelled
        if is_user_error(err):
            raise
        error, failed = err, f"{engine.name} ({type(err).__name__})"
    finally:
        tracker.detach()
    del kept
    return TraceResult(events=settled_frees(tracker.events), categories=tracker.categories,
                       num_ops=tracker.num_ops, seconds=time.perf_counter() - start, error=error, failed_op=failed,
                       notes=notes)


def filled_from_rank0(model: nn.Module, full: dict[str, torch.Tensor] | None,
                      shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Fill the rank's sharded ``model`` from rank 0's ``full`` state dict (None on the other ranks) as torch's
    ``set_model_state_dict(..., StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))`` does, in the fake
    world: rank 0's ``broadcast_object_list`` of the tensors' sizes and dtypes is answered on every rank from
    ``shapes`` (each entry's shape and dtype; the fake group carries no objects); the broadcasts themselves and the
    cutting of each full tensor into the rank's shard run as torch runs them."""
    import torch.distributed as dist
    from torch.distributed import _state_dict_utils
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    sent = {key: _state_dict_utils._TensorInfo(torch.Size(shape), dtype) if shape else torch.zeros((), dtype=dtype)
            for key, (shape, dtype) in shapes.items()}

    def broadcast_object_list(object_list: list[Any], src: int | None = None, group: Any = None, **_: Any) -> None:
        object_list[0] = dict(sent)

    with patched([(dist, "broadcast_object_list", broadcast_object_list)]):
        set_model_state_dict(model, full if full is not None else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _register_all(tensors: list[torch.Tensor], tracker: StorageTracker, category: Category) -> None:
    for t in tensors:
        tracker.register(t, category)


@contextlib.contextmanager
def moved_by_engine(tracker: StorageTracker, *, count: bool) -> Iterator[None]:
    """With ``count``, count each parameter and buffer from the moment FSDP moves it from the host to the device
    while it wraps a unit: FSDP2's ``fully_shard`` moves the unit's managed states
    (``_fsdp_init._move_states_to_device``), FSDP1's constructor with ``device_id`` the unit's parameters and buffers
    not under a nested wrapper (``_init_utils._move_module_to_device`` hands them to its own
    ``_move_states_to_device``, of the same signature). On the trace's CPU copy the move itself moves nothing.

    Either way, the garbage collector runs as each unit starts: a full tensor the engine dropped while it cut the
    unit before is freed by then, as the real one is when the engine drops it (the fake tensors' machinery leaves
    some in reference cycles, which the real run does not have: measured on 2 gloo processes, FSDP2 frees each
    unit's full parameters as ``fully_shard`` returns)."""
    from torch.distributed.fsdp import _init_utils
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    def hooked(move: Callable[..., None]) -> Callable[..., None]:
        def states(params: Any, buffers: Any, device: Any) -> None:
            gc.collect()
            if count:
                _register_all(list(params), tracker, Category.PARAMETERS)
                _register_all(list(buffers), tracker, Category.BUFFERS)
            return move(params, buffers, device)
        return states

    with patched([(owner, "_move_states_to_device", hooked(owner._move_states_to_device))
                  for owner in (_fsdp_init, _init_utils)]):
        yield


def _run_rank(engine: Engine, model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, *, world_size: int,
              rank: int, step: StepFn | None, precision: str | None, steps: int, schedule: Loop,
              cuda: CudaTarget | None, tracker: StorageTracker, twins: TwinMaker, notes: list[str],
              result: Callable[..., TraceResult], checkpoint: Checkpoint | None = None,
              evaluation: Evaluation | None = None) -> TraceResult:
    """`trace_rank`'s body: wrap the copy, run the steps (and the evaluation after them), and return
    ``result(error, failed_op)``."""
    fake_mode = tracker.fake_mode
    user_error = None
    with fresh_dtensor_caches(), fake_world(world_size, rank, engine.replicate, mesh=engine.mesh) as mesh, \
            isolated_process(notes), isolated_rng(notes):
        try:
            replica = fake_replica(model, twins)
            with fake_mode:
                wrapped = engine.wrap(replica, mesh)
                drive = engine.drive(wrapped, mesh) if engine.drive is not None else None
            fake_opt = engine.optimizer(optimizer, model, wrapped)
            if cuda is not None:  # the implementation torch picks on the target's device, not on the trace's CPU
                cuda_default_impl(fake_opt)
                if (note := cuda_capturable_off(fake_opt)) is not None:
                    notes.append(note)
        except Exception as err:  # noqa: BLE001 - a model the engine cannot wrap gets the rescaled estimate
            return result(err, f"{engine.name} ({type(err).__name__})")
        for p in engine.parameters(wrapped):
            tracker.register(p, Category.PARAMETERS)
        # A quantised weight's state, held whole by each rank that holds the weight: those the rank's parameters
        # carry (a pipeline stage's), or all of them where no parameter carries one (an engine that made new ones).
        carried = _carried_ids(engine.parameters(wrapped))
        for _, held in twins.carried:
            if not carried or id(held) in carried:
                tracker.register(held, Category.PARAMETERS)
        for b in wrapped.buffers():
            tracker.register(b, Category.BUFFERS)
        for b in model.buffers():  # the flags and counters a forward reads, shadowed as on one device
            if (fake := twins.existing(b)) is not None and (value := shadow_value(b)) is not None:
                tracker.shadow(fake, value)
        fake_batch = _counted_batch(batch, "the batch", twins, tracker, precision)
        on_phase = phase_bookkeeping(tracker, fake_opt)
        emulation = emulate_cuda(cuda, tracker) if cuda is not None else contextlib.nullcontext()
        # A CPU run's collectives are gloo's; NCCL's buffers (a CUDA target) are not tensors.
        watched = engine.watch(tracker, gloo=cuda is None)
        error = failed = None
        notes.extend(layer_notes(wrapped, cuda is not None))
        with real_run_paths(notes, tracker.host_array), handled_fake_tensor_errors(), emulation as emulated, \
                fake_mode, tracker, watched, tracker.outside_modules(model, wrapped), \
                counted_rng_snapshots(tracker, host=cuda is None), \
                cuda_training_paths(tracker, cuda is not None):
            try:
                enter_training(wrapped, schedule)
                save = checkpoint_saver(tracker, checkpoint, host_is_device=cuda is None, fake_world=True,
                                        notes=notes, gathers=gloo_dtensor_gathers if cuda is None else None)
                if evaluation is not None and (drive is not None or engine.around is not None):
                    notes.append(f"{EVAL_NOT_TRACED} (under {engine.name}, whose schedule or context runs the "
                                 "steps)")
                    evaluation = None
                with engine.around(mesh, fake_batch, cpu=cuda is None) if engine.around is not None \
                        else contextlib.nullcontext():
                    run_steps(wrapped, fake_opt, fake_batch, step=step, precision=precision, device_type="cpu",
                              steps=steps, schedule=schedule, on_phase=on_phase,
                              before_backward=tracker.watch_backward, drive=drive,
                              save=save if evaluation is None else None)
                if evaluation is not None:  # the trainer evaluates after the steps, then saves
                    if not evaluation.keeps_batch:  # the trainer's last training batch is gone by then
                        fake_batch = None
                        twins.forget(batch)
                    evaluated = _evaluate(evaluation, wrapped, fake_opt, twins, tracker, precision, on_phase, steps,
                                          notes, cache=schedule.autocast_cache)
                    if save is not None and evaluated:
                        on_phase(steps, SAVE_PHASE)
                        with torch.no_grad():
                            save(wrapped, fake_opt)
                    elif save is not None:
                        notes.append(f"{SAVE_NOT_TRACED} (the evaluation before it could not be traced)")
            except (LossNotFoundError, StepWouldFailError):
                raise
            except Exception as err:  # noqa: BLE001 - reported as where the trace stopped
                if (failure := mixed_dtensor_failure(err, failed_op_of(err))) is not None:
                    raise StepWouldFailError(failure) from err
                if is_user_error(err):
                    user_error = err
                else:
                    error, failed = err, failed_op_of(err)
            finally:
                if emulated is not None:
                    notes.extend(emulated.notes())
    if user_error is not None:
        raise mark_user_error(user_error)
    if tracker.layouts is not None and tracker.layouts.note():
        notes.append(tracker.layouts.note())
    notes.extend(tracker.assumption_notes())
    if tracker.routing.note():
        notes.append(tracker.routing.note())
    return result(error, failed)


def _counted_batch(batch: Any, what: str, twins: TwinMaker, tracker: StorageTracker, precision: str | None) -> Any:
    """A fake twin of ``batch`` counted as the inputs, each tensor named ``what`` and its path, with the value
    shadows of its small integer tensors (read outside the trace's modes, also when it runs: an evaluation's)."""
    fake_batch = twins.batch(batch, cast=float_dtype_for(precision) is not None)
    for (path, real), fake in zip(named_tensors(batch), iter_tensors(fake_batch)):
        tracker.register(fake, Category.INPUTS)
        tracker.label(fake, Category.INPUTS)  # a twin made while the tracker runs was tracked as it was allocated
        tracker.names[fake] = f"{what}{path}"
        with torch.utils._python_dispatch._disable_current_modes():
            value = shadow_value(real)
        if value is not None:
            tracker.shadow(fake, value)
    return fake_batch


def _evaluate(evaluation: Evaluation, wrapped: nn.Module, fake_opt: torch.optim.Optimizer, twins: TwinMaker,
              tracker: StorageTracker, precision: str | None, on_phase: Callable[[int, str], None],
              steps: int, notes: list[str], *, cache: bool = True) -> bool:
    """The evaluation forward after the steps, on the rank's wrapped copy, in eval mode and without gradients (as
    `preflight.estimate_eval` traces one device's), with the training state the steps left: the gradients set to
    None first where the trainer frees them. False, with a note, where the evaluation could not be traced: the
    training figure stands and no evaluation phase is given (`preflight._estimate._evaluating`); the user's own
    error is raised, as a single-device evaluation raises it."""
    on_phase(steps, EVAL_PHASE)
    if evaluation.frees_gradients:
        fake_opt.zero_grad(set_to_none=True)
    eval_batch = _counted_batch(evaluation.batch, "the evaluation batch", twins, tracker, precision)
    try:
        with evaluating(wrapped), torch.no_grad(), autocast_for(precision, "cpu", cache):
            out = evaluation.forward(wrapped, eval_batch)
        del out
        return True
    except Exception as err:  # noqa: BLE001 - the training figure stands without the evaluation's
        if is_user_error(err):
            raise
        notes.append(f"{EVAL_NOT_TRACED} ({failed_op_of(err)}: {type(err).__name__}: {err})".splitlines()[0][:300])
        return False
    finally:
        twins.forget(evaluation.batch)  # the loader lets go of it after the step


def _carried_ids(parameters: list[torch.Tensor]) -> set[int]:
    """The ids of the tensors ``parameters`` carry in their attributes (a 4-bit weight's ``quant_state``: its
    ``absmax``, ``code`` and nested ``state2``; `preflight._device.held_tensors`)."""
    return {id(t) for p in parameters for _, t in held_tensors(p, any_type=True)}


@contextlib.contextmanager
def fresh_dtensor_caches() -> Iterator[None]:
    """Run the block with DTensor's caches empty, and empty them again after it.

    DTensor caches its sharding decisions, redistribution plans and mesh topologies keyed by device mesh, and two
    meshes compare equal by their layout, not by their process groups: a fake mesh of the job's shape would be
    handed the job's cached entries (collectives on the job's groups, with fake tensors), and the job would be
    handed the trace's (collectives on fake groups that are gone). Emptying them costs the job one recomputation of
    each entry, not a change in what it computes.
    """
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._collective_utils import MeshTopoInfo
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    except ImportError:  # a build of torch without distributed support, or without these caches
        yield
        return

    def clear() -> None:
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
        if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):
            torch._C._clear_DTensor_sharding_propagator_cache()
        clear_redistribute_planner_cache()
        MeshTopoInfo.build_from_mesh.cache_clear()

    clear()
    try:
        yield
    finally:
        clear()


def named_optimizer(engine: str) -> Callable[[torch.optim.Optimizer, nn.Module, nn.Module], torch.optim.Optimizer]:
    """An `Engine.optimizer` that rebuilds the user's optimizer (same class and hyperparameters) over the wrapped
    copy's parameters of the same names; ``engine`` names the engine in the error for a tensor the model lacks."""
    from preflight.trace._twin import clone_optimizer

    def rebuild(user: torch.optim.Optimizer, model: nn.Module, wrapped: nn.Module) -> torch.optim.Optimizer:
        return clone_optimizer(user, ParamTwins(model, dict(wrapped.named_parameters()), engine), foreach=None)

    return rebuild


def local_parameters(wrapped: nn.Module) -> list[torch.Tensor]:
    """The rank's own parameter storages: a DTensor parameter's local tensor, a plain parameter itself."""
    return [getattr(p, "_local_tensor", p) for p in wrapped.parameters()]


class ParamTwins:
    """`clone_optimizer`'s twin maker for a wrapped copy: the user's parameter -> the copy's parameter of the same
    name. ``named``: the copy's parameters under the user's names; ``engine`` names the engine in the error;
    ``rename``: the user's parameter names as ``named`` has them (FSDP1's wrapper prefixes removed)."""

    def __init__(self, model: nn.Module, named: dict[str, torch.Tensor], engine: str,
                 rename: Callable[[str], str] = str) -> None:
        self._by_id = {id(p): named[rename(name)] for name, p in model.named_parameters() if rename(name) in named}
        self._engine = engine

    def tensor(self, t: torch.Tensor, **_: Any) -> torch.Tensor:
        found = self._by_id.get(id(t))
        if found is None:
            raise ValueError("the optimizer holds a tensor that is not one of the model's parameters (existing "
                             "optimizer state, or parameters of another model); the sharded state "
                             f"{self._engine} would make for it is not traced")
        return found


def reporting_resizes(tracker: StorageTracker, alloc: Callable[..., None],
                      free: Callable[..., None]) -> tuple[Callable[..., None], Callable[..., None]]:
    """An engine's storage ``alloc`` / ``free`` functions (they resize a storage in place, which no operator sees),
    each reporting the resize to ``tracker``: a re-allocated block is in `Category.COMMUNICATION`."""
    def alloc_storage(tensor: torch.Tensor, *args: Any) -> None:
        alloc(tensor, *args)
        tracker.resized(tensor, Category.COMMUNICATION)

    def free_storage(tensor: torch.Tensor) -> None:
        free(tensor)
        tracker.resized(tensor)

    return alloc_storage, free_storage


def gloo_scratch(collective: Callable[..., Any], size_of: str) -> Callable[..., Any]:
    """``collective`` with gloo's working copy (module docstring) allocated for the duration of the call.
    ``size_of``: ``"output"`` (the first argument, or ``output`` / ``output_tensor``) or ``"input"`` (the second, or
    ``input`` / ``input_tensor``)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        named = [k for k in (size_of, f"{size_of}_tensor") if k in kwargs]
        buffer = kwargs[named[0]] if named else args[0 if size_of == "output" else 1]
        scratch = torch.empty(buffer.numel() * buffer.element_size(), dtype=torch.uint8, device=buffer.device)
        try:
            return collective(*args, **kwargs)
        finally:
            del scratch
    return run


@contextlib.contextmanager
def gloo_dtensor_gathers() -> Iterator[None]:
    """For the block, DTensor's gathers to a whole tensor (``full_tensor()``, what a full state dict of FSDP2 or
    tensor parallelism calls: ``placement_types``' ``funcol.all_gather_single``) with gloo's working copy of the
    gathered size allocated for the duration of the call (module docstring; a real 2-rank FSDP2 save held one of the
    largest parameter's full size beside its output)."""
    from torch.distributed.tensor import placement_types

    class Scratched:
        def __init__(self, funcol: Any) -> None:
            self._funcol = funcol

        def all_gather_single(self, tensor: torch.Tensor, gather_dim: int, group: Any, *args: Any,
                              **kwargs: Any) -> Any:
            import torch.distributed as dist

            if isinstance(group, tuple):  # (mesh, mesh dim), as the placements pass it
                ranks = group[0].size(group[1])
            else:
                ranks = dist.get_world_size(group)
            scratch = torch.empty(tensor.numel() * tensor.element_size() * ranks, dtype=torch.uint8,
                                  device=tensor.device)
            try:
                return self._funcol.all_gather_single(tensor, gather_dim, group, *args, **kwargs)
            finally:
                del scratch

        def __getattr__(self, name: str) -> Any:
            return getattr(self._funcol, name)

    with patched([(placement_types, "funcol", Scratched(placement_types.funcol))]):
        yield


# The single-tensor collectives FSDP1 and FSDP2 call, and which buffer gloo's working copy has the size of.
GLOO_COPIES = {"all_gather_single": "output", "reduce_scatter_single": "input"}


class ScratchedDist:
    """``torch.distributed`` as an engine's module sees it during the trace: the same, but for the collectives of
    `GLOO_COPIES`, which allocate gloo's working copy (`gloo_scratch`)."""

    def __init__(self, dist: Any) -> None:
        self._dist = dist
        for name, size_of in GLOO_COPIES.items():
            setattr(self, name, gloo_scratch(getattr(dist, name), size_of))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dist, name)


@contextlib.contextmanager
def patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set each ``(owner, name, value)`` for the block; put the previous values back on exit."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def communicating(tracker: StorageTracker, fn: Callable[..., Any],
                  after: Callable[..., None] | None = None) -> Callable[..., Any]:
    """``fn`` with what it allocates in `Category.COMMUNICATION`; ``after(*args, **kwargs)`` runs once it returned
    (to relabel what it handed over, e.g. a sharded gradient)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        before, tracker.phase_category = tracker.phase_category, Category.COMMUNICATION
        try:
            out = fn(*args, **kwargs)
        finally:
            tracker.phase_category = before
        if after is not None:
            after(*args, **kwargs)
        return out
    return run
