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

Modules compiled with inductor are then traced as the compiled run executes them (`partitioned_forwards`): their
forward and backward graphs as AOTAutograd and inductor's partition function split them, so the tensors saved for
backward are the compiled run's, with inductor's fusion approximated (`fused_nodes`). Other backends, and graphs
that cannot be captured, run their Python code eagerly: the figure is then the eager peak, an upper bound for
activations, and the note says so.
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
    modules: dict[str, nn.Module] = dataclasses.field(default_factory=dict)
    partitioned: set[str] = dataclasses.field(default_factory=set)  # traced as AOTAutograd partitions them
    eager: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> why its graph could not be captured
    not_kept_out: bool = False  # torch < 2.6: Dynamo saw the trace (and may skip these frames from now on)

    def capturing_failed(self, name: str, err: BaseException) -> bool:
        """Record that ``name``'s graph could not be captured; False when ``err`` is not a capture failure (the
        step's own error, or preflight's: raised as it is)."""
        from preflight._errors import StepWouldFailError

        if isinstance(err, StepWouldFailError) or name in self.partitioned:
            return False  # a graph that ran once is captured: a later error is the step's
        self.eager[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        return True


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
        name = name or type(getattr(module, "_orig_mod", module)).__name__
        regions.backends[name] = backend_name(module)
        regions.modules[name] = module
    known = {id(getattr(getattr(m, "dynamo_ctx", None), "callback", None)) for m in modules.values()}
    original = getattr(eval_frame, "_callback_from_stance", None)

    def recording(callback: Any) -> Any:
        # Entering a compiled callable: note its backend. The stance makes the original return no callback.
        if callback not in (None, False) and id(callback) not in known:
            regions.backends.setdefault("function", _name_of(eval_frame.innermost_backend(callback)))
        return original(callback)

    if not hasattr(torch.compiler, "set_stance"):  # torch < 2.6: no stance to keep Dynamo out with
        regions.not_kept_out = True
        yield regions
        return
    with torch.compiler.set_stance("force_eager"):
        if original is not None:
            eval_frame._callback_from_stance = recording
        try:
            yield regions
        finally:
            if original is not None:
                eval_frame._callback_from_stance = original


def compiled_notes(regions: CompiledRegions) -> list[str]:
    """Coverage notes: which compiled regions were traced as compiled, and which eagerly (and why)."""
    notes = []
    if regions.not_kept_out:
        notes.append("torch < 2.6 has no torch.compiler.set_stance: Dynamo was not kept out of the trace, and may "
                     "skip the traced compiled code from now on (torch._dynamo.reset() compiles it again)")
    partitioned = sorted(regions.partitioned)
    if partitioned:
        notes.append(f"compiled with torch.compile: {', '.join(f'{n} (inductor)' for n in partitioned)} traced as "
                     "inductor's partitioner splits it (the tensors saved for backward are the compiled run's); "
                     "inside a graph, inductor's fusion is approximated (pointwise operators read only by pointwise "
                     "operators and reductions are not stored) and its buffer reuse is not modelled")
    within = {n for n, m in regions.modules.items() for p in regions.partitioned
              if any(sub is m for sub in regions.modules[p].modules())}  # captured inside a partitioned graph
    eager = {n: b for n, b in regions.backends.items() if n not in regions.partitioned and n not in within}
    if not eager:
        return notes
    where = ", ".join(f"{name} ({backend}{': ' + regions.eager[name] if name in regions.eager else ''})"
                      for name, backend in sorted(eager.items()))
    if all(backend == "eager" for backend in eager.values()):
        notes.append(f"compiled with torch.compile: {where}; the eager backend runs the same kernels, traced eagerly")
    else:
        notes.append(f"compiled with torch.compile: {where}; traced eagerly, so the figure is the eager peak, an "
                     "upper bound for activations (a compiled run saves fewer tensors for backward and fuses "
                     "temporaries)")
    return notes


@contextlib.contextmanager
def partitioned_forwards(regions: CompiledRegions, tracker: Any) -> Iterator[None]:
    """Run each inductor-compiled module as the compiled run does: its forward and backward graphs as
    AOTAutograd's min-cut partitioner splits them (inductor's own partition function), so the tensors saved for
    backward are the compiled run's, not eager's.

    The graphs are captured with ``tracker`` paused (capturing allocates nothing real) and with
    ``torch.compiler.is_compiling()`` true (libraries take the paths they take under Dynamo), then run under the
    tracker operator by operator (`run_graph`): each value is dropped after its last use, and the outputs of
    pointwise operators inductor would fuse into their consumers are not recorded (`fused_nodes`). Inductor's
    buffer reuse within a graph is not modelled. A module whose graph cannot be captured (data-dependent control
    flow, where Dynamo would break the graph; an output that is not a pytree of tensors, such as transformers'
    ``DynamicCache``) runs eagerly, and the note says so. Modules are put back by `restored_module` (the caller's).
    """
    for name, module in regions.modules.items():
        inner = any(other is not module and any(m is module for m in other.modules())
                    for other in regions.modules.values())  # captured as part of the outer graph
        if regions.backends.get(name) == "inductor" and hasattr(module, "_orig_mod") and not inner:
            module.forward = _PartitionedForward(name, module._orig_mod, tracker, regions)
    yield


class _PartitionedForward:
    def __init__(self, name: str, module: nn.Module, tracker: Any, regions: CompiledRegions) -> None:
        self.name, self.module, self.tracker, self.regions = name, module, tracker, regions
        self.compiled: dict[Any, Any] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch
        from torch.utils._pytree import tree_flatten, tree_unflatten

        if self.name in self.regions.eager:
            return self.module(*args, **kwargs)
        flat, spec = tree_flatten((args, kwargs))
        key = (spec, torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), tuple(
            (tuple(x.shape), x.dtype, x.device, x.requires_grad) if isinstance(x, torch.Tensor) else x
            for x in flat if isinstance(x, (torch.Tensor, int, float, bool, str, type(None)))))
        state = {**dict(self.module.named_parameters()),  # one name per tied tensor: functional_call reties them
                 **dict(self.module.named_buffers())}
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]

        def call(params: dict, *inputs: torch.Tensor) -> Any:
            values = list(flat)
            for i, t in zip(positions, inputs):
                values[i] = t
            a, k = tree_unflatten(values, spec)
            return torch.func.functional_call(self.module, params, a, k)

        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.compiled[key] = self._compile(call, len(state))
        paused, compiling = self.tracker.paused, getattr(torch.compiler, "_is_compiling_flag", None)
        self.tracker.paused = True  # the first call captures the graphs; the forward graph itself runs unpaused
        # Libraries take their compile-friendly paths under Dynamo (`torch.compiler.is_compiling()`: transformers
        # skips data-dependent mask checks); the capture takes them too, as the compiled run did.
        if compiling is not None:
            torch.compiler._is_compiling_flag = True
        try:
            out = compiled(state, *tensors)
        except Exception as err:  # noqa: BLE001 - a graph AOTAutograd cannot capture runs eagerly, with a note
            if not self.regions.capturing_failed(self.name, err):
                raise
            out = None
        finally:
            self.tracker.paused = paused
            if compiling is not None:
                torch.compiler._is_compiling_flag = compiling
        if self.name in self.regions.eager:
            return self.module(*args, **kwargs)
        self.regions.partitioned.add(self.name)
        return out

    def _compile(self, fn: Any, num_params_buffers: int) -> Any:
        from torch._functorch.aot_autograd import aot_function

        tracker = self.tracker

        def compiler(gm: Any, example_inputs: Any) -> Any:
            fused = fused_nodes(gm.graph)

            def run(args: list) -> Any:
                paused = tracker.paused
                tracker.paused = False
                try:
                    return run_graph(gm, args, fused, tracker)
                finally:
                    tracker.paused = paused

            run._boxed_call = True
            return run

        partition, decompositions = _inductor_partitioning()
        return aot_function(fn, fw_compiler=compiler, bw_compiler=compiler, partition_fn=partition,
                            decompositions=decompositions, num_params_buffers=num_params_buffers)


