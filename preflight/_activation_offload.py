"""Activation offloading as a run describes it (`preflight.Loop.offload_activations`): the saved-tensor hooks a
training forward runs under, in the trace and in `preflight.measure` alike.

- ``"save_on_cpu"``: torch's ``torch.autograd.graph.save_on_cpu`` (pinned host buffers where CUDA is available):
  every saved tensor, parameters included, is copied to the host as it is saved and copied back when its backward
  node runs; the device copy lives while that node uses it.
- ``"streams"``: the lifetimes of TRL's ``OffloadActivations(use_streams=True)`` (``trl/models/
  activation_offloading.py``, TRL 1.16, a copy of torchtune's ``OffloadActivations``), what
  ``SFTConfig(activation_offloading=True)`` and torchtune's ``enable_activation_offloading`` run. The copies run on
  a side CUDA stream, so each offloaded tensor is kept on the device until its copy is done: the forward keeps the
  offloaded tensors among the last ``max_fwd_stash_size`` (5) saved (the older ones are dropped as a tensor is
  offloaded), and a tensor still stashed when the backward needs it is used as it is. The hooks cover the forward
  and the backward, as TRL's trainers enter them around the whole training step: tensors saved in the backward
  (reentrant checkpointing's recomputation) are offloaded too. A tensor brought back is kept until the next
  backward node that brings tensors back has run, and the rest at the backward's end. Tensors under
  ``min_offload_size`` (1024 bytes), parameters and tensors on a parameter's storage stay on the device, and so
  does a second tensor on a storage the forward stash still holds (TRL keys storages by address; here a key whose
  storage has died matches nothing, where on a GPU a later tensor at the same address would match it); what the
  output head saves (found as TRL finds it, `output_head`) is not offloaded. The streams and events themselves
  only order work; the hooks here keep the same references without them, so they run on a
  CPU host too.

On a CUDA target traced on CPU tensors, `preflight.cuda._offload` gives the hooks' host copies their GPU meaning.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["OFFLOAD_MODES", "StashedOffload", "offloading"]

OFFLOAD_MODES = (None, "save_on_cpu", "streams")
MIN_OFFLOAD_BYTES = 1024  # OffloadActivations' min_offload_size default
FWD_STASH = 5  # OffloadActivations' max_fwd_stash_size default
# Tensors the forward hooks of every `StashedOffload` have offloaded so far (outside a backward): a composed trace
# reads how many each block adds (`preflight.trace._compose`).
FORWARD_OFFLOADS = [0]
_BUFFER = (nn.Buffer,) if hasattr(nn, "Buffer") else ()  # kept on the device, as OffloadActivations keeps them


def _storage(t: torch.Tensor) -> int | None:
    """The C++ storage's address, or None for a tensor without one (sparse, mkldnn)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def output_head(model: nn.Module | None) -> nn.Module | None:
    """The module TRL's ``get_act_offloading_ctx_manager`` keeps from offloading (the output head, whose saved
    tensors the loss needs at once), found as it finds it: through a ``.module`` wrapper and a PEFT model's base,
    ``output`` (or ``output.linear``), else ``lm_head``, else a decoder's ``output`` or ``lm_head``, else the final
    layer norm (``final_layer_norm``, ``ln_f``), else ``head``."""
    if model is None:
        return None
    inner = getattr(model, "module", model)
    if hasattr(inner, "base_model") and hasattr(inner, "peft_config"):
        inner = inner.base_model

    def find(owner: Any, *names: str) -> nn.Module | None:
        for name in names:
            found = getattr(owner, name, None)
            if isinstance(found, nn.Module):
                return found
        return None

    if hasattr(inner, "output"):
        return find(inner, "output") or find(getattr(inner, "output"), "linear")
    if hasattr(inner, "lm_head"):
        return find(inner, "lm_head")
    if hasattr(inner, "decoder"):
        return find(inner.decoder, "output", "lm_head")
    if hasattr(inner, "final_layer_norm") or hasattr(inner, "ln_f"):
        return find(inner, "final_layer_norm", "ln_f")
    return find(inner, "head")


class StashedOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors offloaded with the device lifetimes of TRL's and torchtune's stream-based ``OffloadActivations``
    (module docstring), for the parameters of ``model``; what its output head (`output_head`) saves stays on the
    device, as TRL's ``NoOpManager`` around the head keeps it."""

    def __init__(self, model: nn.Module | None, pin_memory: bool, min_bytes: int = MIN_OFFLOAD_BYTES,
                 stash: int = FWD_STASH) -> None:
        params = set() if model is None else {_storage(p) for p in model.parameters()}
        self._head = output_head(model)
        self._handles: list[Any] = []
        ids = itertools.count(1)
        fwd: dict[int, torch.Tensor] = {}  # id -> the device tensor, kept while its copy runs
        # (storage, offset, dtype) -> the id that holds it on the device, and the storage (weakly): a key outlives
        # its storage where the stash holds a contiguous copy, and a storage made later may reuse the address
        tracked: dict[tuple, tuple[int, StorageWeakRef]] = {}
        key_of: dict[int, tuple] = {}  # id -> its key in `tracked`
        bwd: dict[int, torch.Tensor] = {}  # id -> a copy brought back, kept until the next such node has run
        state: dict[str, Any] = {"node": None, "graph": None, "cleanup": None, "in_head": 0}
        self._state = state

        def track(key: tuple, n: int, t: torch.Tensor) -> None:
            tracked[key] = (n, StorageWeakRef(t.untyped_storage()))
            key_of[n] = key

        def release(n: int) -> None:  # OffloadActivations' release_storage_key, and the stash entry
            fwd.pop(n, None)
            key = key_of.pop(n, None)
            if key is not None and tracked.get(key, (None,))[0] == n:
                del tracked[key]

        def offloaded_already(key: tuple) -> bool:
            entry = tracked.get(key)
            return entry is not None and not entry[1].expired()

        def pack(t: torch.Tensor) -> Any:
            if state["in_head"]:
                return t  # the head's identity hooks
            n = next(ids)
            storage = _storage(t)
            if storage is None:  # no storage to key or copy (OffloadActivations keys it by id: never saved again)
                return ("kept", n, t)
            key = (storage, t.storage_offset(), t.dtype)  # OffloadActivations' _get_unique_tensor_key
            if offloaded_already(key):  # kept on the device, tracked until unpacked
                track(key, n, t)
                return ("kept", n, t)
            if (isinstance(t, (nn.Parameter, *_BUFFER)) or storage in params
                    or t.numel() * t.element_size() < min_bytes):
                return ("kept", n, t)
            original = t
            shape, stride, offset = t.size(), t.stride(), t.storage_offset()
            broadcast = 0 in stride
            if not broadcast and (not t.is_contiguous() or offset != 0):
                t = t.clone(memory_format=torch.contiguous_format) if offset else t.contiguous()
            stride, offset = t.stride(), t.storage_offset()
            for old in [k for k in fwd if k <= n - stash]:
                release(old)
            if broadcast:  # its storage alone is copied
                elements = t.untyped_storage().nbytes() // t.element_size()
                host = torch.empty(elements, dtype=t.dtype, device="cpu", pin_memory=pin_memory)
                host.copy_(torch.as_strided(t, (elements,), (1,), 0))
            else:
                host = torch.empty_like(t, device="cpu", pin_memory=pin_memory)
                host.copy_(t)
            fwd[n] = t
            track(key, n, original)
            if torch._C._current_graph_task_id() == -1:
                FORWARD_OFFLOADS[0] += 1
            return ("offloaded", n, host, t.device, shape, stride, offset)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            if packed[0] == "kept":
                release(packed[1])
                return packed[2]
            _, n, host, device, shape, stride, offset = packed
            graph = torch._C._current_graph_task_id()
            if state["cleanup"] is None and graph != -1:  # the backward's first
                def cleanup() -> None:  # what is left goes at the backward's end
                    bwd.clear()
                    state["cleanup"] = state["node"] = state["graph"] = None
                state["cleanup"], state["graph"] = cleanup, graph
                torch.autograd.Variable._execution_engine.queue_callback(cleanup)
            node = torch._C._current_autograd_node()
            previous: list[int] = []
            # A new node of the backward (not of a backward nested in it, as reentrant checkpointing runs one):
            # the copies brought back before it go once it has run.
            if graph == state["graph"] and node is not state["node"]:
                state["node"] = node
                previous = list(bwd)
            if n in fwd:
                out = fwd[n]
            else:
                out = torch.as_strided(host.to(device, non_blocking=True), shape, stride, offset)
                if node is not None:  # read outside a backward: the caller holds it, nothing stashes it
                    bwd[n] = out
            release(n)

            def after(outputs: Any, inputs: Any) -> None:
                for k in list(fwd):
                    release(k)
                for k in previous:
                    bwd.pop(k, None)

            if node is not None:
                node.register_hook(after)
            return out

        super().__init__(pack, unpack)

    def __enter__(self) -> None:
        if self._head is not None:
            def enter(*args: Any) -> None:
                self._state["in_head"] += 1

            def leave(*args: Any) -> None:  # called even when the head raised, or a hook before ``enter`` did
                self._state["in_head"] = max(self._state["in_head"] - 1, 0)

            self._handles = [self._head.register_forward_pre_hook(enter),
                             self._head.register_forward_hook(leave, always_call=True)]
        super().__enter__()

    def __exit__(self, *args: Any) -> None:
        try:
            super().__exit__(*args)
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []


def offloading(mode: str | None, model: nn.Module | None) -> contextlib.AbstractContextManager:
    """The saved-tensor hooks a training forward runs under for ``mode`` (`OFFLOAD_MODES`); pinned host buffers
    where CUDA is available, as TRL, torchtune and ``save_on_cpu(pin_memory=True)`` pin them."""
    pin = torch.cuda.is_available()
    if mode == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=pin)
    if mode == "streams":
        return StashedOffload(model, pin)
    return contextlib.nullcontext()
