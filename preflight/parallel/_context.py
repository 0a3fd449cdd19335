"""One rank's training step under context parallelism (ring attention, torch's ``context_parallel``), traced on
fake tensors with a fake process group.

A `CPPlan` says how many ranks share one sequence (the ``cp`` dim of the job's mesh), how the ring passes keys and
values (``set_rotate_method``: one all-gather of every rank's keys and values, or an all-to-all per ring step), and
which of the batch's tensors carry the sequence (``context_parallel``'s ``buffers`` and ``buffer_seq_dims``). Each
rank is traced as the job runs it: the fake copy of the model (replicated, or wrapped by FSDP2's ``fully_shard``
over every rank of the job, torchtitan's ``dp_shard_cp`` layout) runs its real steps inside torch's own
``context_parallel`` over the fake mesh's ``cp`` dim, which shards the batch's sequence tensors in place (head-tail
load balancing for causal attention, as torch does by default) and sends every ``scaled_dot_product_attention``
through torch's ring: the sequence-sharded activations, the gathered or rotated keys and values, the merged
outputs and their log-sum-exps, forward and backward, are operators the tracker sees.

On a CUDA target the ring runs the attention kernel the target picks (flash, memory-efficient or cuDNN:
`preflight.cuda`), each of which torch's ring handles. On the CPU torch 2.13's ring has no rule for the CPU's fused
attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu``: "does not have a sharding strategy
registered"), so stock ``context_parallel`` does not run on CPU tensors; `cpu_ring_attention` adds the missing rule
and handler (the same ring, ``_templated_ring_attention`` and its backward, over the CPU kernel) for the duration of
a block: the trace of a CPU target runs inside it, and so do the real gloo runs that check it.

Ranks at the same place in the ring (the same index on the ``cp`` dim) run the same program and share a trace;
ranks at different places do not (with load balancing, rank ``r`` computes ``r`` of its ring steps on half its keys
and the others on half its queries), so a ring of ``degree`` ranks is traced ``degree`` times.

With tensor parallelism beside it (torchtitan's ``(dp, cp, tp)`` mesh, tensor-parallel ranks innermost), the copy is
first laid out by ``parallelize_module`` over the ``tp`` dim, then wrapped by ``fully_shard`` over the ``dp`` and
``cp`` dims flattened; each attention then runs on the rank's own heads and its slice of the sequence, through the
ring over ``cp``. Ranks share a trace where their place in the ring, their tensor-parallel shapes and FSDP2's shards
of them are equal (one layout per tensor-parallel rank on a meta copy, FSDP2's chunks counted: `cp_rank_groups`).

Known limitations: the gradient all-reduce over the ring of a replicated model (without FSDP2) is the user's and is
not traced (it is in place); attention masks other than causal and flex attention are not traced (torch's ring
refuses a mask); the rotary-embedding buffers torchtitan shards with the batch are the model's own here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from preflight._checkpoint import Checkpoint
from preflight._loading import Loading
from preflight._steps import Loop, StepFn
from preflight.cuda import CudaTarget
from preflight.parallel._fsdp2 import FSDP2Plan, apply_fully_shard
from preflight.parallel._rank import Engine, local_parameters, named_optimizer, trace_rank
from preflight.parallel._tensor import (TPPlan, dtensor_watch, grouped_by_shards, lay_out, meshes_outside_modes,
                                        plan_styles, tp_layouts)
from preflight.trace import Sweep, TraceResult, swept

__all__ = ["CPPlan", "cp_rank_groups", "cpu_ring_attention", "sequence_tensors", "trace_cp"]

ROTATE_METHODS = ("allgather", "alltoall")


@dataclasses.dataclass(frozen=True)
class CPPlan:
    """How context parallelism is applied, as the training script applies torch's ``context_parallel``.

    Attributes:
        degree: the ranks one sequence is cut among (the size of the mesh's ``cp`` dim). The job's world size is
            ``degree`` times the data-parallel degree.
        rotate: ``set_rotate_method``'s: ``"allgather"`` (torch's default: every rank's keys and values gathered
            once per attention) or ``"alltoall"`` (passed one rank on per ring step).
        sequence: ``context_parallel``'s ``buffers`` as ``{batch key or index: sequence dim}``; None: every tensor
            of the batch with two or more dims whose dim 1 has the length of the first such tensor's (``input_ids``,
            ``labels``, ``position_ids`` of shape ``(batch, sequence)``).
    """

    degree: int
    rotate: str = "allgather"
    sequence: Mapping[Any, int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.degree, bool) or not isinstance(self.degree, int) or self.degree < 1:
            raise ValueError(f"`CPPlan.degree` should be a positive int (the ranks one sequence is cut among), got "
                             f"{self.degree!r}.")
        if self.rotate not in ROTATE_METHODS:
            raise ValueError(f"`CPPlan.rotate` should be one of {ROTATE_METHODS} (torch's set_rotate_method), got "
                             f"{self.rotate!r}.")
        if self.sequence is not None:
            if not isinstance(self.sequence, Mapping) or not all(
                    isinstance(d, int) and not isinstance(d, bool) for d in self.sequence.values()):
                raise TypeError("`CPPlan.sequence` should map the batch's keys (or tuple indices) to their sequence "
                                f"dim (an int), got {self.sequence!r}.")
            object.__setattr__(self, "sequence", dict(self.sequence))

    def mesh(self, world_size: int, tp: TPPlan | None = None) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The fake mesh's ``(shape, dim names)`` for ``world_size`` ranks: ``(degree,)`` over ``("cp",)`` when the
        ring holds every rank, else ``(world_size // degree, degree)`` over ``("dp", "cp")`` (torchtitan's layout:
        the ranks of one ring are consecutive); with ``tp``, a ``tp`` dim of its degree innermost (``("cp", "tp")``
        or ``("dp", "cp", "tp")``); a ValueError where the degrees do not divide ``world_size``."""
        degree = 1 if tp is None else tp.degree
        if world_size % (self.degree * degree):
            raise ValueError(f"`CPPlan.degree` ({self.degree})" + (f" times `TPPlan.degree` ({degree})" if tp else "")
                             + f" should divide the world size {world_size}: the mesh is (world_size // degree, "
                             "degree" + (", tp degree)." if tp else ")."))
        dp = world_size // (self.degree * degree)
        shape, names = ((dp,), ("dp",)) if dp > 1 else ((), ())
        shape, names = (*shape, self.degree), (*names, "cp")
        if tp is not None:
            shape, names = (*shape, degree), (*names, "tp")
        return shape, names

    @property
    def label(self) -> str:
        return f"context parallel degree {self.degree}, {self.rotate} rotation"