def _inductor_partitioning() -> tuple[Any, Any]:
    """Inductor's partition function (its joint-graph passes, then the min-cut partitioner) and decompositions, as
    ``torch._inductor.compile_fx`` hands them to AOTAutograd; the plain min-cut partitioner where they are missing."""
    try:
        from torch._guards import detect_fake_mode
        from torch._inductor.compile_fx import partition_fn
        from torch._inductor.decomposition import select_decomp_table
        from torch._inductor.virtualized import V

        def partition(gm: Any, joint_inputs: Any, **kwargs: Any) -> Any:
            with V.set_fake_mode(detect_fake_mode(joint_inputs)):  # inductor's passes read it, as under compile_fx
                return partition_fn(gm, joint_inputs, **kwargs)

        return partition, select_decomp_table()
    except ImportError:
        import functools

        from torch._functorch.partitioners import min_cut_rematerialization_partition

        return functools.partial(min_cut_rematerialization_partition, compiler="inductor"), None


# Reductions inductor fuses its pointwise producers into (their own outputs are buffers).
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "var", "var_mean", "std", "prod", "any", "all", "argmax",
               "argmin", "logsumexp"}
# A pointwise buffer read by more consumers than this is stored (inductor's `realize_reads_threshold`).
_MAX_INLINED_READS = 4


