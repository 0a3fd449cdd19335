"""Find a model's repeated stack of blocks, and run the model with only its first blocks.

A transformer's depth is a `nn.ModuleList` (or `nn.Sequential`) of blocks of one class, or a short period of
them (alternating sliding/global attention, a hybrid Mamba/attention pattern). `find_stack` finds it and its
period: the children must agree, period by period, in module classes, parameter and buffer shapes, dtypes,
strides and ``requires_grad``, hook counts and every plain attribute (``sliding_window``, ``attention_type``,
``is_causal`` ...) except layer indices, and every per-layer list of the model's config (``layer_types``) must
repeat with the same period. `truncated` runs the model with its first ``k`` blocks only (the container's table
is put back on exit), and `optimizer_without` gives the optimizer as it would be without the dropped blocks'
parameters (the user's optimizer is not touched).

Known limitations: code that branches on a layer index (``if self.layer_idx == 3``) or on the depth read from the
config is not seen here; `preflight.trace._compose` checks the composed timeline against three traced depths,
which catches a branch taken at those depths but not one taken only deeper in the stack.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import enum
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["Stack", "find_stack", "optimizer_without", "truncated"]

# Config attributes holding the depth (transformers' names; GPT-2's n_layer is its num_hidden_layers).
_DEPTH_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
# Attributes that number a block within its stack: they differ between identical blocks by design.
_INDEX_WORDS = ("idx", "index", "layer_id", "layer_num", "block_id", "block_num")


@dataclasses.dataclass(frozen=True)
class Stack:
    """A repeated stack: ``container`` (named ``name`` in the model) holds ``blocks`` children repeating with
    ``period``."""

    name: str
    container: nn.Module
    blocks: int
    period: int
    configs: tuple[Any, ...] = ()  # config objects whose depth and per-layer lists follow the truncation

    def params_from(self, k: int) -> set[int]:
        """Ids of the parameters of blocks ``k`` and after."""
        children = list(self.container._modules.values())[k:]
        return {id(p) for child in children for p in child.parameters()}


def find_stack(model: nn.Module, optimizer: torch.optim.Optimizer, *, min_periods: int) -> Stack | str:
    """The model's repeated stack with at least ``min_periods`` periods, or the reason there is none."""
    candidates = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2:
            size = sum(p.numel() for p in module.parameters())
            candidates.append((size, name, module))
    if not candidates:
        return "no nn.ModuleList or nn.Sequential of blocks"
    # The depth stack holds most of the weights; lists inside its blocks (experts, heads) are never truncated.
    size, name, container = max(candidates, key=lambda c: c[0])
    children = list(container._modules.values())
    if any(child is None for child in children):
        return f"{name or 'the model'} holds None entries"
    signatures = [_signature(child, i) for i, child in enumerate(children)]
    configs = _configs(model, name)
    per_layer = [values for config in configs for values in _per_layer(config, len(children)).values()]
    rows = [(sig, tuple(values[i] for values in per_layer)) for i, sig in enumerate(signatures)]
    period = next((p for p in range(1, len(rows) + 1) if all(rows[i] == rows[i % p] for i in range(len(rows)))))
    label = name or type(model).__name__
    if len(rows) // period < min_periods:
        return (f"{label} has {len(rows)} blocks repeating with a period of {period}: fewer than {min_periods} "
                "periods, a full trace costs less")
    owners: dict[int, int] = {}
    for i, child in enumerate(children):
        for p in child.parameters():
            if owners.setdefault(id(p), i) != i:
                return f"blocks {owners[id(p)]} and {i} of {label} share a parameter"
    if any(id(p) in owners for p in _params_outside(model, container)):
        return f"a parameter of {label} is also used outside it"
    order = _optimizer_order(optimizer, children, owners, period)
    if order is not None:
        return order
    return Stack(name=name, container=container, blocks=len(children), period=period, configs=tuple(configs))


@contextlib.contextmanager
def truncated(stack: Stack, k: int) -> Iterator[None]:
    """Run the model with the first ``k`` blocks of ``stack`` only, as a ``k``-layer model: the configs' layer
    counts and per-layer lists say ``k`` too (a cache sized from the config then holds ``k`` layers). Everything
    is put back on exit."""
    table = stack.container._modules
    saved = dict(table)
    saved_configs = [(config, dict(vars(config))) for config in stack.configs]
    table.clear()
    table.update(dict(list(saved.items())[:k]))
    try:
        for config, attrs in saved_configs:
            for key, value in _per_layer(config, stack.blocks).items():
                vars(config)[key] = type(attrs[key])(attrs[key][:k])
            for key in _DEPTH_NAMES:
                if attrs.get(key) == stack.blocks:
                    vars(config)[key] = k
        yield
    finally:
        table.clear()
        table.update(saved)
        for config, attrs in saved_configs:
            vars(config).clear()
            vars(config).update(attrs)


