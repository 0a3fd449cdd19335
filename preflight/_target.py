"""Turn a traced single-device peak into what a CUDA target and a sharded rank would see.

CUDA target (``device="cuda"`` or ``gpu=...``). On a CPU host the trace itself already runs with CUDA's
semantics (`preflight.cuda`): CUDA's autocast op lists and weight cast cache, the attention kernel the target GPU
would pick with its saved tensors, the fused dropout with boolean masks, and the foreach optimizer torch picks for
CUDA tensors (see `preflight.trace._run`). Then, on the event list:
    - the two cuBLAS workspaces a training step holds in the caching allocator (forward thread and autograd
      thread; `preflight.cuda._workspace`) are added where the first forward and the first backward start;
    - every storage rounds up to 512 bytes (the caching allocator's ``kMinBlockSize``);
    - `preflight.allocator.simulate` replays the events for ``peak_reserved_bytes`` (segments held from the
      driver, ``torch.cuda.max_memory_reserved()``) and ``peak_allocated_bytes`` (the blocks it hands out, an
      unsplit remainder counted whole: ``torch.cuda.max_memory_allocated()``, measured on an H200 within -1.7%
      to +0.1%);
    - ``device_total_bytes`` adds the CUDA context of the GPU generation (`preflight._gpus`), which is roughly
      what ``nvidia-smi`` shows for the process.

Not modelled when tracing a CUDA target on a CPU-only host: cuDNN convolution workspaces (listed as not
calibrated), the runtime cuDNN version's preference for cuDNN attention (its saved tensors have flash's sizes),
kernels whose fake implementation keeps other tensors than the CUDA kernel, and Adam's ``step`` counters, which
live on the CPU for a CUDA target but are counted here (4 bytes per parameter tensor). None of the CUDA terms has
been measured on a GPU in this repository yet (``benchmarks/gpu_validation.py`` is the harness that does).

Sharding (`shard_events`): every allocation of the traced run is rescaled to what one rank holds, by its
category, and the per-rank peak is read from the rescaled timeline (so it can fall in another phase than the
single-device peak). ZeRO-1 divides optimizer state by the world size; ZeRO-2 and FSDP's ``SHARD_GRAD_OP`` also
gradients; ZeRO-3 and FSDP's ``FULL_SHARD`` also parameters, plus the unsharded parameters of the largest
repeated block and the prefetched next one for the whole step (ZeRO paper, arXiv:1910.02054, Sec 5; FSDP's
``ShardingStrategy``). The optimizer step runs over the rank's shard, so the temporaries it allocates divide
too; an offloaded optimizer step (ZeRO-Offload, FSDP ``CPUOffload``) and offloaded parameter shards leave the
GPU. DDP holds a flat copy of every gradient in its buckets from construction on; with
``gradient_as_bucket_view`` the gradients are views into them, so each gradient the backward makes lives only until
DDP's hook copies it into its bucket (``Reducer::mark_variable_ready_dense``: the copy, then ``grad =
bucket_view``), and the bucket is the gradient from then on. ZeRO's gradient reduction buffers
(`preflight._sharding.zero_buffers`, sized from the DeepSpeed config or DeepSpeed's defaults) are added in the
communication category: at stages 1 and 2 from each backward's first gradient to its end, at stage 3 from the
start. Stages 1 and 2 also hold an fp32 copy of the rank's parameter partition (`zero12_master_bytes`). At stage 3,
DeepSpeed's own terms (less those an offload puts on the host) replace the two gathered blocks
(`preflight._sharding.zero3_terms`): the
fp32 partition copy and the gradient partitions from the start, each full gradient only as a transient, the first
step's gathered module, and from the second step the persistent parameters and those kept from forward to
backward, in the communication category. Shares round up per tensor. Other communication buffers are not counted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import nn

from preflight._device import cuda_available
from preflight._gpus import GPU, get_gpu
from preflight._result import Category, Event
from preflight.cuda import WORKSPACE_UIDS, cublas_workspace_bytes, with_workspaces
from preflight._sharding import SHARDED_STATES, SHARDING_CHOICES, Zero3Terms, ZeroBuffers, shard_breakdown
from preflight.allocator import AllocatorConfig, simulate
from preflight.parallel._deepspeed import DeepSpeedSave

__all__ = ["CudaTerms", "add_workspaces", "check_sharding", "cuda_terms", "deepspeed_save_events", "per_rank_breakdown",
           "resolve_gpu", "round_events", "shard_events"]

_BLOCK = 512  # c10/cuda/CUDACachingAllocator.cpp kMinBlockSize


def resolve_gpu(gpu: str | None, device: torch.device) -> GPU | None:
    """The catalog entry for ``gpu``, or for the local CUDA device's name when it is in the catalog."""
    if gpu is not None:
        return get_gpu(gpu)
    if device.type == "cuda" and cuda_available():  # pragma: no cover - needs a GPU
        try:
            return get_gpu(torch.cuda.get_device_name(device))
        except ValueError:
            return None
    return None


