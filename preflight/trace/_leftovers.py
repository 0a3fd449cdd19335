"""Leave nothing of a trace behind: find the fake tensors that outlived it and repair whatever holds them.

A trace runs the user's own Python code, and that code may store what it computes: a ``functools.lru_cache``
(transformers' ``compile_compatible_method_lru_cache`` on BEiT's relative position index), a mask kept on
``self``, a module-level dict used as a cache, a global rebound on first use. Whatever is stored during the
trace is a `FakeTensor`, and every later real call that reads it would run on fakes (a fake loss, fake
gradients). `Sweep` prevents that without knowing any cache in advance:

1. Before the trace it takes a shallow copy of every loaded module's globals (about 20 ms).
2. The trace's `StorageTracker` keeps a weak set of every tensor an operator returned; the trace's own twins
   are added to it.
3. After the trace, once preflight's own frames and objects are gone, the tensors of that set still alive are
   what the trace left behind. `gc.get_referrers` walks up from them to the containers that hold them, through
   immutable ones (a cached ``(cos, sin)`` tuple), and each holder is repaired:

   - a slot that held one of the user's real tensors before the trace (a module-level ``STATE["pos"]`` or a
     helper's attribute rebound to a value computed from it, or the fake twin standing for it): the real tensor
     is put back (`Sweep.remember`, called as the tracker adopts each real tensor);

   - a ``functools`` cache wrapper (``lru_cache``, ``cache``, bounded or not): cleared (a cache refills itself);
   - a module's globals: the name gets its value from before the trace back, or is removed if it was new;
   - an object's attribute (a ``cached_property`` too): deleted from the instance, so the class default, or
     the property's recomputation, applies again;
   - an entry of a dict, list, set or deque (a keyed cache): removed;
   - a closure cell: set to None (what a lazily filled closure variable starts from).

Each repair is described in the trace's notes. The traced model's own modules are put back separately, and
exactly, by `preflight.trace._restore.restored_module`.

Known limitations: an attribute outside the traced model that held no tensor before the trace (or held one the
trace never read) and now holds a fake is deleted, not restored, and such a closure cell is set to None; fakes
held only by C++ objects (not visible to ``gc``) cannot be found, and are reported as such.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from preflight._warnings import warn
from preflight.trace import _interrupts as interrupts
from preflight.trace._tracker import _is_fake

__all__ = ["Sweep", "clear_traceback_frames", "swept"]

# Containers that only ever hold what they were built with: walk past them to whatever holds them.
_WALK_UP_LEVELS = 6
_MISSING = object()


class Sweep:
    """Find and repair what one or more traces left behind (see the module docstring).

    Use: create it before the trace, `watch` each weak set of traced tensors, and call `run` once the trace's
    own frames have returned. `run` returns the notes describing each repair.
    """

    def __init__(self) -> None:
        self._watched: list[WeakIdKeyDictionary] = []
        self._globals = {id(m.__dict__): (m, dict(m.__dict__))
                         for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)}
        self._before = _Before()
        self._after: list[Callable[[], list[str]]] = []

    def watch(self, tensors: WeakIdKeyDictionary) -> None:
        """Check the keys of ``tensors`` (the trace's fake tensors, weakly held) when the sweep runs."""
        self._watched.append(tensors)

    def after(self, repair: Callable[[], list[str]]) -> None:
        """Call ``repair()`` (returning notes) once the leftovers are repaired."""
        self._after.append(repair)

    def remember(self, real: Any, fake: Any) -> None:
        """``fake`` stands for the user's tensor ``real`` in the trace: wherever the trace left ``fake`` or rebound a
        slot that held ``real``, put ``real`` back; restore ``real.grad`` (a backward through ``real`` sets it)."""
        self._before.remember(real, fake)

    def _alive(self) -> list[Any]:
        return [t for tensors in self._watched for t in list(tensors.keys())]

    def run(self) -> list[str]:
        """Repair every holder of a watched tensor that is still alive; return what was repaired."""
        notes = self._leftovers()
        for repair in self._after:
            notes.extend(repair())
        self._after.clear()
        return notes

    def _leftovers(self) -> list[str]:
        notes = self._before.restore_grads()
        if not self._alive():
            self._before.clear()
            return notes
        gc.collect()  # fakes in garbage cycles are not leftovers
        alive = self._alive()
        if not alive:
            self._before.clear()
            return notes
        notes += _repair(alive, self._globals, self._before)
        if self._before.unlooked:
            notes.append(f"{self._before.unlooked} real tensor(s) the step read came after the first "
                         f"{_Before.LOOKUPS}, whose holders were recorded: a slot of theirs the trace rebound was "
                         "repaired as any leftover (entry removed, attribute deleted), not given its tensor back")
        self._before.clear()
        del alive
        gc.collect()
        remaining = len(self._alive())
        if remaining:
            notes.append(f"{remaining} fake tensor(s) of the trace are still referenced from outside Python "
                         "objects preflight can see; they were left as they are")
        self._watched.clear()
        return notes


def clear_traceback_frames(err: BaseException | None) -> None:
    """Drop the local variables of the finished frames in ``err``'s traceback (and its chained exceptions):
    they hold the trace's fake tensors, which would otherwise stay alive with the exception."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if err.__traceback__ is not None:
            traceback.clear_frames(err.__traceback__)
        err = err.__cause__ or err.__context__


class _Before:
    """What the user's real tensors were and where they were held, recorded as the trace adopted them
    (`preflight.trace._tracker.StorageTracker._adopt`): a slot that held the real tensor and holds a fake after the
    trace (``STATE["pos"] = STATE["pos"] + 1``, ``helper.t = helper.t * 2``) gets the real tensor back instead of
    losing its entry.

    Finding the slots costs one pass over the garbage collector's objects per adopted tensor (tens of
    milliseconds in a process with transformers loaded), so only the first `LOOKUPS` are looked up; a slot of a
    later one that the trace rebound is handled as any other leftover (the entry removed, the attribute deleted)
    and the notes say so."""

    LOOKUPS = 32

    def __init__(self) -> None:
        self.real_of = WeakIdKeyDictionary()  # fake twin -> the user's tensor it stands for
        self.slots: dict[tuple[int, Any], Any] = {}  # (id(container), key) -> the real tensor the slot held
        self._containers: list[Any] = []  # keeps the slots' containers (and so their ids) alive
        self._grads: list[tuple[Any, Any]] = []
        self._looked_up = 0
        self.unlooked = 0

    def remember(self, real: Any, fake: Any) -> None:
        self.real_of[fake] = real
        if real.requires_grad and real.is_leaf and not _is_fake(real.grad):
            # A fake .grad now was put there by preflight (`preflight.trace._run.carry_parameter_hooks`), which puts
            # the real one back itself.
            self._grads.append((real, real.grad))
        if self._looked_up >= self.LOOKUPS:
            self.unlooked += 1
            return
        self._looked_up += 1
        for holder in gc.get_referrers(real):
            if isinstance(holder, types.FrameType):
                continue
            if type(holder) is dict or isinstance(holder, dict) and type(holder).__module__ == "collections":
                keys = [k for k, v in list(holder.items()) if v is real]
            elif isinstance(holder, (list, collections.deque)):
                keys = [i for i, v in enumerate(holder) if v is real]
            elif isinstance(holder, types.CellType):
                keys = [None]
            else:  # an object whose attribute holds it (Python 3.12 reports the object, not its __dict__)
                own = getattr(holder, "__dict__", None) if not isinstance(holder, type) else None
                if type(own) is not dict:
                    continue
                holder = own
                keys = [k for k, v in list(own.items()) if v is real]
            for key in keys:
                self.slots.setdefault((id(holder), key), real)
            if keys:
                self._containers.append(holder)

    def previous(self, holder: Any, key: Any, value: Any) -> Any:
        """What ``holder[key]`` (now ``value``, a leftover fake or a container holding one) held before the trace, or
        `_MISSING`."""
        real = self.real_of.get(value) if isinstance(value, torch.Tensor) else None
        if real is not None:
            return real
        return self.slots.get((id(holder), key), _MISSING)

    def restore_grads(self) -> list[str]:
        changed = [(real, grad) for real, grad in self._grads if real.grad is not grad]
        for real, grad in changed:
            real.grad = grad
        self._grads.clear()
        return ([f"put back .grad of {len(changed)} tensor(s) outside the model that the traced backward had written"]
                if changed else [])

    def clear(self) -> None:
        self.slots.clear()
        self._containers.clear()


def _repair(alive: list[Any], module_globals: dict[int, tuple[types.ModuleType, dict]],
            before: _Before) -> list[str]:
    notes: list[str] = []
    done: set[int] = set()
    targets = list(alive)
    ignore = {id(alive)}  # preflight's own containers of candidates are not holders
    for _ in range(_WALK_UP_LEVELS):
        if not targets:
            break
        ignore.add(id(targets))
        target_ids = {id(t) for t in targets}
        found = gc.get_referrers(*targets)
        ignore.add(id(found))
        holders = [h for h in found if id(h) not in ignore and id(h) not in done and id(h) not in target_ids
                   and not isinstance(h, types.FrameType)]
        del found
        ignore.add(id(holders))
        dicts = [h for h in holders if type(h) is dict and id(h) not in module_globals]
        ignore.add(id(dicts))
        owners = _dict_owners(dicts, ignore) if dicts else {}
        walk_up: list[Any] = []
        ignore.add(id(walk_up))
        for holder in holders:
            done.add(id(holder))
            note = _repair_holder(holder, target_ids, module_globals, owners, before)
            if note is None and isinstance(holder, (tuple, frozenset)):
                walk_up.append(holder)  # an immutable container: repair whatever holds it
            elif note:
                notes.append(note)
        targets = walk_up
    return notes


def _dict_owners(dicts: list[dict], ignore: set[int]) -> dict[int, Any]:
    """For each dict, the object it is the ``__dict__`` of, or the ``functools`` cache it is the storage of."""
    ids = {id(d) for d in dicts}
    owners: dict[int, Any] = {}
    for ref in gc.get_referrers(*dicts):
        if id(ref) in ignore or isinstance(ref, types.FrameType):
            continue
        if isinstance(ref, functools._lru_cache_wrapper):
            # An unbounded functools cache keeps its results in a private dict that only the wrapper holds.
            for d in gc.get_referents(ref):
                if id(d) in ids:
                    owners[id(d)] = ref
            continue
        own = getattr(ref, "__dict__", None) if not isinstance(ref, type) else None
        if type(own) is dict and id(own) in ids:
            owners.setdefault(id(own), ref)
    return owners


def _holds(value: Any, target_ids: set[int]) -> bool:
    return id(value) in target_ids


def _repair_holder(holder: Any, target_ids: set[int], module_globals: dict[int, tuple[types.ModuleType, dict]],
                   owners: dict[int, Any], before: _Before) -> str | None:
    """Repair one holder; return a note, "" for a holder that needs nothing, or None to walk up past it."""
    restored = _restore_slots(holder, target_ids, before)
    if restored:
        return restored
    if isinstance(holder, functools._lru_cache_wrapper):
        holder.cache_clear()
        return f"cleared the functools cache {_name(holder)}, which the trace had filled with fake tensors"
    if isinstance(holder, types.CellType):
        # Its value before the trace is unknown; None is what a lazily filled closure variable starts from
        # (an emptied cell would raise NameError at the next read).
        holder.cell_contents = None
        return "set a closure variable the trace had set to a fake tensor back to None"
    if type(holder) is dict and id(holder) in module_globals:
        module, before = module_globals[id(holder)]
        return _restore_globals(holder, module, before, target_ids)
    if isinstance(holder, dict):
        owner = owners.get(id(holder))
        if isinstance(owner, functools._lru_cache_wrapper):
            owner.cache_clear()
            return f"cleared the functools cache {_name(owner)}, which the trace had filled with fake tensors"
        if owner is not None:
            return _delete_attributes(owner, holder, target_ids)
        keys = [k for k, v in list(holder.items()) if _holds(k, target_ids) or _holds(v, target_ids)]
        for k in keys:
            del holder[k]
        return f"removed {len(keys)} entr{'y' if len(keys) == 1 else 'ies'} from {_where(holder, module_globals)}"
    if isinstance(holder, (list, collections.deque)):
        kept = [v for v in holder if not _holds(v, target_ids)]
        removed = len(holder) - len(kept)
        holder.clear()
        holder.extend(kept)
        return f"removed {removed} item(s) from {_where(holder, module_globals)}"
    if isinstance(holder, set):
        gone = [v for v in holder if _holds(v, target_ids)]
        holder.difference_update(gone)
        return f"removed {len(gone)} item(s) from {_where(holder, module_globals)}"
    if isinstance(holder, (tuple, frozenset)):
        return None
    own = getattr(holder, "__dict__", None) if not isinstance(holder, type) else None
    if isinstance(own, dict) and any(_holds(v, target_ids) for v in own.values()):
        return _delete_attributes(holder, own, target_ids)
    return None


def _restore_slots(holder: Any, target_ids: set[int], before: _Before) -> str | None:
    """Put back the user's tensors in the slots of ``holder`` that held one before the trace, when ``holder`` has
    no other leftover; a note, or None when there was nothing to put back (or more to repair)."""
    if isinstance(holder, dict):
        slots = [(k, v) for k, v in list(holder.items()) if _holds(v, target_ids)]
    elif isinstance(holder, (list, collections.deque)):
        slots = [(i, v) for i, v in enumerate(holder) if _holds(v, target_ids)]
    elif isinstance(holder, types.CellType):
        slots = [(None, holder.cell_contents)]
    else:
        own = getattr(holder, "__dict__", None) if not isinstance(holder, type) else None
        if not isinstance(own, dict) or not any(_holds(v, target_ids) for v in own.values()):
            return None
        return _restore_slots(own, target_ids, before)
    previous = [(k, before.previous(holder, k, v)) for k, v in slots]
    if not previous or any(p is _MISSING for _, p in previous):
        return None
    for key, value in previous:
        if key is None:
            holder.cell_contents = value
        else:
            holder[key] = value
    return (f"put back the value from before the trace in {len(previous)} slot(s) of a {type(holder).__name__} that "
            "the trace had set to a fake tensor")


def _restore_globals(namespace: dict, module: types.ModuleType, before: dict, target_ids: set[int]) -> str:
    names = [k for k, v in list(namespace.items()) if _holds(v, target_ids)]
    for name in names:
        old = before.get(name, _MISSING)
        if old is _MISSING:
            del namespace[name]
        else:
            namespace[name] = old
    return f"restored global(s) {', '.join(names)} of module {module.__name__} to their values before the trace"


def _delete_attributes(owner: Any, namespace: dict, target_ids: set[int]) -> str:
    names = [k for k, v in list(namespace.items()) if _holds(v, target_ids)]
    for name in names:
        del namespace[name]
    return (f"deleted attribute(s) {', '.join(names)} that the trace set to fake tensors on a "
            f"{type(owner).__qualname__} object")


def _where(container: Any, module_globals: dict[int, tuple[types.ModuleType, dict]]) -> str:
    """``module.NAME`` when a module global is ``container``, else its type: for the notes."""
    for module, namespace in module_globals.values():
        for name, value in namespace.items():
            if value is container:
                return f"{module.__name__}.{name}"
    return f"a {type(container).__name__} the trace wrote into"


def _name(fn: Any) -> str:
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"


def swept(trace: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a trace function taking ``sweep=``: give it a fresh `Sweep`, and once it has returned (or
    raised), repair what its traces left behind. Its result's ``notes`` list gets the repairs; its ``error``, an
    exception it kept, loses its frames' locals (they hold fakes)."""

    @functools.wraps(trace)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # Ctrl-C waits for a safe point (`preflight.trace._interrupts`); an interrupted trace returns nothing.
        with interrupts.deferred_interrupts():
            sweep = Sweep()
            try:
                result = trace(*args, sweep=sweep, **kwargs)
            except BaseException as err:
                clear_traceback_frames(err)
                with interrupts.finishing():
                    _run_or_warn(sweep)
                    _collect_young()
                raise
            clear_traceback_frames(result.error)
            with interrupts.finishing():
                result.notes.extend(_run_or_warn(sweep))
                _collect_young()
        return result

    return wrapper


