"""Trace ``torch.compile``d models without changing anything about their compilation.

TorchDynamo refuses to compile a frame while a non-infra ``TorchDispatchMode`` is active (the trace's
`StorageTracker` is one), and the refusal sticks: ``CatchErrorsWrapper.__call__`` in
``torch/_dynamo/convert_frame.py`` returns a ``ConvertFrameReturn`` whose default strategy is ``SKIP`` with
``apply_to_code=True``, so the code object (a class's ``forward``, shared by every instance) is never compiled
again in the process, until ``torch._dynamo.reset()``. Run as it is, one trace of a compiled model would turn
compilation off for every later model of the same class.

The refusal is only reached when Dynamo's frame callback is installed. A compiled callable installs it on entry
with ``_callback_from_stance(callback)`` (``torch/_dynamo/eval_frame.py``), which returns ``None`` (no callback:
frames run as plain Python, nothing is marked) under the ``"force_eager"`` stance. `dynamo_kept_out` sets that
stance for the duration of the trace only (``torch.compiler.set_stance``, restored on exit), so compiled modules
and functions run their original Python code, Dynamo's caches are neither read nor written, and nothing is reset.
It also records which compiled regions the trace entered, to say so in the estimate's coverage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["CompiledRegions", "compiled_modules", "dynamo_kept_out"]


@dataclasses.dataclass
class CompiledRegions:
    """The compiled regions a trace ran through: ``backend`` names (``"inductor"``, ``"aot_eager"``, ...) by where
    they were found (a module's qualified name, or ``"function"`` for compiled functions called from forward)."""

    backends: dict[str, str] = dataclasses.field(default_factory=dict)


def compiled_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The ``torch.compile``d modules in ``model``'s tree (``OptimizedModule`` wrappers and modules compiled in place
    with ``module.compile()``), by qualified name (``""`` for ``model`` itself)."""
    if "torch._dynamo" not in sys.modules:  # nothing can have been compiled without it
        return {}
    from torch._dynamo.eval_frame import OptimizedModule

    return {name: m for name, m in model.named_modules(remove_duplicate=False)
            if isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None}


def backend_name(module_or_fn: Any) -> str:
    """The name of the backend a compiled module or callable uses (``"inductor"``, ``"aot_eager"``, ``"eager"``, a
    custom backend's function name), or ``"unknown"``."""
    from torch._dynamo.eval_frame import innermost_backend

    ctx = getattr(module_or_fn, "dynamo_ctx", None)
    callback = getattr(ctx, "callback", None)
    if callback is None and getattr(module_or_fn, "_compiled_call_impl", None) is not None:
        return "unknown"  # module.compile(): the backend is held in a closure, found when it runs
    return _name_of(innermost_backend(callback)) if callback is not None else "unknown"


def _name_of(backend: Any) -> str:
    # torch.compile wraps the backend: inductor in `_TorchCompileInductorWrapper` (`compiler_name`), anything else
    # in `_TorchCompileWrapper` (`compiler_fn`: a registered backend's function, or the user's callable).
    if getattr(backend, "compiler_name", None) == "inductor":
        return "inductor"
    fn = getattr(backend, "compiler_fn", backend)
    return str(getattr(fn, "__name__", None) or type(fn).__name__)


@contextlib.contextmanager
def dynamo_kept_out(model: nn.Module) -> Iterator[CompiledRegions]:
    """Run the body with TorchDynamo off (the ``"force_eager"`` stance), restoring the stance on exit.

    Yields the `CompiledRegions` found: compiled modules in ``model``'s tree before the body runs, and compiled
    callables the body entered (filled in as it runs).
    """
    regions = CompiledRegions()
    if "torch._dynamo" not in sys.modules:  # Dynamo never loaded: no compiled code, no callback to keep out
        yield regions
        return
    import torch
    from torch._dynamo import eval_frame

    modules = compiled_modules(model)
    for name, module in modules.items():
        regions.backends[name or type(getattr(module, "_orig_mod", module)).__name__] = backend_name(module)
    known = {id(getattr(getattr(m, "dynamo_ctx", None), "callback", None)) for m in modules.values()}
    original = getattr(eval_frame, "_callback_from_stance", None)

    def recording(callback: Any) -> Any:
        # Entering a compiled callable: note its backend. The stance makes the original return no callback.
        if callback not in (None, False) and id(callback) not in known:
            regions.backends.setdefault("function", _name_of(eval_frame.innermost_backend(callback)))
        return original(callback)

    with torch.compiler.set_stance("force_eager"):
        if original is not None:
            eval_frame._callback_from_stance = recording
        try:
            yield regions
        finally:
            if original is not None:
                eval_frame._callback_from_stance = original


def compiled_notes(regions: CompiledRegions) -> list[str]:
    """Coverage notes for the compiled regions a trace ran eagerly."""
    if not regions.backends:
        return []
    where = ", ".join(f"{name} ({backend})" for name, backend in sorted(regions.backends.items()))
    if all(backend == "eager" for backend in regions.backends.values()):
        return [f"compiled with torch.compile: {where}; the eager backend runs the same kernels, traced eagerly"]
    return [f"compiled with torch.compile: {where}; traced eagerly, so the figure is the eager peak, an upper "
            "bound for activations (a compiled run saves fewer tensors for backward and fuses temporaries)"]
