"""Measure the real peak of the same training steps that `preflight.estimate` predicts."""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from preflight._device import (OutsideModules, cuda_available, cuda_peaks, cuda_reset_peaks, held_tensors, iter_tensors, live_storages,
                               map_tensors, model_device)
from preflight._result import Measurement
from preflight._run import Run, check_run
from preflight._steps import with_optimizer_impl, StepFn, check_step, enter_training, run_steps
from preflight.trace import float_dtype_for

__all__ = ["measure", "collective_calls", "cpu_profiled_peak", "frees_placed", "freed_addresses", "lost_free_peaks",
           "placed_peaks", "profiled_memory_peak", "repaired_memory_peak", "replayed_peak", "session_peak",
           "step_events"]


def measure(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    run: Run | None = None,
    *,
    step: StepFn | None = None,
) -> Measurement:
    """Run ``steps`` real training steps and measure their peak memory.

    **This trains the model**: weights, optimizer state and RNG streams change, as in any training step. With a
    ``*-true`` precision the model and the batch's floating tensors are first cast in place to that dtype.

    The peak counts every live tensor storage on the model's device, including those alive before the steps
    (parameters, buffers, the batch, existing optimizer state), as `preflight.estimate` does:

    - CUDA: ``torch.cuda.max_memory_allocated`` (and ``max_memory_reserved``) over the steps.
    - CPU: the profiler's allocator events (``profile_memory=True``), summed in time order, on top of the bytes
      alive before the steps. This sees allocations inside kernels too (e.g. convolution scratch). The parameters
      and buffers of modules outside the model that the steps call (a distillation teacher) are counted too, as a
      GPU's allocator counts them (not for a compiled model, where a module hook would change what is compiled).

    Args:
        model, optimizer, batch, step: as for `preflight.estimate`.
        run: the same `preflight.Run` a prediction takes; its precision and loop apply. The steps run where the
            model's tensors are: a target is for predictions, so a ``run.target.device`` other than the model's is a
            ValueError; the parallel plan is whatever this process really runs (a DDP model runs DDP).

    Returns:
        A `Measurement`.

    Example:
        >>> m = preflight.measure(model, torch.optim.AdamW(model.parameters()), batch)  # doctest: +SKIP
        >>> m.peak_bytes  # doctest: +SKIP
    """
    run = check_run(run)
    precision, schedule, steps = run.precision, run.loop, run.loop.steps
    check_step(step)
    optimizer = with_optimizer_impl(optimizer, run.loop.optimizer_impl)
    device = model_device(model)
    wanted = run.target.device
    if wanted is not None and torch.device(wanted).type != device.type:
        raise ValueError(f"`measure` runs real steps where the model's tensors are ({device}), but `run.target` says "
                         f"{str(wanted)!r}. Move the model there first, or leave the target out.")
    if device.type == "meta":
        raise ValueError("Cannot measure a model on the meta device: it has no memory. Use `preflight.estimate`.")
    dtype = float_dtype_for(precision)
    if dtype is not None:
        model.to(dtype)
        batch = _cast_floating(batch, dtype)
    enter_training(model, run.loop)

    def run() -> None:
        run_steps(model, optimizer, batch, step=step, precision=precision, device_type=device.type, steps=steps,
                  schedule=schedule)

    if device.type == "cuda" and cuda_available():  # pragma: no cover - needs a GPU
        cuda_reset_peaks(device)
        start = time.perf_counter()
        run()
        allocated, reserved = cuda_peaks(device)
        seconds = time.perf_counter() - start
        return Measurement(
            peak_bytes=allocated,
            peak_reserved_bytes=reserved,
            device=str(device),
            method="cuda-allocator",
            steps=steps,
            step_seconds=seconds / steps,
        )
    if device.type != "cpu":
        raise ValueError(f"Measuring on {device.type!r} is not supported; measure runs on CUDA or CPU.")
    before = _live_before(model, optimizer, batch, device)
    # The modules outside the model that the steps call (a teacher): alive before the profiler's window, as on a GPU.
    outside = OutsideModules(model, device, before)
    with outside:
        peak, seconds = cpu_profiled_peak(run, resident=before)
    return Measurement(
        peak_bytes=sum(before.values()) + outside.nbytes() + peak, device="cpu", method="cpu-profiler", steps=steps,
        step_seconds=seconds / steps,
    )



