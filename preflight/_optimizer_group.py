"""`OptimizerGroup`: several optimizers one training step uses, seen as one.

A GAN's step updates the generator with one optimizer and the discriminator with another (Lightning's manual
optimization returns both from ``configure_optimizers``). Everything preflight reads of "the optimizer" (its
parameter groups, its state, its state dict for a checkpoint, the closed-form state size) reads the union; the
trace makes a fake clone of each member, and the user's step, which calls its own optimizers, is pointed at those
clones while it runs (`manual_optimizers`). Its members are the user's objects, never changed.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["STANDS_FOR", "OptimizerGroup", "manual_optimizers", "members", "stands_for"]


class _UnionState(Mapping):
    """The members' ``state`` read as one mapping (parameter -> its state), written through to the member that
    trains the parameter."""

    def __init__(self, group: OptimizerGroup) -> None:
        self._group = group

    def _owner(self, p: Any) -> torch.optim.Optimizer:
        for opt in self._group.optimizers:
            if p in opt.state or any(p is q for g in opt.param_groups for q in g["params"]):
                return opt
        raise KeyError(p)

    def __getitem__(self, p: Any) -> Any:
        return self._owner(p).state[p]

    def __contains__(self, p: Any) -> bool:  # without the members' defaultdicts making an entry
        return any(p in opt.state for opt in self._group.optimizers)

    def get(self, p: Any, default: Any = None) -> Any:
        return next((opt.state[p] for opt in self._group.optimizers if p in opt.state), default)

    def __setitem__(self, p: Any, value: Any) -> None:
        self._owner(p).state[p] = value

    def __iter__(self) -> Iterator[Any]:
        for opt in self._group.optimizers:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._group.optimizers)


class OptimizerGroup(torch.optim.Optimizer):
    """Several optimizers used by one training step (a GAN's generator and discriminator optimizers), for
    `preflight.estimate` and ``check`` with ``Run(loop=Loop(manual=True))``: the step calls each one itself.

    ``param_groups`` is every member's groups in order, ``state`` every member's state (`_UnionState`), ``step`` and
    ``zero_grad`` call each member's, ``state_dict`` is ``{"optimizers": [each member's]}`` (the list Lightning
    saves as ``optimizer_states``).

    Args:
        optimizers: the optimizers, at least one; each a ``torch.optim.Optimizer``.

    Raises:
        TypeError: a member is not an optimizer, or is itself a group.
        ValueError: no optimizer, or a parameter trained by two members.

    Example:
        >>> opts = OptimizerGroup([Adam(gen.parameters()), Adam(disc.parameters())])  # doctest: +SKIP
        >>> preflight.estimate(model, opts, batch, Run(loop=Loop(manual=True)), step=gan_step)  # doctest: +SKIP

    Known limitations: a step that uses several optimizers is traced with `Loop.manual` on one device; the loop's
    own step (``manual=False``) steps every member after one backward.
    """

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:  # noqa: D107 - no Optimizer.__init__:
        # the members hold the groups and the state.
        members = list(optimizers)
        if not members:
            raise ValueError("`OptimizerGroup` needs at least one optimizer, got none.")
        for opt in members:
            if not isinstance(opt, torch.optim.Optimizer) or isinstance(opt, OptimizerGroup):
                raise TypeError(f"`OptimizerGroup` takes torch.optim.Optimizer instances (not groups), got "
                                f"{type(opt).__name__}.")
        seen: set[int] = set()
        for opt in members:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) in seen:
                        raise ValueError("a parameter is trained by two optimizers of the `OptimizerGroup`; each "
                                         "parameter should belong to one of them.")
                    seen.add(id(p))
        self.optimizers = members
        self.defaults: dict[str, Any] = {}
        self._optimizer_step_pre_hooks: dict[int, Callable[..., Any]] = collections.OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable[..., Any]] = collections.OrderedDict()
        self._optimizer_state_dict_pre_hooks: dict[int, Callable[..., Any]] = collections.OrderedDict()
        self._optimizer_state_dict_post_hooks: dict[int, Callable[..., Any]] = collections.OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: dict[int, Callable[..., Any]] = collections.OrderedDict()
        self._optimizer_load_state_dict_post_hooks: dict[int, Callable[..., Any]] = collections.OrderedDict()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self) -> _UnionState:  # type: ignore[override]
        return _UnionState(self)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        for opt, own in zip(self.optimizers, state_dict["optimizers"], strict=True):
            opt.load_state_dict(own)

    def __repr__(self) -> str:
        return f"OptimizerGroup({', '.join(type(opt).__name__ for opt in self.optimizers)})"


def members(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers ``optimizer`` stands for: an `OptimizerGroup`'s members, else itself."""
    return list(optimizer.optimizers) if isinstance(optimizer, OptimizerGroup) else [optimizer]


_SWAPPED = ("param_groups", "state", "defaults")
# Set on a shallow copy of an optimizer made to trace a first step again (its state left out): the optimizer the
# user's step calls, which `manual_optimizers` points at the copy's clone.
STANDS_FOR = "_preflight_stands_for"


def stands_for(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The user's optimizer ``optimizer`` is, or is a copy of (`STANDS_FOR`)."""
    return optimizer.__dict__.get(STANDS_FOR, optimizer)


@contextlib.contextmanager
def manual_optimizers(real: torch.optim.Optimizer, fake: torch.optim.Optimizer,
                      on_step: Callable[[bool], None]) -> Iterator[None]:
    """For the block, each of ``real``'s optimizers (`members`, or the user's optimizer a copy stands for) steps its
    fake clone's parameters and state: a step that calls the user's own optimizers (manual optimization) updates
    the trace's twins, not the weights. ``on_step(True)`` is called as each one's ``step`` starts, ``on_step(False)``
    as it ends; the user's own step hooks do not run (the loop's own step runs none either). Each optimizer's
    instance dict is put back as it was on the way out (groups, state, defaults, hooks, and whatever a step sets
    on it, such as the flag an LR scheduler's wrapper of ``step`` sets)."""
    pairs = list(zip((stands_for(opt) for opt in members(real)), members(fake), strict=True))
    kept = [dict(opt.__dict__) for opt, _ in pairs]
    try:
        for opt, clone in pairs:
            for name in _SWAPPED:
                opt.__dict__[name] = clone.__dict__[name]
            opt.__dict__["_optimizer_step_pre_hooks"] = collections.OrderedDict()
            opt.__dict__["_optimizer_step_post_hooks"] = collections.OrderedDict()
            opt.register_step_pre_hook(lambda *_: on_step(True))
            opt.register_step_post_hook(lambda *_: on_step(False))
        yield
    finally:
        for (opt, _), own in zip(pairs, kept, strict=True):
            opt.__dict__.clear()
            opt.__dict__.update(own)
