"""Run training steps of the user's real model on fake tensors and record every allocation and free.

The user's module is run as it is (its code, hooks, checkpointing and PEFT wrappers), with its parameters and
buffers swapped for fake twins for the duration of the trace (``torch.func.functional_call``'s mechanism),
under a `FakeTensorMode`: no real memory is allocated for them, and nothing of the user's is written. On exit
the module's attributes, training flags and the RNG streams are restored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from preflight.cuda import CudaTarget, device_backward_scratch, emulate_cuda
from preflight.trace._compat import real_run_paths
from preflight._checkpoint import Checkpoint
from preflight._device import iter_tensors, named_tensors, planned_fill
from preflight._errors import StepWouldFailError
from preflight._optimizer_group import manual_optimizers
from preflight._quiet import handled_fake_tensor_errors
from preflight.trace import _interrupts as interrupts
from preflight.trace._blame import is_user_error, mark_user_error
from preflight.trace._compiled import compiled_notes, dynamo_kept_out, partitioned_forwards
from preflight.trace._generation import longest_generation
from preflight.trace._step_checks import kernel_dtype_error, mixed_dtensor_failure
from preflight.trace._leftovers import Sweep, swept
from preflight.trace._library_kernels import PAGED_MIN_NUMEL, cuda_training_paths, layer_notes
from preflight.trace._process import isolated_process, isolated_rng
from preflight.trace._restore import restored_module
from preflight._result import Category, Event
from preflight._steps import LossNotFoundError, Loop, StepFn, enter_training, needs_closure, run_steps
from preflight.trace._tracker import SHADOW_MAX_NUMEL, StorageTracker, failed_op_of
from preflight.trace._twin import (TwinMaker, clone_optimizer, cuda_capturable_off, cuda_default_impl,
                                  float_dtype_for)

__all__ = ["EVAL_NOT_TRACED", "EVAL_PHASE", "SAVE_NOT_TRACED", "SAVE_PHASE", "FakeRun", "TensorSpec", "TraceResult",
           "can_shadow", "checkpoint_saver", "counted_rng_snapshots", "op_logger", "phase_bookkeeping",
           "preserved_state", "shadow_value", "trace_steps"]

# The phase of a checkpoint save traced after the steps (`preflight._steps.run_steps`'s ``save``).
SAVE_PHASE = "save"
EVAL_PHASE = "eval/forward"  # an evaluation traced after the training steps (`preflight._steps.Evaluation`)
# The note of such an evaluation the trace could not run: no evaluation phase is given, the training figure stands.
EVAL_NOT_TRACED = "evaluation after the steps: not traced"
# The note of a save the trace could not run: the saving phase is then the training state the steps leave alone.
SAVE_NOT_TRACED = "checkpoint save: not traced, its figure is the training state the steps leave, a lower bound"


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Shape, stride, dtype and storage offset (in elements) of a tensor seen in the trace."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    storage_offset: int = 0

    @staticmethod
    def of(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype, x.storage_offset())
        return x


def op_logger(record_op: Callable[[Any, Any], bool] | None, op_log: list[tuple[int, int, Any, Any, Any]],
              events_so_far: Callable[[], int]) -> Callable[..., None]:
    """A tracker's ``on_op`` that appends the operator calls ``record_op(func, args)`` selects to ``op_log`` as
    ``(op_index, event_index, func, args, kwargs)``, ``event_index`` being ``events_so_far()`` at the call (kernel
    scratch is calibrated from it: `preflight._scratch`). Tensors are logged as `TensorSpec`: holding the fake
    tensors would keep their storages alive and change the trace."""

    def on_op(index: int, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if record_op is not None and record_op(func, args):
            op_log.append((index, events_so_far(), func, tree_map(TensorSpec.of, args),
                           tree_map(TensorSpec.of, kwargs)))

    return on_op


@dataclasses.dataclass
class TraceResult:
    """What a trace recorded. ``error`` is set when the trace stopped early (then events are partial)."""

    events: list[Event]
    categories: dict[int, Category]
    num_ops: int
    seconds: float
    error: BaseException | None = None
    failed_op: str | None = None
    op_log: list[tuple[int, int, Any, Any, Any]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    lower_bound: str | None = None  # the trace ran to the end, but its peak is a lower bound: why
    upper_bound: str | None = None  # the trace ran to the end, but its peak is an upper bound: why
    # Parameters of modules outside the model that the step read, counted (`StorageTracker.outside_bytes`).
    outside_bytes: int = 0
    # A rank's loading traced before its steps (`preflight.parallel.trace_rank` with a `preflight.Loading`), apart.
    loading: TraceResult | None = None
    # uids of the optimizer state a bitsandbytes paged optimizer keeps in CUDA managed memory on a GPU
    paged: frozenset[int] = frozenset()
    # an evaluation trace: the bytes of what the step returned (the outputs an evaluation loop may keep)
    output_bytes: int = 0


def phase_bookkeeping(tracker: StorageTracker, fake_opt: torch.optim.Optimizer) -> Callable[[int, str], None]:
    """The ``on_phase(step, phase)`` callback every training trace gives `run_steps`: it labels the gradients
    when the optimizer phase starts and the optimizer state once a step has run, closes the backward, lets the
    optimizer read placeholders only in its own phase, and names the phase and the category of what it
    allocates."""
    fake_params = [p for group in fake_opt.param_groups for p in group["params"]]

    def on_phase(i: int, phase: str) -> None:
        if phase in (SAVE_PHASE, EVAL_PHASE):  # after the last step, outside every step (`Estimate.step_peaks`)
            tracker.end_backward()
            tracker.placeholders_allowed = False
            tracker.phase = phase
            tracker.phase_category = Category.TEMPORARIES if phase == SAVE_PHASE else Category.ACTIVATIONS
            return
        if phase == "optimizer":  # gradients are complete: label them
            for p in fake_params:
                if p.grad is not None:
                    tracker.label(p.grad, Category.GRADIENTS)
        if phase in ("zero_grad", "end", "manual"):  # state exists once the step ran
            for st in fake_opt.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        tracker.label(v, Category.OPTIMIZER_STATE)
        tracker.end_backward()
        tracker.placeholders_allowed = phase == "optimizer"
        tracker.phase = f"step{i}/{phase}"
        # A pipeline schedule interleaves forwards and backwards: what it allocates is counted as activations.
        tracker.phase_category = Category.ACTIVATIONS if phase in ("forward", "pipeline", "manual") \
            else Category.TEMPORARIES

    return on_phase


def checkpoint_saver(tracker: StorageTracker, checkpoint: Checkpoint | None, *, host_is_device: bool,
                     fake_world: bool, notes: list[str],
                     gathers: Callable[[], contextlib.AbstractContextManager] | None = None,
                     ) -> Callable[[nn.Module, torch.optim.Optimizer], None] | None:
    """The ``save`` a trace gives `run_steps` for ``checkpoint`` (None: no save), run under the tracker: it gathers
    what the run's save gathers (`preflight._checkpoint.collect_state`), labels what the save made by what it holds
    (the model's entries as parameters, the optimizer's as optimizer state), holds it to the end of the phase, and
    drops it. ``host_is_device``: the target is the CPU. On another target, the entries a full state dict moves to
    the host (``offload_to_cpu``) leave the device (`StorageTracker.hosted`), which the CPU-hosted trace cannot
    see by itself. ``fake_world``: the trace runs in a fake process group, whose object collectives are answered
    (`preflight._checkpoint.answered_object_collectives`), FSDP1's optimizer given a state for every trained
    parameter first (`preflight._checkpoint.every_parameter_in_state`). ``gathers()``: a context the save runs in
    (the engine's collectives as the job's backend runs them)."""
    if checkpoint is None:
        return None
    from preflight._checkpoint import answered_object_collectives, collect_state, engine_of, every_parameter_in_state

    def save(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        start = len(tracker.events)
        engine = engine_of(model)
        if engine == "fsdp1" and fake_world:
            every_parameter_in_state(optimizer)
        try:
            with answered_object_collectives() if fake_world else contextlib.nullcontext(), \
                    gathers() if gathers is not None else contextlib.nullcontext():
                held = collect_state(model, optimizer, checkpoint, host_is_device=host_is_device)
        except Exception as err:  # noqa: BLE001 - the training step's figure stands; the save's is labelled
            notes.append(f"{SAVE_NOT_TRACED} ({type(err).__name__}: {err})".splitlines()[0][:300])
            return
        born = {e.uid for e in tracker.events[start:] if e.nbytes > 0}
        entries: list[int] = []
        for part, category in (("model", Category.PARAMETERS), ("optimizer", Category.OPTIMIZER_STATE)):
            for t in iter_tensors(held.get(part)):
                uid = tracker.uid_of(t)
                if uid in born and uid not in entries:
                    tracker.label(t, category)
                    entries.append(uid)
        if fake_world:
            notes.append("checkpoint save: the engine's exchanges of Python objects (all_gather_object, "
                         "broadcast_object_list) answered as if every rank were this one")
        moved = [uid for uid in entries if not host_is_device and checkpoint.offload_to_cpu and engine != "plain"]
        if moved:
            tracker.hosted(moved)
            notes.append(f"checkpoint save: the {len(moved)} tensor(s) the full state dict gathered are moved to host "
                         "memory (offload_to_cpu); each is counted on the device until the next is gathered, an upper "
                         "bound of the moment before its copy to the host")
        del held

    return save


@swept
def trace_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    *,
    step: StepFn | None,
    precision: str | None,
    trace_device: torch.device,
    target_device: torch.device,
    steps: int,
    schedule: Loop = Loop(),
    record_op: Callable[[Any, Any], bool] | None = None,
    routing: str = "balanced",
    cuda: CudaTarget | None = None,
    checkpoint: Checkpoint | None = None,
    batches: Sequence[Any] | None = None,
    sweep: Sweep,
) -> TraceResult:
    """Trace ``steps`` training steps on fake tensors (and a checkpoint save after them, in the phase `SAVE_PHASE`,
    when ``checkpoint`` says the run saves). With ``batches``, step ``i`` trains on ``batches[i - 1]`` (``batch`` is
    not used, ``steps`` is their number), each batch counted from its step's start until the next one replaces it.
    Nothing of the trace outlives it (`preflight.trace._leftovers`: ``sweep`` is supplied by the decorator).

    Args:
        record_op: ``record_op(func, args) -> bool``; operators for which it is true are logged with their fake
            arguments in ``op_log`` as ``(op_index, event_index, func, args, kwargs)`` (used to calibrate kernel
            scratch memory); tensors are logged as `TensorSpec`.
        routing: the mixture-of-experts routing assumed where a per-expert loop needs the router's choices
            (`preflight.trace._routing`).
        cuda: the CUDA device a CPU trace stands for (`preflight.cuda`): its autocast lists, attention and
            dropout kernels are applied. Default: when ``target_device`` is CUDA and ``trace_device`` is not, an
            unnamed one (`CudaTarget.of(None)`).

    Raises:
        LossNotFoundError: the step produced no loss (a wrong argument, not a tracing limitation).
        Exception: the user's own exception from their step, with a note (`preflight.trace._blame`).
    """
    start = time.perf_counter()
    op_log: list[tuple[int, int, Any, Any, Any]] = []
    on_op = op_logger(record_op, op_log, lambda: len(tracker.events))
    if cuda is None and target_device.type == "cuda" and trace_device.type != "cuda":
        cuda = CudaTarget.of(None)
    if batches is not None:
        batch, steps = None, len(batches)
    try:
        run = FakeRun(model, batch, precision=precision, trace_device=trace_device, on_op=on_op, routing=routing,
                      sweep=sweep, layouts=target_device.type == trace_device.type == "cpu",
                      cuda=cuda if trace_device.type != "cuda" else None)
    except Exception as err:  # noqa: BLE001 - twins preflight cannot make: a gap in coverage, never the user's error
        return TraceResult(events=[], categories={}, num_ops=0, seconds=time.perf_counter() - start, error=err,
                           failed_op=f"making fake copies of the model and batch ({type(err).__name__})")
    tracker, fake_mode = run.tracker, run.fake_mode
    try:
        fake_opt = clone_optimizer(optimizer, run.twins, foreach=None)
        if target_device.type == "cuda":  # the implementation torch picks for CUDA tensors (a for-loop on CPU)
            cuda_default_impl(fake_opt)
    except Exception as err:  # noqa: BLE001 - an optimizer we cannot rebuild gets the analytic estimate
        run.finish()
        return TraceResult(events=tracker.events, categories=tracker.categories, num_ops=0,
                           seconds=time.perf_counter() - start, error=err,
                           failed_op=f"{type(optimizer).__name__}(param_groups, **defaults)", notes=run.notes)
    if target_device.type == "cuda" and (note := cuda_capturable_off(fake_opt)) is not None:
        run.notes.append(note)
    if target_device.type == "cuda" and getattr(fake_opt, "is_paged", False):
        # bitsandbytes warns that it cannot page on the host the trace runs on; the run's GPU pages (`paged_state`).
        fake_opt._cpu_paged_warned = True
    for st in fake_opt.state.values():
        for key, v in list(st.items()):
            if isinstance(v, torch.Tensor) and v.device.type != "meta" and not isinstance(v, FakeTensor):
                # State some optimizers create in __init__ (Adagrad's step counter): fake it, keep its value.
                st[key] = fake_mode.from_tensor(v)
                tracker.shadow(st[key], v.detach().clone())
            if isinstance(st[key], torch.Tensor):
                tracker.register(st[key], Category.OPTIMIZER_STATE)

    on_phase = phase_bookkeeping(tracker, fake_opt)
    try:
        with run.active(model):
            enter_training(model, schedule)
            run_steps(model, fake_opt, run.batch, step=step, precision=precision, device_type=trace_device.type,
                      steps=steps, schedule=schedule, on_phase=on_phase, before_backward=tracker.watch_backward,
                      save=checkpoint_saver(tracker, checkpoint, host_is_device=target_device.type == "cpu",
                                            fake_world=False, notes=run.notes),
                      batches=None if batches is None else lambda i: run.step_batch(batches[i - 1]),
                      manual=(lambda on_step: manual_optimizers(optimizer, fake_opt, on_step)) if schedule.manual
                      else None)
    except BaseException:
        run.finish()  # the tracker lets go of its callbacks on every way out (`StorageTracker.detach`)
        raise
    bound = []
    if tracker.placeholders_used and needs_closure(fake_opt):
        bound.append(f"{type(optimizer).__name__}.step(closure) decides how many times to evaluate the closure from "
                     f"values computed from the parameters ({tracker.placeholders_used} read); the trace took the "
                     "first exit, so later evaluations and the history they build are not in the figure")
    elif tracker.placeholders_used:
        run.notes.append(f"the optimizer read {tracker.placeholders_used} parameter-dependent value(s); "
                         "placeholders were used (they change arithmetic, not which tensors exist)")
    if tracker.routing.note():
        run.notes.append(tracker.routing.note())
    run.notes.extend(tracker.assumption_notes())
    if tracker.layouts is not None and tracker.layouts.note():
        run.notes.append(tracker.layouts.note())
    paged = paged_state(optimizer, fake_opt, tracker)
    run.finish()
    return TraceResult(
        events=settled_frees(tracker.events),
        categories=tracker.categories,
        num_ops=tracker.num_ops,
        seconds=time.perf_counter() - start,
        error=run.error,
        failed_op=run.failed_op,
        op_log=op_log,
        notes=run.notes,
        lower_bound="; ".join(bound) or None,
        paged=paged,
        outside_bytes=tracker.outside_bytes(),
    )


def paged_state(optimizer: torch.optim.Optimizer, fake_opt: torch.optim.Optimizer,
                tracker: StorageTracker) -> frozenset[int]:
    """The uids of the states a bitsandbytes paged ``optimizer`` allocates with ``F.get_paged`` (CUDA managed
    memory) on a GPU: ``state1`` and ``state2`` of each parameter of `PAGED_MIN_NUMEL` elements or more. Its other
    state (smaller parameters' states, the 8-bit states' block maxima, ``unorm_vec``) is ordinary device memory.
    The trace runs on the host, where bitsandbytes pages nothing, so the rule is applied to the state it made."""
    if not getattr(optimizer, "is_paged", False):
        return frozenset()
    uids = set()
    for p, state in fake_opt.state.items():
        if isinstance(p, torch.Tensor) and p.numel() >= PAGED_MIN_NUMEL:
            for key in ("state1", "state2"):
                if isinstance(state.get(key), torch.Tensor) and (uid := tracker.uid_of(state[key])) is not None:
                    uids.add(uid)
    return frozenset(uids)


def settled_frees(events: list[Event]) -> list[Event]:
    """``events`` with simultaneous frees settled: each run of consecutive frees at one operator is released in
    the order its storages were allocated.

    Storages released together (an autocast weight cache cleared) are freed in the order of a hash map keyed by
    address, which varies between runs and between depths of one model. Frees at one operator with no allocation
    between them change no peak and nothing live at it, and leave the caching allocator the same free blocks in
    any order; a fixed order makes the trace reproducible event for event and regular across depths (the
    depth-independent trace, `preflight.trace._compose`, fits each free to its allocation by position).
    """
    born: dict[int, int] = {}
    out: list[Event] = []
    run: list[Event] = []  # consecutive frees at one operator

    def flush() -> None:
        out.extend(sorted(run, key=lambda f: born.get(f.uid, -1)))
        run.clear()

    for i, e in enumerate(events):
        if e.nbytes < 0:
            if run and (run[0].op, run[0].phase) != (e.op, e.phase):
                flush()
            run.append(e)
        else:
            flush()
            born[e.uid] = i
            out.append(e)
    flush()
    return out


class FakeRun:
    """The fake world one trace runs in: a `FakeTensorMode`, a `StorageTracker`, and fake twins of the model's
    parameters and buffers and of the batch, registered with the tracker (small integer batch tensors keep a
    shadow of their values).

    Use: build it, make any other twins (an optimizer, outside fake mode), run the user's code inside
    ``with run.active(model):`` (errors the trace cannot get past are kept in ``error`` / ``failed_op``; the user's
    own errors, `preflight.trace._blame.is_user_error`, and `LossNotFoundError` are raised), then `finish`. Every
    fake tensor of the run is watched by ``sweep``, which repairs whatever still holds one once the tracing function
    has returned.
    """

    def __init__(self, model: nn.Module, batch: Any, *, precision: str | None, trace_device: torch.device,
                 sweep: Sweep, on_op: Callable[..., None] | None = None, routing: str = "balanced",
                 layouts: bool = False, cuda: CudaTarget | None = None) -> None:
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        # Library operators run as CUDA kernels compose them for a CUDA target and on a GPU host alike.
        self.tracker = StorageTracker(self.fake_mode, on_op=on_op, routing=routing, layouts=layouts,
                                      cuda=cuda is not None or trace_device.type == "cuda")
        sweep.watch(self.tracker.tensors)
        self.tracker.on_adopt = sweep.remember
        self.twins = TwinMaker(self.fake_mode, trace_device, cast_dtype=float_dtype_for(precision))
        self.tracker.twin_of = self.twins.existing
        self.state = self.twins.module_state(model)
        self.batch = self.twins.batch(batch, cast=float_dtype_for(precision) is not None)
        self.notes: list[str] = layer_notes(model, cuda is not None)
        self.cuda = cuda
        self.trace_device = trace_device
        self.what = "the training step"  # what the user's code runs, for the note on an error of theirs
        self.error: BaseException | None = None
        self.failed_op: str | None = None
        optimizers: dict[int, list[torch.optim.Optimizer]] | None = None
        for name, p in model.named_parameters():
            self.tracker.register(self.state[name], Category.PARAMETERS)
            self.tracker.names[self.state[name]] = f"parameter '{name}'"
            if getattr(p, "_post_accumulate_grad_hooks", None) and optimizers is None:
                optimizers = _optimizers_by_parameter()
            carry_parameter_hooks(p, self.state[name], self.notes, sweep, (optimizers or {}).get(id(p), []))
        held = [(name, self.state[name].grad) for name, _ in model.named_parameters()
                if self.state[name].grad is not None]
        for name, grad in held:
            self.tracker.register(grad, Category.GRADIENTS)
            self.tracker.names[grad] = f"gradient of '{name}' held before the run"
        if held:
            self.notes.append(f"{len(held)} parameter(s) held a .grad before the run "
                              f"({sum(g.untyped_storage().nbytes() for _, g in held):,} B): counted from the start, "
                              "as the run holds them until its loop sets them to None")
        for path, twin in self.twins.carried:  # a quantised weight's state (absmax, code): held with the weight
            self.tracker.register(twin, Category.PARAMETERS)
            self.tracker.names[twin] = f"quantisation state {path}"
        for name, buffer in model.named_buffers():
            self.tracker.register(self.state[name], Category.BUFFERS)
            self.tracker.names[self.state[name]] = f"buffer '{name}'"
            if (value := shadow_value(buffer)) is not None:  # a flag or counter the forward reads (`if self.on[0]:`)
                self.tracker.shadow(self.state[name], value)
        self._register_batch(batch, self.batch)
        self._twin_args = (trace_device, float_dtype_for(precision))

    def _register_batch(self, batch: Any, fake_batch: Any, values: list[Any] | None = None) -> None:
        """Count ``fake_batch`` as the inputs, with the value shadows of ``batch``'s small integer tensors
        (``values``, made outside any mode, else here)."""
        named = list(named_tensors(batch))
        values = [shadow_value(real) for _, real in named] if values is None else values
        for (path, _), fake, value in zip(named, iter_tensors(fake_batch), values):
            self.tracker.register(fake, Category.INPUTS)
            self.tracker.names[fake] = f"the batch{path}"
            if value is not None:
                self.tracker.shadow(fake, value)

    def step_batch(self, batch: Any) -> Any:
        """A fresh twin of ``batch`` counted as inputs from now on (`trace_steps`'s ``batches``): not kept by the
        run, so it is freed with the step's last reference to it, as a loader's batch is. Made while the trace
        runs, outside its modes (the user's tensors are read, never traced)."""
        device, cast = self._twin_args
        with _disable_current_modes():
            fake = TwinMaker(self.fake_mode, device, cast_dtype=cast).batch(batch, cast=cast is not None)
            values = [shadow_value(real) for _, real in named_tensors(batch)]
        self._register_batch(batch, fake, values)
        return fake

    @contextlib.contextmanager
    def active(self, model: nn.Module) -> Iterator[None]:
        """Run the user's code with its module reparametrized to the twins, under fake mode and the tracker (and
        the CUDA target's semantics when ``cuda`` is set)."""
        if self.cuda is not None:
            emulation = emulate_cuda(self.cuda, self.tracker)
        elif self.trace_device.type == "cuda":  # pragma: no cover - needs a GPU
            emulation = device_backward_scratch(self.trace_device)
        else:
            emulation = contextlib.nullcontext()
        emulated = user_error = None
        # Once the user's code has returned or is unwinding, a Ctrl-C waits until the model is put back. Dynamo is
        # kept out before anything else and restored last: no frame of the user's is seen by it under the tracker.
        with interrupts.finishing(begun=False) as finishing, dynamo_kept_out(model) as compiled, \
                preserved_state(model, self.notes), real_run_paths(self.notes, self.tracker.host_array), \
                longest_generation(self.tracker, self.notes), handled_fake_tensor_errors(), \
                emulation as emulated, self.fake_mode, self.tracker, self.tracker.outside_modules(model), \
                counted_rng_snapshots(self.tracker, host=self.cuda is None), \
                cuda_training_paths(self.tracker, self.cuda is not None), \
                _reparametrize_module(model, self.state, tie_weights=True, strict=False), \
                partitioned_forwards(compiled, self.tracker):
            try:
                yield
            except (LossNotFoundError, StepWouldFailError):
                raise
            except Exception as err:  # noqa: BLE001 - any failure of the user's code under fake tensors is reported
                if kernel_dtype_error(err):  # torch's own check, made before dispatch: the real step raises it too
                    raise StepWouldFailError(f"The training step would fail at its first step: {err} ("
                                             f"{failed_op_of(err)}). Fix: cast one to the other's dtype. No memory "
                                             "was predicted: a step that fails has no peak.") from err
                if (failure := mixed_dtensor_failure(err, failed_op_of(err))) is not None:
                    raise StepWouldFailError(failure) from err
                if is_user_error(err):  # the real step raises it too: the user's, not a limit of the trace
                    user_error = err
                else:
                    self.error, self.failed_op = err, failed_op_of(err)
            finally:
                finishing()
                if emulated is not None:
                    self.notes.extend(emulated.notes())
        self.notes.extend(compiled_notes(compiled))
        if user_error is not None:  # raised once the model is restored (which would undo a note on its objects)
            raise mark_user_error(user_error, self.what)

    def finish(self) -> None:
        """Stop listening for frees: the events after the user's code are not part of any peak."""
        self.tracker.detach()


@contextlib.contextmanager
def counted_rng_snapshots(tracker: StorageTracker, *, host: bool) -> Iterator[None]:
    """Count the CPU generator's state each ``torch.get_rng_state()`` of the traced code returns, for as long as
    the snapshot lives, when the target is the host: activation checkpointing keeps one per checkpointed region
    from its forward to its recomputation (``preserve_rng_state``, ``torch/utils/checkpoint.py``), 5,056 bytes of
    host memory each that no operator allocates. On a CUDA target the snapshots (of the CUDA generators too) are
    host memory and not counted. Only the tracing thread's calls count."""
    if not host:
        yield
        return
    real_get = torch.get_rng_state
    held: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def get_rng_state() -> torch.Tensor:
        state = real_get()
        if _get_current_dispatch_mode() is tracker:
            # A stand-in of the snapshot's size, allocated as an operator of the trace, freed with the snapshot.
            held[state] = torch.empty(state.untyped_storage().nbytes(), dtype=torch.uint8, device="cpu")
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = real_get


def carry_parameter_hooks(real: torch.Tensor, twin: torch.Tensor, notes: list[str], sweep: Sweep,
                          optimizers: list[torch.optim.Optimizer]) -> None:
    """Give ``twin`` the hooks the user put on the parameter ``real``: gradient hooks (``register_hook``) as they
    are, and post-accumulate-grad hooks (the optimizer step fused into backward, torch's tutorial
    "How to save memory by fusing the optimizer step into the backward pass") called with ``real``, whose ``.grad``
    is the twin's fake gradient while the hook runs: a hook looks its optimizer up by the real parameter, and that
    optimizer's work on it runs on the twin (`StorageTracker._adopt`). What the hook leaves in ``.grad`` (None after
    ``zero_grad``) becomes the twin's; the real parameter's gradient is put back, and so are the optimizers'
    ``state`` tables over ``real`` (the entries the hook's optimizer created are removed after the trace)."""
    for hook in list((getattr(real, "_backward_hooks", None) or {}).values()):
        twin.register_hook(hook)
    hooks = list((getattr(real, "_post_accumulate_grad_hooks", None) or {}).values())
    if not hooks or not twin.requires_grad:
        return
    tables = [opt.state for opt in optimizers]
    had = [real in table for table in tables]

    def put_back_state() -> list[str]:
        added = [table for table, present in zip(tables, had) if not present and real in table]
        for table in added:
            del table[real]
        return []

    sweep.after(put_back_state)

    def on_real(fake: torch.Tensor) -> None:
        saved = real.grad
        try:
            real.grad = fake.grad
        except RuntimeError as err:  # the real parameter lives on another device than the trace
            notes.append(f"a post-accumulate-grad hook on a parameter could not run in the trace ({err}); what it "
                         "frees or allocates in backward is not in the figure")
            return
        try:
            for hook in hooks:
                hook(real)
            fake.grad = real.grad if isinstance(real.grad, FakeTensor) else None
        finally:
            real.grad = saved

    twin.register_post_accumulate_grad_hook(on_real)


def _optimizers_by_parameter() -> dict[int, list[torch.optim.Optimizer]]:
    """The live optimizers of each parameter, by the parameter's id: what post-accumulate-grad hooks step (one
    optimizer per parameter in torch's tutorial). One pass over the garbage collector's objects."""
    import gc
    import warnings

    found: dict[int, list[torch.optim.Optimizer]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on lazily imported objects may warn
        optimizers = [o for o in gc.get_objects() if isinstance(o, torch.optim.Optimizer)]
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                found.setdefault(id(p), []).append(opt)
    return found


def shadow_value(t: Any) -> torch.Tensor | None:
    """The values a batch tensor's twin carries as its shadow (`can_shadow`): a copy of ``t`` (the model may write
    into its batch, ``labels[mask] = -100``, and the shadow runs that for real), or for a planned tensor
    (`preflight._device.planned`) its constant; None for a tensor without one."""
    if not can_shadow(t):
        return None
    if t.device.type == "meta":  # at most SHADOW_MAX_NUMEL elements, like any shadow
        return torch.full(tuple(t.shape), planned_fill(t), dtype=t.dtype)
    return t.detach().to("cpu", copy=True)


def can_shadow(t: Any) -> bool:
    """Whether a real batch tensor or buffer keeps a value shadow in the trace: small integer tensors (ids, masks,
    flags, counters)."""
    return (
        isinstance(t, torch.Tensor)
        and (t.device.type != "meta" or planned_fill(t) is not None)
        and not t.is_floating_point()
        and not t.is_complex()
        and t.numel() <= SHADOW_MAX_NUMEL
    )


@contextlib.contextmanager
def preserved_state(model: nn.Module, notes: list[str]) -> Iterator[None]:
    """Restore the model (attributes, hook tables, flags: `preflight.trace._restore`) on exit, and keep the process
    as it was (random streams, global hooks and flags, outer modes: `preflight.trace._process`); ``notes`` gets
    what was suspended or put back."""
    with isolated_process(notes), restored_module(model), isolated_rng(notes):
        yield