def _is_op(node: Any) -> bool:
    import torch

    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)


def _pointwise(node: Any) -> bool:
    import torch

    return _is_op(node) and torch.Tag.pointwise in node.target.tags


def _view(node: Any) -> bool:
    return _is_op(node) and node.target.is_view


def fused_nodes(graph: Any) -> set[Any]:
    """The nodes of an AOTAutograd graph whose outputs inductor never stores: pointwise operators read only by
    pointwise operators and reductions of the same graph (directly or through views), at most
    `_MAX_INLINED_READS` times, and not graph outputs. Inductor generates them inside their consumers' kernels.
    Everything else (graph inputs and outputs, matmuls, convolutions and other library kernels, and what they
    read) is a buffer. An approximation of inductor's scheduler: it may also store a buffer this leaves fused."""
    from torch.utils._pytree import tree_flatten

    output = next(n for n in graph.nodes if n.op == "output")
    returned = {n for n in tree_flatten(output.args)[0] if hasattr(n, "users")}

    def readers(node: Any) -> list[Any] | None:
        found = []
        for user in node.users:
            if user is output or user in returned:
                return None
            if _view(user):
                more = readers(user)
                if more is None:
                    return None
                found.extend(more)
            else:
                found.append(user)
        return found

    fused = set()
    for node in graph.nodes:
        if not _pointwise(node) or node in returned:
            continue
        users = readers(node)
        if users is not None and len(users) <= _MAX_INLINED_READS and all(
                _pointwise(u) or (_is_op(u) and u.target.overloadpacket.__name__ in _REDUCTIONS) for u in users):
            fused.add(node)
    return fused


def run_graph(gm: Any, args: list, fused: set[Any], tracker: Any) -> Any:
    """Run ``gm``'s graph operator by operator as inductor's generated code holds buffers: inputs are taken from
    the boxed ``args`` (cleared, as a compiled graph does) and every value is dropped after its last use; the
    outputs of ``fused`` nodes are not recorded (``tracker.unrecorded``), as they never exist in the compiled run."""
    from torch.utils._pytree import tree_map

    nodes = list(gm.graph.nodes)
    last_use: dict[Any, Any] = {}
    for node in reversed(nodes):
        for used in node.all_input_nodes:
            last_use.setdefault(used, node)
    inputs = list(args)
    args.clear()
    inputs.reverse()
    env: dict[Any, Any] = {}

    def load(x: Any) -> Any:
        return tree_map(lambda v: env[v] if v in env else v, x)

    for node in nodes:
        if node.op == "placeholder":
            env[node] = inputs.pop()
        elif node.op == "output":
            return load(node.args[0])
        elif node.op == "get_attr":
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            env[node] = value
        else:
            tracker.unrecorded = node in fused
            try:
                target = node.target if node.op == "call_function" else getattr(gm, node.target)
                env[node] = target(*load(node.args), **load(node.kwargs))
            finally:
                tracker.unrecorded = False
        for used in node.all_input_nodes:
            if last_use.get(used) is node:
                env.pop(used, None)
    return None