def round_events(events: Sequence[Event]) -> list[Event]:
    """Events with every size rounded up to the allocator's 512-byte blocks."""
    return [dataclasses.replace(e, nbytes=_round(e.nbytes)) for e in events]


def add_workspaces(events: Sequence[Event], gpu: GPU | None) -> tuple[list[Event], str]:
    """``events`` with the step's cuBLAS workspaces (`preflight.cuda._workspace`: the forward thread's, and the
    autograd thread's where there is a backward), and a note saying so."""
    cc = gpu.compute_capability if gpu is not None else (8, 0)  # preflight.cuda's assumption for an unnamed GPU
    nbytes = cublas_workspace_bytes(cc)
    out = with_workspaces(events, nbytes)
    added = sum(e.uid in WORKSPACE_UIDS for e in out)
    if added == 2:
        return out, (f"two cuBLAS workspaces of {nbytes:,} B (forward and autograd threads) counted as allocated, "
                     "as the caching allocator holds them")
    if added == 1:
        return out, (f"one cuBLAS workspace of {nbytes:,} B (the forward thread's) counted as allocated, as the "
                     "caching allocator holds it")
    return out, "no cuBLAS workspace counted: no operator was traced"


def _round(nbytes: int) -> int:
    sign = -1 if nbytes < 0 else 1
    return sign * (-(-abs(nbytes) // _BLOCK) * _BLOCK)


@dataclasses.dataclass(frozen=True)
class CudaTerms:
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    device_total_bytes: int | None
    fragmentation: float
    notes: tuple[str, ...]


def cuda_terms(events: Sequence[Event], gpu: GPU | None, allocator: AllocatorConfig | None,
               nccl: tuple[int, str] | None = None) -> CudaTerms:
    """Reserved memory from the allocator simulation, and the device total when the GPU is known (with NCCL's
    buffers, ``(bytes, note)`` from `preflight.cuda._nccl.nccl_buffers`, on a rank of several)."""
    # Negative uids are calibrated kernel scratch; storages alive before the trace are allocations too.
    sim = simulate(events, config=allocator)
    notes = [f"reserved memory simulated with the CUDA caching allocator's rules "
             f"({sim.num_segments} segments, {sim.fragmentation:.1%} fragmentation at the peak)"]
    total = None
    if gpu is not None:
        total = sim.peak_reserved_bytes + gpu.context_bytes  # cuBLAS workspaces are in the events already
        notes.append(f"device total adds the CUDA context ({gpu.context_bytes:,} B, as given)" if gpu.context_given
                     else f"device total adds the CUDA context (~{gpu.context_bytes >> 20} MiB, approximate) of a "
                          f"{gpu.name}; Target(cuda_context=...) / --cuda-context gives the one you measured")
        if nccl is not None:
            total += nccl[0]
            notes.append(nccl[1])
    return CudaTerms(sim.peak_reserved_bytes, sim.peak_allocated_bytes, total, sim.fragmentation, tuple(notes))


def check_sharding(world_size: int, sharding: str | None) -> str | None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"`world_size` should be a positive integer, got {world_size!r}.")
    if sharding is None:
        return "ddp" if world_size > 1 else None
    if sharding not in SHARDING_CHOICES:
        raise ValueError(f"`sharding` should be one of {SHARDING_CHOICES}, got {sharding!r}.")
    return sharding


def largest_unit_bytes(model: nn.Module, dtype: torch.dtype | None) -> int:
    """Parameter bytes of the largest repeated block (the unit FSDP or ZeRO-3 gathers at once)."""
    best = 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for child in module:
                size = sum(p.numel() * (dtype.itemsize if dtype and p.is_floating_point() else p.element_size())
                           for p in child.parameters())
                best = max(best, size)
    return best


def per_rank_breakdown(breakdown: dict[str, int], model: nn.Module, *, world_size: int, sharding: str,
                       dtype: torch.dtype | None, offload_optimizer: bool = False, offload_params: bool = False,
                       zero_buffers: ZeroBuffers | None = None, zero3: Zero3Terms | None = None,
                       state_scale: float = 1.0) -> tuple[dict[str, int], str]:
    """One rank's breakdown, rescaled by category from a single-device breakdown (for a lower bound, which has no
    event timeline to rescale, and for evaluation), and a note saying how it was derived. ``zero_buffers``: ZeRO's
    gradient reduction buffers alive at that moment, added as communication. ``zero3``: DeepSpeed ZeRO-3's own
    terms (`preflight._sharding.zero3_terms`), as they stand from the second step on: they replace the gathered
    unit and the gradient share. ``state_scale``: the optimizer state's bytes per traced byte (`shard_events`)."""
    unit = largest_unit_bytes(model, dtype)
    if state_scale != 1.0:
        breakdown = {**breakdown, "optimizer_state": math.ceil(breakdown.get("optimizer_state", 0) * state_scale)}
    out = shard_breakdown(breakdown, world_size=world_size, sharding=sharding, largest_unit_param_bytes=unit,
                          offload_optimizer=offload_optimizer, offload_params=offload_params)
    if sharding in ("zero1", "zero2") and not offload_optimizer:
        out["optimizer_state"] += zero12_master_bytes(model, world_size)
    if zero3 is not None:
        out["temporaries"] -= min(2 * (unit or breakdown["parameters"]), breakdown["parameters"])
        out["gradients"] = zero3.grad_partition_bytes
        out["optimizer_state"] += zero3.master_bytes
        communication = zero3.persistent_bytes + zero3.gathered_bytes
        out[Category.COMMUNICATION.value] = out.get(Category.COMMUNICATION.value, 0) + communication
    offloaded = [name for name, on in (("optimizer state", offload_optimizer), ("parameters", offload_params)) if on]
    note = (f"per-rank figures for {sharding} over {world_size} rank(s), derived from the single-device trace's "
            f"breakdown at its peak (largest gathered unit: {unit} bytes)"
            + (f"; {' and '.join(offloaded)} offloaded to the CPU" if offloaded else ""))
    if zero_buffers is not None and zero_buffers.nbytes:
        out[Category.COMMUNICATION.value] = out.get(Category.COMMUNICATION.value, 0) + zero_buffers.nbytes
        note += f"; {zero_buffers.note()}"
    if zero3 is not None:
        note += f"; {zero3.note()}"
    return out, note


# uids for the per-rank terms shard_events adds (the tracker's uids are >= 0, calibrated scratch's are < 0).
_GATHERED_UID, _DDP_BUCKETS_UID, _ZERO_BUFFERS_UID = -(2**62), -(2**62) + 1, -(2**62) + 2
# ZeRO-3's terms (`Zero3Terms`): fp32 partition copy, gradient partitions, the first step's gathered module, the
# persistent and gathered parameters from the second step, the initial fp32 gradient, each step's fp32 gradient.
_Z3_MASTER, _Z3_GRADS, _Z3_FIRST, _Z3_STEADY, _Z3_INIT_GRAD, _Z3_STEP_GRAD = (-(2**62) + 3 + i for i in range(6))
_Z12_MASTER = -(2**62) + 9  # stages 1 and 2: the fp32 partition copy
_Z3_REGATHERED = -(2**62) + 10  # ZeRO-3's persistent parameters gathered again after a save
_DS_SAVE_UID = -(2**61)  # a DeepSpeed save's allocations: this minus their key


def zero12_master_bytes(model: nn.Module, world_size: int) -> int:
    """ZeRO stages 1 and 2's fp32 copy of the rank's partition of the flat 16-bit (or model-dtype) parameter group:
    ``stage_1_and_2.py __init__``, ``weights_partition = ...[partition_id].detach().clone().to(dtype=
    master_weights_and_grads_dtype)``, a copy even when the model is fp32 (DeepSpeed 0.19.8). The flat group's
    padding for alignment is not counted."""
    numel = sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
    return 4 * -(-numel // world_size)


def shard_events(events: Sequence[Event], categories: dict[int, Category], model: nn.Module, *, world_size: int,
                 sharding: str, dtype: torch.dtype | None, offload_optimizer: bool = False,
                 offload_params: bool = False, zero_buffers: ZeroBuffers | None = None,
                 zero3: Zero3Terms | None = None, gradient_as_bucket_view: bool = False,
                 state_scale: float = 1.0) -> tuple[list[Event], dict[int, Category], str]:
    """One rank's events under ``sharding`` (module docstring), their categories, and a note saying how.
    ``zero_buffers``: ZeRO's gradient reduction buffers, for a ``zero*`` sharding. ``zero3``: DeepSpeed ZeRO-3's
    own terms (`_with_zero3`), for ``"zero3"``: they replace the gathered unit and the gradient share.
    ``gradient_as_bucket_view``: DDP's option; each traced gradient is freed right after its allocation (DDP copies
    it into its bucket and points ``.grad`` at the bucket), and its later free is dropped. ``state_scale``: the
    optimizer state's (and its step's temporaries') bytes per traced byte: DeepSpeed's optimizer steps the fp32
    copy of the partition, so the state a 16-bit model's trace holds in 16 bits is fp32 there (`deepspeed_terms`).

    The arguments are checked by `preflight._sharding.shard_breakdown` beforehand.
    """
    sharded = SHARDED_STATES[sharding]
    fsdp_offload = offload_params and sharding.startswith("fsdp")  # CPUOffload: grads and the step on the CPU too
    zero = {Category.OPTIMIZER_STATE.value} if offload_optimizer or fsdp_offload else set()
    zero |= {Category.PARAMETERS.value} if offload_params else set()
    zero |= {Category.GRADIENTS.value} if fsdp_offload else set()

    def share(nbytes: int, category: str) -> int:
        if category in zero:
            return 0
        if category == Category.OPTIMIZER_STATE.value:
            nbytes = math.ceil(nbytes * state_scale)
        if category in sharded:
            return -(-nbytes // world_size)
        return nbytes

    bucket_views = sharding == "ddp" and gradient_as_bucket_view
    sizes: dict[int, int] = {}
    out: list[Event] = []
    for e in events:
        if e.nbytes > 0:
            category = categories.get(e.uid, Category.TEMPORARIES).value
            if category == Category.TEMPORARIES.value and e.phase.endswith("/optimizer"):
                category = Category.OPTIMIZER_STATE.value  # the step's temporaries live and die with the shard
            if zero3 is not None and category == Category.GRADIENTS.value:
                # stage3.py __add_grad_to_ipg_bucket copies each full gradient into the reduction buffer as it is
                # made and drops it: a transient here, the rank's share being the gradient partitions (zero3).
                out.extend([e, dataclasses.replace(e, nbytes=-e.nbytes)])
                continue
            sizes[e.uid] = share(e.nbytes, category)
            nbytes = sizes[e.uid]
        else:
            nbytes = -sizes.pop(e.uid, 0)
        if nbytes:
            out.append(dataclasses.replace(e, nbytes=nbytes))
        if nbytes > 0 and bucket_views and category == Category.GRADIENTS.value:
            out.append(dataclasses.replace(e, nbytes=-sizes.pop(e.uid)))  # copied into its bucket view
    categories = dict(categories)
    extra: list[Event] = []
    unit = largest_unit_bytes(model, dtype)
    if sharding in ("zero1", "zero2") and not offload_optimizer:
        extra.append(Event(_Z12_MASTER, zero12_master_bytes(model, world_size), -1, "setup"))
        categories[_Z12_MASTER] = Category.OPTIMIZER_STATE
    if zero3 is not None:
        out = _with_zero3(out, zero3)
        categories.update({_Z3_MASTER: Category.OPTIMIZER_STATE, _Z3_GRADS: Category.GRADIENTS,
                           _Z3_FIRST: Category.COMMUNICATION, _Z3_STEADY: Category.COMMUNICATION,
                           _Z3_INIT_GRAD: Category.GRADIENTS, _Z3_STEP_GRAD: Category.GRADIENTS})
    elif Category.PARAMETERS.value in sharded:
        total = sum(e.nbytes for e in events if e.nbytes > 0 and categories.get(e.uid) is Category.PARAMETERS)
        gathered = min(2 * (unit or total), total)  # the unit in use and the prefetched next one
        extra.append(Event(_GATHERED_UID, gathered, -1, "setup"))
        categories[_GATHERED_UID] = Category.TEMPORARIES
    if sharding == "ddp":
        grads = sum(p.numel() * (dtype.itemsize if dtype is not None and p.is_floating_point() else p.element_size())
                    for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
        extra.append(Event(_DDP_BUCKETS_UID, grads, -1, "setup"))
        categories[_DDP_BUCKETS_UID] = Category.GRADIENTS
    offloaded = [name for name, on in (("optimizer state", offload_optimizer), ("parameters", offload_params)) if on]
    note = (f"per-rank figures for {sharding} over {world_size} rank(s): every traced allocation rescaled to one "
            f"rank's share" + ("" if zero3 is not None else f" (largest gathered unit: {unit} bytes)")
            + (f"; {' and '.join(offloaded)} offloaded to the CPU" if offloaded else "")
            + ("; DDP's buckets counted from construction, gradients as views into them (gradient_as_bucket_view: "
               "each gradient the backward makes is freed once copied into its bucket)" if bucket_views else
               "; DDP's buckets, a flat copy of every gradient, counted from construction" if sharding == "ddp"
               else ""))
    if zero3 is not None:
        note += f"; {zero3.note()}"
    if zero_buffers is not None and zero_buffers.nbytes:
        categories[_ZERO_BUFFERS_UID] = Category.COMMUNICATION
        note += f"; {zero_buffers.note()}"
        if not zero_buffers.during_backward:
            extra.append(Event(_ZERO_BUFFERS_UID, zero_buffers.nbytes, -1, "setup"))
        else:
            gradients = {uid for uid, c in categories.items() if c is Category.GRADIENTS}
            out = _during_backward(out, Event(_ZERO_BUFFERS_UID, zero_buffers.nbytes, -1, ""), gradients)
    return extra + out, categories, note


def deepspeed_save_events(events: Sequence[Event], categories: dict[int, Category], save: DeepSpeedSave,
                          z: Zero3Terms | None, *, rank0: bool) -> tuple[list[Event], dict[int, Category]]:
    """One rank's ``events`` (`shard_events`' output, ending with the training steps) followed by a checkpoint save
    under DeepSpeed (`preflight.parallel._deepspeed.deepspeed_save`), in the phase ``"save"``, and their categories.
    ``rank0``: rank 0's save, else another rank's. ``z``: the ZeRO-3 terms the events hold (None at stages 1 and
    2). At stage 3 the save starts from the state the step leaves: the non-persistent parameters released after
    their last use in the backward (``partitioned_param_coordinator.py __params_to_release``: their next use is
    past the recorded trace) and the persistent ones gathered (``stage3.py _post_step``), where the steps' events
    keep the gathered parameters of the step (`_with_zero3`) to its end; a consolidation partitions the persistent
    ones first and gathers them again after it (``checkpoint_event_prologue`` / ``_epilogue``)."""
    at = events[-1] if events else Event(0, 0, -1, "setup")

    def event(uid: int, nbytes: int) -> Event:
        return Event(uid, nbytes, at.op, "save")

    out = list(events)
    categories = dict(categories)
    persistent = z.persistent_bytes if z is not None else 0
    if z is not None:
        alive: dict[int, int] = {}
        for e in events:
            if e.uid in (_Z3_FIRST, _Z3_STEADY):
                alive[e.uid] = alive.get(e.uid, 0) + e.nbytes
        out += [event(uid, -n) for uid, n in alive.items() if n > 0]
        out.append(event(_Z3_REGATHERED, persistent))
        categories[_Z3_REGATHERED] = Category.COMMUNICATION
    if save.consolidates:
        out.append(event(_Z3_REGATHERED, -persistent))
    out += [event(_DS_SAVE_UID - key, nbytes) for key, nbytes in (save.rank0 if rank0 else save.others)]
    if save.consolidates:
        out.append(event(_Z3_REGATHERED, persistent))
    return [e for e in out if e.nbytes], categories


def _with_zero3(events: list[Event], z: Zero3Terms) -> list[Event]:
    """``events`` with ZeRO-3's terms (`preflight._sharding.zero3_terms` for their sources) placed in time: the fp32
    partition copy, the gradient partitions, the initial fp32 gradient and the first step's gathered module from the
    start; at the first optimizer phase the initial gradient gives way to the step's; in each optimizer phase the
    step's fp32 gradient; from the second step on the persistent and gathered parameters replace the first step's."""
    def event(uid: int, nbytes: int, at: Event) -> Event:
        return Event(uid, nbytes, at.op, at.phase)

    start = Event(0, 0, -1, "setup")
    out = [event(_Z3_MASTER, z.master_bytes, start), event(_Z3_GRADS, z.grad_partition_bytes, start),
           event(_Z3_INIT_GRAD, z.init_grad_bytes, start), event(_Z3_FIRST, z.first_step_gathered_bytes, start)]
    init_alive = first_alive = True
    in_step = False
    for e in events:
        step, _, phase = e.phase.partition("/")
        optimizer = phase == "optimizer"
        if optimizer and not in_step:
            out.append(event(_Z3_STEP_GRAD, z.step_grad_bytes, e))
            if init_alive:
                out.append(event(_Z3_INIT_GRAD, -z.init_grad_bytes, e))
                init_alive = False
        elif in_step and not optimizer:
            out.append(event(_Z3_STEP_GRAD, -z.step_grad_bytes, e))
        in_step = optimizer
        if first_alive and step.startswith("step") and step[4:].isdigit() and int(step[4:]) >= 2:
            out += [event(_Z3_FIRST, -z.first_step_gathered_bytes, e),
                    event(_Z3_STEADY, z.persistent_bytes + z.gathered_bytes, e)]
            first_alive = False
        out.append(e)
    if in_step and out:
        out.append(event(_Z3_STEP_GRAD, -z.step_grad_bytes, out[-1]))
    return [e for e in out if e.nbytes]


def _during_backward(events: list[Event], buffer: Event, gradients: set[int]) -> list[Event]:
    """``events`` with ``buffer`` allocated at the first gradient (a uid in ``gradients``) each backward makes and
    freed after the backward's last event: DeepSpeed's ``setup_buckets`` runs in the first gradient's hook
    (``stage_1_and_2.py grad_handling_hook`` -> ``process_gradients``), and the buffers are released when the
    backward's reduction ends."""
    out: list[Event] = []
    inside = alive = False
    for e in events:
        backward = e.phase.endswith("/backward")
        if inside and not backward and alive:
            out.append(dataclasses.replace(buffer, nbytes=-buffer.nbytes, op=e.op, phase=e.phase))
            alive = False
        inside = backward
        if backward and not alive and e.nbytes > 0 and e.uid in gradients:
            out.append(dataclasses.replace(buffer, op=e.op, phase=e.phase))
            alive = True
        out.append(e)
    if alive:
        out.append(dataclasses.replace(buffer, nbytes=-buffer.nbytes, op=events[-1].op, phase=events[-1].phase))
    return out