def step_events(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any], *,
                step: StepFn | None = None) -> tuple[list[tuple[int, int]], list[int]]:
    """Real CPU training steps over ``batches`` (one step each, in order; each batch copied as its step starts, as
    a loader's batch arrives), as the allocation events the caching-allocator model replays
    (`preflight.allocator.simulate`): ``(uid, nbytes)`` in time order, the parameters' storages first (as a trace
    registers them), and the index of each step's last event (a step runs from its forward to the next one's).
    **This trains the model.** The CPU profiler sees the allocations of this thread only."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    marks: list[Any] = []

    def on_phase(i: int, phase: str) -> None:
        if phase in ("forward", "end"):
            while marks:
                marks.pop().__exit__(None, None, None)
        if phase == "forward":
            marks.append(record_function(f"## step{i}"))
            marks[-1].__enter__()

    def copied(batch: Any) -> Any:
        return map_tensors(lambda t: t.clone(), batch)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_steps(model, optimizer, None, step=step, precision=None, device_type="cpu", steps=len(batches),
                  on_phase=on_phase, batches=lambda i: copied(batches[i - 1]))
    allocations, calls = _profiled_allocations(prof, "## step")
    events = [(uid, p.untyped_storage().nbytes()) for uid, p in enumerate(model.parameters())]
    uids: dict[int, int] = {}
    ends: list[int] = []
    call_ends = sorted(end for _, end in calls)
    for when, nbytes, ptr in allocations:
        while call_ends and when > call_ends[0]:
            ends.append(len(events) - 1)
            call_ends.pop(0)
        if nbytes > 0:
            uids[ptr] = len(events)
            events.append((len(events), nbytes))
        elif ptr in uids:  # a block from before the steps (the parameters are listed already) is not freed here
            events.append((uids.pop(ptr), nbytes))
    ends += [len(events) - 1] * (len(batches) - len(ends))
    return events, ends


def cpu_profiled_peak(fn: Any, *, repair_lost_frees: bool = False,
                      resident: Mapping[int, int] | None = None) -> tuple[int, float]:
    """Run ``fn()`` under the CPU profiler; return the peak of allocated-minus-freed bytes and the wall time.

    ``resident``: the storages counted as alive before (`preflight._device.live_storages`), so that frees of
    blocks from before the run are counted right (`profiled_memory_peak`). With ``repair_lost_frees``, frees the
    profiler did not record are put back (`repaired_memory_peak`, which reads every recorded free at its recorded
    size and takes no ``resident``): needed where other threads free tensors, as gloo's worker threads do with a
    collective's buffers.
    """
    from torch.profiler import ProfilerActivity, profile

    from preflight._quiet import StderrFilter

    with StderrFilter(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    if repair_lost_frees:
        return repaired_memory_peak(prof), seconds
    return profiled_memory_peak(prof, resident=resident), seconds


def repaired_memory_peak(prof: Any) -> int:
    """Like `profiled_memory_peak`, with the frees the profiler lost put back.

    The profiler records a free only on a thread that carries its thread-local state. gloo runs a collective on a
    worker thread with that state, but the worker drops the finished work (and with it the collective's input and
    output tensors, when FSDP2 no longer holds them) outside it: those frees are never recorded, and the summed
    curve keeps the blocks alive to the end (measured: 2 processes of FSDP2, 1 to 6 blocks of 4 MiB per run, a
    different number each run). An address allocated again proves that the block there was freed before: the free
    is placed just before that allocation, the latest it can have happened, so the result is still an upper bound
    of the true peak (a lost block whose address is never reused stays counted).
    """
    allocations, _ = _profiled_allocations(prof)
    return replayed_peak([(nbytes, ptr) for _, nbytes, ptr in allocations])


def lost_free_peaks(prof: Any, alive: set[int], call_prefix: str, *,
                    within: str | None = None) -> tuple[int, int, int]:
    """The peak of a profiled session three ways, for runs whose collectives free blocks on gloo's worker threads,
    where the profiler loses the free (`repaired_memory_peak`): ``(repaired, lost frees at call end, lost frees
    dropped)``, from `placed_peaks` over the session's CPU allocations and its ranges named with ``call_prefix``
    (``record_function(call_prefix + "forward")``, ...). ``alive``: the storage addresses of the tensors alive at
    the end (e.g. from ``gc.get_objects()``). ``within``: the peak inside the range named ``call_prefix +
    within`` alone (e.g. ``"save"``), what was alive when it began counted."""
    allocations, calls = _profiled_allocations(prof, call_prefix)
    window = None
    if within is not None:
        spans = _profiled_allocations(prof, call_prefix + within)[1]
        if len(spans) != 1:
            raise ValueError(f"{len(spans)} ranges are named {call_prefix + within!r} in the profile, not one.")
        window = spans[0]
    return placed_peaks(allocations, calls, alive, window=window)


@contextlib.contextmanager
def collective_calls(call_prefix: str, settle_s: float = 2.0) -> Iterator[None]:
    """Make the frees of gloo's collectives visible to a CPU profile taken inside the block.

    A synchronous collective returns when gloo's worker thread has run it, but the worker drops its references to the
    tensors it was handed a moment later; when the caller has dropped its own by then (under load, often), the block
    is freed on the worker's thread, where the profiler loses the free. Inside this block each synchronous
    ``torch.distributed`` collective (i) runs in a profiler range named ``call_prefix + name``, so that
    `lost_free_peaks` places a free still lost at the end of the collective that allocated the block, and (ii) waits
    after it returns, up to ``settle_s`` seconds, until the worker has released the tensors it was handed (their use
    counts back to their values before the call), so that the caller's own frees happen on its thread. The
    functional collectives DTensor issues (``torch.ops._c10d_functional``: a tensor-parallel layer's all-gather of
    its output, a sequence-parallel reduce-scatter), which return before gloo has run them, are waited for as they
    are issued and then treated the same way (`_SettledFunctionalCollectives`). Neither changes what is allocated.
    Calls with ``async_op=True`` are left as they are: their work may finish later.

    Example:
        >>> with collective_calls("## "):
        ...     pass  # dist.all_gather_single(...) here runs inside record_function("## all_gather_single")
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.profiler import record_function

    def ranged(fn: Any, name: str) -> Any:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def called(*args: Any, **kwargs: Any) -> Any:
            try:
                asynchronous = signature.bind(*args, **kwargs).arguments.get("async_op", False)
            except TypeError:  # let the collective itself report the bad call
                asynchronous = True
            if asynchronous:
                return fn(*args, **kwargs)
            handed = list(iter_tensors((args, kwargs)))
            counts = [t._use_count() for t in handed]
            with record_function(call_prefix + name):
                result = fn(*args, **kwargs)
            _settle(handed, counts, settle_s)
            return result
        return called

    replaced = []
    for name, original in list(vars(c10d).items()):
        # the collectives a caller may run synchronously: those taking ``async_op``, and the object exchanges
        if name.startswith("_") or type(original) is not types.FunctionType:
            continue
        if "async_op" not in inspect.signature(original).parameters and not name.endswith(("_object", "_object_list")):
            continue
        wrapper = ranged(original, name)
        for module in (c10d, dist):
            if getattr(module, name, None) is original:
                replaced.append((module, name, original))
                setattr(module, name, wrapper)
    try:
        with _SettledFunctionalCollectives(call_prefix, settle_s):
            yield
    finally:
        for module, name, original in reversed(replaced):
            setattr(module, name, original)


