"""Fake twins of the user's objects: parameters, buffers, batch and optimizer, with no memory behind them.

A twin has the shape, dtype, stride and ``requires_grad`` of the original and lives on the trace device inside a
`FakeTensorMode`. Twins are memoised by identity so tied weights stay tied. The user's objects are only read.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from preflight._device import iter_tensors, map_held_tensors, map_tensors
from preflight._optimizer_group import OptimizerGroup

__all__ = ["TwinMaker", "clone_optimizer", "cuda_capturable_off", "cuda_default_impl", "float_dtype_for", "gradients_held_by"]

# The parameters whose .grad a twin carries (by id), or None: every parameter's (`gradients_held_by`).
_HELD: contextvars.ContextVar[frozenset[int] | None] = contextvars.ContextVar("preflight_held_gradients", default=None)


@contextlib.contextmanager
def gradients_held_by(params: Iterable[torch.Tensor]) -> Iterator[None]:
    """Twins made inside carry the ``.grad`` of ``params`` only: a step traced again after the real steps ran (a
    verification) starts with the gradients held when the run began, not those the real steps left."""
    token = _HELD.set(frozenset(id(p) for p in params))
    try:
        yield
    finally:
        _HELD.reset(token)


def float_dtype_for(precision: str | None) -> torch.dtype | None:
    """The dtype floating parameters are cast to under ``precision``, or None to keep theirs."""
    return {"32-true": torch.float32, "bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision or "")


class TwinMaker:
    """Make fake twins on ``device`` under ``fake_mode``, casting floating tensors to ``cast_dtype`` if given."""

    def __init__(self, fake_mode: Any, device: torch.device, cast_dtype: torch.dtype | None = None) -> None:
        self.fake_mode = fake_mode
        self.device = device
        self.cast_dtype = cast_dtype
        self._memo: dict[int, torch.Tensor] = {}
        self._keep: list[torch.Tensor] = []  # keep originals alive so ids stay unique while memoised
        # storage -> (the first tensor twinned on it, its twin): what a parameter subclass holds on its parameter's
        # storage is twinned on its twin's
        self._storages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Tensors carried by a parameter subclass's attributes (a 4-bit weight's quantisation state): memory the
        # weight holds on the device, (description, twin) in the order made.
        self.carried: list[tuple[str, torch.Tensor]] = []

    def tensor(self, t: torch.Tensor, *, cast: bool = True, requires_grad: bool | None = None,
               _held: bool = False) -> torch.Tensor:
        """A fake twin of ``t`` (the same twin for the same ``t``). ``_held``: ``t`` is held by a parameter
        subclass, and shares its twin's storage where it shares the parameter's."""
        key = id(t)
        if key in self._memo:
            return self._memo[key]
        if t.is_nested:
            raise NotImplementedError(
                "a nested (jagged) tensor cannot be given a fake twin: its lengths are symbolic sizes, which need a "
                "symbolic shape environment the trace does not run (pad the batch, or pass a padded worst case)")
        dtype = t.dtype
        if cast and self.cast_dtype is not None and t.is_floating_point():
            dtype = self.cast_dtype
        twin = self._alias(t, dtype) if _held else None
        if twin is None:
            with self.fake_mode:
                twin = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dtype, device=self.device)
            storage = _storage_key(t)
            if storage is not None:
                self._storages.setdefault(storage, (t, twin))
        wants_grad = t.requires_grad if requires_grad is None else requires_grad
        if wants_grad and (twin.is_floating_point() or twin.is_complex()):
            twin.requires_grad_(True)
        self._memo[key] = twin
        self._keep.append(t)
        for name, value in map_held_tensors(t, self._carry).items():
            setattr(twin, name, value)
        return twin

    def _alias(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """A twin of ``t`` on the storage of the twin already made for another tensor of ``t``'s storage, where it
        fits there with the same element type: one block, as on the device (bitsandbytes' ``Int8Params`` is its
        ``CB``: ``_quantize`` sets ``self.data = CB``). None otherwise."""
        known = self._storages.get(_storage_key(t) or 0)
        if known is None:
            return None
        real, base = known
        if base.dtype != dtype or real.dtype != t.dtype:
            return None
        offset = t.storage_offset() - real.storage_offset() + base.storage_offset()
        span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
        if offset < 0 or (offset + span) * base.element_size() > base.untyped_storage().nbytes():
            return None
        with self.fake_mode:
            return torch.empty(0, dtype=dtype, device=self.device).set_(base.untyped_storage(), offset,
                                                                        tuple(t.shape), tuple(t.stride()))

    def _carry(self, path: str, t: torch.Tensor) -> torch.Tensor:
        """The twin of a tensor a parameter subclass holds (`preflight._device.map_held_tensors`)."""
        known = self.existing(t)
        if known is not None:
            return known
        twin = self.tensor(t, cast=False, requires_grad=False, _held=True)
        self.carried.append((path, twin))
        return twin

    def forget(self, tensors: Any) -> None:
        """Let go of the twins of ``tensors`` (a nested batch), so that a twin nothing else holds is freed: a
        trainer's training batch before it evaluates, or the evaluation batch after it."""
        for t in iter_tensors(tensors):
            if self._memo.pop(id(t), None) is not None:
                self._keep = [k for k in self._keep if k is not t]
                self._storages = {k: v for k, v in self._storages.items() if v[0] is not t}

    def existing(self, t: torch.Tensor) -> torch.Tensor | None:
        """The twin already made for ``t``, or None."""
        return self._memo.get(id(t))

    def module_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Twins of every parameter and buffer of ``model``, keyed by their qualified names (tied names included);
        a parameter's twin holds the twin of the dense ``.grad`` it holds."""
        state: dict[str, torch.Tensor] = {}
        held = _HELD.get()
        for name, p in model.named_parameters(remove_duplicate=False):
            state[name] = twin = self.tensor(p)
            grad = p.grad
            if grad is None or (held is not None and id(p) not in held) or twin.grad is not None:
                continue
            if grad.layout == torch.strided and grad.shape == p.shape:
                # A gradient the parameter holds before the run (a backward ran, no zero_grad since) stays on the
                # device until the loop sets it to None; a backward accumulates into it. Cast as the parameter.
                twin.grad = self.tensor(grad, requires_grad=False)
        for name, b in model.named_buffers(remove_duplicate=False):
            state[name] = self.tensor(b, requires_grad=False)
        return state

    def batch(self, batch: Any, *, cast: bool) -> Any:
        """Twin a nested batch; floating tensors are cast only when ``cast`` (the ``*-true`` precisions)."""
        return map_tensors(lambda t: self.tensor(t, cast=cast, requires_grad=t.requires_grad), batch)



