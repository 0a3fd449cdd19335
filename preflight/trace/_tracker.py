"""Track live tensor storages while operators run, and know the values of small input-derived tensors.

`StorageTracker` is a `TorchDispatchMode` entered inside a `FakeTensorMode`. It sees every operator before the
fake mode does and records, for each new storage an operator returns, one allocation event; a
``weakref.finalize`` on the storage records the matching free. Replaying the events gives the live-bytes curve
and its peak, which on CPU matched the profiler's allocator events to within a few hundred bytes
(``shared/notes/feasibility.md``).

It also carries *value shadows*: real copies of small integer tensors from the batch (token ids, attention
masks) and of whatever is computed from them alone. When the model asks for a value that a fake tensor cannot
give (``mask.all().item()``, ``nonzero``), the shadow answers, so the trace takes the same branch the real run
takes instead of failing or taking a "tracing" path. Shadows never hold more than `SHADOW_MAX_NUMEL` elements
per tensor.

Tensors made from host data (``torch.tensor(ndarray)``, lists, ``arange``, ``full``) have known values and are
shadowed too; a boolean mask with a shadow can index (``x[mask]``), in forward and backward. Small draws of
uniform random operators (``torch.rand([]) < layerdrop``) get a synthetic shadow at the top of their range, so
the trace takes the worst case for memory (every LayerDrop layer kept); `assumption_notes` says where that was read.

Two more stated assumptions about values computed from parameters, each named with its line in `assumption_notes`:
``x.all()`` over them is True (sanity checks of a healthy run: ``if not torch.isfinite(h).all()``, and
torch.distributions' argument checks), and handed
to NumPy they are zeros (DETR's Hungarian matching in scipy: the matches' count, not their values, sizes memory).

Known limitations: allocations inside kernels (convolution workspaces, library scratch) are invisible here;
`preflight._scratch` calibrates them. Other data-dependent control flow on values computed from parameters
stops the trace, except mixture-of-experts routing, which follows a stated assumption
(`preflight.trace._routing`); the failing exception then carries the operator and the user's line that asked
for the value (`failed_op_of`). Normal draws (``randn``) have no top of range and get no synthetic shadow.
"""

from __future__ import annotations

import dis
import itertools
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary, WeakTensorKeyDictionary

from preflight.trace import _interrupts as interrupts
from preflight.trace._fake_kernels import COMPOSITES, FAKE_KERNELS
from preflight.trace._library_kernels import composite_kernel
from preflight._device import OutsideModules, model_device
from preflight._errors import StepWouldFailError
from preflight.trace._frames import failure_site, user_frame
from preflight.trace._in_place import IN_PLACE_IN_BACKWARD
from preflight.trace._layouts import LayoutCalibration
from preflight.trace._packed import EMPTY, PACK, host_lengths, pack_padded_sequence
from preflight.trace._sparse import CONSTRUCT, SparseShadows, constructed, is_sparse, sparse_call
from preflight._result import Category, Event
from preflight.trace._routing import RoutingShadows
from preflight.trace._step_checks import STEP_CHECKS

__all__ = ["StorageTracker", "SHADOW_MAX_NUMEL", "failed_op_of"]

# Large enough for a 4-D attention mask of a few thousand tokens, small enough to cost little real memory.
SHADOW_MAX_NUMEL = 1 << 24

# Operators whose output shape or Python result depends on tensor values: they need a shadow to run.
_DATA_DEPENDENT = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.item.default,  # reaches the tracker whole when called below autograd (a library's kernel)
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.repeat_interleave.Tensor,
    torch.ops.aten.equal.default,
    torch.ops.aten.allclose.default,
}


_SCALAR_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
                 torch.ops.aten.is_nonzero.default}


def _placeholder(func: Any, args: Any) -> Any:
    if func is torch.ops.aten.is_nonzero.default:
        return True
    dtype = args[0].dtype
    return True if dtype is torch.bool else (1.0 if dtype.is_floating_point or dtype.is_complex else 1)