def _settle(handed: list[torch.Tensor], counts: list[int], settle_s: float) -> None:
    """Wait, up to ``settle_s`` seconds, until no tensor in ``handed`` has more references than ``counts``."""
    deadline = time.monotonic() + settle_s
    while any(t._use_count() > c for t, c in zip(handed, counts)) and time.monotonic() < deadline:
        time.sleep(1e-4)


class _SettledFunctionalCollectives(TorchDispatchMode):
    """Inside `collective_calls`: each functional collective (``torch.ops._c10d_functional``, what DTensor's
    redistributions and torch's tensor-parallel styles issue) runs in a profiler range named ``call_prefix`` + its
    name, is waited for at once, and returns only when gloo's worker has let go of the tensors it was handed.

    A functional collective returns before gloo has run it, and gloo's worker holds its input until it drops the
    finished work: when the caller has dropped the input by then (a tensor-parallel layer's local output, gathered
    and never used again), the block is freed on the worker's thread and lost to the profiler (measured: a
    tensor-parallel Llama's 8 MiB logits shard, now and then, on a loaded machine). Waiting earlier changes no
    allocation: the output was allocated when the call was issued, and the caller's own wait finds it done. An op on
    DTensors is handed back to DTensor first (as torch's ``CommDebugMode`` does), so the collectives it issues come
    here; every other op runs as it would."""

    def __init__(self, call_prefix: str, settle_s: float) -> None:
        super().__init__()
        self.call_prefix, self.settle_s = call_prefix, settle_s

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs it and issues its collectives, which come back here
        name = func.overloadpacket.__name__ if isinstance(func, torch._ops.OpOverload) else ""
        if getattr(func, "namespace", None) not in ("_c10d_functional", "_c10d_functional_autograd") or \
                name.startswith("_") or name == "wait_tensor":
            return func(*args, **kwargs)  # not a collective (``_wrap_tensor_autograd``, the waits themselves)
        from torch.profiler import record_function

        handed = list(iter_tensors((args, kwargs)))
        counts = [t._use_count() for t in handed]
        with record_function(self.call_prefix + name):
            result = func(*args, **kwargs)
            made = [out for out in iter_tensors(result) if not any(out is h for h in handed)]
            for out in iter_tensors(result):
                torch.ops._c10d_functional.wait_tensor(out)
        # A new output is held by this frame alone once gloo has let go (autograd saves it only after this returns).
        _settle(handed + made, counts + [1] * len(made), self.settle_s)
        return result


