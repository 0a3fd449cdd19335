"""One rank's training step under tensor parallelism (DTensor's ``parallelize_module``), alone or inside FSDP2 on
a 2-D mesh, traced on fake tensors with a fake process group.

A `TPPlan` says which modules are parallelized how: DTensor's own styles (``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``, ``PrepareModuleInput`` / ``Output``, or the user's own ``ParallelStyle``), keyed by module
name with ``*`` wildcards as ``parallelize_module`` takes them, or the model's own plan (a transformers model's
``base_model_tp_plan`` and ``_tp_plan``, translated to those styles). The fake copy of the model is parallelized
with that plan over a fake mesh of the job's shape (``("tp",)``, or ``("dp", "tp")`` with FSDP2's ``fully_shard``
over the ``dp`` dim after, torchtitan's layout) as this rank, and the real step runs as
`preflight.parallel._rank.trace_rank` describes. So the rank's peak comes out of DTensor's own program: its local
parameter shards and their optimizer state, the activations each rank holds (sharded where the style leaves them
sharded, whole where it gathers), and the functional collectives' outputs (the all-reduce after a row-wise layer,
the all-gathers of sequence parallelism), each an operator the tracker sees.

Ranks whose parameters are cut to the same local shapes run the same program and share a trace
(`tp_rank_groups`, which applies the plan to a meta copy as each rank to read its shapes).

Known limitations: transformers' own tensor-parallel engine (``from_pretrained(tp_plan="auto")``) is not DTensor's
and is not traced; its plan words are translated to DTensor's styles for the same layouts (`model_styles`), a word
no DTensor style says is laid out by transformers' own style for it inside ``parallelize_module``
(`_TransformersStyle`), and a word transformers does not register is refused with the entry named. Loss parallelism
(``loss_parallel()``) is a context the user's step enters; it runs in the trace only where the step enters it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import math
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from preflight._checkpoint import Checkpoint
from preflight._loading import Loading
from preflight._steps import Evaluation, Loop, StepFn
from preflight.cuda import CudaTarget
from preflight.parallel._fake_group import fake_world
from preflight.parallel._fsdp2 import FSDP2Plan, apply_fully_shard, shard_rows, watched_fsdp2
from preflight.parallel._rank import (Engine, MetaTwins, fake_replica, fresh_dtensor_caches, local_parameters,
                                     named_optimizer, trace_rank, with_cells)
from preflight.trace import Sweep, TraceResult, swept
from preflight.trace._tracker import StorageTracker

__all__ = ["TPPlan", "WrappedTP", "closed_form_activations", "grouped_by_shards", "laid_out_locals",
           "laid_out_parameters", "lay_out", "model_styles", "plan_styles", "read_tp", "tp_layouts", "tp_rank_groups", "trace_tp",
           "unmatched_styles"]


@dataclasses.dataclass(frozen=True)
class TPPlan:
    """How tensor parallelism is applied, as the training script applies it with ``parallelize_module``.

    Attributes:
        degree: the ranks one tensor-parallel group holds (the size of the mesh's ``tp`` dim). The job's world size
            is ``degree`` times the data-parallel degree.
        styles: ``parallelize_module``'s ``parallelize_plan``: module name (``*`` matches one name part) -> a
            ``torch.distributed.tensor.parallel.ParallelStyle``. None: the model's own plan (`model_styles`).
    """

    degree: int
    styles: Mapping[str, Any] | None = None  # None: the transformers model's own tp plan

    def __post_init__(self) -> None:
        if isinstance(self.degree, bool) or not isinstance(self.degree, int) or self.degree < 1:
            raise ValueError(f"`TPPlan.degree` should be a positive int (the tensor-parallel group's ranks), got "
                             f"{self.degree!r}.")
        if self.styles is not None:
            from torch.distributed.tensor.parallel import ParallelStyle

            if not isinstance(self.styles, Mapping):
                raise TypeError("`TPPlan.styles` should be a dict of module name -> ParallelStyle (what "
                                f"parallelize_module takes) or None, got {type(self.styles).__name__}.")
            wrong = {k: v for k, v in self.styles.items() if not isinstance(k, str) or not isinstance(v, ParallelStyle)}
            if wrong:
                name, style = next(iter(wrong.items()))
                raise TypeError(f"`TPPlan.styles` should map module names (str) to ParallelStyle instances "
                                f"(ColwiseParallel(), RowwiseParallel(), ...); got {name!r}: {style!r}.")
            object.__setattr__(self, "styles", dict(self.styles))

    def mesh(self, world_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The fake mesh's ``(shape, dim names)`` for ``world_size`` ranks: ``(degree,)`` over ``("tp",)`` when
        the plan holds every rank, else ``(world_size // degree, degree)`` over ``("dp", "tp")`` (torchtitan's
        layout: the ranks of one tensor-parallel group are consecutive); a ValueError where ``degree`` does not
        divide ``world_size``."""
        if world_size % self.degree:
            raise ValueError(f"`TPPlan.degree` ({self.degree}) should divide the world size {world_size}: the mesh is "
                             "(world_size // degree, degree).")
        if world_size == self.degree:
            return (self.degree,), ("tp",)
        return (world_size // self.degree, self.degree), ("dp", "tp")


# transformers' tp plan words that DTensor's styles express as they are (transformers.distributed.tensor_parallel
# registers the same layouts under these words): column-wise (output sharded on the last dim), row-wise (input
# sharded, output all-reduced), column-wise with the output gathered back whole (``colwise_gather_output``,
# ``colwise_rep``), row-wise over a replicated input that each rank cuts locally (``rowwise_split_input``,
# ``rowwise_rep``: Olmo2's o_proj after its full-width q/k norms), an embedding cut along the vocabulary (ids
# replicated, output all-reduced), a parameter every rank keeps whole (``replicate``: no style), and a replicated
# parameter whose partial gradient is summed over the tensor-parallel ranks (``replicated_with_grad_allreduce``:
# Qwen3's per-head q/k norms; `_grad_all_reduce`).
def _hf_style(word: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
            "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
            "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
            "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
            "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
            "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
            "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
            "replicate": lambda: None, "replicated_with_grad_allreduce": _grad_all_reduce}[word]()


_HF_WORDS = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_split_input", "rowwise_rep",
             "embedding_rowwise", "embedding_colwise", "replicate", "replicated_with_grad_allreduce")


def _grad_all_reduce() -> Any:
    """transformers' ``ReplicatedWithGradAllReduce`` as a DTensor style: the module's parameters stay whole on every
    rank, and each gradient is all-reduced in place over the mesh once it is accumulated."""
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import ParallelStyle

    class GradAllReduce(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            def all_reduce(param: torch.Tensor) -> None:
                dist.all_reduce(param.grad, group=device_mesh.get_group())

            for param in module.parameters(recurse=False):
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(all_reduce)
            return module

    return GradAllReduce()


def model_styles(model: nn.Module) -> dict[str, Any]:
    """The model's own tensor-parallel plan as DTensor styles: a transformers model's ``config.base_model_tp_plan``
    (its keys under the base model's prefix) and the class's ``_tp_plan`` (the head's), each word translated as
    `_hf_style` says; ``replicate`` entries are left out (kept whole).

    Raises:
        ValueError: the model has no plan of its own, or an entry whose word has no DTensor style here (named).
    """
    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and not hasattr(model, prefix):  # the base model itself: its plan's names are its own
        prefix = ""
    plan = {f"{prefix}.{k}" if prefix else k: v for k, v in base.items()}
    plan.update(dict(getattr(model, "_tp_plan", None) or {}))
    if not plan:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan of its own (no config."
                         "base_model_tp_plan): give TPPlan(degree, styles={'module.name': ColwiseParallel(), ...}), "
                         "the plan you pass to parallelize_module.")
    plan = _with_parameter_entries(model, plan)
    unknown = {k: v for k, v in plan.items() if not callable(v) and v not in _HF_WORDS}
    if unknown:
        name, word = next(iter(unknown.items()))
        raise ValueError(f"{type(model).__name__}'s tensor-parallel plan has {name!r}: {word!r}, which preflight "
                         f"translates to no DTensor style (it translates {', '.join(_HF_WORDS)}, and lays "
                         f"{', '.join(_module_words()) or 'no other word'} out with transformers' own styles): give "
                         "TPPlan(degree, styles=...) with the styles your script applies.")
    styles = {name: word() if callable(word) else _hf_style(word) for name, word in plan.items()}
    return {name: style for name, style in styles.items() if style is not None}


# Words that name fused weights only (an experts module's entries naming its parameters), never a module.
_HF_FUSED_WORDS = ("packed_colwise", "packed_rowwise")
_HF_PARAMETER_WORDS = (*_HF_FUSED_WORDS, "colwise", "rowwise")


def _module_words() -> tuple[str, ...]:
    """The words transformers registers a style for (``ALL_PARALLEL_STYLES``) that no DTensor module style says, so
    its own style lays the module out (`_TransformersStyle`): a mixture-of-experts block's experts
    (``moe_tp_experts``), latent attention's key/value down-projection (``mla_kv_a_proj``: its output's rotary part's
    gradient all-reduced), a module whose forward runs on its own parameters' local shards (``local_params``:
    attention sinks), a forward's partial output all-reduced (``all_reduce``), an identity expert's input divided
    by the ranks (``moe_identity_expert``), a norm over a sequence-sharded input (``sequence_parallel``); none
    without transformers."""
    try:
        registered = _transformers_styles()
    except ImportError:
        return ()
    return tuple(word for word in registered if word not in _HF_WORDS and word not in _HF_FUSED_WORDS)


def _with_parameter_entries(model: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` with each entry whose word is one of `_module_words` a factory of `_TransformersStyle`, the
    entries naming the module's own parameters folded into it (an experts module's ``experts.gate_up_proj:
    packed_colwise``, ``experts.down_proj: rowwise``; attention sinks' ``self_attn.sinks: colwise`` beside
    ``self_attn: local_params``); the rest as they are. transformers cuts such parameters itself
    (``apply_tensor_parallelism``: each parameter entry's ``shard_param``, the module entry's ``install_forward``),
    which DTensor's module styles cannot say."""
    names = [name.split(".") for name, _ in model.named_parameters()]
    out = dict(plan)
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    own = _module_words()
    for key, word in plan.items():
        if word not in own:
            continue
        inner = {k[len(key) + 1:]: w for k, w in plan.items() if k.startswith(key + ".")
                 and "." not in k[len(key) + 1:] and w in _HF_PARAMETER_WORDS
                 and any(_matches(parts, k.split(".")) for parts in names)}
        for name in inner:
            del out[f"{key}.{name}"]
        out[key] = functools.partial(_TransformersStyle, word, inner, text)
    return out


def _transformers_styles() -> Any:
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    return ALL_PARALLEL_STYLES


def _TransformersStyle(module_word: str, parameter_words: dict[str, str], config: Any = None) -> Any:
    """A DTensor style that lays a module out as transformers' own tensor parallelism does: each named parameter cut
    by its word's ``shard_param`` (``packed_colwise``: the fused gate and up projections cut as a
    ``_StridedShard`` so each rank holds its slice of both; ``rowwise``: the last dim; ``colwise``: a bare
    parameter's last dim but one, its only dim for a vector), then the module's word's ``install_forward``
    (``moe_tp_experts``: the forward on the local shards, its input's and routing weights' gradients all-reduced,
    its partial output all-reduced; ``mla_kv_a_proj``: the output's rotary part's gradient all-reduced, reading
    ``qk_rope_head_dim`` off ``config``, which transformers hands the module for it; ``local_params``: the forward
    with the module's own DTensor parameters swapped for their local shards)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    class TransformersStyle(ParallelStyle):
        def __init__(self) -> None:
            self.module_word, self.parameter_words = module_word, dict(parameter_words)

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            styles = _transformers_styles()
            for name, word in self.parameter_words.items():
                styles[word].shard_param(module, name, device_mesh)
            if self.module_word == "mla_kv_a_proj":  # as transformers' apply_tensor_parallelism gives it
                module.config = config
            styles[self.module_word].install_forward(module, device_mesh)
            return module

    return TransformersStyle()


def plan_styles(model: nn.Module, plan: TPPlan) -> dict[str, Any]:
    """The plan's styles, or the model's own where the plan gives none (`model_styles`)."""
    return dict(plan.styles) if plan.styles is not None else model_styles(model)



def unmatched_styles(model: nn.Module, plan: TPPlan) -> list[str]:
    """The plan's module names (``*`` matching one name part, as ``parallelize_module`` matches them) that match no
    submodule of ``model``: ``parallelize_module`` skips them with a warning, and so does the trace. A ValueError
    where the model has no plan of its own and the `TPPlan` gives none (`model_styles`)."""
    names = [name.split(".") for name, _ in model.named_modules() if name]
    return [key for key in plan_styles(model, plan)
            if key and not any(_matches(parts, key.split(".")) for parts in names)]


def _matches(parts: list[str], key: list[str]) -> bool:
    """Whether a module name's parts match a plan key's (``*`` matching one name part), as ``parallelize_module``
    matches them."""
    return len(parts) == len(key) and all(fnmatch.fnmatch(p, t) for p, t in zip(parts, key))


def laid_out_parameters(model: nn.Module, plan: TPPlan) -> set[str]:
    """The names of ``model``'s parameters ``plan`` lays out as DTensors: those of the modules its names match
    (``*`` matching one name part, as ``parallelize_module`` matches them). The others stay plain tensors under
    tensor parallelism alone."""
    keys = [key.split(".") for key in plan_styles(model, plan) if key]
    out = set()
    for name, module in model.named_modules():
        parts = name.split(".")
        if name and any(_matches(parts, k) for k in keys):
            out.update(f"{name}.{p}" for p, _ in module.named_parameters(recurse=False))
    return out


def tp_mesh(plan: TPPlan, world_size: int, fsdp: FSDP2Plan | None = None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The fake mesh of a tensor-parallel run: `TPPlan.mesh`, or with FSDP2's HSDP beside it (``fsdp.replicate`` >
    1) torchtitan's 3-D mesh ``(replicate, world_size // (replicate * degree), degree)`` over ``("replicate",
    "shard", "tp")`` (its ``dp_replicate``, ``dp_shard`` and ``tp``: a tensor-parallel group's ranks consecutive,
    then a shard group's); a ValueError where the degrees do not divide the world."""
    replicate = 1 if fsdp is None else fsdp.replicate
    if replicate == 1:
        return plan.mesh(world_size)
    if world_size % (replicate * plan.degree) or world_size == replicate * plan.degree:
        raise ValueError(f"HSDP's replicate degree ({replicate}) times the tensor-parallel degree ({plan.degree}) "
                         f"should divide the world size {world_size} and leave a shard dim of at least 2: the mesh "
                         "is (replicate, world_size // (replicate * degree), degree).")
    return (replicate, world_size // (replicate * plan.degree), plan.degree), ("replicate", "shard", "tp")


def _engine(model: nn.Module, plan: TPPlan, fsdp: FSDP2Plan | None, world_size: int) -> Engine:
    styles = plan_styles(model, plan)
    shape, names = tp_mesh(plan, world_size, fsdp)

    def wrap(replica: nn.Module, mesh: Any) -> nn.Module:
        with meshes_outside_modes():
            return _wrap(replica, mesh)

    def _wrap(replica: nn.Module, mesh: Any) -> nn.Module:
        lay_out(replica, mesh["tp"] if len(shape) > 1 else mesh, styles)
        if fsdp is not None:  # FSDP2 over the data-parallel dim, or HSDP over the two (a 2-D sub-mesh)
            apply_fully_shard(replica, mesh["replicate", "shard"] if len(shape) == 3 else mesh["dp"], fsdp)
        return replica

    return Engine(name="parallelize_module" + (" + fully_shard" if fsdp is not None else ""), wrap=wrap,
                  optimizer=_optimizer, parameters=local_parameters, watch=dtensor_watch(fsdp is not None),
                  mesh=(shape, names))


_optimizer = named_optimizer("tensor parallelism")  # the user's, rebuilt over the laid-out copy's parameters


def lay_out(module: nn.Module, mesh: Any, styles: dict[str, Any]) -> None:
    """``parallelize_module(module, mesh, styles)``, with the parameters the module shared under several names (tied
    input and output embeddings) shared again where their new DTensors are laid out alike, as transformers ties them
    after its own layout (``tie_weights``): ``parallelize_module`` gives each module a parameter of its own, and a
    tied model trained so would hold, and train, two."""
    from torch.distributed.tensor.parallel import parallelize_module

    shared: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    parallelize_module(module, mesh, styles)
    for names in (n for n in shared.values() if len(n) > 1):
        first = module.get_parameter(names[0])
        for name in names[1:]:
            owner, _, leaf = name.rpartition(".")
            other = module.get_parameter(name)
            if other is not first and _laid_out_alike(first, other):
                module.get_submodule(owner)._parameters[leaf] = first


def _laid_out_alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two parameters of the same shape, dtype and DTensor placements (plain tensors: none)."""
    return (a.shape == b.shape and a.dtype == b.dtype
            and getattr(a, "placements", None) == getattr(b, "placements", None))


def dtensor_watch(fsdp: bool) -> Callable[..., contextlib.AbstractContextManager[None]]:
    """The engine's watch: meshes built outside the fake mode, and FSDP2's own watch where it shards a dim."""
    @contextlib.contextmanager
    def watch(tracker: StorageTracker, *, gloo: bool) -> Iterator[None]:
        with watched_fsdp2(tracker, gloo=gloo) if fsdp else contextlib.nullcontext(), meshes_outside_modes():
            yield

    return watch


@contextlib.contextmanager
def meshes_outside_modes() -> Iterator[None]:
    """For the block, build every ``DeviceMesh`` outside the fake mode and the tracker: a mesh is bookkeeping made of
    small integer CPU tensors (its coordinates come from ``nonzero``, which a fake tensor cannot answer), never the
    run's device memory. FSDP2 over a tensor-parallel parameter concatenates the two meshes while it wraps."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils._python_dispatch import _disable_current_modes

    init = DeviceMesh.__init__

    def outside(self: Any, *args: Any, **kwargs: Any) -> None:
        with _disable_current_modes():
            init(self, *args, **kwargs)

    DeviceMesh.__init__ = outside
    try:
        yield
    finally:
        DeviceMesh.__init__ = init


def tp_rank_groups(model: nn.Module, plan: TPPlan | WrappedTP, world_size: int,
                   fsdp: FSDP2Plan | None = None) -> list[list[int]]:
    """Ranks grouped by the local shapes of their parameters once the plan is applied, and by FSDP2's shards of them
    (over the ``dp`` dim), or by the layout a parallelized model was read with (`read_tp`): ranks of one group run
    the same program and trace the same. For a plan, each tensor-parallel rank's shapes (what FSDP2 gathers back)
    are read off a meta copy parallelized as that rank in a fake world of the tensor-parallel ranks alone, and
    FSDP2's cut of each local tensor over the shard dim (`preflight.parallel._fsdp2.shard_rows`: ``torch.chunk`` of
    dim 0, as ``fully_shard`` cuts a DTensor's local tensor) is counted, so a world of thousands of ranks costs
    ``degree`` layouts. A read layout is applied to a meta copy as every rank (no step runs)."""
    if isinstance(plan, WrappedTP):  # each rank's local shapes as the read layout wraps a meta copy
        engine = _read_engine(plan, fsdp)
        return grouped_by_shards(world_size, lambda rank: (laid_out_locals(model, engine, world_size, rank), 0), 1)
    shape, _ = tp_mesh(plan, world_size, fsdp)
    by_tp_rank = tp_layouts(model, plan)
    shard = shape[-2] if fsdp is not None else 1  # FSDP2's dim: ("dp", "tp") or ("replicate", "shard", "tp")
    return grouped_by_shards(world_size, lambda rank: (by_tp_rank[rank % plan.degree], (rank // plan.degree) % shard),
                             shard)


def tp_layouts(model: nn.Module, plan: TPPlan) -> list[list[torch.Tensor]]:
    """Each tensor-parallel rank's local parameter tensors under ``plan`` alone (meta tensors), by rank."""
    alone = _engine(model, plan, None, plan.degree)
    return [laid_out_locals(model, alone, plan.degree, rank) for rank in range(plan.degree)]


def laid_out_locals(model: nn.Module, engine: Engine, world_size: int, rank: int) -> list[torch.Tensor]:
    """The local tensors of the parameters of a meta copy of ``model`` wrapped by ``engine`` as ``rank`` of a fake
    world of ``world_size`` ranks."""
    with fresh_dtensor_caches(), fake_world(world_size, rank, mesh=engine.mesh) as mesh:
        return local_parameters(engine.wrap(fake_replica(model, MetaTwins()), mesh))


def grouped_by_shards(world_size: int, place: Callable[[int], tuple[Any, int]], shard: int,
                      key: Callable[[int], Any] = lambda rank: None) -> list[list[int]]:
    """Ranks grouped by what they hold: ``place(rank)`` gives the rank's local tensors before FSDP2 and its index on
    the ``shard`` ranks FSDP2 cuts them among (1: no FSDP2), ``key(rank)`` anything else that sets its program (its
    pipeline rank). Ranks of one group hold tensors of the same shapes and FSDP2 shards of the same rows."""
    signatures: dict[tuple[Any, ...], list[int]] = {}
    for rank in range(world_size):
        tensors, index = place(rank)
        rows = shard_rows(tensors, shard, index) if shard > 1 else ()
        signature = (key(rank), tuple(tuple(t.shape) for t in tensors), rows)
        signatures.setdefault(signature, []).append(rank)
    return list(signatures.values())


@swept
def trace_tp(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    *,
    world_size: int,
    rank: int,
    plan: TPPlan | WrappedTP,
    fsdp: FSDP2Plan | None = None,
    step: StepFn | None,
    precision: str | None,
    steps: int,
    schedule: Loop = Loop(),
    record_op: Callable[[Any, Any], bool] | None = None,
    routing: str = "balanced",
    cuda: CudaTarget | None = None,
    sweep: Sweep,
    checkpoint: Checkpoint | None = None,
    loading: Loading | None = None,
    evaluation: Evaluation | None = None,
) -> TraceResult:
    """Trace ``steps`` training steps of rank ``rank`` of ``world_size`` under tensor parallelism (module docstring),
    and the trainer's evaluation after them where ``evaluation`` gives one (`preflight.parallel.trace_rank`).

    Args:
        model, optimizer, batch: the user's; only read. The optimizer is rebuilt (same class and hyperparameters)
            over the parallelized copy's parameters.
        plan: the tensor-parallel plan, or the layout of a model already parallelized (`read_tp`), whose copy is
            laid out the same over the fake mesh; ``fsdp``: FSDP2 over the ``dp`` dim of the 2-D mesh (None: none;
            then the plan's degree is the world size).
        record_op, routing, cuda: as for `preflight.trace.trace_steps`.

    Returns:
        A `TraceResult` whose events are this rank's; ``error`` is set when the trace stopped or the plan could not
        be applied to the copy.

    Raises:
        ProcessGroupInUseError: a fake process group cannot be made in this process.
        LossNotFoundError, StepWouldFailError: as for `preflight.trace.trace_steps`.
        Exception: the user's own exception from their step (`preflight.trace._blame`).
    """
    engine = _read_engine(plan, fsdp) if isinstance(plan, WrappedTP) else _engine(model, plan, fsdp, world_size)
    return trace_rank(engine, model, optimizer, batch, world_size=world_size,
                      rank=rank, step=step, precision=precision, steps=steps, schedule=schedule, record_op=record_op,
                      routing=routing, cuda=cuda, sweep=sweep, checkpoint=checkpoint, loading=loading, evaluation=evaluation)


@dataclasses.dataclass(frozen=True)
class WrappedTP:
    """How ``parallelize_module`` laid a model out before preflight saw it (`read_tp`).

    Attributes:
        mesh: the job's device mesh as ``(shape, dim names)`` (names None for a mesh made without them).
        rank: this process's place in it (row-major).
        layouts: each tensor-parallel parameter or buffer by qualified name -> ``(the dim names of the sub-mesh its
            tensor-parallel placements are over, None for the whole mesh; those placements)``.
        fsdp_dims: the mesh dims FSDP2 shards over where ``fully_shard`` wrapped the model after it was laid out
            (TP x FSDP2); None: no FSDP2.
        storages: for a local shard that is a view into a larger block (a library that sliced the whole weight and
            kept the slice, as transformers' tensor parallelism does), by qualified name: ``(the block's key, its
            bytes, the view's offset, shape and strides)``. The copy holds blocks of the same size: the job holds them.
    """

    mesh: tuple[tuple[int, ...], tuple[str, ...] | None]
    rank: int
    layouts: dict[str, tuple[tuple[str, ...] | None, tuple[Any, ...]]]
    fsdp_dims: tuple[str, ...] | None = None
    storages: dict[str, tuple[int, int, int, tuple[int, ...], tuple[int, ...]]] = dataclasses.field(
        default_factory=dict)

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh[0])

    def note(self) -> str:
        dims = " x ".join(map(str, self.mesh[0]))
        fsdp = f", then wrapped by fully_shard over {'/'.join(self.fsdp_dims)}" if self.fsdp_dims else ""
        return (f"the model was already parallelized with DTensor ({len(self.layouts)} tensor-parallel tensor(s) over "
                f"a mesh of {dims} ranks{fsdp}; this process is rank {self.rank}): its layout and its modules' hooks "
                "were read from the model and each rank traced on a fake copy laid out the same")


def _refuse_expert_parallelism(model: nn.Module) -> None:
    """Raise a ValueError naming expert parallelism where transformers laid the model's experts out over ranks
    (``DistributedConfig(ep_size=...)``: its experts modules are marked ``_is_expert_parallel``)."""
    experts = [name for name, module in model.named_modules() if getattr(module, "_is_expert_parallel", False)]
    if experts:
        raise ValueError(f"the model's experts are already laid out over ranks by expert parallelism ({experts[0]} "
                         f"and {len(experts) - 1} more: transformers' DistributedConfig(ep_size=...)), but its "
                         "config does not record the layout, which preflight reads it from. Plan it on the model "
                         "before "
                         "from_pretrained lays it out: Run(parallel=ParallelPlan(world_size, 'fsdp2', "
                         "ep=EPPlan(ep_size))) traces each rank through transformers' own layout and token exchange "
                         "(`preflight estimate --ep N` from a config).")


def read_tp(model: nn.Module) -> WrappedTP | None:
    """The layout of a model ``parallelize_module`` (or ``distribute_module``) already parallelized, alone or then
    wrapped by ``fully_shard`` over another dim of the same mesh (torchtitan's TP x FSDP2); None where no parameter or
    buffer of it is distributed by tensor parallelism (FSDP2 alone: `preflight.parallel.read_fsdp2` reads that).

    Raises:
        ValueError: its DTensors live on meshes of different roots, FSDP2's units over different meshes, or its
            experts laid out by transformers' expert parallelism (not traced yet).
    """
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build of torch without distributed support
        return None
    fsdp_meshes = []  # each fully_shard call's mesh (slicing a mesh makes a new, equal object each time)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                fsdp_meshes.append(group.mesh_info.mesh)
    _refuse_expert_parallelism(model)
    if any(m != fsdp_meshes[0] or m.mesh_dim_names != fsdp_meshes[0].mesh_dim_names for m in fsdp_meshes):
        raise ValueError("the model's fully_shard units were wrapped over different meshes; the per-rank trace "
                         "follows one")
    fsdp_mesh = fsdp_meshes[0] if fsdp_meshes else None
    fsdp_dims = None
    if fsdp_mesh is not None:
        if fsdp_mesh.mesh_dim_names is None:
            return None  # FSDP2 over an unnamed mesh: no tensor-parallel dim beside it can be named
        fsdp_dims = tuple(fsdp_mesh.mesh_dim_names)
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    dtensors = [(name, t) for name, t in tensors if isinstance(t, DTensor)]
    layouts: dict[str, tuple[tuple[str, ...] | None, tuple[Any, ...]]] = {}
    storages: dict[str, tuple[int, int, int, tuple[int, ...], tuple[int, ...]]] = {}
    roots = {}
    for name, t in dtensors:
        mesh = t.device_mesh
        root = mesh._get_root_mesh()
        roots[id(root)] = root
        if fsdp_dims is None:
            layouts[name] = (None if mesh is root else tuple(mesh.mesh_dim_names), tuple(t.placements))
            local = t.to_local()
            block = local.untyped_storage()
            if block.nbytes() > local.numel() * local.element_size():
                storages[name] = (block.data_ptr() or id(block), block.nbytes(), local.storage_offset(),
                                  tuple(local.shape), tuple(local.stride()))
            continue
        names = tuple(mesh.mesh_dim_names or ())
        tp_dims = tuple(d for d in names if d not in fsdp_dims)
        if tp_dims:  # FSDP2's spec over (FSDP's dims, the tensor-parallel dims): the latter's placements
            layouts[name] = (tp_dims, tuple(p for d, p in zip(names, t.placements) if d in tp_dims))
    if not layouts:
        return None
    if len(roots) > 1:
        raise ValueError("the model's DTensors live on device meshes of different roots; the per-rank trace follows "
                         "one mesh")
    root = next(iter(roots.values()))
    coordinate = root.get_coordinate()
    rank = 0
    for index, size in zip(coordinate, root.shape):
        rank = rank * size + index
    return WrappedTP(mesh=(tuple(root.shape), None if root.mesh_dim_names is None else tuple(root.mesh_dim_names)),
                     rank=rank, layouts=layouts, fsdp_dims=fsdp_dims, storages=storages)


def _read_engine(layout: WrappedTP, fsdp: FSDP2Plan | None = None) -> Engine:
    """The engine that lays a fake copy out as ``layout`` says: each DTensor tensor distributed over the fake mesh's
    matching sub-mesh with its placements (each rank keeps its own chunk; no data moves), and every hook that closes
    over one of the job's device meshes made again over the fake one; then, for TP x FSDP2, ``fully_shard`` as
    ``fsdp`` says over the fake mesh's FSDP dims."""
    from torch.distributed.tensor import distribute_tensor

    def wrap(replica: nn.Module, mesh: Any) -> nn.Module:
        with meshes_outside_modes():
            laid_out = _lay_out(replica, mesh)
            if layout.fsdp_dims is not None and fsdp is not None:
                apply_fully_shard(laid_out, mesh[layout.fsdp_dims], fsdp)
        return laid_out

    def _lay_out(replica: nn.Module, mesh: Any) -> nn.Module:  # inside `wrap`'s meshes_outside_modes
        def fake(real: Any) -> Any:
            root = real._get_root_mesh()
            return mesh if real is root or real.mesh_dim_names is None else mesh[tuple(real.mesh_dim_names)]

        blocks: dict[int, torch.Tensor] = {}  # a block of the job's -> the copy's
        for name, (dims, placements) in layout.layouts.items():
            owner_name, _, attr = name.rpartition(".")
            owner = replica.get_submodule(owner_name)
            whole = getattr(owner, attr)
            sub = mesh if dims is None else mesh[dims]
            local = distribute_tensor(whole.detach(), sub, list(placements), src_data_rank=None)
            held = layout.storages.get(name)
            if held is not None and tuple(local.to_local().shape) == held[3]:
                local = _in_block(local, held, blocks)
            if attr in owner._parameters:
                owner._parameters[attr] = nn.Parameter(local, requires_grad=whole.requires_grad)
            else:
                owner._buffers[attr] = local
        for module in replica.modules():
            for table in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks"):
                hooks = getattr(module, table, None) or {}
                for handle, fn in list(hooks.items()):
                    hooks[handle] = _over_mesh(fn, fake)
            # transformers' tensor parallelism replaces `forward` on the instance by a closure over the mesh
            if isinstance(vars(module).get("forward"), types.FunctionType):
                module.forward = _over_mesh(module.forward, fake)
        return replica

    return Engine(name="the model's DTensor layout", wrap=wrap, optimizer=_optimizer, parameters=local_parameters,
                  watch=dtensor_watch(layout.fsdp_dims is not None), mesh=layout.mesh)


def _in_block(local: Any, held: tuple[int, int, int, tuple[int, ...], tuple[int, ...]],
              blocks: dict[int, torch.Tensor]) -> Any:
    """``local`` (a DTensor) made again with its local tensor a view into a block of the size the job's shard lives
    in (`WrappedTP.storages`); shards of one block share one."""
    from torch.distributed.tensor import DTensor

    key, nbytes, offset, shape, stride = held
    own = local.to_local()
    if key not in blocks:
        blocks[key] = torch.empty(nbytes, dtype=torch.uint8, device=own.device)
    view = blocks[key].view(own.dtype).as_strided(shape, stride, offset) if nbytes % own.element_size() == 0 \
        else None
    if view is None:
        return local
    return DTensor.from_local(view, local.device_mesh, local.placements, run_check=False, shape=local.shape,
                              stride=local.stride())


def _over_mesh(fn: Any, fake: Callable[[Any], Any]) -> Any:
    """``fn`` (a hook) made again with each device mesh its closure holds replaced by ``fake(mesh)``; ``fn`` itself
    where it closes over none (DTensor's styles register closures over the mesh, `distribute_module`)."""
    from torch.distributed.device_mesh import DeviceMesh

    return with_cells(fn, lambda value: fake(value) if isinstance(value, DeviceMesh) else value)


def closed_form_activations(model: nn.Module, batch: Any, degree: int, sequence_parallel: bool) -> int | None:
    """The activation bytes users compute by hand for a transformer under tensor parallelism: Korthikanti et al.,
    "Reducing Activation Recomputation in Large Transformer Models" (2022), per layer ``s*b*h*(10 + 24/t +
    5*a*s/(h*t))`` with tensor parallelism and ``s*b*h/t*(34 + 5*a*s/h)`` with sequence parallelism, times the
    layers (what Megatron's theoretical memory report computes). It counts a GPT layer in 16-bit with dropout masks
    and nothing outside the layers. None where the model has no transformers config (hidden size, heads, layers) or
    the batch no ``input_ids`` of shape (batch, sequence)."""
    config = getattr(model, "config", None)
    h = getattr(config, "hidden_size", None)
    a = getattr(config, "num_attention_heads", None)
    layers = getattr(config, "num_hidden_layers", None)
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if not all(isinstance(v, int) and v > 0 for v in (h, a, layers)) or not isinstance(ids, torch.Tensor) \
            or ids.dim() != 2:
        return None
    b, seq = ids.shape
    t = degree
    if sequence_parallel:
        per_layer = seq * b * h / t * (34 + 5 * a * seq / h)
    else:
        per_layer = seq * b * h * (10 + 24 / t + 5 * a * seq / (h * t))
    return int(per_layer * layers)


def uses_sequence_parallel(model: nn.Module, plan: TPPlan | WrappedTP) -> bool:
    """Whether the plan (or the laid-out model's hooks) shards activations along the sequence: a
    ``SequenceParallel`` style in the plan, or transformers' own ``sequence_parallel`` word (`_TransformersStyle`)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    if isinstance(plan, TPPlan):
        return any(isinstance(style, SequenceParallel) or getattr(style, "module_word", None) == "sequence_parallel"
                   for style in plan_styles(model, plan).values())
    return False  # a laid-out model keeps its hooks, not its styles
