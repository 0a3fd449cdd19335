"""Closed-form model-state bytes: what a trace cannot fail to know.

Used as the labelled lower bound when a trace fails, and as a cross-check. Formulas follow each optimizer's
``step`` in torch.optim (state tensors per parameter) and bitsandbytes' ``Optimizer2State.init_state``
(uint8 states, one fp32 absmax per 256-element block, fp32 states below ``min_8bit_size`` = 4096 elements).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from preflight._device import iter_tensors
from preflight._optimizer_group import OptimizerGroup
from preflight.trace._library_kernels import PAGED_MIN_NUMEL

__all__ = ["ModelState", "model_state", "optimizer_state_bytes", "sparse_gradient_parameters"]

# torch.optim classes -> number of full-size state tensors per parameter (before hyperparameter options).
_FULL_STATES = {
    "Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2, "Adagrad": 1, "RMSprop": 1,
    "Rprop": 2, "ASGD": 1, "SGD": 0, "LBFGS": 0, "SparseAdam": 2,
}
_BNB_BLOCK = 256  # bitsandbytes.optim.optimizer.Optimizer2State.init_state: blocksize = 256


@dataclasses.dataclass(frozen=True)
class ModelState:
    """Bytes that exist regardless of activations. ``optimizer_state`` is None when the optimizer is unknown."""

    parameters: int
    buffers: int
    gradients: int
    optimizer_state: int | None
    inputs: int
    managed: int = 0  # paged optimizer state in CUDA managed memory, outside the allocator


def model_state(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, device: torch.device,
                param_dtype: torch.dtype | None = None) -> ModelState:
    """Parameters, buffers, gradients of trainable parameters, optimizer state and batch bytes. A sparse gradient
    (`sparse_gradient_parameters`) holds the rows the batch looked up, not the table: it counts 0 here, as does the
    momentum SGD clones from it."""
    params = list(model.parameters())
    sparse = sparse_gradient_parameters(model)
    by_dtype = param_dtype is not None

    def nbytes(t: torch.Tensor) -> int:
        size = param_dtype.itemsize if by_dtype and t.is_floating_point() else t.element_size()
        return t.numel() * size

    seen: set[int] = set()
    param_bytes = grad_bytes = 0
    for p in params:
        if id(p) in seen or is_lazy(p):  # a lazy module's parameter has no shape before its first forward
            continue
        seen.add(id(p))
        param_bytes += nbytes(p)
        if p.requires_grad and id(p) not in sparse:
            grad_bytes += nbytes(p)
    buffer_bytes = sum(nbytes(b) for b in {id(b): b for b in model.buffers()}.values() if not is_lazy(b))
    state = optimizer_state_bytes(optimizer, param_dtype=param_dtype, sparse=sparse)
    inputs = _batch_bytes(batch)
    managed = 0
    if state is not None and getattr(optimizer, "is_paged", False) and device.type == "cuda":
        managed = optimizer_state_bytes(optimizer, param_dtype=param_dtype, paged_only=True) or 0
        state -= managed
    return ModelState(param_bytes, buffer_bytes, grad_bytes, state, inputs, managed)


def sparse_gradient_parameters(model: nn.Module) -> frozenset[int]:
    """The ids of the parameters whose gradients are sparse: the weights of ``nn.Embedding`` and ``nn.EmbeddingBag``
    built with ``sparse=True`` (a sparse COO tensor of the looked-up rows)."""
    if not isinstance(model, nn.Module):  # a pipeline schedule holds its stages' modules, not one module
        return frozenset()
    return frozenset(id(m.weight) for m in model.modules()
                     if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse)


def _batch_bytes(batch: Any) -> int:
    return sum(t.numel() * t.element_size() for t in iter_tensors(batch))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, param_dtype: torch.dtype | None = None, *,
                          paged_only: bool = False, sparse: frozenset[int] = frozenset()) -> int | None:
    """Steady-state bytes of ``optimizer``'s state, or None for an optimizer this module does not know.
    ``paged_only``: of a bitsandbytes optimizer, only the states it pages on CUDA (`PAGED_MIN_NUMEL`). ``sparse``:
    ids of parameters with sparse gradients, whose SGD momentum is a sparse clone of the gradient (not counted)."""
    if isinstance(optimizer, OptimizerGroup):  # each member's, where each is known
        each = [optimizer_state_bytes(opt, param_dtype, paged_only=paged_only, sparse=sparse)
                for opt in optimizer.optimizers]
        return None if None in each else sum(each)
    name = type(optimizer).__name__
    # bitsandbytes optimizers are known by their configuration (``args.optim_bits``, resolved per parameter by
    # ``get_config`` with any ``GlobalOptimManager`` override), not by class name: HF's "adamw_bnb_8bit" is
    # ``bnb.optim.AdamW(..., optim_bits=8)``, not ``AdamW8bit``.
    bnb_config = getattr(optimizer, "get_config", None) if hasattr(getattr(optimizer, "args", None), "optim_bits") \
        else None
    total = 0
    for gindex, group in enumerate(optimizer.param_groups):
        for pindex, p in enumerate(group["params"]):
            if not p.requires_grad or is_lazy(p):
                continue
            item = param_dtype.itemsize if param_dtype is not None and p.is_floating_point() else p.element_size()
            if bnb_config is not None:
                per = _bnb_bytes(optimizer, bnb_config(gindex, pindex, group), p, paged_only=paged_only)
                if per is None:
                    return None
                total += per
                continue
            full = _FULL_STATES.get(name)
            if full is None and name == "Adafactor":
                total += _adafactor_bytes(p, item)
                continue
            if full is None:
                return None
            if name == "SGD" and group.get("momentum", 0) and id(p) not in sparse:
                full = 1
            if name in ("Adam", "AdamW") and group.get("amsgrad", False):
                full += 1
            if name == "RMSprop":
                full += bool(group.get("momentum", 0)) + bool(group.get("centered", False))
            total += full * p.numel() * item
            if name not in ("SGD", "LBFGS"):
                total += 4  # the fp32 scalar ``step`` tensor
    return total


def _adafactor_bytes(p: torch.Tensor, item: int) -> int:
    # torch.optim.Adafactor: row and column variance for >= 2-D parameters, full variance for vectors.
    if p.dim() >= 2:
        rows = p.numel() // p.shape[-1]
        cols = p.numel() // p.shape[-2]
        return (rows + cols) * item + 4
    return p.numel() * item + 4


def _bnb_bytes(optimizer: Any, config: dict, p: torch.Tensor, *, paged_only: bool = False) -> int | None:
    # Follows Optimizer1State/Optimizer2State.init_state; AdEMAMix keeps a double-size state1 (two EMAs) and a
    # (2, blocks) absmax1. ``step`` is a Python int there, so it has no tensor bytes.
    from bitsandbytes.optim.optimizer import Optimizer1State, Optimizer2State  # loaded: optimizer is one of its

    if isinstance(optimizer, Optimizer2State):
        states = 2
    elif isinstance(optimizer, Optimizer1State):
        states = 1
    else:
        return None
    from bitsandbytes.optim.ademamix import AdEMAMix

    double = isinstance(optimizer, AdEMAMix)
    n = p.numel()
    unorm = 4 if config.get("max_unorm", 0.0) > 0.0 and not double else 0
    eight = config["optim_bits"] == 8 and n >= config["min_8bit_size"]
    if paged_only:  # state1 and state2 themselves, of a parameter large enough to be paged
        return (states + double) * n * (1 if eight else 4) if n >= PAGED_MIN_NUMEL else 0
    if eight:
        blocks = -(-n // _BNB_BLOCK)
        return (states + double) * (n + 4 * blocks) + unorm
    return (states + double) * 4 * n + unorm