def sequence_tensors(batch: Any, plan: CPPlan) -> list[tuple[torch.Tensor, int]]:
    """The batch's tensors ``context_parallel`` shards, with their sequence dims, as ``plan.sequence`` names them
    (its default: every tensor of two or more dims whose dim 1 is as long as the first such tensor's).

    Raises:
        ValueError: a named key the batch lacks or whose value is not a tensor, or a batch with no such tensor.
    """
    if isinstance(batch, Mapping):
        items = list(batch.items())
    elif isinstance(batch, (list, tuple)):
        items = list(enumerate(batch))
    else:
        items = [(0, batch)]
    if plan.sequence is not None:
        found = dict(items)
        out = []
        for key, dim in plan.sequence.items():
            value = found.get(key)
            if not isinstance(value, torch.Tensor) or not -value.dim() <= dim < value.dim():
                raise ValueError(f"`CPPlan.sequence` names {key!r} with sequence dim {dim}, but the batch's {key!r} "
                                 f"is {_describe(value)}: name the batch's tensors that carry the sequence.")
            if not any(t is value for t, _ in out):
                out.append((value, dim % value.dim()))
        return out
    tensors = [(key, v) for key, v in items if isinstance(v, torch.Tensor) and v.dim() >= 2]
    if not tensors:
        raise ValueError("context parallelism shards the batch's sequence, but the batch holds no tensor of two or "
                         "more dims: give CPPlan(sequence={key: dim}).")
    length = tensors[0][1].shape[1]
    out: dict[int, tuple[torch.Tensor, int]] = {}  # one entry per tensor: a batch may hold one under two keys
    for _, v in tensors:
        if v.shape[1] == length:
            out.setdefault(id(v), (v, 1))
    return list(out.values())


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return "missing" if value is None else f"a {type(value).__name__}"