class StorageTracker(TorchDispatchMode):
    """Record allocation and free events of tensor storages, and shadow small input-derived values.

    Args:
        fake_mode: the `FakeTensorMode` the trace runs under (used to make fake outputs of shadowed
            data-dependent operators).
        on_op: optional callback ``on_op(index, func, args, kwargs, out)`` after each operator, for
            kernel-scratch bookkeeping.
        routing: the mixture-of-experts routing assumed for router selections on unknown values
            (`preflight.trace._routing`).

    Attributes:
        events: allocation (``nbytes > 0``) and free (``nbytes < 0``) events in order.
        categories: category of each storage ``uid`` (updated by `label`).
        phase: the current phase name, stamped on events.
        num_ops: operators seen so far.
    """

    def __init__(self, fake_mode: Any, on_op: Callable[..., None] | None = None, routing: str = "balanced",
                 layouts: bool = False, cuda: bool = False) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        # Library operators run as the target's kernel composes them (`preflight.trace._library_kernels`).
        self.cuda = cuda
        self._composites: dict[Any, Any] = {}
        self._composing: set[Any] = set()
        self._kernel_notes: dict[str, int] = {}
        # The real CPU kernel's output layouts (`preflight.trace._layouts`): only meaningful when the target is the CPU.
        self.layouts = LayoutCalibration() if layouts else None
        self.on_op = on_op
        self.events: list[Event] = []
        self.categories: dict[int, Category] = {}
        self.phase = "setup"
        self.phase_category = Category.TEMPORARIES
        self.num_ops = 0
        self.last_op: str | None = None
        self.failed_op: str | None = None  # the innermost operator that raised
        self.placeholders_allowed = False
        self.placeholders_used = 0
        self._uids: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [uid of its current block]
        self._sizes: dict[int, int] = {}  # uid -> bytes currently counted
        self._counter = itertools.count()
        self._finalizers: list[weakref.finalize] = []
        self._shadows: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # fake tensor -> real tensor
        self._between_nodes = False  # the autograd engine is accumulating a node's outputs: `watch_backward`
        self._node_in_place: frozenset[Any] | None = None  # what the running node writes in place (`_in_place`)
        self._node_made: set[int] = set()  # the storages the running node's formula made (its temporaries)
        self._in_place: tuple | None = None  # an in-place accumulation, confirmed at the next operator
        self._last_product: tuple[int | None, Any] = (None, None)  # (uid, call site) of the last mm/bmm
        # Every fake tensor seen, by identity (a WeakSet would compare tensors with ==): `preflight.trace._leftovers`.
        self.tensors: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.routing = RoutingShadows(routing, SHADOW_MAX_NUMEL)
        self._drawn: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # fake tensor -> site of its random draw
        self._draw_reads: dict[tuple[str, str], int] = {}  # (draw site, read site) -> reads
        self._host_reads: dict[str, int] = {}  # line -> fake tensors of unknown values read into NumPy there
        # What the user calls the tensors that exist before the step ("parameter 'lm_head.weight'"): error messages.
        self.names: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.paused = False  # pass operators through unrecorded: capturing a compiled graph allocates nothing real
        self.unrecorded = False  # the running operator's outputs never exist in the real run (fused by inductor)
        # Real tensors the user's code hands to an operator (a counter on ``self``, a module-level tensor, a loss
        # module's buffer) run as fake twins: `_adopt`. ``twin_of`` finds an existing twin (a parameter of the
        # user's optimizer outside the model); ``on_adopt(real, fake)`` lets the leftover sweep put the real back.
        self.twin_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None
        self.on_adopt: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        self._adopted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(real) -> (real, its fake twin)
        self._external: set[int] = set()  # uids of adopted twins: memory that exists outside the trace, uncounted
        # The modules outside the model that the step calls (a distillation teacher, a reference model), whose
        # parameters and buffers sit on the device for the whole run (`outside_modules`): [modules, bytes].
        self._outside = [0, 0]
        self._outside_modules: OutsideModules | None = None
        self._borrowed: set[int] = set()  # ids of shadows that are the user's own tensors: read, never written
        self._host: set[int] = set()  # uids of host copies on a CUDA target (`to_host`)
        # Real host tensors the trace made for kernels that use their pointers (`_host_tensor`) -> their twins.
        self._host_reals = WeakTensorKeyDictionary()
        self.sparse = SparseShadows()  # the real indices of sparse gradients (`preflight.trace._sparse`)

    # ---- storages -------------------------------------------------------------------------------------------

    def register(self, tensor: torch.Tensor, category: Category) -> int | None:
        """Count a tensor that exists before the trace (a parameter, buffer, batch tensor or optimizer state)."""
        return self._track(tensor, category, op=-1)

    def uid_of(self, tensor: torch.Tensor) -> int | None:
        """The uid of ``tensor``'s storage, if tracked (for a wrapper subclass such as a DTensor: its first inner
        tensor's)."""
        inner = _inner_tensors(tensor)
        if inner is not None:
            return next((uid for uid in map(self.uid_of, inner) if uid is not None), None)
        try:
            holder = self._uids.get(tensor.untyped_storage())
        except (NotImplementedError, RuntimeError):
            return None
        return None if holder is None else holder[0]

    def bytes_of(self, tensors: Any) -> int:
        """The bytes of the distinct tracked storages of ``tensors`` (an iterable of tensors)."""
        uids = {self.uid_of(t) for t in tensors}
        return sum(self._sizes.get(uid, 0) for uid in uids if uid is not None)

    def label(self, tensor: torch.Tensor, category: Category) -> None:
        """Put ``tensor``'s storage in ``category`` (e.g. a gradient once it lands in ``param.grad``)."""
        uid = self.uid_of(tensor)
        if uid is not None:
            self.categories[uid] = category

    def resized(self, tensor: torch.Tensor, category: Category | None = None) -> None:
        """Record that ``tensor``'s storage was resized in place outside any operator (``storage.resize_``, as FSDP2
        frees and re-allocates its all-gather outputs); the new block gets ``category`` (default: the old one's)."""
        uid = self._track(tensor, self.phase_category, self.num_ops)
        if uid is not None and category is not None:
            self.categories[uid] = category

    def _track(self, tensor: torch.Tensor, category: Category, op: int) -> int | None:
        inner = _inner_tensors(tensor)
        if inner is not None:  # a wrapper subclass (DTensor): its memory is its inner tensors'
            uids = [self._track(t, category, op) for t in inner]
            return next((uid for uid in uids if uid is not None), None)
        fake = _is_fake(tensor)
        if tensor.device.type == "meta" and not fake:
            return None
        if fake:
            self.tensors[tensor] = None
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse or other storage-less tensors
            return None
        nbytes = storage.nbytes()
        holder = self._uids.get(storage)
        if holder is not None:
            uid = holder[0]
            if nbytes != self._sizes[uid]:
                # Resized in place (resize_, set_, out= ops): the allocator allocates a new block, copies, and
                # frees the old one; record that, under a new uid (the allocator simulation needs one per block).
                holder[0] = self._new_uid(nbytes, self.categories[uid], op)
                self._release(uid)
            return holder[0]
        holder = [self._new_uid(nbytes, category, op)]
        self._uids[storage] = holder
        self._finalizers.append(weakref.finalize(storage, self._free, holder))
        return holder[0]

    def _new_uid(self, nbytes: int, category: Category, op: int) -> int:
        uid = next(self._counter)
        self._sizes[uid] = nbytes
        self.categories[uid] = category
        self.events.append(Event(uid, nbytes, op, self.phase))
        return uid

    def hosted(self, uids: list[int]) -> None:
        """Take storages the traced code moved to host memory off the device (a checkpoint's entries, gathered one
        after another and copied to the host): in the order they were allocated, each is freed just before the next
        one's allocation (the last: now), and its later free is not recorded. A trace for a CUDA target runs on CPU
        tensors, where such a copy is no copy at all."""
        wanted = set(uids)
        positions = sorted((i, e.uid) for i, e in enumerate(self.events) if e.nbytes > 0 and e.uid in wanted
                           and e.uid in self._sizes)
        ends = [i for i, _ in positions[1:]] + [len(self.events)]
        for (_, uid), end in reversed(list(zip(positions, ends))):
            op = self.events[end - 1].op
            self.events.insert(end, Event(uid, -self._sizes[uid], op, self.phase))
            self._external.add(uid)

    def to_host(self, tensor: torch.Tensor) -> int:
        """Take ``tensor``'s storage, just allocated by the traced code, off the device: a copy made in host memory,
        which a trace for a CUDA target cannot tell from the device's (an activation a saved-tensor hook offloads,
        `preflight.cuda._offload`). Its allocation is forgotten and its free will not be recorded; returns its
        bytes."""
        uid = self.uid_of(tensor)
        if uid is None or uid in self._external:
            return 0
        at = next((i for i in range(len(self.events) - 1, -1, -1)
                   if self.events[i].uid == uid and self.events[i].nbytes > 0), None)
        if at is not None:
            del self.events[at]
        self._external.add(uid)
        self._host.add(uid)
        return self._sizes.get(uid, 0)

    def on_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage was taken off the device by `to_host`."""
        return self.uid_of(tensor) in self._host

    def _free(self, holder: list[int]) -> None:
        self._release(holder[0])

    def _release(self, uid: int) -> None:
        nbytes = self._sizes.pop(uid, 0)
        if nbytes and uid not in self._external:
            self.events.append(Event(uid, -nbytes, self.num_ops, self.phase))

    def detach(self) -> None:
        """Stop listening for frees (after the trace; the remaining storages die with the fake mode)."""
        if self._in_place is not None:
            self._settle_in_place()
        for fin in self._finalizers:
            fin.detach()
        self._finalizers.clear()
        self._adopted.clear()
        self._borrowed.clear()
        # The caller's operator callback usually closes over this tracker: drop it, so that the tracker and its fake
        # mode die by reference counting when the trace returns, not in a later garbage collection that runs their
        # finalizers (Python code) wherever the user's program happens to be, outside `deferred_interrupts`.
        self.on_op = None

    # ---- gradient accumulation ----------------------------------------------------------------------------
    #
    # When two gradient contributions meet in a node's input buffer, the autograd engine adds them in place
    # into the first (``old_var.add_(var)``) if it holds the only reference to that tensor and its storage and
    # the tensor is a plain, dense one; otherwise it allocates ``old_var + var``
    # (torch/csrc/autograd/input_buffer.cpp, ``accumulate`` / ``can_accumulate_inplace``). A fake tensor is a
    # tensor subclass, so in the trace the engine always allocates: an extra buffer the plain run does not
    # have (measured: +5% on Mamba's reference scan). The engine accumulates between one node's post-hooks and
    # the next node's pre-hooks, so hooks on every node of the graph tell this tracker when an ``add`` is the
    # engine's; the sum then takes over the first operand's storage, as in the plain run. If that operand is
    # still alive at the next operator, the engine did not hold the only reference: the sum is counted as the
    # new allocation it then is.
    #
    # ``at::linear`` does the same (``aten/src/ATen/native/Linear.cpp``): an input it cannot flatten into one
    # ``addmm`` (a non-contiguous one: ``nn.MultiheadAttention(batch_first=True)``'s in-projection, a linear after a
    # ``transpose``) goes through ``matmul`` and adds the bias with ``output.add_(bias)``, or with
    # ``at::add(output, bias)`` when the bias is "subclass-like", which every tensor is while a dispatch mode runs.
    # The trace would hold the product and the sum at once where the plain run holds one (+1.5% to +2.4% on a
    # batch-first attention block with two micro-batches accumulated). `_linear_bias_add` recognises that ``add``:
    # its first operand is the product an ``mm`` or ``bmm`` just made, dispatched from the same Python call (one C++
    # function made both; a ``+`` written in Python is an instruction of its own), and its second is a 1-D bias.

    def watch_backward(self, loss: torch.Tensor) -> None:
        """Hook every node of ``loss``'s graph so the engine's gradient accumulation is recognised."""
        def entering(writes_in_place: frozenset[Any] | None) -> Callable[..., None]:
            def hook(*_: Any) -> None:
                self._between_nodes = False
                self._node_in_place = writes_in_place
                self._node_made = set()
            return hook

        def leaving(*_: Any) -> None:
            self._between_nodes = True
            self._node_in_place = None
            self._node_made = set()

        seen: set[Any] = set()
        stack = [loss.grad_fn] if loss.grad_fn is not None else []
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            node.register_prehook(entering(IN_PLACE_IN_BACKWARD.get(node.name())))
            node.register_hook(leaving)
            stack.extend(n for n, _ in node.next_functions if n is not None and n not in seen)

    def end_backward(self) -> None:
        self._between_nodes = False
        self._node_in_place = None
        self._node_made = set()

    def _in_place_in_plain_run(self, func: Any, args: Any, kwargs: dict) -> str | None:
        """Whether ``func`` writes into its first operand in the plain run, where a dispatch mode sees it out of
        place, and why: ``"engine"`` (the engine's accumulation), ``"linear"`` (linear's bias add), ``"formula"``
        (a backward formula's, `preflight.trace._in_place`, on a tensor the formula itself made)."""
        if (self._node_in_place is not None and func in self._node_in_place and not torch.is_grad_enabled()
                and args and isinstance(args[0], torch.Tensor) and self.uid_of(args[0]) in self._node_made):
            return "formula"
        if func is torch.ops.aten.add.Tensor:
            if self._between_nodes and not torch.is_grad_enabled() and isinstance(args[1], torch.Tensor):
                return "engine"
            if self._linear_bias_add(func, args, kwargs):
                return "linear"
        return None

    def _linear_bias_add(self, func: Any, args: Any, kwargs: dict) -> bool:
        """Whether ``func(*args)`` is ``at::linear``'s bias ``add`` on its own product (see above)."""
        if func is not torch.ops.aten.add.Tensor or kwargs or len(args) != 2 or self._last_product[0] is None:
            return False
        product, bias = args
        if not (isinstance(bias, torch.Tensor) and bias.dim() == 1 and isinstance(product, torch.Tensor)
                and product.dim() >= 2 and product.shape[-1] == bias.shape[0]):
            return False
        uid, site = self._last_product
        if self.uid_of(product) != uid:
            return False
        here = _call_site()
        return here is not None and here == site and _calls(here)

    def _accumulate_in_place(self, args: Any, out: Any, index: int, why: str) -> bool:
        old = args[0]
        if not (isinstance(old, torch.Tensor) and _is_fake(old) and isinstance(out, torch.Tensor) and _is_fake(out)
                and old._base is None
                and out.shape == old.shape and out.dtype == old.dtype and out.device == old.device
                and is_non_overlapping_and_dense_or_false(old)):
            return False
        try:
            old_storage, new_storage = old.untyped_storage(), out.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return False
        old_holder = self._uids.get(old_storage)
        if old_holder is None or old_storage.nbytes() != new_storage.nbytes():
            return False
        # The sum takes over the old storage's block: the old storage's end frees nothing, the sum's end frees it.
        new_holder = [old_holder[0]]
        old_holder[0] = -1
        self._uids[new_storage] = new_holder
        self._finalizers.append(weakref.finalize(new_storage, self._free, new_holder))
        self.tensors[out] = None
        if why != "formula":  # a formula writes into its own temporary in the plain run, whoever else holds it
            self._in_place = (weakref.ref(old_storage), new_storage, old_holder, new_holder, index, len(self.events))
        return True

    def _settle_in_place(self) -> None:
        old_ref, new_storage, old_holder, new_holder, index, position = self._in_place
        self._in_place = None
        if old_ref() is None:
            return  # the engine held the only reference: accumulated in place
        # Still referenced elsewhere: the plain run allocates the sum too. Give each storage its own block.
        old_holder[0] = new_holder[0]
        uid = next(self._counter)
        nbytes = new_storage.nbytes()
        self._sizes[uid] = nbytes
        self.categories[uid] = self.categories[old_holder[0]]
        self.events.insert(position, Event(uid, nbytes, index, self.phase))
        new_holder[0] = uid

    # ---- value shadows --------------------------------------------------------------------------------------

    def shadow(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """Remember that ``fake`` holds the values of ``real`` (a small CPU tensor)."""
        if real.numel() <= SHADOW_MAX_NUMEL:
            self._shadows[fake] = real

    def answer(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """Give ``fake`` the values of ``real`` as a stated assumption (`preflight.trace._generation`), replacing any
        shadow it had, synthetic routing values included."""
        self.shadow(fake, real)
        self.routing.forget(fake)

    def _real_args(self, args: Any, kwargs: dict) -> tuple[bool, Any, Any]:
        known = True

        def to_real(x: Any) -> Any:
            nonlocal known
            if isinstance(x, torch.Tensor):
                if not _is_fake(x):
                    if x.device.type == "meta" or _inner_tensors(x) is not None:  # a DTensor of fakes: unknown
                        known = False
                    return x  # a real tensor (a constant the model made) is its own value
                real = self._shadows.get(x)
                if real is None:
                    known = False
                return real
            if isinstance(x, torch.device) and x.type != "cpu":
                return torch.device("cpu")
            return x

        real_args = tree_map(to_real, args)
        real_kwargs = tree_map(to_real, kwargs)
        return known, real_args, real_kwargs

    def _run_real(self, func: Any, args: Any, kwargs: dict) -> tuple[bool, Any]:
        """Run ``func`` on the shadows of its tensor arguments, if every one has a shadow."""
        if torch.Tag.nondeterministic_seeded in func.tags:
            return False, None
        if func._schema.is_mutable and any(
            isinstance(a, torch.Tensor) and not _is_fake(a) for a in tree_flatten((args, kwargs))[0]
        ):
            return False, None  # never write to a real tensor of the user's
        known, real_args, real_kwargs = self._real_args(args, kwargs)
        if not known:
            return False, None
        if self._borrowed and func._schema.is_mutable and any(
                id(self._shadows.get(a)) in self._borrowed for a in _written(func, args, kwargs)):
            return False, None  # the shadow is the user's own tensor: never written
        with _disable_current_modes():
            try:
                return True, func(*real_args, **real_kwargs)
            except Exception:  # a shadow is an optimisation: when it cannot run, the value is just unknown
                return False, None

    # ---- dispatch -------------------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if interrupts.requested() and _computes(func):
            # A safe point for a deferred Ctrl-C (`preflight.trace._interrupts`): before an operator that computes
            # a tensor. Not before a metadata query (``prim.device``, ``sym_size``): C++ asks those from accessors
            # that cannot carry an exception (raising there aborts the process).
            interrupts.check()
        kwargs = kwargs or {}
        if self.paused:  # a graph being captured (`preflight.trace._compiled`), not a step running
            return func(*args, **kwargs)
        index = self.num_ops
        self.num_ops += 1
        self.last_op = str(func)
        if self._in_place is not None and func not in _METADATA:  # a query inside the same call settles nothing
            self._settle_in_place()
        if func not in _LIFTS:  # a lift's real argument is a constant the step just made (torch.tensor(0.0))
            args, kwargs = self._adopt(args, kwargs)
        composite = self._composite(func)
        if composite is not None:  # its operators are traced one by one
            run, note = composite
            text = note(*args, **kwargs)
            if text is not None:
                self._kernel_notes[text] = self._kernel_notes.get(text, 0) + 1
            with self:
                return run(*args, **kwargs)
        try:
            out = self._dispatch(func, args, kwargs)
        except Exception as exc:
            self.failed_op = self.failed_op or str(func)
            _mark_failure(exc, func, self.phase)
            raise
        if self.unrecorded:
            pass
        elif not ((why := self._in_place_in_plain_run(func, args, kwargs))
                  and self._accumulate_in_place(args, out, index, why)):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    uid = self._track(t, self.phase_category, index)
                    if self._node_in_place is not None and uid is not None:
                        self._node_made.add(uid)
            self.sparse.release()
            if func in _PRODUCTS and isinstance(out, torch.Tensor):
                self._last_product = (self.uid_of(out), _call_site())
        if self.on_op is not None:
            self.on_op(index, func, args, kwargs, out)
        return out

    def _composite(self, func: Any) -> Any:
        if func in self._composing:  # the operator itself, called from inside its composite
            return None
        if func not in self._composites:
            torch_composite = COMPOSITES.get(func)
            self._composites[func] = (self._composed(func, torch_composite), _no_note) \
                if torch_composite is not None else composite_kernel(func, self.cuda)
        return self._composites[func]

    def _composed(self, func: Any, run: Callable[..., Any]) -> Callable[..., Any]:
        def composed(*args: Any, **kwargs: Any) -> Any:
            self._composing.add(func)
            try:
                return run(*args, **kwargs)
            finally:
                self._composing.discard(func)
        return composed

    def _adopt(self, args: Any, kwargs: dict) -> tuple[Any, dict]:
        """``args`` and ``kwargs`` with every real tensor replaced by its fake twin, so that no operator of the trace
        reads or writes the user's memory: ``self.seen += n``, ``GLOBAL.add_(1)`` or a loss module's running
        statistics run on the twin, and the user's tensor keeps its value. The twin stands for memory that exists
        before the step and is not counted (as the real tensor was not); it carries the real values as its
        shadow, so data-dependent reads still see them."""
        flat, spec = tree_flatten((args, kwargs))
        if not any(_adoptable(x) for x in flat):
            return args, kwargs
        fresh = []
        for i, x in enumerate(flat):
            if not _adoptable(x):
                continue
            held = self._adopted.get(id(x))
            if held is not None:
                flat[i] = held[1]
                continue
            if x in self._host_reals:  # the trace's own host tensor (`_host_tensor`), not the user's
                flat[i] = self._host_twin(x)
                continue
            fake = self.twin_of(x) if self.twin_of is not None else None
            if fake is None:
                fake = self.fake_mode.from_tensor(x)
                self._adopt_storage(fake)
                if x.numel() <= _ADOPT_COPY_NUMEL or (not x.is_floating_point() and x.numel() <= SHADOW_MAX_NUMEL):
                    with _disable_current_modes():
                        self._shadows[fake] = x.detach().to("cpu", copy=True)
                elif x.device.type == "cpu":
                    # Too large to copy: its values are read from the user's tensor, which is never written.
                    self._shadows[fake] = x
                    self._borrowed.add(id(x))
            self._adopted[id(x)] = (x, fake)
            self.tensors[fake] = None
            fresh.append((x, fake))
            flat[i] = fake
        for real, fake in fresh:
            if self.on_adopt is not None:
                self.on_adopt(real, fake)
        return tree_unflatten(flat, spec)

    def outside_modules(self, model: nn.Module, *also: nn.Module) -> OutsideModules:
        """While the user's code runs: count the parameters and buffers of the modules it calls outside ``model``
        and ``also`` (an engine's copy of it) on ``model``'s device (`preflight._device.OutsideModules`), each from its module's first call on, as
        parameters: they stay on the device for the whole run. `outside_bytes` sums them."""
        self._outside_modules = OutsideModules(nn.ModuleList([model, *also]), model_device(model),
                                               on_new=self._outside_called, where=user_frame)
        return self._outside_modules

    def _outside_called(self, nbytes: int, module: nn.Module) -> None:
        uid = next(self._counter)
        self._sizes[uid] = nbytes
        self.categories[uid] = Category.PARAMETERS
        self.events.append(Event(uid, nbytes, self.num_ops, self.phase))  # never freed: it outlives the trace
        self._outside[0] += 1
        self._outside[1] += nbytes

    def outside_bytes(self) -> int:
        """The bytes of the modules outside the model that the step called (`outside_modules`)."""
        return self._outside[1]

    def _adopt_storage(self, fake: torch.Tensor) -> None:
        try:
            storage = fake.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return
        if self._uids.get(storage) is not None:  # a view of a tensor adopted before
            return
        uid = next(self._counter)
        self._sizes[uid] = storage.nbytes()
        self.categories[uid] = Category.BUFFERS
        self._external.add(uid)
        self._uids[storage] = [uid]

    def _dispatch(self, func: Any, args: Any, kwargs: dict) -> Any:
        check = STEP_CHECKS.get(func)
        if check is not None:
            with _disable_current_modes():  # the checks compute on real shadows and stand-ins
                check(self, func, args, kwargs)  # raises StepWouldFailError where the real kernel would raise
        if func is torch.ops.aten.index.Tensor:
            args = self._expand_mask_indices(args)
        if func is torch.ops.aten._ctc_loss.Tensor and args[3] in self._shadows:
            return self._ctc_loss(args)
        if func is torch.ops.aten.masked_select.default and args[1] in self._shadows and args[0] not in self._shadows:
            return self._masked_select(args)
        if func is PACK and args[1] in self._shadows:
            data, batch_sizes = pack_padded_sequence(args[0], self._shadows[args[1]], args[2])
            return data, self._host_tensor(batch_sizes)
        if func is EMPTY:
            lengths = host_lengths(args, kwargs, _caller_code)
            if lengths is not None:
                return self._host_tensor(lengths)
        if any(is_sparse(a) for a in args):  # positional in every operator that takes one
            return sparse_call(self.sparse, func, args, kwargs,
                               accumulating=self.phase.endswith("backward") and not torch.is_grad_enabled())
        if func is CONSTRUCT:
            out = func(*args, **kwargs)
            constructed(self.sparse, args, out, self.shadow_of)
            return out
        if func in _DATA_DEPENDENT:
            self._note_draw_read(args, kwargs)
            ok, real_out = self._run_real(func, args, kwargs)
            if ok:
                out = self._fake_like(real_out)
            elif self.placeholders_allowed and func in _SCALAR_READS:
                # The optimizer reading a value computed from parameters (Adafactor's relative step size):
                # it changes arithmetic, not which tensors exist, so a placeholder keeps the trace going.
                self.placeholders_used += 1
                out = _placeholder(func, args)
            else:
                out = func(*args, **kwargs)  # raises the fake mode's data-dependent error
            self._route(func, args, kwargs, out, data_dependent=ok)
        else:
            out = FAKE_KERNELS.get(func, func)(*args, **kwargs)  # kernels whose meta functions disagree with them
            if self.layouts is not None:
                out = self.layouts.match(func, args, kwargs, out)
            if torch.Tag.nondeterministic_seeded in func.tags:
                self._shadow_random_draw(func, args, kwargs, out)
            else:
                self._propagate_shadow(func, args, kwargs, out)
            self._route(func, args, kwargs, out, data_dependent=False)
        return out

    def _fake_like(self, real_out: Any) -> Any:
        def convert(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                fake = self.fake_mode.from_tensor(x)
                self.shadow(fake, x)
                return fake
            return x

        return tree_map(convert, real_out)

    def _propagate_shadow(self, func: Any, args: Any, kwargs: dict, out: Any) -> None:
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if any(t.numel() > SHADOW_MAX_NUMEL for t in outs):
            self._forget_mutated(func, args, kwargs)
            return
        has_tensor_arg = any(isinstance(a, torch.Tensor) for a in tree_flatten((args, kwargs))[0])
        if not has_tensor_arg and not _is_factory(func):
            return
        if func in _COLLECTIVE_SHADOWS:  # a collective's result comes from the other ranks: the rule answers it
            _COLLECTIVE_SHADOWS[func](self, args, kwargs)
            return
        ok, real_out = self._run_real(func, args, kwargs)
        if not ok:
            self._forget_mutated(func, args, kwargs)
            self._assume_check_holds(func, outs)
            return
        reals = [t for t in tree_flatten(real_out)[0] if isinstance(t, torch.Tensor)]
        if len(reals) != len(outs):
            return
        with _disable_current_modes():
            reals = _owned(reals, args, kwargs)
            if func.overloadpacket.__name__ in _UNINITIALIZED:  # its values are whatever the allocator left there
                for real in reals:
                    real.zero_()
        for fake, real in zip(outs, reals):
            if tuple(fake.shape) == tuple(real.shape):
                self.shadow(fake, real)
        self._carry_draw_site(args, kwargs, outs)

    def _forget_mutated(self, func: Any, args: Any, kwargs: dict | None = None) -> None:
        # An in-place op whose result we could not compute leaves a stale shadow on what it wrote: drop it. Only
        # the written arguments: `hidden[mask] = v` writes `hidden`, and `mask` keeps its shadow for backward.
        if func._schema.is_mutable:
            for a in _written(func, args, kwargs or {}):
                self._shadows.pop(a, None)

    # ---- checks the real kernels make (preflight.trace._step_checks) -------------------------------------------

    def shadow_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The real values of ``t``, if it has a shadow."""
        return self._shadows.get(t) if _is_fake(t) else None

    def fail(self, func: Any, real: BaseException, operands: dict[str, torch.Tensor], fix: str) -> None:
        """Raise `StepWouldFailError` for ``func``, which the real run would stop at with ``real``."""
        site = user_frame()
        where = f"{func} at {site}" if site else str(func)
        described = "; ".join(f"{name}: {self.describe(t)}" for name, t in operands.items())
        raise StepWouldFailError(
            f"The training step would fail at its first step: {type(real).__name__}: {real} (in {where}, "
            f"{self.phase}). {described}. Fix: {fix}. No memory was predicted: a step that fails has no peak."
        ) from real

    def from_batch(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a batch tensor or a view of one."""
        return any(x is not None and self.names.get(x, "").startswith("the batch") for x in (t, t._base))

    def describe(self, t: torch.Tensor) -> str:
        """``t`` as the user knows it: a parameter or batch tensor by name, else its dtype and shape."""
        name = self.names.get(t)
        if name is None and t._base is not None:
            name = self.names.get(t._base)
            name = None if name is None else f"a view of {name}"
        shape = "x".join(map(str, t.shape)) or "scalar"
        what = f"{str(t.dtype).removeprefix('torch.')} {shape}"
        return f"{name} ({what})" if name else f"a tensor ({what}) computed in the step"

    # ---- boolean masks, random draws ------------------------------------------------------------------------

    def _expand_mask_indices(self, args: Any) -> Any:
        """``x[mask]`` with a shadowed boolean mask: give ``aten.index`` the mask's ``nonzero()`` coordinates, as
        the real kernel does internally (``expandTensors``), so the output shape is known. The coordinates are
        allocated here as the kernel allocates them."""
        self_, indices = args[0], args[1]
        if not any(_is_mask(i) and i in self._shadows for i in indices):
            return args
        expanded: list[Any] = []
        for index in indices:
            if _is_mask(index) and index in self._shadows:
                coords = self.__torch_dispatch__(torch.ops.aten.nonzero.default, (), (index,))
                expanded.extend(self.__torch_dispatch__(torch.ops.aten.unbind.int, (), (coords, 1)))
            else:
                expanded.append(index)
        return (self_, expanded, *args[2:])

    def _host_tensor(self, real: torch.Tensor) -> torch.Tensor:
        """``real``, a host tensor a kernel reads or writes through its pointer (`preflight.trace._packed`), tracked
        now: on the CPU it is the step's memory; on a CUDA target it is host memory and taken off the device."""
        self._track(real, self.phase_category, self.num_ops - 1)
        if self.cuda:
            self.to_host(real)
        self._host_reals[real] = None
        return real

    def _host_twin(self, real: torch.Tensor) -> torch.Tensor:
        """The fake twin that stands for ``real`` (made by `_host_tensor`) in operators, made at its first use (after
        the kernel that made it wrote it), shadowed with its values. Unlike the user's adopted tensors, nothing
        holds ``real`` here: it is freed when the step drops it, as in the real run."""
        fake = self._host_reals[real]
        if fake is None:
            fake = self.fake_mode.from_tensor(real)
            self._adopt_storage(fake)
            with _disable_current_modes():
                self._shadows[fake] = real.detach().clone()
            self.tensors[fake] = None
            self._host_reals[real] = fake
        return fake

    def _masked_select(self, args: Any) -> torch.Tensor:
        """``masked_select(self, mask)`` with a known mask (from the batch) over values the trace does not know
        (scores computed from parameters): its size is the number of True elements of the mask broadcast to both
        shapes; the values are never read."""
        source, mask = args[0], self._shadows[args[1]]
        with _disable_current_modes():
            shape = torch.broadcast_shapes(tuple(source.shape), tuple(mask.shape))
            count = int(mask.expand(shape).sum())
        return source.new_empty((count,))

    def _ctc_loss(self, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``aten._ctc_loss.Tensor`` has no fake implementation: its ``log_alpha`` output is ``(batch, input length,
        2 * max(target_lengths) + 1)``, known from the target lengths' shadow (the labels of the batch). As the CPU
        and CUDA kernels allocate it (aten/src/ATen/native/LossCTC.cpp, ``ctc_loss_cpu_template``)."""
        log_probs, target_lengths = args[0], self._shadows[args[3]]
        batch, steps = target_lengths.numel(), log_probs.size(0)
        with _disable_current_modes():
            max_target = int(target_lengths.max()) if batch else 0
        like = {"dtype": log_probs.dtype, "device": log_probs.device}
        nll = torch.empty(batch, **like)
        log_alpha = torch.empty(batch, steps, 2 * max_target + 1, **like)
        return nll, log_alpha

    def _shadow_random_draw(self, func: Any, args: Any, kwargs: dict, out: Any) -> None:
        """A small draw of a uniform random operator gets a shadow at the top of its range (``torch.rand`` just
        below 1, ``randint`` ``high - 1``): ``torch.rand([]) < layerdrop`` is False, so every layer is kept, the
        worst case for memory. Where such a value is read is reported by `assumption_notes`."""
        if not isinstance(out, torch.Tensor) or out.numel() > _DRAW_MAX_NUMEL:
            self._forget_mutated(func, args, kwargs)
            return
        with _disable_current_modes():
            top = _top_of_range(func, args, kwargs, out.dtype)
            real = None if top is None else torch.full(tuple(out.shape), top, dtype=out.dtype)
        if real is None:
            self._forget_mutated(func, args, kwargs)
            return
        self.shadow(out, real)
        self._drawn[out] = user_frame() or "an unknown line"

    def _carry_draw_site(self, args: Any, kwargs: dict, outs: list[torch.Tensor]) -> None:
        sites = {self._drawn[a] for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)
                 and a in self._drawn}
        if sites:
            for t in outs:
                self._drawn[t] = min(sites)

    def _note_draw_read(self, args: Any, kwargs: dict) -> None:
        for a in tree_flatten((args, kwargs))[0]:
            if isinstance(a, torch.Tensor) and a in self._drawn:
                key = (self._drawn[a], user_frame() or "an unknown line")
                self._draw_reads[key] = self._draw_reads.get(key, 0) + 1
                return

    def host_array(self, fake: torch.Tensor) -> Any:
        """The NumPy array the real run would make of ``fake``: its shadow's values, else zeros of its shape and
        dtype (values computed from parameters cannot be known; the line is named in `assumption_notes`). Zeros keep
        every shape that does not depend on the values, e.g. the matches of DETR's Hungarian matcher."""
        import numpy as np

        real = self._shadows.get(fake)
        if real is not None:
            with _disable_current_modes():
                return real.detach().cpu().numpy()
        line = user_frame() or "an unknown line"
        self._host_reads[line] = self._host_reads.get(line, 0) + 1
        dtype = fake.dtype if fake.dtype in _NUMPY_DTYPES else torch.float32
        with _disable_current_modes():
            return np.zeros(tuple(fake.shape), dtype=torch.empty((), dtype=dtype).numpy().dtype)

    def _assume_check_holds(self, func: Any, outs: list[torch.Tensor]) -> None:
        """``x.all()`` over values the trace cannot know is taken as True. Training code reads it for sanity
        checks that hold in a healthy run (DETR: ``if not torch.isfinite(h).all(): clamp``; the detection loss:
        ``if not (boxes[:, 2:] >= boxes[:, :2]).all(): raise``), and preflight predicts a healthy run. Each line
        that read such a value is named in `assumption_notes`."""
        if func not in _ALL_TRUE or len(outs) != 1:
            return
        with _disable_current_modes():
            self.shadow(outs[0], torch.ones((), dtype=torch.bool))
        self._drawn[outs[0]] = _ASSUMED_CHECK

    def assumption_notes(self) -> list[str]:
        """One coverage note per line that read a synthetic random value (see `_shadow_random_draw`), per line that
        read unknown values into NumPy, per assumed kernel choice of a library operator, and for coalesces of
        sparse tensors whose ids were not known."""
        notes = [f"{text} ({n} call(s))" for text, n in self._kernel_notes.items()]
        notes += [n for n in [self.sparse.note()] if n]
        for (drawn, read), n in self._draw_reads.items():
            if drawn == _ASSUMED_CHECK:
                notes.append(f"sanity check: `.all()` at {read} over values the trace cannot know was taken as True "
                             f"({n} time(s): a healthy run, e.g. finite values)")
            else:
                notes.append(f"layerdrop/random branch: the random draw at {drawn}, read at {read} ({n} time(s)), "
                             "was traced at the top of its range (every layer kept: the worst case for memory)")
        if self._outside[1] and self._outside_modules is not None and self._outside_modules.first is not None:
            first, line = self._outside_modules.first
            notes.append(f"outside the model: the step called a {first} that is not part of the model (at "
                         f"{line or 'an unknown line'}); the parameters and buffers of its {self._outside[0]} "
                         f"module(s) that hold some ({self._outside[1]:,} B) are counted as parameters from that call "
                         "on: they stay on the device for the whole run")
        notes += [f"host values: a tensor computed from parameters was read into NumPy at {line} ({n} time(s)); its "
                  "values cannot be known in a trace and were taken as zeros (shapes that depend on them would "
                  "differ)" for line, n in self._host_reads.items()]
        return notes

    # ---- mixture-of-experts routing (preflight.trace._routing) ----------------------------------------------------

    def _route(self, func: Any, args: Any, kwargs: dict, out: Any, *, data_dependent: bool) -> None:
        """Give a router's index output on unknown values a synthetic shadow, and track what derives from it."""
        with _disable_current_modes():  # the synthetic indices are real tensors
            synthetic = self.routing.synthesize(func, args, kwargs, out, self._has_shadow)
        if synthetic is not None:
            self.shadow(*synthetic)
        self.routing.propagate(args, kwargs, out, self._has_shadow, data_dependent)

    def _has_shadow(self, t: torch.Tensor) -> bool:
        return t in self._shadows


_PRODUCTS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)
# Queries of a tensor's metadata that C++ makes between an operator and the next (``prim.device`` after ``add``
# returns, before ``at::linear`` drops its product): no tensor is made or dropped by them.
_METADATA = frozenset(getattr(getattr(namespace, name, None), overload, None)
                      for namespace, name, overload in (
                          (torch.ops.prim, "device", "default"), (torch.ops.aten, "sym_size", "int"),
                          (torch.ops.aten, "sym_stride", "int"), (torch.ops.aten, "sym_numel", "default"),
                          (torch.ops.aten, "sym_storage_offset", "default"))) - {None}
# Frames between an operator's Python caller and the tracker: the dispatcher's, the modes', dynamo's disable wrapper.
_DISPATCH_FILES = tuple(os.path.join(os.path.dirname(torch.__file__), *parts) for parts in (
    ("_ops.py",), ("utils", "_python_dispatch.py"), ("_subclasses",), ("_compile.py",),
    ("_dynamo", "eval_frame.py"), ("utils", "_stats.py"))) + (os.path.dirname(os.path.abspath(__file__)),)


def _call_site() -> tuple[int, int, Any] | None:
    """The Python instruction that called into the operators being dispatched now: (frame id, bytecode offset, code)
    of the innermost frame outside the dispatcher, the modes and this package's trace."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_DISPATCH_FILES):
        frame = frame.f_back
    return None if frame is None else (id(frame), frame.f_lasti, frame.f_code)


def _caller_code() -> Any:
    site = _call_site()
    return None if site is None else site[2]


def _calls(site: tuple[int, int, Any]) -> bool:
    """Whether the instruction at ``site`` is a call (``F.linear(...)``), not an operator written in Python."""
    _, offset, code = site
    return 0 <= offset < len(code.co_code) and "CALL" in dis.opname[code.co_code[offset]]


def _no_note(*args: Any, **kwargs: Any) -> None:
    return None


def _computes(func: Any) -> bool:
    """Whether ``func`` returns a tensor (a computation), as opposed to metadata (a device, a size, a flag)."""
    known = _COMPUTES.get(func)
    if known is None:
        known = _COMPUTES[func] = any(isinstance(r.type, (torch.TensorType, torch.ListType, torch.OptionalType))
                                      and "Tensor" in str(r.type) for r in func._schema.returns)
    return known


_COMPUTES: dict[Any, bool] = {}


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


_LIFTS = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift.default}

# Real tensors up to this many elements are copied for their shadow when adopted (`StorageTracker._adopt`).
_ADOPT_COPY_NUMEL = 1 << 16


def _adoptable(x: Any) -> bool:
    """A real, dense tensor of the user's (not a fake, not meta, not a wrapper subclass of fakes)."""
    return (isinstance(x, torch.Tensor) and not _is_fake(x) and x.device.type != "meta"
            and x.layout == torch.strided and _inner_tensors(x) is None)


def _inner_tensors(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The inner tensors of a traceable wrapper subclass (a DTensor's local shard) or of a sparse COO tensor (its
    indices and values: `preflight.trace._sparse`), or None for any other tensor."""
    if is_sparse(t):
        with _disable_current_modes():  # the fake tensor's own mode answers; the tracker does not count a view
            return [t._indices(), t._values()]
    if _is_fake(t) or not is_traceable_wrapper_subclass(t):
        return None
    names, _ = t.__tensor_flatten__()
    return [x for x in (getattr(t, name) for name in names) if isinstance(x, torch.Tensor)]


def _written(func: Any, args: Any, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an operator writes (``Tensor(a!)`` in its schema)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return written


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _owned(reals: list[torch.Tensor], args: Any, kwargs: dict) -> list[torch.Tensor]:
    """``reals``, with any that shares memory with a real (non-fake) argument copied: ``torch.from_numpy(a)``
    (``lift_fresh``) or a view of a module's constant returns the user's own memory, which in-place operators
    on the shadow would otherwise write."""
    users = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
             if isinstance(a, torch.Tensor) and not _is_fake(a) and a.device.type != "meta"
             and a.layout == torch.strided}
    if not users:
        return reals
    return [r.clone() if r.untyped_storage().data_ptr() in users else r for r in reals]


# Draws this small or smaller get a synthetic shadow: scalars and per-layer vectors, never activation-sized noise.
_DRAW_MAX_NUMEL = 64
_NUMPY_DTYPES = (torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool)
# Reductions to "every element is true" (`_assume_check_holds`): ``x.all()``, and ``torch._is_all_true`` with which
# torch.distributions validates its arguments (``Normal(mu, scale)``: ``scale > 0`` everywhere).
_ALL_TRUE = frozenset({torch.ops.aten.all.default, torch.ops.aten._is_all_true.default})
# The "draw site" of a value `_assume_check_holds` gave a synthetic shadow.
_ASSUMED_CHECK = "<assumed check>"


def _top_of_range(func: Any, args: Any, kwargs: dict, dtype: torch.dtype) -> float | int | None:
    """The largest value ``func`` (a uniform draw) can return, or None for other random operators."""
    name = func.overloadpacket.__name__
    bound = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    if name in ("rand", "rand_like", "uniform", "uniform_"):
        high, low = float(bound.get("to", 1.0)), float(bound.get("from", 0.0))
        # Exclusive upper bound: the largest representable value below it, in the output's dtype.
        return torch.nextafter(torch.tensor(high, dtype=dtype), torch.tensor(low, dtype=dtype)).item()
    if name in ("randint", "randint_like") and not isinstance(bound.get("high"), torch.Tensor):
        return int(bound["high"]) - 1
    if name == "random_" and bound.get("to") is not None:
        return int(bound["to"]) - 1
    return None


def _mark_failure(exc: BaseException, func: Any, phase: str) -> None:
    """Name, on the exception, the innermost operator that raised it, the user's line that called it and the
    phase (in backward the user's line is only where backward was called)."""
    if getattr(exc, _FAILED_OP, None) is None:
        site = user_frame()
        setattr(exc, _FAILED_OP, f"{func} at {site} ({phase})" if site else f"{func} ({phase})")


_FAILED_OP = "_preflight_failed_op"


def failed_op_of(err: BaseException) -> str:
    """What stopped a trace: the operator and user line that raised ``err`` (or an error it was raised from),
    else, for an error raised in Python outside any operator, the Python line that raised it."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if getattr(e, _FAILED_OP, None) is not None:
            return getattr(e, _FAILED_OP)
        e = e.__cause__ or e.__context__
    return failure_site(err)


# Operators whose outputs hold no values yet: their shadows are zeros, not the allocator's leftovers (which a later
# read would take for values), until an operator writes them.
_UNINITIALIZED = {"empty_like", "new_empty", "new_empty_strided"}


def _all_to_all_shadow(tracker: StorageTracker, args: Any, kwargs: dict) -> None:
    """``c10d.alltoall_base_(output, input, group, output_splits, input_splits, ...)`` in a fake process group
    (the trace of one rank), with equal splits and a shadowed input (token counts per destination, as a
    mixture-of-experts dispatch exchanges them): the output's shadow is what this rank would receive if every rank
    of the group sent what this rank sends, each rank's block for this rank being this rank's own (the trace's
    routing assumption is the same for every rank's tokens). Anything else leaves the output without a shadow."""
    output, source, group = args[0], args[1], args[2]
    splits = [list(a) for a in args[3:5]]
    tracker._shadows.pop(output, None)
    real = tracker.shadow_of(source)
    if real is None or any(splits) or real.dim() == 0:
        return
    if not hasattr(group, "rank"):  # the dispatcher hands the group boxed (a ScriptObject)
        group = torch._C._distributed_c10d.ProcessGroup.unbox(group)
    size, rank = group.size(), group.rank()
    if real.shape[0] % size:
        return
    with _disable_current_modes():
        block = real.reshape(size, -1)[rank]
        received = block.repeat(size).reshape(output.shape).to(output.dtype)
    tracker.shadow(output, received)


_COLLECTIVE_SHADOWS: dict[Any, Callable[[StorageTracker, Any, dict], None]] = {}
if hasattr(torch.ops, "c10d") and hasattr(torch.ops.c10d, "alltoall_base_"):  # builds with distributed support
    _COLLECTIVE_SHADOWS[torch.ops.c10d.alltoall_base_.default] = _all_to_all_shadow


def _is_factory(func: Any) -> bool:
    # arange, full, zeros, ...: no tensor inputs, deterministic, small outputs can be shadowed.
    return func.overloadpacket.__name__ in _FACTORIES


_FACTORIES = {"arange", "full", "zeros", "ones", "scalar_tensor", "eye", "linspace", "tril_indices", "triu_indices"}
