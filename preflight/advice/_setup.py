"""The set-up `advise` changes, and the changes it can make to it (`Move`), each applied on the way to a trace.

A `Move` changes a `Candidate` (the model, optimizer, batch and `Run` a trace is given) inside an `ExitStack` that
puts back whatever it switched on: checkpointing is switched on the model and off again (`restored_module`), LoRA
is a copy of the architecture on the meta device, an 8-bit optimizer is built over the same parameters, and
precision, the optimizer step's implementation and ZeRO-Offload are changes of the `Run`. `_Setup.trace_moves`
traces a set of moves applied in one order (LoRA first: it builds the model the others act on) and keeps each
figure, so a single option and a combination containing it share the trace.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import types
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from preflight._device import iter_tensors, map_tensors
from preflight._estimate import estimate
from preflight._quiet import quiet_import_logs
from preflight._result import Estimate
from preflight._loading import Loading
from preflight._run import Run, pinned
from preflight._steps import StepFn, half_dtype, with_optimizer_impl
from preflight._units import format_bytes
from preflight.parallel import ParallelPlan
from preflight.trace import restored_module

# Ranking among options that fit: cheapest first. What each costs is in its `cost` text. A combination costs what
# its costliest change costs.
COST_ORDER = (
    "allocator",  # an environment variable
    "eval_kept",  # the evaluation's kept predictions moved to the host every k batches: a slower evaluation
    "eval_batch",  # smaller evaluation batches: more evaluation steps, a slower evaluation
    "meta-init",  # how the script builds and loads the model, not how it trains
    "fused",  # the same updates in one kernel: usually faster
    "micro_batch",  # same updates, lower throughput
    "for-loop",  # the same updates, one kernel launch per parameter: a slower step
    "bf16-mixed",  # usually no quality change, needs bf16 hardware
    "fsdp_param_dtype",  # FSDP2 casts the gathered parameters in place of autocast's per-op casts
    "zero1", "zero2",  # DDP's communication volume, needs the GPUs
    "checkpointing",  # about one extra forward per step
    "offload_activations",  # the saved activations over PCIe, there and back, every step
    "zero3",  # 1.5x DDP's communication
    "adamw8bit",  # another optimizer
    "offload",  # the optimizer step on the CPU: host memory and PCIe traffic, a slower step
    "bf16-true",  # precision risk for the updates
    "lora",  # changes what is trained
    "qlora",  # changes what is trained, over base weights rounded to 4 bits
    "more_gpus",  # another job: the GPUs to run it on (offered when one GPU cannot run the training as it is)
)
LORA_RANK = 16
_IMPL_COSTS = {
    "fused": "the same updates, computed by one fused kernel per step (torch's fastest implementation where the "
             "optimizer has one; parameters must be floating point on CUDA or CPU)",
    "for-loop": "the same updates, one parameter at a time: a slower optimizer step (a kernel launch per tensor)",
}
_PRECISION_COSTS = {
    "bf16-mixed": "autocast runs matmuls and convolutions in bf16 while weights, gradients and optimizer state stay "
                  "fp32: usually no quality change; needs bf16 hardware (NVIDIA Ampere or newer) for speed",
    "bf16-true": "weights, gradients and optimizer state in bf16: updates smaller than bf16's 8-bit mantissa "
                 "resolves are lost, which can slow or stall convergence without stochastic rounding or Kahan "
                 "summation",
}
_CHECKPOINTING_COST = ("recomputes each checkpointed block's forward during backward: about one extra forward pass "
                       "per step (a forward is roughly a third of a training step's compute)")
_OFFLOAD_ACTIVATIONS_COST = (
    "the tensors autograd saves are copied to host memory in the forward and back in the backward: twice the saved "
    "activations over PCIe per step, and pinned host memory to hold them; TRL's activation_offloading and "
    "torchtune's enable_activation_offloading overlap the copies with compute on a side stream (torch's save_on_cpu "
    "copies synchronously: a slower step)")
_EIGHT_BIT_COST = ("a different optimizer: block-wise 8-bit Adam states (Dettmers et al. 2022, arXiv:2110.02861) "
                   "matched 32-bit Adam in the paper's benchmarks, but check the loss curve; needs bitsandbytes where "
                   "you train")
_OFFLOAD_COST = ("the optimizer step runs on the CPU: host memory for the state, gradients copied over PCIe every "
                 "step, and a slower step (ZeRO-Offload, arXiv:2101.06840)")
_LORA_COST = ("changes what is trained: only low-rank adapters learn, which can fall short of full fine-tuning on "
              "tasks far from the pre-training data; the base weights stay frozen")
_QLORA_COST = (_LORA_COST.removesuffix("; the base weights stay frozen") + "; the frozen base weights are rounded to "
               "4 bits (NF4, QLoRA), and each forward and backward dequantizes them: a slower step")
_MICRO_COST = ("{k} forward/backward passes per optimizer step instead of 1: the same updates{rounding}, lower "
               "throughput when the full batch kept the GPU busy")


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """One change to the training set-up, or several made together, with the predicted peak.

    Attributes:
        change: what to change, machine-readable: ``{"micro_batch_size": 4, "accumulate_grad_batches": 2}``,
            ``{"gradient_checkpointing": True}``, ``{"optimizer": "bitsandbytes.optim.AdamW8bit"}``,
            ``{"peft": "lora", "r": 16, "target_modules": "all-linear", "base_dtype": "bfloat16"}``,
            ``{"precision": "bf16-mixed"}``, ``{"optimizer_impl": "fused"}``, ``{"sharding": "zero2",
            "world_size": 8}``, ``{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}``; a combination has
            the keys of each of its changes.
        description: the change and its predicted effect, in words.
        predicted_peak_bytes: what the changed set-up needs, traced: the figure a verdict compares with the budget
            (`preflight.Estimate.required_bytes`: the device total where a GPU target is simulated, else the
            allocated peak). Sharding over more GPUs than the run has: derived from the traced breakdown.
        fits: ``predicted_peak_bytes`` is within the budget less headroom.
        cost: what the change costs (compute, communication, optimizer or model quality).
        run: the run's description with the change made (`preflight.Run`): pass it to `preflight.estimate` or
            ``check`` as it is, or print ``run.cli_flags()`` for ``preflight estimate``. Changes to the model, the
            optimizer or the batch are in ``change`` (the description stays as it was there).
        changes: the names of the changes made (one for a single change; a combination's in cost order), as
            ``advise`` ranks them: ``("fused", "checkpointing", "bf16-true")``.
    """

    change: dict[str, Any]
    description: str
    predicted_peak_bytes: int
    fits: bool
    cost: str
    run: Run
    # What ``run`` changes of the description advise was given (`Run.changes_from`), for `apply`.
    run_changes: dict[str, Any] = dataclasses.field(default_factory=dict)
    changes: tuple[str, ...] = ()

    def apply(self, run: Run) -> Run:
        """``run`` with this suggestion's change of the description made, so suggestions compose:
        ``micro_batch.apply(bf16.run)`` is the bf16 run with the micro-batch's accumulation. (The model, optimizer
        or batch changes in ``change`` are the caller's to make.)"""
        return run.with_changes(self.run_changes)

    def to_dict(self) -> dict[str, Any]:
        """The suggestion as plain values (the JSON report's and the CLI's form), the changed run as its fields and
        as ``preflight estimate`` flags."""
        plain = self.run.to_dict()
        changes = {name: {k: plain[name][k] for k in value} if isinstance(value, dict) else plain[name]
                   for name, value in self.run_changes.items()}
        return {"description": self.description, "predicted_peak_bytes": self.predicted_peak_bytes,
                "fits": self.fits, "change": self.change, "cost": self.cost, "run": plain, "run_changes": changes,
                "cli_flags": self.run.cli_flags(), "changes": list(self.changes)}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What one trace is given: the model, optimizer, batch and run, with some moves made."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Any
    run: Run


@dataclasses.dataclass(frozen=True)
class Move:
    """One change `advise` can make, alone or with others.

    ``key`` is its cost class (`COST_ORDER`); moves of one ``group`` exclude each other (a combination keeps one
    precision, one optimizer); ``order`` is where it is applied (LoRA first, since it builds the model the
    checkpointing switch and the optimizer act on); ``apply`` makes it on a candidate, entering on ``stack``
    whatever must be undone after the trace. ``words`` names it in a combination's description."""

    key: str
    group: str
    change: dict[str, Any]
    words: str
    cost: str
    apply: Callable[[Candidate, contextlib.ExitStack], Candidate]
    order: int

    @property
    def rank(self) -> int:
        return COST_ORDER.index(self.key)


def need(est: Estimate) -> int:
    """What a verdict compares with the budget (the CLI's exit status and the callbacks' decision): the largest need
    of the run's phases traced with the steps (training, and the loading and the checkpoint save where the run
    describes them)."""
    return est.run_required_bytes


@dataclasses.dataclass(frozen=True)
class _Setup:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Any
    step: StepFn | None
    run: Run  # the user's description; each option's `Suggestion.run` is it changed
    device: torch.device  # where the user's model plans for: pinned for traces of meta copies (LoRA's)
    budget_bytes: int
    limit: int
    headroom: float
    make_batch: Callable[[int], Any] | None
    baseline: Estimate
    traced: dict[frozenset[tuple[str, str]], Estimate] = dataclasses.field(default_factory=dict)

    @property
    def plan(self) -> ParallelPlan | None:
        return self.run.parallel

    @property
    def precision(self) -> str | None:
        return self.run.precision

    @property
    def world_size(self) -> int:
        return self.run.world_size

    def make(self, batch_size: int) -> Any:
        """A batch of ``batch_size`` samples (the caller's ``make_batch``, else the batch resized)."""
        return self.make_batch(batch_size) if self.make_batch is not None else resize_batch(self.batch, batch_size)

    def trace(self, *, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
              batch: Any = None, step: StepFn | None = None, run: Run | None = None) -> Estimate:
        """Trace the set-up with some parts replaced (under ``run`` instead of the user's, when given); a trace
        that fails is an error, not a lower bound."""
        run = pinned(run or self.run, self.device)
        est = estimate(model if model is not None else self.model,
                       optimizer if optimizer is not None else self.optimizer,
                       batch if batch is not None else self.batch, run,
                       step=step if step is not None else self.step)
        if est.coverage.lower_bound:
            raise RuntimeError(f"the trace failed at operator {est.coverage.failed_op}: {est.coverage.reason}")
        return est

    @contextlib.contextmanager
    def applied(self, moves: Iterable[Move]) -> Any:
        """The user's set-up with ``moves`` made (in their order), undone on exit."""
        candidate = Candidate(self.model, self.optimizer, self.batch, self.run)
        with contextlib.ExitStack() as stack:
            for move in sorted(moves, key=lambda m: m.order):
                candidate = move.apply(candidate, stack)
            yield candidate

    def trace_moves(self, moves: Iterable[Move]) -> Estimate:
        """The trace of the set-up with ``moves`` made; each set is traced once."""
        moves = list(moves)
        key = frozenset((m.key, repr(sorted(m.change.items()))) for m in moves)
        if key not in self.traced:
            with self.applied(moves) as c:
                self.traced[key] = self.trace(model=c.model, optimizer=c.optimizer, batch=c.batch, run=c.run)
        return self.traced[key]

    def need_of(self, moves: Iterable[Move]) -> int | None:
        """What the verdict compares for the set-up with ``moves`` made (`trace_moves`), or None where that set
        cannot be traced (it is then not offered)."""
        try:
            return need(self.trace_moves(moves))
        except Exception:  # noqa: BLE001 - e.g. no 8-bit form, or a change ZeRO-3's trace does not take
            return None

    def with_loop(self, **changes: Any) -> Run:
        """The user's run with its loop changed."""
        return self.run.replace(loop=dataclasses.replace(self.run.loop, **changes))

    def versus(self, figure: int) -> str:
        """``figure`` (what a changed set-up needs) against the current set-up's and the budget, in words."""
        base = need(self.baseline)
        delta = figure - base
        change = f"{'-' if delta < 0 else '+'}{format_bytes(abs(delta))} ({delta / base:+.1%})" if base else ""
        verdict = "fits" if figure <= self.limit else f"still {format_bytes(figure - self.limit)} over"
        return f"predicted peak {format_bytes(figure)}, {change} vs {format_bytes(base)} now; {verdict}"


# ---- moves -------------------------------------------------------------------------------------------------


def available_moves(setup: _Setup) -> list[Move]:
    """Every move that applies to the user's set-up, cheapest first (the micro-batch at its smallest, 1). A step that
    runs its own optimizers (`Loop.manual`) calls the user's model and optimizers: only the moves that change neither,
    the precision and the batch, apply to it."""
    moves = [*impl_moves(setup), *precision_moves(setup)] if not setup.run.loop.manual else precision_moves(setup)
    builds = (meta_init_move, fsdp_param_dtype_move, micro_batch_move, checkpointing_move, offload_activations_move,
              eight_bit_move, offload_move, lora_move, qlora_move)
    for build in builds if not setup.run.loop.manual else (micro_batch_move,):
        move = build(setup)
        if move is not None:
            moves.append(move)
    return sorted(moves, key=lambda m: m.rank)


def _run_move(key: str, group: str, change: dict[str, Any], words: str, cost: str,
              edit: Callable[[Run], Run]) -> Move:
    return Move(key, group, change, words, cost, lambda c, stack: dataclasses.replace(c, run=edit(c.run)), order=3)


_META_INIT_COST = ("changes how the script builds and loads the model, not how it trains: build it on the meta device "
                   "(torch.device('meta'), Lightning's init_module(empty_init=True)), wrap it, then materialise each "
                   "rank's shards (to_empty) and load them in place (torch.distributed.checkpoint, or "
                   "set_model_state_dict with broadcast_from_rank0)")


def meta_init_move(setup: _Setup) -> Move | None:
    """The model built on meta, each rank materialising its own shards, where the run says it loads the whole model
    (or moves it from the host) on several ranks."""
    loading = setup.run.loading
    if loading is None or loading == Loading("meta") or setup.run.world_size == 1:
        return None
    words = ("each rank's shards read from a distributed checkpoint rather than broadcast from rank 0"
             if loading.from_rank0 else "the model built on meta, each rank materialising its own shards")
    return _run_move("meta-init", "loading", {"loading": "meta"}, words, _META_INIT_COST,
                     lambda run: run.replace(loading=Loading("meta")))


def impl_moves(setup: _Setup) -> list[Move]:
    """The optimizer step fused, or one parameter at a time, where the optimizer's class takes it."""
    out = []
    for impl in ("fused", "for-loop"):
        if setup.run.loop.optimizer_impl == impl:
            continue
        try:
            with_optimizer_impl(setup.optimizer, impl)
        except ValueError:  # the optimizer has no such implementation
            continue
        out.append(_run_move(impl, "optimizer", {"optimizer_impl": impl}, f"{impl} optimizer step", _IMPL_COSTS[impl],
                             lambda run, impl=impl: run.replace(loop=dataclasses.replace(run.loop,
                                                                                         optimizer_impl=impl))))
    return out


def precision_moves(setup: _Setup) -> list[Move]:
    """bf16-mixed (from fp32) and bf16-true (from fp32 or mixed), for fp32 parameters."""
    floating = [p.dtype for p in setup.model.parameters() if p.is_floating_point()]
    if not floating or any(d != torch.float32 for d in floating):
        return []
    wanted = []
    if setup.precision in (None, "32-true"):
        wanted.append("bf16-mixed")
    if setup.precision not in ("bf16-true", "16-true"):
        wanted.append("bf16-true")
    return [_run_move(p, "precision", {"precision": p}, f"precision {p}", _PRECISION_COSTS[p],
                      lambda run, p=p: run.replace(precision=p)) for p in wanted]


_FSDP_PARAM_DTYPE_COST = (
    "the forward and backward compute on {dtype} copies of the gathered parameters, cast as FSDP2 gathers them "
    "(MixedPrecisionPolicy(param_dtype=torch.{dtype}, reduce_dtype=torch.float32), torchtitan's default) where "
    "autocast casts per operator: the operators autocast keeps in fp32 (norms, softmax, losses) then see {dtype} "
    "weights; the sharded parameters, the gradients' reduction and the optimizer state stay fp32")


def fsdp_param_dtype_move(setup: _Setup) -> Move | None:
    """FSDP2 casting the parameters it gathers to the mixed precision's dtype, for a run planned under FSDP2 with
    autocast and no such policy: autocast keeps its cast of each gathered parameter (a leaf that requires grad) in
    its cache until the autocast region ends, so every unit's parameters stay gathered, cast, through the forward;
    cast by FSDP2, they are freed with the unit's reshard. The run keeps its precision (autocast then finds the
    parameters already cast)."""
    from preflight.parallel import FSDP2Plan

    plan = setup.plan
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(setup.precision or "")
    if not isinstance(plan, ParallelPlan) or plan.sharding != "fsdp2" or dtype is None or plan.pp is not None or \
            plan.cp is not None:
        return None
    fsdp = plan.fsdp if plan.fsdp is not None else FSDP2Plan()
    if not isinstance(fsdp, FSDP2Plan) or fsdp.param_dtype is not None:
        return None
    changed = dataclasses.replace(plan, fsdp=fsdp.gathering(dtype))
    name = str(dtype).removeprefix("torch.")
    return _run_move("fsdp_param_dtype", "fsdp_param_dtype", {"fsdp_param_dtype": name},
                     f"FSDP2 gathering {name} parameters (MixedPrecisionPolicy)",
                     _FSDP_PARAM_DTYPE_COST.format(dtype=name), lambda run: run.replace(parallel=changed))


def micro_batch_move(setup: _Setup, size: int = 1) -> Move | None:
    """A micro-batch of ``size`` samples with gradient accumulation keeping the global batch, traced as an
    accumulation micro-step (the earlier micro-batches' gradients are alive during the next one)."""
    micro = batch_size_of(setup.batch)
    if micro is None or micro < 2 or size >= micro:
        return None
    if setup.run.pipelined:
        return pipeline_micro_move(setup, size)
    if setup.run.loop.manual:
        return _manual_micro_move(setup, micro, size)
    current = micro * setup.run.loop.accumulate

    def apply(c: Candidate, stack: contextlib.ExitStack) -> Candidate:
        return dataclasses.replace(c, batch=setup.make(size),
                                   run=c.run.replace(loop=dataclasses.replace(c.run.loop, accumulate=2)))

    accumulate = -(-current // size)
    return Move("micro_batch", "micro_batch", {"micro_batch_size": size, "accumulate_grad_batches": accumulate},
                f"micro-batch {size} x {accumulate} accumulation steps",
                _MICRO_COST.format(k=accumulate, rounding=""), apply, order=2)


_MANUAL_MICRO_COST = ("each optimizer step of your training step sees {size} samples instead of {micro}: to keep the "
                      "updates, accumulate the gradients of {k} batches before each optimizer step in the training "
                      "step (the loop does not accumulate under manual optimization)")


def _manual_micro_move(setup: _Setup, micro: int, size: int) -> Move:
    """A batch of ``size`` samples for a step that runs its own optimizers (`Loop.manual`): its loop does not
    accumulate, so the step is traced as it is, at the smaller batch; keeping the updates is the user's to write."""

    def apply(c: Candidate, stack: contextlib.ExitStack) -> Candidate:
        return dataclasses.replace(c, batch=setup.make(size))

    return Move("micro_batch", "micro_batch", {"micro_batch_size": size}, f"batch {size}",
                _MANUAL_MICRO_COST.format(size=size, micro=micro, k=-(-micro // size)), apply, order=2)


def pipeline_micro_move(setup: _Setup, size: int) -> Move | None:
    """Under a pipeline plan, the schedule's micro-batches are the accumulation: the same step batch cut into more
    micro-batches of ``size`` sequences (``PPPlan.microbatches``), so each stage holds smaller activations in flight;
    None where ``size`` does not divide the step batch or is not smaller than today's micro-batch."""
    rows = batch_size_of(setup.batch)
    pp = setup.run.parallel.pp
    if rows is None or size < 1 or rows % size or size >= rows // pp.n_microbatches:
        return None
    count = rows // size

    def edit(run: Run) -> Run:
        return run.replace(parallel=dataclasses.replace(run.parallel, pp=dataclasses.replace(run.parallel.pp,
                                                                                             microbatches=count)))

    cost = (f"{count} pipeline micro-batches per step instead of {pp.n_microbatches}: the same updates, smaller "
            "matrix products per micro-batch")
    return Move("micro_batch", "micro_batch", {"micro_batch_size": size, "microbatches": count},
                f"{count} micro-batches of {size}", cost,
                lambda c, stack: dataclasses.replace(c, run=edit(c.run)), order=3)


def checkpointing_how(model: nn.Module) -> str | None:
    """How activation checkpointing would be switched on for ``model``, or None (already on, or no way known)."""
    if _hf_checkpointing(model):
        if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
            return None
        return "transformers' activation_checkpointing_enable, use_reentrant=False"
    blocks = repeated_blocks(model)
    return f"torch.utils.checkpoint on each of the {len(blocks)} {type(blocks[0]).__name__} blocks" if blocks else None


def enable_checkpointing(model: nn.Module) -> None:
    """Switch activation checkpointing on (inside `restored_module(model)`, which switches it back)."""
    if _hf_checkpointing(model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # gradient_* names are deprecated in transformers 5
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    for block in repeated_blocks(model):
        # An instance attribute (restored_module deletes it), bound to the block: a per-rank trace's copy of the
        # model rebinds it to the block's copy (a closure over this block would run the original). A forward the
        # block already has of its own (accelerate's hooks) is kept under the checkpoint.
        own = vars(block).get("forward")
        if own is None or (isinstance(own, types.MethodType) and own.__self__ is block):
            block.forward = types.MethodType(_checkpointed(getattr(own, "__func__", None) or type(block).forward),
                                             block)
        else:
            block.forward = _checkpointed(own)


def checkpointing_move(setup: _Setup) -> Move | None:
    how = checkpointing_how(setup.model)
    if how is None:
        return None

    def apply(c: Candidate, stack: contextlib.ExitStack) -> Candidate:
        stack.enter_context(restored_module(c.model))
        enable_checkpointing(c.model)
        return c

    return Move("checkpointing", "checkpointing", {"gradient_checkpointing": True}, "activation checkpointing",
                _CHECKPOINTING_COST, apply, order=1)


def offload_activations_move(setup: _Setup) -> Move | None:
    """The saved activations offloaded to host memory as TRL and torchtune offload them
    (`preflight.Loop.offload_activations` ``"streams"``), on a CUDA target where
    the run does not offload them yet (on a CPU target the host is the device: nothing leaves it)."""
    pipeline = setup.run.pipelined  # not traced under a schedule
    if setup.run.loop.offload_activations or pipeline or not str(setup.baseline.device).startswith("cuda"):
        return None
    return _run_move("offload_activations", "offload_activations", {"offload_activations": "streams"},
                     "activations offloaded to host memory", _OFFLOAD_ACTIVATIONS_COST,
                     lambda run: run.replace(loop=dataclasses.replace(run.loop, offload_activations="streams")))


def eight_bit(optimizer: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, str, str] | None:
    """``optimizer`` with 8-bit state (bitsandbytes), its name and what changes in words; None where there is no
    such optimizer: torch's AdamW and Adam become ``AdamW8bit`` / ``Adam8bit`` (Adam's L2 weight decay is not
    AdamW's), a bitsandbytes optimizer with 32-bit state (``args.optim_bits == 32``, e.g. HF's
    ``"paged_adamw_32bit"``) the same class with ``optim_bits=8``. Built over the user's parameters outside any
    trace; it only reads them (its state is made at the first step)."""
    if hasattr(getattr(optimizer, "args", None), "optim_bits"):
        return _bnb_8bit(optimizer)
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        return None
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        return None  # bitsandbytes' 8-bit Adam has no AMSGrad
    try:
        with quiet_import_logs("bitsandbytes"):  # an option preflight considers, not an import the user asked for
            import bitsandbytes as bnb
    except ImportError:
        return None
    cls = bnb.optim.AdamW8bit if type(optimizer) is torch.optim.AdamW else bnb.optim.Adam8bit
    keys = ("lr", "betas", "eps", "weight_decay")
    groups = [{"params": list(g["params"]), **{k: _plain(g[k]) for k in keys}} for g in optimizer.param_groups]
    new = cls(groups, **{k: _plain(optimizer.defaults[k]) for k in keys})
    name = f"bitsandbytes.optim.{cls.__name__}"
    return new, name, f"{name} instead of torch.optim.{type(optimizer).__name__} (8-bit state for tensors of 4096 " \
                      "or more elements)"


def _bnb_8bit(optimizer: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, str, str] | None:
    if optimizer.args.optim_bits == 8:
        return None
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    if "optim_bits" not in accepted:
        return None
    kwargs = {k: _plain(v) for k, v in optimizer.defaults.items() if k in accepted}
    if "is_paged" in accepted:
        kwargs["is_paged"] = optimizer.is_paged
    kwargs["optim_bits"] = 8
    if "args" in accepted:  # bitsandbytes reads the options from args when given: change it there too
        args = copy.copy(optimizer.args)
        args.optim_bits = 8
        kwargs["args"] = args
    groups = [{**{k: _plain(v) for k, v in g.items() if k != "params"}, "params": list(g["params"])}
              for g in optimizer.param_groups]
    try:
        new = cls(groups, **kwargs)
    except ValueError:  # a class fixed at 32 bits (e.g. AdamW32bit) takes no optim_bits=8
        return None
    name = f"bitsandbytes.optim.{cls.__name__}"
    return new, name, (f"{name} with optim_bits=8 instead of 32 (8-bit state for tensors of "
                       f"{optimizer.args.min_8bit_size} or more elements; the HF Trainer's \"*_8bit\" optim choices)")


def eight_bit_move(setup: _Setup) -> Move | None:
    found = eight_bit(setup.optimizer)
    if found is None or _dtensor_parameters(setup):
        return None
    _, name, _ = found
    change = {"optimizer": name}
    if hasattr(getattr(setup.optimizer, "args", None), "optim_bits"):
        change["optim_bits"] = 8

    def apply(c: Candidate, stack: contextlib.ExitStack) -> Candidate:
        made = eight_bit(c.optimizer)
        if made is None:
            raise ValueError(f"no 8-bit form of {type(c.optimizer).__name__}")
        return dataclasses.replace(c, optimizer=made[0])

    return Move("adamw8bit", "optimizer", change, name.removeprefix("bitsandbytes.optim."), _EIGHT_BIT_COST, apply,
                order=2)


def _dtensor_parameters(setup: _Setup) -> bool:
    """The run steps DTensor parameters (FSDP2, tensor or expert parallelism, planned or laid out), which
    bitsandbytes' optimizers cannot step (`preflight.trace._step_checks.library_optimizer_over_dtensors`)."""
    plan = setup.plan
    if plan is not None and (plan.sharding == "fsdp2" or plan.tp is not None or plan.ep is not None):
        return True
    return _laid_out(setup.model)


def _laid_out(model: nn.Module) -> bool:
    """The model's parameters are DTensors: a layout (tensor or expert parallelism, fully_shard) made before."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def offload_move(setup: _Setup) -> Move | None:
    """ZeRO-Offload: ZeRO-2 with the optimizer state and step on the CPU over the run's GPUs (one included)."""
    if setup.baseline.world_size > 1 or setup.plan is not None:
        return None
    n = setup.world_size
    plan = ParallelPlan(n, "zero2", offload_optimizer=True, source="preflight.advise's ZeRO-Offload option")
    return _run_move("offload", "optimizer", {"offload_optimizer": True, "zero_stage": 2, "world_size": n},
                     "ZeRO-Offload of the optimizer", _OFFLOAD_COST, lambda run: run.replace(parallel=plan))


_MORE_GPUS_COST = ("a job over {n} GPUs instead of one: ZeRO-3's communication (about 1.5x DDP's volume, ZeRO paper "
                   "Sec 7), and a global batch {n} times the micro-batch times the accumulation (divide the "
                   "accumulation by {n} to keep it)")


def more_gpus_move(n: int) -> Move:
    """DeepSpeed ZeRO-3 over ``n`` GPUs, for a run planned on one: parameters, gradients and optimizer state
    sharded, predicted as `preflight.estimate` predicts that plan."""
    plan = ParallelPlan(n, "zero3", source="preflight.advise's plan for more GPUs")
    return _run_move("more_gpus", "parallel", {"sharding": "zero3", "world_size": n},
                     f"DeepSpeed ZeRO-3 over {n} GPUs", _MORE_GPUS_COST.format(n=n),
                     lambda run: run.replace(parallel=plan))


def lora_base_dtype(setup: _Setup) -> torch.dtype:
    """The dtype LoRA's frozen base weights are loaded in: the compute dtype of a mixed-precision run (as users
    load them: ``from_pretrained(..., dtype=torch.bfloat16)``), else the model's."""
    mixed = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(setup.precision or "")
    return mixed or next((p.dtype for p in setup.model.parameters() if p.is_floating_point()), torch.float32)


def lora_model(model: nn.Module, dtype: torch.dtype, quantization: Any = None) -> nn.Module | None:
    """LoRA (peft, r=`LORA_RANK`, all linear layers but the output head) over a copy of ``model``'s architecture
    built on the meta device with base weights in ``dtype`` (peft keeps the adapters in fp32); None for a model
    that is not a transformers ``PreTrainedModel`` or is already a PEFT model. With ``quantization`` (a
    ``BitsAndBytesConfig``) the base is quantized as ``from_pretrained`` quantizes it and prepared as peft's
    ``prepare_model_for_kbit_training`` prepares it (QLoRA: the other weights in fp32)."""
    try:
        with quiet_import_logs("bitsandbytes"):  # peft imports bitsandbytes where installed
            import peft
        import transformers
    except ImportError:
        return None
    if not isinstance(model, transformers.PreTrainedModel) or isinstance(model, peft.PeftModel):
        return None
    config = copy.deepcopy(model.config)  # _from_config and peft write to the config they are given
    kwargs: dict[str, Any] = {}
    attn = getattr(model.config, "_attn_implementation", None)
    if attn is not None:
        kwargs["attn_implementation"] = attn  # the same attention kernel as the user's model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's notes on Conv1D fan-in and deprecated names
        with torch.device("meta"):  # the architecture only: no weights are copied or allocated
            try:
                base = type(model)._from_config(config, dtype=dtype, **kwargs)
            except TypeError:  # transformers < 4.56 names it torch_dtype
                base = type(model)._from_config(config, torch_dtype=dtype, **kwargs)
            if quantization is not None:
                from preflight._quantize import quantize_on_meta

                quantize_on_meta(base, quantization)
                # Checkpointing is a move of its own (`checkpointing_move`), not switched on here.
                base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
            return peft.get_peft_model(base, peft.LoraConfig(r=LORA_RANK, target_modules="all-linear"))


def _adapters_move(setup: _Setup, lora: nn.Module | None, key: str, change: dict[str, Any], words: str,
                   cost: str) -> Move | None:
    """Training ``lora`` (a PEFT model) instead, with AdamW over its adapters at the user's hyperparameters."""
    if lora is None:
        return None
    hyper = {k: _plain(v) for k, v in setup.optimizer.defaults.items() if k in ("lr", "betas", "eps", "weight_decay")}
    trainable = [p for p in lora.parameters() if p.requires_grad]

    def apply(c: Candidate, stack: contextlib.ExitStack) -> Candidate:
        return dataclasses.replace(c, model=lora, optimizer=torch.optim.AdamW(trainable, **hyper))

    change = {"peft": "lora", "r": LORA_RANK, "target_modules": "all-linear", **change}
    return Move(key, "lora", change, words, cost, apply, order=0)


def _adapters_refused(setup: _Setup) -> str | None:
    """Why adapters cannot be planned under the run's parallel plan, or None: DTensor's styles lay out
    ``nn.Linear`` and ``nn.Embedding`` only, not peft's LoRA layers that replace them."""
    if setup.run.parallel is not None and setup.run.parallel.tp is not None:
        return ("tensor parallelism lays out nn.Linear and nn.Embedding modules, not the peft layers that replace "
                "them, so a LoRA model is not planned under a tensor-parallel plan")
    if setup.run.parallel is not None and setup.run.parallel.ep is not None:
        return ("transformers' expert parallelism lays out the transformers model itself, not a peft model around "
                "it, so a LoRA model is not planned under an expert-parallel plan")
    if _laid_out(setup.model):
        return ("the model is already laid out (DTensor parameters): peft's LoRA layers would replace modules the "
                "layout distributed, so a LoRA model is not planned over it")
    return None


def lora_move(setup: _Setup) -> Move | None:
    if _adapters_refused(setup) is not None:
        return None
    dtype = lora_base_dtype(setup)
    name = str(dtype).removeprefix("torch.")
    return _adapters_move(setup, lora_model(setup.model, dtype), "lora", {"base_dtype": name},
                          f"LoRA r={LORA_RANK} over {name} base weights", _LORA_COST)


def qlora_move(setup: _Setup) -> Move | None:
    """QLoRA: LoRA over base weights in NF4 with double quantization (the QLoRA paper's recipe), computing in the
    run's mixed-precision dtype; None without bitsandbytes or where LoRA does not apply."""
    if _adapters_refused(setup) is not None:
        return None
    try:
        with quiet_import_logs("bitsandbytes"):
            import bitsandbytes  # noqa: F401
        from preflight._quantize import bnb_config
    except ImportError:
        return None
    compute = half_dtype(setup.precision) or torch.float32  # as `preflight estimate --quantize` computes
    lora = lora_model(setup.model, compute, bnb_config("nf4", compute_dtype=compute, double_quant=True))
    return _adapters_move(setup, lora, "qlora", {"quantize": "nf4", "double_quant": True},
                          f"QLoRA r={LORA_RANK} over NF4 base weights", _QLORA_COST)


# ---- helpers ------------------------------------------------------------------------------------------------


def batch_size_of(batch: Any) -> int | None:
    """The size of dim 0 of the first tensor with at least one dimension in ``batch`` (None if there is none)."""
    return next((int(t.shape[0]) for t in iter_tensors(batch) if t.dim()), None)


def resize_batch(batch: Any, batch_size: int) -> Any:
    """``batch`` with ``batch_size`` samples: every tensor whose dim 0 is the batch size is truncated or repeated.

    The batch size is dim 0 of the first tensor found (`batch_size_of`, mappings in insertion order). Tensors
    whose dim 0 differs (e.g. position ids of shape ``(1, seq)``) and non-tensors are kept as they are. Truncation
    keeps the first samples; growing repeats the batch (sample ``i`` is sample ``i % n``). Results are new,
    contiguous tensors (a slice would keep the whole original storage alive), with the same device, dtype and
    ``requires_grad``; the mapping, list, tuple and namedtuple types are kept.

    Args:
        batch: a tensor or a nested dict/list/tuple of tensors, as a dataloader yields.
        batch_size: the number of samples wanted, >= 1.

    Returns:
        The resized batch.

    Raises:
        ValueError: ``batch_size`` < 1, or no tensor in ``batch`` has a dimension.

    Example:
        >>> resize_batch({"x": torch.arange(4).reshape(2, 2)}, 3)["x"].tolist()
        [[0, 1], [2, 3], [0, 1]]

    Known limitations: samples are copies, so values repeat; this is for tracing and measuring memory, where
    only shapes (and masks' structure) matter, not for training.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` should be a positive integer, got {batch_size!r}.")
    current = batch_size_of(batch)
    if current is None:
        raise ValueError("`batch` has no tensor with a batch dimension to resize; pass a make_batch(b) function.")

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != current:
            return t
        source = t.detach()
        if batch_size > current:
            source = source.repeat(-(-batch_size // current), *([1] * (t.dim() - 1)))
        out = source[:batch_size].clone(memory_format=torch.contiguous_format)
        return out.requires_grad_(t.requires_grad) if t.is_floating_point() else out

    return map_tensors(resize, batch)



def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of the model's largest ``nn.ModuleList`` (by parameters) with at least two children."""
    best: list[nn.Module] = []
    best_params = -1
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            params = sum(p.numel() for p in module.parameters())
            if params > best_params:
                best, best_params = list(module), params
    return best


def _hf_checkpointing(model: nn.Module) -> bool:
    return bool(getattr(model, "supports_gradient_checkpointing", False)) and (
        callable(getattr(model, "activation_checkpointing_enable", None))
        or callable(getattr(model, "gradient_checkpointing_enable", None))
    )


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A callable ``forward`` under ``torch.utils.checkpoint`` (non-reentrant); bound as a method of a block, the
    block is the first argument ``forward`` gets."""
    from torch.utils.checkpoint import checkpoint

    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return checkpointed_forward


def _plain(value: Any) -> Any:
    """A tensor hyperparameter (torch allows a tensor lr) as a Python number; bitsandbytes wants floats."""
    if isinstance(value, torch.Tensor):
        return value.item()
    return value