@contextlib.contextmanager
def cpu_ring_attention() -> Iterator[None]:
    """For the block, let torch's ``context_parallel`` run on CPU tensors: DTensor gets a sharding rule for the CPU's
    fused attention kernel and its backward (every tensor sharded on the sequence dim, dim 2, as torch's rule for
    the CUDA flash kernel has it), and the ring a handler that runs torch's own ``_templated_ring_attention`` (and
    its backward) over that kernel, as it does over the CUDA ones (module docstring). Both are removed on exit."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring
    from torch.distributed.tensor.experimental._context_parallel._sharding_rules import _op_strategy_context

    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    def forward_rule(schema: OpSchema) -> OpStrategy:  # out, logsumexp | query, key, value
        return expand_to_full_mesh_op_strategy(schema.get_mesh_from_args(), schema, [[Shard(2)] * 5], input_index=2)

    def backward_rule(schema: OpSchema) -> OpStrategy:  # grad q, k, v | grad_out, q, k, v, out, logsumexp
        return expand_to_full_mesh_op_strategy(schema.get_mesh_from_args(validate=False), schema, [[Shard(2)] * 9],
                                               input_index=3)

    def ring_forward(mesh: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
                     is_causal: bool = False, *, attn_mask: Any = None, scale: float | None = None) -> Any:
        if attn_mask is not None:
            raise NotImplementedError("context parallelism's ring runs attention without a mask (causal or none)")
        return ring._templated_ring_attention(mesh.get_group(), 2, forward, query=query, key=key, value=value,
                                              is_causal=is_causal, dropout_p=dropout_p, scale=scale)

    def ring_backward(mesh: Any, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      out: torch.Tensor, logsumexp: torch.Tensor, dropout_p: float, is_causal: bool, *,
                      attn_mask: Any = None, scale: float | None = None) -> Any:
        if attn_mask is not None:
            raise NotImplementedError("context parallelism's ring runs attention without a mask (causal or none)")
        return ring._templated_ring_attention_backward(
            mesh.get_group(), 2, backward, grad_out=grad_out, grad_out_name="grad_out", query=query, key=key,
            value=value, out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=scale)

    def handler(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:  # as torch's `_sdpa_handler`
        info = DTensor._op_dispatcher.unwrap_to_op_info(op, args, kwargs)
        DTensor._op_dispatcher.sharding_propagator.propagate(info)
        sharding = info.output_sharding
        if sharding is None or sharding.needs_redistribute:
            raise RuntimeError(f"context parallelism's ring got {op} inputs that are not sharded on the sequence")
        run = ring_forward if op is forward else ring_backward
        return DTensor._op_dispatcher.wrap(run(info.compute_mesh, *info.local_args, **info.local_kwargs),
                                           sharding.output_spec)

    saved = {op: ring.custom_ops.get(op) for op in (forward, backward)}
    with _op_strategy_context(forward, forward_rule, RuntimeSchemaInfo(3)), \
            _op_strategy_context(backward, backward_rule, RuntimeSchemaInfo(6)):
        ring.custom_ops.update({forward: handler, backward: handler})
        try:
            yield
        finally:
            for op, value in saved.items():
                if value is None:
                    ring.custom_ops.pop(op, None)
                else:
                    ring.custom_ops[op] = value


@contextlib.contextmanager
def ring_of(mesh: Any, batch: Any, plan: CPPlan, *, cpu: bool) -> Iterator[None]:
    """For the block, ``context_parallel`` over ``mesh`` with the batch's sequence tensors sharded in place and not
    restored (torchtitan's ``no_restore_buffers``), rotating as the plan says; with ``cpu``, inside
    `cpu_ring_attention`. torch's rotate method (a module-level option) is put back on exit."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    tensors = sequence_tensors(batch, plan)
    before = ring._cp_options.rotate_method
    ring.set_rotate_method(plan.rotate)
    try:
        with cpu_ring_attention() if cpu else contextlib.nullcontext(), \
                context_parallel(mesh, buffers=[t for t, _ in tensors], buffer_seq_dims=[d for _, d in tensors],
                                 no_restore_buffers={t for t, _ in tensors}):
            yield
    finally:
        ring._cp_options.rotate_method = before


def _engine(plan: CPPlan, fsdp: FSDP2Plan | None, world_size: int, tp: TPPlan | None = None,
            styles: dict[str, Any] | None = None) -> Engine:
    """The ring's engine: with ``tp``, the copy laid out by ``parallelize_module`` with ``styles`` over the ``tp``
    dim; with ``fsdp``, then wrapped by ``fully_shard`` over every rank of the non-tensor-parallel dims."""
    shape, names = plan.mesh(world_size, tp)

    def wrap(replica: nn.Module, mesh: Any) -> nn.Module:
        with meshes_outside_modes():
            if tp is not None:
                lay_out(replica, mesh["tp"], styles)
            if fsdp is not None:  # FSDP2 over every rank of the dp and cp dims: torchtitan's dp_shard_cp
                apply_fully_shard(replica, data_mesh(mesh), fsdp)
        return replica

    def around(mesh: Any, batch: Any, *, cpu: bool) -> contextlib.AbstractContextManager[None]:
        return ring_of(mesh["cp"] if len(shape) > 1 else mesh, batch, plan, cpu=cpu)

    name = "context_parallel" + (" + parallelize_module" if tp is not None else "") + (
        " + fully_shard" if fsdp is not None else "")
    return Engine(name=name, wrap=wrap, optimizer=named_optimizer("context parallelism"), parameters=local_parameters,
                  watch=dtensor_watch(fsdp is not None), mesh=(shape, names), around=around)


def data_mesh(mesh: Any) -> Any:
    """The mesh FSDP2 shards over: a 1-D mesh whole; else its ``dp`` dim or a ring's ``cp`` dim, or both flattened
    (torchtitan's ``dp_shard_cp``), whatever other dims (``pp``, ``tp``) it has."""
    if mesh.ndim == 1:
        return mesh
    dims = tuple(d for d in ("dp", "cp") if d in mesh.mesh_dim_names)
    return mesh[dims]._flatten("dp_cp") if len(dims) == 2 else mesh[dims[0]]


def cp_rank_groups(plan: CPPlan, world_size: int, model: nn.Module | None = None,
                   tp: TPPlan | None = None, fsdp: FSDP2Plan | None = None) -> list[list[int]]:
    """Ranks grouped by their place in the ring (their index on the ``cp`` dim): ranks of one group run the same
    program and trace the same (module docstring). With ``tp`` (and ``model``), ranks grouped by their place in the
    ring, the local shapes of their parameters under ``tp`` and FSDP2's shards of them (`grouped_by_shards`: one
    layout per tensor-parallel rank)."""
    plan.mesh(world_size, tp)  # a ValueError where the degrees do not divide the world
    if tp is None:
        return [[r for r in range(world_size) if r % plan.degree == place] for place in range(plan.degree)]
    # On the (dp, cp, tp) mesh rank r is tensor-parallel rank r % tp, at place r // tp % cp in its ring, and at
    # index r // tp of the dp and cp dims flattened, which FSDP2 shards over.
    by_tp_rank, degree = tp_layouts(model, tp), tp.degree
    shard = world_size // degree if fsdp is not None else 1
    return grouped_by_shards(world_size, lambda rank: (by_tp_rank[rank % degree], rank // degree), shard,
                             key=lambda rank: rank // degree % plan.degree)


@swept
def trace_cp(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    *,
    world_size: int,
    rank: int,
    plan: CPPlan,
    fsdp: FSDP2Plan | None = None,
    tp: TPPlan | None = None,
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
) -> TraceResult:
    """Trace ``steps`` training steps of rank ``rank`` of ``world_size`` under context parallelism (module
    docstring).

    Args:
        model, optimizer, batch: the user's; only read. The optimizer is rebuilt (same class and hyperparameters)
            over the copy's parameters; the batch's sequence tensors are sharded on the copy of the batch.
        plan: the context-parallel plan; ``fsdp``: FSDP2 over every rank of the job's data-parallel and ring dims
            (None: the model replicated); ``tp``: tensor parallelism over an innermost ``tp`` dim.
        record_op, routing, cuda: as for `preflight.trace.trace_steps`.

    Returns:
        A `TraceResult` whose events are this rank's; ``error`` is set when the trace stopped.

    Raises:
        ProcessGroupInUseError: a fake process group cannot be made in this process.
        LossNotFoundError, StepWouldFailError: as for `preflight.trace.trace_steps`.
        Exception: the user's own exception from their step (`preflight.trace._blame`).
    """
    sequence_tensors(batch, plan)  # a ValueError naming what the plan asks of the batch, before any trace
    engine = _engine(plan, fsdp, world_size, tp, None if tp is None else plan_styles(model, tp))
    return trace_rank(engine, model, optimizer, batch, world_size=world_size, rank=rank,
                      step=step, precision=precision, steps=steps, schedule=schedule, record_op=record_op,
                      routing=routing, cuda=cuda, sweep=sweep, checkpoint=checkpoint, loading=loading)