def _storage_key(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s storage (its ``StorageImpl``), valid while ``t`` is kept alive; None without one."""
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError, TypeError):  # sparse, nested or other storage-less tensors
        return None


def cuda_default_impl(optimizer: torch.optim.Optimizer) -> None:
    """Set ``foreach=True`` on the groups of ``optimizer`` (a clone traced on the CPU for a CUDA target) where torch
    would pick foreach on a CUDA device: groups that leave ``foreach`` and ``fused`` to the default, are not
    differentiable, and whose parameters are all of the types torch's foreach step takes
    (``torch.optim.optimizer._foreach_supported_types``: plain tensors, parameters and, once
    ``torch.distributed.tensor`` is imported, DTensors; not FSDP1's ``FlatParameter``), a FakeTensor twin counting
    as the plain parameter it stands for. The rule is
    ``_default_to_fused_or_foreach`` in ``torch/optim/optimizer.py`` with the device taken as CUDA."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.optim.optimizer import _foreach_supported_types

    def supported(p: torch.Tensor) -> bool:  # a FakeTensor twin stands for the user's plain parameter
        return type(p) in _foreach_supported_types or type(p) is FakeTensor

    for group in optimizer.param_groups:
        if "foreach" not in group or group["foreach"] is not None or group.get("fused") or \
                group.get("differentiable"):
            continue
        if all(supported(p) for p in group["params"]):
            group["foreach"] = True


def cuda_capturable_off(optimizer: torch.optim.Optimizer) -> str | None:
    """Turn ``capturable`` off on the groups of ``optimizer`` (a clone traced on the CPU for a CUDA target): torch's
    capturable step (for CUDA graphs) asserts that its tensors are on a GPU, which the trace's are not. Returns the
    coverage note saying what that leaves out, or None where no group was capturable."""
    count = 0
    for group in optimizer.param_groups:
        if group.get("capturable"):
            group["capturable"] = False
            count += len(group["params"])
    if not count:
        return None
    return (f"capturable=True (CUDA graphs) was traced as capturable=False for {count} parameter(s): its step "
            f"counters on the GPU (one 0-dim tensor per parameter, 512 B each after the allocator's rounding: "
            f"{count * 512:,} B) and the 0-dim bias corrections it computes there are not in the figure")


def clone_optimizer(optimizer: torch.optim.Optimizer, twins: Any, *, foreach: bool | None,
                    param_groups: list[tuple[int, list[torch.Tensor]]] | None = None,
                    keep_state: bool = True) -> torch.optim.Optimizer:
    """A new optimizer of the same class and hyperparameters over the twins of ``optimizer``'s parameters.

    Existing state (an optimizer that has stepped, e.g. resumed from a checkpoint) is twinned too.

    Args:
        foreach: when not None, set ``foreach`` on every group that left it to the default (``None``), so the
            trace uses the implementation the target device would (for-loop on CPU, foreach on CUDA).
        param_groups: the clone's groups as ``(index of the user's group whose hyperparameters it takes,
            parameters)``, for a clone whose parameters do not map one to one (FSDP1's flat parameters); default:
            each group's twins.
        keep_state: twin the existing state too; False: the clone starts without state (its state belongs to
            tensors the clone does not hold, such as DeepSpeed's flat partitions).

    Raises:
        TypeError: the class cannot be rebuilt from its ``param_groups`` and ``defaults``.
    """
    if isinstance(optimizer, OptimizerGroup):  # each member cloned over its own twins
        if param_groups is not None:
            raise TypeError("an OptimizerGroup's parameters map one to one: it takes no param_groups")
        return OptimizerGroup([clone_optimizer(opt, twins, foreach=foreach, keep_state=keep_state)
                               for opt in optimizer.optimizers])
    groups = []
    if param_groups is None:
        param_groups = [(i, [twins.tensor(p) for p in group["params"]])
                        for i, group in enumerate(optimizer.param_groups)]
    for index, params in param_groups:
        new_group = {k: v for k, v in optimizer.param_groups[index].items() if k != "params"}
        new_group["params"] = params
        if foreach is not None and "foreach" in new_group and new_group["foreach"] is None:
            new_group["foreach"] = foreach
        groups.append(new_group)
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}
    kwargs.update(_configuration(optimizer, accepted))
    for name in ("params", "self"):
        kwargs.pop(name, None)
    # Constructed outside fake mode: bitsandbytes builds its quantisation maps with data-dependent calls.
    clone = cls(groups, **kwargs)
    if isinstance(getattr(optimizer, "name2qmap", None), dict):
        # bitsandbytes' quantisation maps, built at construction when optim_bits=8 reaches Optimizer8bit: share
        # the user's (constant lookup tables, only read) so the clone has at its first step what the original has.
        clone.name2qmap = dict(optimizer.name2qmap)
    for p, state in optimizer.state.items() if keep_state else ():
        clone.state[twins.tensor(p)] = {k: _twin_state(twins, v) for k, v in state.items()}
    return clone


def _configuration(optimizer: torch.optim.Optimizer, accepted: Any) -> dict[str, Any]:
    """Constructor arguments an optimizer keeps outside ``defaults``, read back from the instance.

    bitsandbytes keeps ``optim_bits``, ``min_8bit_size``, ``max_unorm`` and ``skip_zeros`` in ``optimizer.args``
    and ``is_paged`` on the instance, not in ``defaults``: rebuilt from ``defaults`` alone,
    ``bnb.optim.AdamW(..., optim_bits=8)`` (what HF's ``optim="adamw_bnb_8bit"`` builds) would get 32-bit state.
    Passing ``args`` itself keeps every option bitsandbytes reads from it (its ``get_config`` reads ``args``, not
    the ``optim_bits`` argument, which classes such as ``AdamW8bit`` reject unless left at its default).
    """
    found: dict[str, Any] = {}
    config = getattr(optimizer, "args", None)
    if hasattr(config, "optim_bits"):
        if "args" in accepted:
            found["args"] = config
        else:  # e.g. AdEMAMix: takes optim_bits and min_8bit_size by name, and no args
            found.update({k: v for k, v in vars(config).items() if k in accepted})
    if "is_paged" in accepted and hasattr(optimizer, "is_paged"):
        found["is_paged"] = optimizer.is_paged
    betas = optimizer.defaults.get("betas")
    if hasattr(config, "optim_bits") and "momentum" in accepted and "betas" not in accepted and betas:
        # bitsandbytes' SGD and LARS keep momentum and dampening as ``betas`` (and refuse momentum=0)
        found["momentum"] = betas[0]
        if "dampening" in accepted and len(betas) > 1:
            found["dampening"] = betas[1]
    return found


def _twin_state(twins: TwinMaker, value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if value.numel() <= 1 and value.device.type != "meta":
        # Step counters are read with .item(): keep a real copy; the tracer fakes it and shadows its value.
        return value.detach().clone()
    return twins.tensor(value, cast=False, requires_grad=False)