def freed_addresses(prof: Any) -> set[int]:
    """The CPU addresses a finished profile saw freed (e.g. while dropping the objects that held them)."""
    allocations, _ = _profiled_allocations(prof)
    return {address for _, nbytes, address in allocations if nbytes < 0}


def placed_peaks(allocations: list[tuple[int, int, int]], calls: list[tuple[int, int]],
                 alive: set[int], *, window: tuple[int, int] | None = None) -> tuple[int, int, int]:
    """``(repaired, lost frees at call end, lost frees dropped)`` peaks of ``(time, nbytes, address)`` allocation
    (> 0) and free (< 0) events in time order, with ``calls`` the ``(start, end)`` times of the profiled phases.

    A free is lost where an address is allocated again with no free recorded in between (the reuse proves it), or
    where a block is still allocated at the end while no live tensor holds it (``alive``; a block held only by C++,
    such as DDP's gradient buckets, would be taken as lost, so do not use this there). ``repaired`` places each
    proven free just before the reuse and keeps the rest to the end (an upper bound, `replayed_peak`); ``at call
    end`` places every lost free at the end of the innermost call that encloses the allocation, or before the reuse
    when that comes first: gloo's worker loop drops a finished collective right after running it, and the engines
    wait for each collective inside the phase that issued it, so this is the latest such a free can happen;
    ``dropped`` leaves lost blocks out (a lower bound). Where the last two agree, no lost block is alive at the peak.
    ``window``: ``(start, end)`` times; the peak between them alone, what was alive at ``start`` counted.

    Example:
        >>> placed_peaks([(0, 10, 1), (1, 20, 2), (5, 30, 3)], [(0, 2)], alive={3})  # 1 and 2: lost in the call
        (60, 30, 30)
    """
    lost, live = _reused(allocations)
    for ptr, i in live.items():
        if ptr not in alive:
            lost[i] = None
    placed = list(allocations)
    for i, reused in lost.items():
        start, nbytes, ptr = allocations[i]
        ends = [end for begin, end in calls if begin <= start <= end]
        at = min(ends) if ends else reused
        if at is not None and reused is not None:
            at = min(at, reused - 1)
        if at is not None:
            placed.append((at, -nbytes, ptr))
    placed.sort(key=lambda a: a[0])
    dropped = [a for i, a in enumerate(allocations) if i not in lost]
    def counted(replay: list[tuple[int, int, int]]) -> list[bool] | None:
        if window is None:
            return None
        before = [i for i, (when, _, _) in enumerate(replay) if when < window[0]]
        return [window[0] <= when <= window[1] or (bool(before) and i == before[-1])
                for i, (when, _, _) in enumerate(replay)]

    return tuple(replayed_peak([(nbytes, ptr) for _, nbytes, ptr in replay],  # type: ignore[return-value]
                               counted=counted(replay))
                 for replay in (allocations, placed, dropped))


def _reused(allocations: list[tuple[int, int, int]]) -> tuple[dict[int, int | None], dict[int, int]]:
    """Over ``(time, nbytes, address)`` allocation (> 0) and free (< 0) events in time order: the allocations whose
    address is allocated again with no free recorded in between (index -> time of that reuse, which proves the free
    was lost), and the address -> index of each allocation still live at the end."""
    lost: dict[int, int | None] = {}
    live: dict[int, int] = {}
    for i, (when, nbytes, ptr) in enumerate(allocations):
        if nbytes > 0:
            if ptr in live:
                lost[live[ptr]] = when
            live[ptr] = i
        else:
            live.pop(ptr, None)
    return lost, live


