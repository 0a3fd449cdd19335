"""Process state a trace must leave as it found it, and must not be seen by: random streams, global hooks, torch's
global flags, the environment, and the user's own dispatch modes and saved-tensor hooks.

A trace runs the user's step inside the user's process. Whatever the step touches beyond its model and batch
would otherwise be touched twice:

- **Random streams** (`isolated_rng`): Python's ``random`` and NumPy's legacy global stream are routed per thread
  for the duration: the calling thread draws from a private copy of the global state (so its draws, or a
  ``random.seed`` in the step, change nothing), while other threads keep drawing from the global stream, which is
  left where they took it (restoring it at exit would make them repeat their draws). torch's generators cannot be
  routed per thread: they are restored at exit when they changed, and when other Python threads were alive the
  restore is reported, since a draw another thread made meanwhile will repeat.
- **Global hooks** (`isolated_process`): module hooks registered with ``register_module_forward_hook`` and its
  siblings, and optimizer hooks registered with ``register_optimizer_step_post_hook`` / ``..._pre_hook``, are
  suspended: they would run on preflight's fake copies (an SWA ``AveragedModel`` updated by a global optimizer
  hook would count steps that never happened). What they allocate is not in the trace; the notes say how many.
- **Global flags and the environment**: torch's process-wide switches a step may flip (matmul precision, TF32,
  cuDNN benchmark and determinism, deterministic algorithms, default dtype, anomaly detection) and
  ``os.environ`` are put back as they were.
- **The user's dispatch modes and saved-tensor hooks** active around the call are taken off for the trace and put
  back after: they would see fake tensors.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _python_dispatch

__all__ = ["CudaRng", "isolated_process", "isolated_rng"]

_RANDOM_EXCLUDED = frozenset({"Random", "SystemRandom"})


class CudaRng:
    """Read and write the CUDA generators' states; only where CUDA is already initialised (reading them would
    initialise it otherwise, which is itself a change). Tests pass a double."""

    def get(self) -> list[torch.Tensor] | None:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        return torch.cuda.get_rng_state_all()

    def set(self, states: list[torch.Tensor]) -> None:
        torch.cuda.set_rng_state_all(states)


@contextlib.contextmanager
def isolated_rng(notes: list[str] | None = None, cuda: Any = None) -> Iterator[None]:
    """Leave every random stream (torch CPU and CUDA, Python, NumPy) as it would be had the block not run (module
    docstring); ``notes`` gets a line when torch's streams were restored while other threads were alive. ``cuda``
    reads and writes the CUDA generators (default `CudaRng`)."""
    cuda = cuda if cuda is not None else CudaRng()
    others_alive = threading.active_count() > 1
    cpu_state = torch.get_rng_state()
    cuda_states = cuda.get()
    with _routed(random, random._inst, _copy_python), _routed_numpy():
        try:
            yield
        finally:
            changed = not torch.equal(torch.get_rng_state(), cpu_state)
            torch.set_rng_state(cpu_state)
            if cuda_states is not None:
                now = cuda.get()
                changed = changed or now is None or any(not torch.equal(a, b) for a, b in zip(now, cuda_states))
                cuda.set(cuda_states)
            if changed and (others_alive or threading.active_count() > 1) and notes is not None:
                notes.append("torch's global random stream changed while preflight ran, with other threads alive; it "
                             "was put back as it was before, so a draw another thread made meanwhile will repeat")


def _copy_python(global_random: random.Random) -> random.Random:
    private = random.Random()
    private.setstate(global_random.getstate())
    return private


@contextlib.contextmanager
def _routed_numpy() -> Iterator[None]:
    np = sys.modules.get("numpy")
    mtrand = getattr(getattr(np, "random", None), "mtrand", None)
    global_state = getattr(mtrand, "_rand", None)
    if global_state is None:
        yield
        return

    def copy(g: Any) -> Any:
        private = np.random.RandomState()
        private.set_state(g.get_state())
        return private

    with _routed(np.random, global_state, copy):
        yield


@contextlib.contextmanager
def _routed(namespace: Any, global_gen: Any, copy: Callable[[Any], Any]) -> Iterator[None]:
    """Route the functions of ``namespace`` that are methods of ``global_gen`` (``random.random`` is
    ``random._inst.random``): the calling thread uses a private copy of ``global_gen``, other threads the original.
    A draw through a method the caller took beforehand (``from random import random``) still reaches the global
    generator: when no other thread is alive, that is undone at exit."""
    owner = threading.get_ident()
    private = copy(global_gen)
    state = global_gen.getstate() if hasattr(global_gen, "getstate") else global_gen.get_state()
    alone = threading.active_count() == 1
    saved: dict[str, Any] = {}
    for name, value in list(vars(namespace).items()):
        if name in _RANDOM_EXCLUDED or getattr(value, "__self__", None) is not global_gen:
            continue
        saved[name] = value
        setattr(namespace, name, _route(name, owner, private, global_gen))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(namespace, name, value)
        if alone and threading.active_count() == 1:
            current = global_gen.getstate() if hasattr(global_gen, "getstate") else global_gen.get_state()
            if not _same_state(current, state):
                (global_gen.setstate if hasattr(global_gen, "setstate") else global_gen.set_state)(state)


def _route(name: str, owner: int, private: Any, global_gen: Any) -> Callable[..., Any]:
    mine, theirs = getattr(private, name), getattr(global_gen, name)

    def routed(*args: Any, **kwargs: Any) -> Any:
        return (mine if threading.get_ident() == owner else theirs)(*args, **kwargs)

    routed.__name__ = name
    routed.__doc__ = theirs.__doc__
    return routed


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape"):  # numpy arrays in RandomState.get_state()
        return bool((a == b).all())
    return a == b


# ---- global hooks, flags, environment, outer modes ---------------------------------------------------------------

def _hook_tables() -> list[tuple[str, dict]]:
    from torch.nn.modules import module
    from torch.optim import optimizer

    names = [n for n in vars(module) if n.startswith("_global_") and n.endswith("hooks")]
    tables = [(f"torch.nn.modules.module.{n}", getattr(module, n)) for n in sorted(names)]
    tables += [(f"torch.optim.optimizer.{n}", getattr(optimizer, n))
               for n in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks") if hasattr(optimizer, n)]
    return [(name, table) for name, table in tables if isinstance(table, dict)]


# Process-wide switches of torch: (name, getter, setter).
_FLAGS: list[tuple[str, Callable[[], Any], Callable[[Any], None]]] = [
    ("torch.get_float32_matmul_precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    ("torch.get_default_dtype", torch.get_default_dtype, torch.set_default_dtype),
    ("torch.is_anomaly_enabled", torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    ("torch.are_deterministic_algorithms_enabled",
     lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
     lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
    ("torch.backends.cudnn.benchmark", lambda: torch.backends.cudnn.benchmark,
     lambda v: setattr(torch.backends.cudnn, "benchmark", v)),
    ("torch.backends.cudnn.deterministic", lambda: torch.backends.cudnn.deterministic,
     lambda v: setattr(torch.backends.cudnn, "deterministic", v)),
    ("torch.backends.cudnn.allow_tf32", lambda: torch.backends.cudnn.allow_tf32,
     lambda v: setattr(torch.backends.cudnn, "allow_tf32", v)),
    ("torch.backends.cuda.matmul.allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32,
     lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", v)),
    ("torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
     lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
     lambda v: setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", v)),
    ("torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
     lambda: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
     lambda v: setattr(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction", v)),
]


@contextlib.contextmanager
def isolated_process(notes: list[str]) -> Iterator[None]:
    """Run a trace with the user's global hooks suspended, their dispatch modes and saved-tensor hooks off, and
    torch's global flags and the environment put back afterwards (module docstring). ``notes`` gets what was
    suspended or put back."""
    with _suspended_hooks(notes), _outer_modes_off(notes), _restored_flags(notes), _no_anomaly_checks(notes):
        yield


@contextlib.contextmanager
def _no_anomaly_checks(notes: list[str]) -> Iterator[None]:
    """Autograd's anomaly detection checks every gradient for NaN by reading its values, which fake tensors do not
    have; it allocates nothing on the device, so the trace runs without it."""
    if not torch.is_anomaly_enabled():
        yield
        return
    check_nan = torch.is_anomaly_check_nan_enabled()
    torch.set_anomaly_enabled(False)
    try:
        yield
    finally:
        torch.set_anomaly_enabled(True, check_nan)
        notes.append("autograd anomaly detection was off during the trace (its NaN checks read values fake tensors "
                     "do not have; it holds no device memory)")


@contextlib.contextmanager
def _suspended_hooks(notes: list[str]) -> Iterator[None]:
    saved = [(name, table, list(table.items())) for name, table in _hook_tables()]
    suspended = [name.rsplit(".", 1)[1] for name, _, items in saved if items]
    count = sum(len(items) for _, _, items in saved)
    for _, table, _items in saved:
        table.clear()
    try:
        yield
    finally:
        for _, table, items in saved:  # as before: a hook the traced step registered is the real step's to register
            table.clear()
            table.update(items)
        if count:
            notes.append(f"{count} global hook(s) ({', '.join(suspended)}) were not run in the trace: they would see "
                         "preflight's fake copies; memory they allocate in the real run is not counted")


@contextlib.contextmanager
def _outer_modes_off(notes: list[str]) -> Iterator[None]:
    modes = []
    while torch._C._len_torch_dispatch_stack() > 0:
        modes.append(_python_dispatch._pop_mode())
    hooks = []
    while torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
        hooks.append(torch._C._autograd._top_saved_tensors_default_hooks(True))
        torch._C._autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(hooks):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
        for mode in reversed(modes):
            _python_dispatch._push_mode(mode)
        if modes or hooks:
            what = [f"{len(modes)} dispatch mode(s) ({', '.join(type(m).__name__ for m in reversed(modes))})"] \
                if modes else []
            what += [f"{len(hooks)} saved-tensor hook pair(s)"] if hooks else []
            notes.append(f"{' and '.join(what)} active around the call were off during the trace (they would see "
                         "fake tensors); what they do in the real run is not counted")


@contextlib.contextmanager
def _restored_flags(notes: list[str]) -> Iterator[None]:
    flags = [(name, get, put, get()) for name, get, put in _FLAGS]
    environ = dict(os.environ)
    try:
        yield
    finally:
        changed = []
        for name, get, put, value in flags:
            if get() != value:
                put(value)
                changed.append(name.removeprefix("torch.").replace("get_", "").replace("is_", ""))
        for key in set(os.environ) | set(environ):
            if os.environ.get(key) != environ.get(key):
                changed.append(f"${key}")
                if key in environ:
                    os.environ[key] = environ[key]
                else:
                    del os.environ[key]
        if changed:
            notes.append(f"the traced step changed {', '.join(sorted(changed))}; put back as it was before the trace")