@contextlib.contextmanager
def fake_region() -> Iterator[None]:
    """For fake-tensor work outside a `swept` trace (nothing of the user's code runs, so nothing to sweep): Ctrl-C
    waits for the exit, and what the block made is freed before it (`_collect_young`). Return from a function
    inside the block, so that its locals are gone by then."""
    with interrupts.deferred_interrupts():
        try:
            yield
        finally:
            with interrupts.finishing():
                _collect_young()


def _collect_young() -> None:
    """Free the trace's fake mode now, while interrupts are deferred. torch's dispatch makes self-referencing closures
    over the mode (``FakeTensorMode._dispatch_impl``'s ``go``), so the mode, its storages' ``__del__`` and its weak
    dictionaries' callbacks would otherwise wait for a later collection, in the user's code, where a Ctrl-C landing
    in them is dropped ("Exception ignored in ..."). Those closures are young: collecting the two young generations
    frees them, and the mode then dies by reference counting, at a fraction of a full collection's cost."""
    gc.collect(1)


def _run_or_warn(sweep: Sweep) -> list[str]:
    try:
        return sweep.run()
    except Exception as err:  # noqa: BLE001 - never crash the user's run; say what could not be checked
        warn(f"preflight could not check that its trace left no fake tensors behind ({type(err).__name__}: "
             f"{err}); if later real steps fail on FakeTensors, please report it.", RuntimeWarning)
        return []