def _profiled_allocations(prof: Any, call_prefix: str | None = None) -> tuple[list[tuple[int, int, int]],
                                                                            list[tuple[int, int]]]:
    """A finished CPU profile's allocation events ``(time, nbytes, address)`` in time order, and the ``(start,
    end)`` times of its ranges named with ``call_prefix``."""
    allocations, calls, _ = _walked_profile(prof, call_prefix)
    return allocations, calls


# The operators that hand their tensors to a process group (c10d's and the functional collectives): a block such an
# operator allocates (gloo's staging copy, a functional collective's output) may be freed by gloo's worker thread.
_COLLECTIVE_PREFIXES = ("c10d::", "_c10d_functional::")


def _walked_profile(prof: Any, call_prefix: str | None = None) -> tuple[list[tuple[int, int, int]],
                                                                      list[tuple[int, int]], set[int]]:
    """`_profiled_allocations`, and the indices (into the allocations) of the blocks allocated inside a collective
    operator (`_COLLECTIVE_PREFIXES`)."""
    from torch._C._profiler import _EventType

    allocations, calls, inside = [], [], []
    stack = [(node, False) for node in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, collective = stack.pop()
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
            allocations.append((node.start_time_ns, node.typed[1].alloc_size, node.typed[1].ptr))
            inside.append(collective)
        else:
            try:
                name = node.name
            except UnicodeDecodeError:  # some Python frames' names do not decode; none is a call or a collective
                name = ""
            if call_prefix is not None and name.startswith(call_prefix):
                calls.append((node.start_time_ns, node.end_time_ns))
            collective = collective or name.startswith(_COLLECTIVE_PREFIXES)
        stack.extend((child, collective) for child in node.children)
    order = sorted(range(len(allocations)), key=lambda i: allocations[i][0])
    return [allocations[i] for i in order], calls, {new for new, old in enumerate(order) if inside[old]}


def frees_placed(allocations: list[tuple[int, int, int]], handed: set[int], ends: list[int],
                 alive: Callable[[], set[int] | None]) -> list[tuple[int, int]]:
    """The ``(nbytes, address)`` events of ``allocations`` (``(time, nbytes, address)``, allocations > 0 and frees
    < 0, in time order) with the frees the profiler lost put back, for `session_peak`.

    A free is lost where it happens on a thread without the profiler's state: gloo's worker thread drops a finished
    collective, and with it the staging copy or output the collective operator allocated, outside that state when
    the caller has already let go (measured on a Lightning job of tensor parallel 2 x FSDP2 2: 64 KiB functional
    all-reduce outputs and a 1 MiB reduce-scatter copy, a different few in each step, each counted to the end of the
    step). An address allocated again proves its block was freed before; a block a collective operator allocated
    (``handed``: indices into ``allocations``) that is still allocated at the end while no Python tensor holds it
    (``alive()``: the addresses live tensors hold, asked only if there is such a block; None: unknown, every block
    held) was freed on gloo's thread.
    The free of a proven block is placed just before the reuse, the latest it can have happened; that of a handed
    block at the first of ``ends`` (phase boundaries: the end of the forward, of the backward, ...) after its
    allocation, when that comes first: gloo's worker drops a collective right after running it, and the engines
    wait for each collective inside the phase that issued it. A block C++ alone holds (DDP's gradient buckets) is not
    allocated by a collective operator, and stays counted.

    Example:
        >>> frees_placed([(0, 10, 1), (1, 20, 2), (5, 30, 1)], handed={1}, ends=[3], alive=lambda: set())
        [(10, 1), (20, 2), (-20, 2), (-10, 1), (30, 1)]
    """
    lost, live = _reused(allocations)
    unheld = [i for i in live.values() if i in handed]
    if unheld:
        held = alive()
        if held is not None:
            lost.update((i, None) for i in unheld if allocations[i][2] not in held)
    placed = [(when, 0, nbytes, ptr) for when, nbytes, ptr in allocations]
    ends = sorted(ends)
    for i, reused in lost.items():
        start, nbytes, ptr = allocations[i]
        at = next((end for end in ends if end >= start), None) if i in handed else None
        if reused is not None:
            at = reused - 1 if at is None else min(at, reused - 1)
        if at is not None:
            placed.append((at, -1, -nbytes, ptr))  # before the events of the same instant
    placed.sort(key=lambda a: (a[0], a[1]))
    return [(nbytes, ptr) for _, _, nbytes, ptr in placed]


def replayed_peak(events: list[tuple[int, int]], counted: list[bool] | None = None) -> int:
    """The peak of live bytes over ``(nbytes, address)`` allocation (> 0) and free (< 0) events in time order, where
    an allocation at an address still live frees the block there first (its free was not recorded). ``counted``:
    the events after which the live bytes count toward the peak (all of them by default)."""
    live = peak = 0
    sizes: dict[int, int] = {}  # address -> bytes of the block live there
    for i, (nbytes, ptr) in enumerate(events):
        if nbytes > 0:
            live += nbytes - sizes.get(ptr, 0)
            sizes[ptr] = nbytes
        else:
            live -= sizes.pop(ptr, -nbytes)  # a block allocated before the session: its size as recorded
        if counted is None or counted[i]:
            peak = max(peak, live)
    return peak


def profiled_memory_peak(prof: Any, *, with_end: bool = False, resident: Mapping[int, int] | None = None) -> Any:
    """Peak of allocated-minus-freed CPU bytes over a finished ``torch.profiler.profile`` session; with
    ``with_end``, ``(peak, bytes still allocated at the end)``.

    The profiler records every CPU allocation and free (`_profiled_allocations`); summed in time order they give
    the live-bytes curve of what was allocated during the session. A free of a block allocated before the session
    is recorded only where the profiler's size table still has the address, and that entry may be stale: a block
    allocated while profiling and freed while not leaves its entry behind, and a later block at the same address
    is freed at the old block's size. A Lightning step with gradient accumulation frees a 4-byte scalar from before
    its window every time; once in four clean-clone CI runs that step read 245 KB low, as a stale size there
    would. With ``resident`` (address -> bytes of the storages the caller counts as alive at the start,
    `preflight._device.live_storages`) such frees count at the resident block's own size and those of any other
    block not at all, since the caller's baseline does not hold it; without, at the size the profiler recorded.
    """
    peak, end = session_peak(profiled_events(prof), resident)
    return (peak, end) if with_end else peak


def profiled_events(prof: Any) -> list[tuple[int, int]]:
    """The ``(nbytes, address)`` CPU allocation (> 0) and free (< 0) events of a finished profiler session, in time
    order."""
    allocations, _ = _profiled_allocations(prof)
    return [(nbytes, ptr) for _, nbytes, ptr in allocations]


def session_survivors(events: list[tuple[int, int]]) -> dict[int, int]:
    """address -> bytes of the blocks allocated over ``events`` and not freed in them."""
    alive: dict[int, int] = {}
    for nbytes, ptr in events:
        if nbytes > 0:
            alive[ptr] = nbytes
        else:
            alive.pop(ptr, None)
    return alive


def session_peak(events: list[tuple[int, int]], resident: Mapping[int, int] | None = None) -> tuple[int, int]:
    """``(peak, live at the end)`` of the bytes allocated over ``(nbytes, address)`` allocation (> 0) and free (< 0)
    events in time order, minus their frees; see `profiled_memory_peak` for ``resident``.

    Example:
        >>> session_peak([(-300, 1), (100, 2)])  # a block from before freed: counted at its recorded size
        (0, -200)
        >>> session_peak([(-300, 1), (100, 2)], resident={})  # ... not held by the baseline: not counted
        (100, 100)
        >>> session_peak([(-300, 1), (100, 2)], resident={1: 50})  # a resident block: counted at its own size
        (50, 50)
    """
    earlier = dict(resident or {})  # resident blocks not freed yet
    session: set[int] = set()  # addresses allocated in the session and not freed yet
    live = peak = 0
    for nbytes, ptr in events:
        if nbytes > 0:
            session.add(ptr)
            live += nbytes
        elif ptr in session or resident is None:
            session.discard(ptr)
            live += nbytes
        else:
            live -= earlier.pop(ptr, 0)
        peak = max(peak, live)
    return peak, live


def _live_before(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
                 device: torch.device) -> dict[int, int]:
    tensors = [list(model.parameters()), list(model.buffers()), batch]
    tensors.append([held for p in model.parameters() for _, held in held_tensors(p)])  # quantisation state
    tensors.append([p.grad for p in model.parameters() if p.grad is not None])
    tensors.append([list(s.values()) for s in optimizer.state.values()])
    return live_storages(tensors, device)


def _cast_floating(batch: Any, dtype: torch.dtype) -> Any:
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, batch)
