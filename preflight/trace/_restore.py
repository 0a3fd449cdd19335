"""Put the user's model back exactly as it was after preflight ran its code.

A trace (and `preflight.advise`'s option trials) runs the user's own module: its forward may cache tensors on
``self``, register hooks, flip flags; the trace itself swaps parameters in and out. `restored_module` snapshots
every module's attributes (and those of the plain objects they refer to: a transformers model's ``config``, a
helper object that caches on itself), the contents of dict attributes (parameter,
buffer, submodule and hook tables) and ``requires_grad`` flags, puts all of them back on exit, and checks that
nothing differs. `preflight.trace._process` does the same for the process around the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from preflight._device import is_plain_object

__all__ = ["NotRestoredError", "restored_module"]


class NotRestoredError(RuntimeError):
    """The user's model could not be put back as it was: a bug to report, never swallowed."""


_MISSING = object()


@contextlib.contextmanager
def restored_module(model: nn.Module) -> Iterator[None]:
    """Restore ``model`` on exit (see the module docstring).

    Raises:
        NotRestoredError: something still differs after restoring.
    """
    saved = _snapshot(model)
    try:
        yield
    finally:
        for obj, attrs, tables in saved.objects:
            current = obj.__dict__
            for key in [k for k in current if k not in attrs]:
                del current[key]
            for key, value in attrs.items():
                if current.get(key, _MISSING) is not value:
                    current[key] = value
            for key, items in tables.items():
                table = attrs[key]
                if not _same_items(table, items):
                    table.clear()
                    table.update(items)
        for p, flag in saved.requires_grad:
            if p.requires_grad != flag:
                p.requires_grad_(flag)
        if not _snapshot(model).same_as(saved):
            raise NotRestoredError(f"preflight could not restore {type(model).__name__} after running it; please "
                                   "report this with the model's class.")


@dataclasses.dataclass
class _Snapshot:
    objects: list[tuple[Any, dict[str, Any], dict[str, list[tuple[Any, Any]]]]]
    requires_grad: list[tuple[torch.Tensor, bool]]

    def same_as(self, other: _Snapshot) -> bool:
        if len(self.objects) != len(other.objects) or len(self.requires_grad) != len(other.requires_grad):
            return False
        for (o1, a1, t1), (o2, a2, t2) in zip(self.objects, other.objects):
            if o1 is not o2 or a1.keys() != a2.keys() or any(a1[k] is not a2[k] for k in a1):
                return False
            if t1.keys() != t2.keys() or any(not _same_items(dict(t1[k]), t2[k]) for k in t1):
                return False
        return all(p1 is p2 and f1 == f2 for (p1, f1), (p2, f2) in zip(self.requires_grad, other.requires_grad))


def _snapshot(model: nn.Module) -> _Snapshot:
    objects: list[Any] = []
    seen: set[int] = set()
    for module in model.modules():
        # The module, its config, and the plain objects it refers to (a helper that caches on itself).
        for obj in (module, *(v for v in module.__dict__.values() if is_plain_object(v))):
            if id(obj) not in seen:
                seen.add(id(obj))
                objects.append(obj)
    entries = []
    for obj in objects:
        attrs = dict(obj.__dict__)
        tables = {k: list(v.items()) for k, v in attrs.items() if isinstance(v, dict)}
        entries.append((obj, attrs, tables))
    return _Snapshot(entries, [(p, p.requires_grad) for p in model.parameters()])


def _same_items(table: Mapping[Any, Any], items: list[tuple[Any, Any]]) -> bool:
    return len(table) == len(items) and all(
        k1 == k2 and v1 is v2 for (k1, v1), (k2, v2) in zip(table.items(), items)
    )