def optimizer_without(optimizer: torch.optim.Optimizer, dropped: set[int]) -> torch.optim.Optimizer:
    """A shallow copy of ``optimizer`` whose groups and state leave out the parameters in ``dropped`` (ids). It keeps
    the optimizer's own attributes, which ``copy.copy`` drops (torch's ``Optimizer.__getstate__`` keeps only
    defaults, state and groups): bitsandbytes' ``args`` (``optim_bits``...) and ``is_paged``. Callables are not
    carried (an LR scheduler's wrapper of ``step`` is bound to the user's optimizer)."""
    defaults = dict(optimizer.defaults)
    view = copy.copy(optimizer)  # Optimizer.__setstate__ adds "differentiable" to the defaults it shares
    optimizer.defaults.clear()
    optimizer.defaults.update(defaults)
    view.defaults = dict(view.defaults)
    for name, value in vars(optimizer).items():
        if not callable(value):
            view.__dict__.setdefault(name, value)
    view.param_groups = [{**group, "params": [p for p in group["params"] if id(p) not in dropped]}
                         for group in optimizer.param_groups]
    view.state = collections.defaultdict(dict, {p: s for p, s in optimizer.state.items() if id(p) not in dropped})
    return view


def _signature(block: nn.Module, index: int) -> tuple:
    """What must agree between blocks of one period position; strings naming the block's own path (PEFT's
    ``target_name``, ``model.layers.3.self_attn.q_proj``) have the block's index replaced."""
    def plain(value: Any) -> Any:
        value = _plain(value)
        return _without_index(value, f".{index}.") if index >= 0 else value

    modules = []
    for name, module in block.named_modules(remove_duplicate=False):
        attrs = tuple(sorted((k, plain(v)) for k, v in vars(module).items()
                             if not k.startswith("_") and not _is_index(k)
                             and not isinstance(v, (nn.Module, torch.Tensor))))
        hooks = tuple(len(getattr(module, table, {})) for table in
                      ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))
        modules.append((name, type(module).__qualname__, attrs, hooks))
    params = tuple((n, tuple(p.shape), tuple(p.stride()), p.dtype, p.requires_grad, type(p).__name__)
                   for n, p in block.named_parameters(remove_duplicate=False))
    buffers = tuple((n, tuple(b.shape), tuple(b.stride()), b.dtype)
                    for n, b in block.named_buffers(remove_duplicate=False))
    return tuple(modules), params, buffers


def _without_index(value: Any, mark: str) -> Any:
    if isinstance(value, str):
        return value.replace(mark, ".#.")
    if isinstance(value, tuple):
        return tuple(_without_index(v, mark) for v in value)
    return value


def _is_index(key: str) -> bool:
    key = key.lower()
    return any(word in key for word in _INDEX_WORDS)


def _plain(value: Any) -> Any:
    """A comparable stand-in for an attribute value: itself for plain values, containers recursively, the type
    name for other objects (a shared config, a function)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype, torch.device, enum.Enum)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(repr(_plain(v)) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((repr(k), _plain(v)) for k, v in value.items()))
    return ("object", type(value).__qualname__)


def _configs(model: nn.Module, name: str) -> list[Any]:
    """The config of the stack's model: that of the nearest module above the stack ``name`` that holds one
    (``module.config``), with the sub-configs in it. A multimodal model's vision tower has a config of its own,
    whose depth may equal the language model's but must not follow its truncation."""
    owner = None
    module = model
    for part in ([*name.split(".")[:-1]] if name else []):
        if getattr(module, "config", None) is not None:
            owner = module.config
        module = getattr(module, part)
    if getattr(module, "config", None) is not None:
        owner = module.config
    found: list[Any] = []
    seen: set[int] = set()
    pending = [owner]
    while pending:
        config = pending.pop()
        if config is None or id(config) in seen or isinstance(config, (nn.Module, torch.Tensor)):
            continue
        seen.add(id(config))
        try:
            items = list(vars(config).items())
        except TypeError:
            continue
        found.append(config)
        pending.extend(v for _, v in items if type(v).__name__.endswith("Config"))
    return found


def _per_layer(config: Any, blocks: int) -> dict[str, tuple]:
    """A config's per-layer lists (``layer_types``: a list or tuple of length ``blocks``), by attribute name."""
    return {key: tuple(_plain(v) for v in value) for key, value in sorted(vars(config).items())
            if isinstance(value, (list, tuple)) and len(value) == blocks}


def _params_outside(model: nn.Module, container: nn.Module) -> Iterator[torch.nn.Parameter]:
    """Parameters reachable from the model without going through ``container``."""
    inside = {id(m) for m in container.modules()}
    for module in model.modules():
        if id(module) in inside:
            continue
        yield from module._parameters.values()


def _optimizer_order(optimizer: torch.optim.Optimizer, children: list[nn.Module], owners: dict[int, int],
                     period: int) -> str | None:
    """None if, in every parameter group, the stack's parameters form one run in block order with the same
    parameter order in every block of a period position (so a deeper model's groups are a shallower one's with
    whole blocks inserted), else the reason."""
    names = {id(p): n for child in children for n, p in child.named_parameters()}
    for g, group in enumerate(optimizer.param_groups):
        blocks = [owners.get(id(p)) for p in group["params"]]
        run = [i for i, b in enumerate(blocks) if b is not None]
        if not run:
            continue
        if run != list(range(run[0], run[-1] + 1)):
            return f"parameter group {g} mixes the stack's parameters with others"
        order = [blocks[i] for i in run]
        if order != sorted(order):
            return f"parameter group {g} does not hold the stack's parameters in block order"
        pattern: dict[int, list[str]] = {}
        for i in run:
            p = group["params"][i]
            pattern.setdefault(owners[id(p)], []).append(names.get(id(p), ""))
        for b in range(len(children)):
            if pattern.get(b) != pattern.get(b % period):
                return f"parameter group {g} holds different parameters of blocks {b % period} and {b}"
    return None
