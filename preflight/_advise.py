"""`advise`: what to change when a run does not fit, each option with a peak traced from the changed set-up.

A suggestion is the run's description changed (`Suggestion.run`: precision, loop, target or parallel plan), plus,
where the change is to the model, the optimizer or the batch, what to change there (`Suggestion.change`).
Every option is applied to a trace, never to the user's objects for good: a smaller micro-batch is traced with
gradient accumulation, activation checkpointing is switched on for the trace and switched back (every module's
attributes and hook tables restored, then checked), an 8-bit optimizer is built over the same parameters, LoRA
is traced on a copy of the architecture built on the meta device (no weights copied), and precisions are the
trace's own option. Sharding a single-device run is the exception: it is derived from the traced breakdown
with `preflight._target.shard_events` (every traced allocation rescaled to one rank's share), and says so.

Under a data-parallel plan (``run.parallel``, a `preflight.ParallelPlan`, as the callbacks read it off the
trainer), the current set-up and every option are predicted per rank as `preflight.estimate` predicts that plan
(FSDP traced through its own program for each rank, ZeRO rescaled with DeepSpeed's buffers from the config), and
the sharding options become the stronger shardings of the same engine.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from preflight._warnings import warn
from preflight._autotune import max_batch_size, split_global_batch
from preflight._budget import check_headroom, usable_bytes
from preflight._device import iter_tensors, map_tensors, resolve_device
from preflight._estimate import estimate, read_plan_off_ddp, summarize_events
from preflight.parallel._deepspeed import deepspeed_terms
from preflight._guard import untouched
from preflight._quiet import quiet_import_logs
from preflight._result import Estimate
from preflight._run import Run, check_run, pinned, run_budget
from preflight._steps import StepFn, with_optimizer_impl
from preflight._target import round_events, shard_events
from preflight._units import format_bytes
from preflight.parallel import ParallelPlan
from preflight.trace import NotRestoredError, float_dtype_for, restored_module

__all__ = ["Suggestion", "advise", "resize_batch", "batch_size_of"]

# Ranking among options that fit: cheapest first. What each costs is in its `cost` text.
_COST_ORDER = (
    "allocator",  # an environment variable
    "fused",  # the same updates in one kernel: usually faster
    "micro_batch",  # same updates, lower throughput
    "for-loop",  # the same updates, one kernel launch per parameter: a slower step
    "bf16-mixed",  # usually no quality change, needs bf16 hardware
    "zero1", "zero2",  # DDP's communication volume, needs the GPUs
    "checkpointing",  # about one extra forward per step
    "zero3",  # 1.5x DDP's communication
    "adamw8bit",  # another optimizer
    "offload",  # the optimizer step on the CPU: host memory and PCIe traffic, a slower step
    "bf16-true",  # precision risk for the updates
    "lora",  # changes what is trained
)
_LITTLE_SAVING = 0.05  # checkpointing that saves less than this fraction of the peak is flagged as saving little
_LORA_RANK = 16
_RESERVED_GAP = 0.10  # reserved this far above allocated: fragmentation worth an allocator setting


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """One change to the training set-up, with its predicted peak.

    Attributes:
        change: what to change, machine-readable: ``{"micro_batch_size": 4, "accumulate_grad_batches": 2}``,
            ``{"gradient_checkpointing": True}``, ``{"optimizer": "bitsandbytes.optim.AdamW8bit"}``,
            ``{"peft": "lora", "r": 16, "target_modules": "all-linear"}``, ``{"precision": "bf16-mixed"}``,
            ``{"sharding": "zero2", "world_size": 8}``, ``{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}``.
        description: the change and its predicted effect, in words.
        predicted_peak_bytes: the peak of the changed set-up, traced (sharding: derived from the traced
            breakdown; allocator: the simulated reserved peak).
        fits: ``predicted_peak_bytes`` is within the budget less headroom.
        cost: what the change costs (compute, communication, optimizer or model quality).
        run: the run's description with the change made (`preflight.Run`): pass it to `preflight.estimate` or
            ``check`` as it is, or print ``run.cli_flags()`` for ``preflight estimate``. Changes to the model, the
            optimizer or the batch are in ``change`` (the description stays as it was there).
    """

    change: dict[str, Any]
    description: str
    predicted_peak_bytes: int
    fits: bool
    cost: str
    run: Run
    # What ``run`` changes of the description advise was given (`Run.changes_from`), for `apply`.
    run_changes: dict[str, Any] = dataclasses.field(default_factory=dict)

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
                "cli_flags": self.run.cli_flags()}


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

    @property
    def plan(self) -> ParallelPlan | None:
        return self.run.parallel

    @property
    def precision(self) -> str | None:
        return self.run.precision

    @property
    def world_size(self) -> int:
        return self.run.world_size

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

    def with_loop(self, **changes: Any) -> Run:
        """The user's run with its loop changed."""
        return self.run.replace(loop=dataclasses.replace(self.run.loop, **changes))

    def versus(self, peak: int) -> str:
        """``peak`` against the current peak and the budget, in words."""
        base = self.baseline.peak_bytes
        delta = peak - base
        change = f"{'-' if delta < 0 else '+'}{format_bytes(abs(delta))} ({delta / base:+.1%})" if base else ""
        verdict = "fits" if peak <= self.limit else f"still {format_bytes(peak - self.limit)} over"
        return f"predicted peak {format_bytes(peak)}, {change} vs {format_bytes(base)} now; {verdict}"


@untouched()
def advise(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    run: Run | None = None,
    *,
    step: StepFn | None = None,
    make_batch: Callable[[int], Any] | None = None,
    headroom: float = 0.0,  # 0: the budget as given; DEFAULT_HEADROOM (0.10) keeps room for the allocator
) -> list[Suggestion]:
    """Suggest changes that lower the training peak, each with the peak predicted for the changed set-up.

    The current set-up is traced once; then each applicable option is traced with the change applied (see the
    module docstring). Options that do not lower the peak are left out, except checkpointing, whose description
    then says it saves little or nothing, and where the peak is:

    - ``micro_batch`` (only when the current batch does not fit): the largest micro-batch below the current
      batch that fits, found with `max_batch_size` (traced as a gradient-accumulation micro-step, because the
      accumulated gradients are alive during the next micro-batch), split with `split_global_batch` so the
      global batch is kept.
    - ``checkpointing``: activation checkpointing. Hugging Face models: ``activation_checkpointing_enable``
      (``gradient_checkpointing_enable`` before transformers 5) with ``use_reentrant=False``; other models: each
      child of the largest ``nn.ModuleList`` (the repeated blocks) runs under ``torch.utils.checkpoint``.
    - ``adamw8bit``: bitsandbytes' ``AdamW8bit`` (``Adam8bit`` for ``torch.optim.Adam``) over the same parameter
      groups and hyperparameters, when the optimizer is torch's AdamW or Adam and bitsandbytes is installed.
      A bitsandbytes optimizer with 32-bit state (``args.optim_bits == 32``, e.g. HF's ``"paged_adamw_32bit"``)
      gets the same class with ``optim_bits=8`` instead.
    - ``lora``: LoRA (peft, r=16, all linear layers) for a transformers ``PreTrainedModel`` that is not already
      a PEFT model, with AdamW over the adapters.
    - ``bf16-mixed`` and ``bf16-true``: for fp32 parameters.
    - ``offload``: ZeRO-Offload (ZeRO-2 with the optimizer state and step on the CPU) on one GPU.
    - Under ``run.parallel``: the stronger shardings of the plan's engine over its ranks,
      each predicted as `preflight.estimate` predicts it: DDP -> FSDP ``SHARD_GRAD_OP`` and FSDP2
      (``fully_shard``), traced per rank; ``SHARD_GRAD_OP`` -> ``FULL_SHARD``; ZeRO-1 -> ZeRO-2 -> ZeRO-3 (the
      plan's DeepSpeed config with the stage changed).
    - ``allocator``: ``expandable_segments:True`` when the estimate simulates the CUDA allocator and its
      reserved peak is more than 10% above the allocated peak.
    - ``fused`` and ``for-loop``: the optimizer step's implementation (`preflight.Loop.optimizer_impl`), when the
      optimizer's class takes it and it lowers the peak (torch's default on CUDA, foreach, holds temporaries the
      size of every parameter it updates).

    Args:
        model, optimizer, batch, step: as for `preflight.estimate`.
        run: how the run trains (`preflight.Run`), the set-up each option changes. Its target's budget is what
            the peak may use (``Target(budget="24GiB")``, else the catalog GPU's memory, else the CUDA device's
            capacity); ``batch`` is one micro-batch, so the global batch the micro-batch option keeps is
            ``batch size * run.loop.accumulate``; under ``run.parallel`` every peak is the largest rank's, as
            `preflight.estimate` predicts that plan.
        make_batch: ``make_batch(b)`` returns a batch of ``b`` samples; default: `resize_batch` of ``batch``.
        headroom: the fraction of the budget kept free, in [0, 1).

    Returns:
        Suggestions ranked: those that fit first, then by cost (cheapest first: allocator setting, a fused
        optimizer step, micro-batch, a for-loop optimizer step, bf16-mixed, ZeRO-1/2, checkpointing, ZeRO-3, 8-bit
        AdamW, optimizer offload, pure bf16,
        LoRA), then by peak.
        An option whose trace fails is left out with a ``RuntimeWarning`` saying why.

    Raises:
        ValueError: a bad option, or no budget on a machine without CUDA.
        RuntimeError: the current set-up cannot be traced (there is nothing to compare the options with), or an
            option changed the user's model and it could not be restored (never expected; a bug to report).

    Example:
        >>> for s in preflight.advise(model, opt, batch, Run(target=Target(budget="24GiB"))):  # doctest: +SKIP
        ...     print(s.fits, format_bytes(s.predicted_peak_bytes), s.description)

    Known limitations:
        - Options are traced one at a time, not combined.
        - ZeRO-Offload's number rescales the single-GPU peak's categories; the offloaded run's peak may fall at
          another moment (see `preflight._sharding`).
        - Generic checkpointing wraps only the children of the largest ``nn.ModuleList``; models whose blocks
          live in ``nn.Sequential`` or are called in a custom loop get no checkpointing suggestion.
        - LoRA's suggestion uses r=16 on every linear layer but the output head; other ranks and targets differ.
        - Optimizer CPU offload and FSDP wrapping options are not suggested yet.
    """
    run = check_run(run)
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` should be a torch.nn.Module, got {type(model).__name__}.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"`optimizer` should be a torch.optim.Optimizer instance, got {type(optimizer).__name__}.")
    if make_batch is not None and not callable(make_batch):
        raise TypeError(f"`make_batch` should be None or a callable make_batch(batch_size) -> batch, got "
                        f"{type(make_batch).__name__}.")
    check_headroom(headroom)
    budget_bytes = run_budget(run, model)
    model, run, _ = read_plan_off_ddp(model, run)  # a DDP model's plan is the run's, its module the one changed
    if run.parallel is not None and run.parallel.sharding is None and run.parallel.world_size > 1:
        run = run.replace(parallel=dataclasses.replace(run.parallel, sharding="ddp"))  # what estimate plans
    target = resolve_device(run.target.planned_device, model)
    baseline = estimate(model, optimizer, batch, pinned(run, target), step=step)
    if baseline.coverage.lower_bound:
        raise RuntimeError(
            f"preflight could not trace the current training step (operator {baseline.coverage.failed_op}: "
            f"{baseline.coverage.reason}), so no option can be compared with it. Pass `step=` with a step that "
            "traces."
        )
    setup = _Setup(model, optimizer, batch, step, run, target, budget_bytes, usable_bytes(budget_bytes, headroom),
                   headroom, make_batch, baseline)
    options: tuple[tuple[str, Callable[[_Setup], list[tuple[str, Suggestion]]]], ...] = (
        ("optimizer implementation", _optimizer_impl),
        ("micro-batch", _micro_batch),
        ("activation checkpointing", _checkpointing),
        ("8-bit AdamW", _adamw8bit),
        ("LoRA", _lora),
        ("bf16 precision", _bf16),
        ("sharding", _sharding),
        ("optimizer offload", _offload),
        ("allocator setting", _allocator),
    )
    ranked: list[tuple[str, Suggestion]] = []
    for name, option in options:
        try:
            ranked.extend(option(setup))
        except NotRestoredError:
            raise
        except Exception as err:  # noqa: BLE001 - one option failing must not hide the others (reported below)
            reason = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            warn(f"preflight.advise left out the {name} option: {reason}", RuntimeWarning)
    ranked.sort(key=lambda ks: (not ks[1].fits, _COST_ORDER.index(ks[0]), ks[1].predicted_peak_bytes))
    return [dataclasses.replace(s, run_changes=s.run.changes_from(run)) for _, s in ranked]


# ---- options ------------------------------------------------------------------------------------------------


_IMPL_COSTS = {
    "fused": "the same updates, computed by one fused kernel per step (torch's fastest implementation where the "
             "optimizer has one; parameters must be floating point on CUDA or CPU)",
    "for-loop": "the same updates, one parameter at a time: a slower optimizer step (a kernel launch per tensor)",
}


def _optimizer_impl(setup: _Setup) -> list[tuple[str, Suggestion]]:
    """The optimizer step as a fused kernel, or one parameter at a time, when that lowers the peak: torch's default
    on CUDA (foreach) allocates temporaries the size of all the parameters it updates."""
    out = []
    for impl in ("fused", "for-loop"):
        if setup.run.loop.optimizer_impl == impl:
            continue
        changed = setup.with_loop(optimizer_impl=impl)
        try:
            with_optimizer_impl(setup.optimizer, impl)
        except ValueError:  # the optimizer has no such implementation
            continue
        est = setup.trace(run=changed)
        if est.peak_bytes >= setup.baseline.peak_bytes:
            continue
        argument = {"fused": "fused=True", "for-loop": "foreach=False"}[impl]
        text = f"optimizer step {impl} ({type(setup.optimizer).__name__}({argument})): {setup.versus(est.peak_bytes)}"
        out.append((impl, Suggestion({"optimizer_impl": impl}, text, est.peak_bytes, est.peak_bytes <= setup.limit,
                                     _IMPL_COSTS[impl], changed)))
    return out


def _micro_batch(setup: _Setup) -> list[tuple[str, Suggestion]]:
    if setup.baseline.peak_bytes <= setup.limit:
        return []  # the current batch fits: no need for a smaller one
    micro = batch_size_of(setup.batch)
    if micro is None:
        raise ValueError("no tensor with a batch dimension in the batch; pass make_batch=")
    current = micro * setup.run.loop.accumulate  # the global batch to keep
    if micro < 2:
        return []
    make = setup.make_batch or (lambda b: resize_batch(setup.batch, b))
    search = pinned(setup.with_loop(accumulate=2), setup.device)
    search = search.replace(target=dataclasses.replace(search.target, budget=setup.budget_bytes))
    result = max_batch_size(setup.model, setup.optimizer, make, search, step=setup.step, max_batch=micro - 1,
                            headroom=setup.headroom)
    cost_micro = ("{k} forward/backward passes per optimizer step instead of 1: the same updates{rounding}, "
                  "lower throughput when the full batch kept the GPU busy")
    if result.batch_size == 0:
        change = {"micro_batch_size": 1, "accumulate_grad_batches": current}
        text = (f"micro-batch 1 with {current} gradient-accumulation steps does not fit either: "
                f"{setup.versus(result.predicted_peak_bytes)}; combine it with another option")
        return [("micro_batch", Suggestion(change, text, result.predicted_peak_bytes, False,
                                           cost_micro.format(k=current, rounding=""),
                                           setup.with_loop(accumulate=current)))]
    plan = split_global_batch(current, result.batch_size)
    if plan.micro_batch_size == result.batch_size:
        peak = result.predicted_peak_bytes
    else:  # a divisor below the largest that fits: traced too (kernel scratch need not be affine in the batch)
        peak = setup.trace(batch=make(plan.micro_batch_size), run=setup.with_loop(accumulate=2)).peak_bytes
    change = {"micro_batch_size": plan.micro_batch_size, "accumulate_grad_batches": plan.accumulation_steps}
    text = (f"{plan.note} (gradient accumulation; the largest micro-batch that fits is {result.batch_size}, found "
            f"with {result.traces} traces): {setup.versus(peak)}")
    rounding = "" if plan.exact else f" with a global batch of {plan.global_batch_size} instead of {current}"
    return [("micro_batch", Suggestion(change, text, peak, peak <= setup.limit,
                                       cost_micro.format(k=plan.accumulation_steps, rounding=rounding),
                                       setup.with_loop(accumulate=plan.accumulation_steps)))]


def _checkpointing(setup: _Setup) -> list[tuple[str, Suggestion]]:
    model = setup.model
    if _hf_checkpointing(model):
        if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
            return []  # already on
        how = "transformers' activation_checkpointing_enable, use_reentrant=False"
        with restored_module(model):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # gradient_* names are deprecated in transformers 5
                enable = getattr(model, "activation_checkpointing_enable", None)
                if enable is not None:
                    enable(activation_checkpointing_kwargs={"use_reentrant": False})
                else:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            est = setup.trace()
    else:
        blocks = repeated_blocks(model)
        if not blocks:
            return []
        how = f"torch.utils.checkpoint on each of the {len(blocks)} {type(blocks[0]).__name__} blocks"
        with restored_module(model):
            for block in blocks:
                # An instance attribute (restored_module deletes it), bound to the block: a per-rank trace's copy of
                # the model rebinds it to the block's copy (a closure over this block would run the original). A
                # forward the block already has of its own (accelerate's hooks) is kept under the checkpoint.
                own = vars(block).get("forward")
                if own is None or (isinstance(own, types.MethodType) and own.__self__ is block):
                    block.forward = types.MethodType(_checkpointed(getattr(own, "__func__", None)
                                                                   or type(block).forward), block)
                else:
                    block.forward = _checkpointed(own)
            est = setup.trace()
    base = setup.baseline
    saving = base.peak_bytes - est.peak_bytes
    text = f"activation checkpointing ({how}): {setup.versus(est.peak_bytes)}"
    if saving < _LITTLE_SAVING * base.peak_bytes:  # kept, unlike other options, to say it does not help here
        amount = f"saves little ({saving / base.peak_bytes:.1%})" if saving > 0 else "does not lower the peak"
        text += (f". It {amount}: the peak is in {base.peak_phase}, where activations hold "
                 f"{format_bytes(base.breakdown.get('activations', 0))} of it")
    cost = ("recomputes each checkpointed block's forward during backward: about one extra forward pass per step "
            "(a forward is roughly a third of a training step's compute)")
    return [("checkpointing", Suggestion({"gradient_checkpointing": True}, text, est.peak_bytes,
                                         est.peak_bytes <= setup.limit, cost, setup.run))]


def _adamw8bit(setup: _Setup) -> list[tuple[str, Suggestion]]:
    optimizer = setup.optimizer
    if hasattr(getattr(optimizer, "args", None), "optim_bits"):
        return _bnb_8bit(setup)
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        return []
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        return []  # bitsandbytes' 8-bit Adam has no AMSGrad
    try:
        with quiet_import_logs("bitsandbytes"):  # an option preflight considers, not an import the user asked for
            import bitsandbytes as bnb
    except ImportError:
        return []
    decoupled = type(optimizer) is torch.optim.AdamW
    cls = bnb.optim.AdamW8bit if decoupled else bnb.optim.Adam8bit  # Adam's L2 weight decay is not AdamW's
    keys = ("lr", "betas", "eps", "weight_decay")
    groups = [{"params": list(g["params"]), **{k: _plain(g[k]) for k in keys}} for g in optimizer.param_groups]
    # Built over the user's parameters outside any trace; it only reads them (its state is made at the first step).
    new = cls(groups, **{k: _plain(optimizer.defaults[k]) for k in keys})
    est = setup.trace(optimizer=new)
    base = setup.baseline
    if est.peak_bytes >= base.peak_bytes:
        return []
    name = f"bitsandbytes.optim.{cls.__name__}"
    state_before, state_after = base.breakdown.get("optimizer_state", 0), est.breakdown.get("optimizer_state", 0)
    text = (f"{name} instead of torch.optim.{type(optimizer).__name__} (8-bit state for tensors of 4096 or more "
            f"elements; optimizer state at the peak {format_bytes(state_before)} -> {format_bytes(state_after)}): "
            f"{setup.versus(est.peak_bytes)}")
    cost = ("a different optimizer: block-wise 8-bit Adam states (Dettmers et al. 2022, arXiv:2110.02861) matched "
            "32-bit Adam in the paper's benchmarks, but check the loss curve; needs bitsandbytes where you train")
    return [("adamw8bit", Suggestion({"optimizer": name}, text, est.peak_bytes, est.peak_bytes <= setup.limit, cost,
                                     setup.run))]


def _bnb_8bit(setup: _Setup) -> list[tuple[str, Suggestion]]:
    """A bitsandbytes optimizer with 32-bit state (HF's "paged_adamw_32bit", "lion_32bit", ...): the same class
    with ``optim_bits=8``. Known by its configuration (``args.optim_bits``), whatever the class is called."""
    optimizer = setup.optimizer
    if optimizer.args.optim_bits == 8:
        return []
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    if "optim_bits" not in accepted:
        return []
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
        # Built over the user's parameters outside any trace; it only reads them.
        new = cls(groups, **kwargs)
    except ValueError:  # a class fixed at 32 bits (e.g. AdamW32bit) takes no optim_bits=8
        return []
    est = setup.trace(optimizer=new)
    base = setup.baseline
    if est.peak_bytes >= base.peak_bytes:
        return []
    name = f"bitsandbytes.optim.{cls.__name__}"
    state_before, state_after = base.breakdown.get("optimizer_state", 0), est.breakdown.get("optimizer_state", 0)
    text = (f"{name} with optim_bits=8 instead of 32 (8-bit state for tensors of {optimizer.args.min_8bit_size} "
            f"or more elements; optimizer state at the peak {format_bytes(state_before)} -> "
            f"{format_bytes(state_after)}; the HF Trainer's \"*_8bit\" optim choices): "
            f"{setup.versus(est.peak_bytes)}")
    cost = ("8-bit optimizer state: block-wise quantised states (Dettmers et al. 2022, arXiv:2110.02861) matched "
            "32-bit state in the paper's benchmarks, but check the loss curve")
    return [("adamw8bit", Suggestion({"optimizer": name, "optim_bits": 8}, text, est.peak_bytes,
                                     est.peak_bytes <= setup.limit, cost, setup.run))]


def _lora(setup: _Setup) -> list[tuple[str, Suggestion]]:
    try:
        with quiet_import_logs("bitsandbytes"):  # peft imports bitsandbytes where installed
            import peft
        import transformers
    except ImportError:
        return []
    model = setup.model
    if not isinstance(model, transformers.PreTrainedModel) or isinstance(model, peft.PeftModel):
        return []
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
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
            lora = peft.get_peft_model(base, peft.LoraConfig(r=_LORA_RANK, target_modules="all-linear"))
    trainable = [p for p in lora.parameters() if p.requires_grad]
    hyper = {k: _plain(v) for k, v in setup.optimizer.defaults.items() if k in ("lr", "betas", "eps", "weight_decay")}
    est = setup.trace(model=lora, optimizer=torch.optim.AdamW(trainable, **hyper))
    if est.peak_bytes >= setup.baseline.peak_bytes:
        return []
    n_train = sum(p.numel() for p in trainable)
    n_all = sum(p.numel() for p in lora.parameters())
    change = {"peft": "lora", "r": _LORA_RANK, "target_modules": "all-linear"}
    text = (f"LoRA (peft, r={_LORA_RANK}, all linear layers but the output head) with AdamW over the adapters: "
            f"trains {n_train:,} of {n_all:,} parameters ({n_train / n_all:.2%}); {setup.versus(est.peak_bytes)}")
    cost = ("changes what is trained: only low-rank adapters learn, which can fall short of full fine-tuning on "
            "tasks far from the pre-training data; the base weights stay frozen")
    return [("lora", Suggestion(change, text, est.peak_bytes, est.peak_bytes <= setup.limit, cost, setup.run))]


def _bf16(setup: _Setup) -> list[tuple[str, Suggestion]]:
    floating = [p.dtype for p in setup.model.parameters() if p.is_floating_point()]
    if not floating or any(d != torch.float32 for d in floating):
        return []
    candidates = []
    if setup.precision in (None, "32-true"):
        candidates.append(("bf16-mixed", "autocast runs matmuls and convolutions in bf16 while weights, gradients "
                           "and optimizer state stay fp32: usually no quality change; needs bf16 hardware "
                           "(NVIDIA Ampere or newer) for speed"))
    if setup.precision not in ("bf16-true", "16-true"):
        candidates.append(("bf16-true", "weights, gradients and optimizer state in bf16: updates smaller than "
                           "bf16's 8-bit mantissa resolves are lost, which can slow or stall convergence without "
                           "stochastic rounding or Kahan summation"))
    out = []
    for precision, cost in candidates:
        changed = setup.run.replace(precision=precision)
        est = setup.trace(run=changed)
        if est.peak_bytes >= setup.baseline.peak_bytes:
            continue
        text = f"precision {precision!r} instead of {setup.precision or 'fp32'}: {setup.versus(est.peak_bytes)}"
        out.append((precision, Suggestion({"precision": precision}, text, est.peak_bytes,
                                          est.peak_bytes <= setup.limit, cost, changed)))
    return out


def _sharding(setup: _Setup) -> list[tuple[str, Suggestion]]:
    """Under a plan over several ranks, its engine's stronger shardings; one device has none to offer."""
    return _stronger_sharding(setup) if setup.plan is not None and setup.plan.world_size > 1 else []


# Under a plan: the stronger shardings of the same engine, with the cost class `_COST_ORDER` ranks them by.
_STRONGER = {"ddp": (("fsdp-grad-op", "zero2"), ("fsdp2", "zero3")), "fsdp-grad-op": (("fsdp-full", "zero3"),),
             "zero1": (("zero2", "zero2"), ("zero3", "zero3")), "zero2": (("zero3", "zero3"),)}
_SHARDING_NAMES = {"fsdp-grad-op": "FSDP SHARD_GRAD_OP (gradients and optimizer state sharded)",
                   "fsdp-full": "FSDP FULL_SHARD (parameters too)", "fsdp2": "FSDP2 (fully_shard on every block)",
                   "zero2": "DeepSpeed ZeRO stage 2", "zero3": "DeepSpeed ZeRO stage 3"}


def _stronger_sharding(setup: _Setup) -> list[tuple[str, Suggestion]]:
    """The run's plan with a stronger sharding of the same engine, predicted as `preflight.estimate` predicts it."""
    plan = setup.plan
    assert plan is not None
    base = setup.baseline
    out = []
    for sharding, cost_class in _STRONGER.get(plan.sharding or "", ()):
        deepspeed, change = None, {"sharding": sharding, "world_size": plan.world_size}
        if plan.deepspeed is not None:  # the same config, at the new stage
            deepspeed = copy.deepcopy(dict(plan.deepspeed))
            deepspeed.setdefault("zero_optimization", {})["stage"] = int(sharding[-1])
            change["zero_stage"] = int(sharding[-1])
        fsdp = plan.fsdp if plan.sharding.startswith("fsdp") else None  # FSDP1's units carry over to FULL_SHARD
        other = dataclasses.replace(plan, sharding=sharding, fsdp=fsdp, deepspeed=deepspeed,
                                    offload_params=plan.offload_params and sharding in ("zero3", "fsdp-full"))
        changed = setup.run.replace(parallel=other)
        peak = setup.trace(run=changed).peak_bytes
        if peak >= base.peak_bytes:
            continue
        how = ("each rank's step traced through FSDP's own program" if sharding.startswith("fsdp") else
               "the traced allocations rescaled to one rank's share, plus DeepSpeed's gradient reduction buffers "
               "from the config")
        text = (f"{_SHARDING_NAMES[sharding]} over the same {plan.world_size} GPUs instead of {plan.sharding}: "
                f"{setup.versus(peak)} per GPU ({how})")
        cost = ("more communication per step: sharded parameters are gathered for every forward and backward "
                "(about 1.5x DDP's volume, ZeRO paper Sec 7)" if cost_class == "zero3" else
                "about DDP's communication volume (a reduce-scatter instead of an all-reduce, then an all-gather "
                "of the updated parameters; ZeRO paper Sec 7)")
        out.append((cost_class, Suggestion(change, text, peak, peak <= setup.limit, cost, changed)))
    return out


def _per_rank_peak(setup: _Setup, **sharding: Any) -> int:
    """The per-rank peak of the baseline trace rescaled by `shard_events` (as ``estimate(world_size=...)`` does)."""
    base = setup.baseline
    offload = {k: sharding.get(k, False) for k in ("offload_optimizer", "offload_params")}
    terms, _ = deepspeed_terms(setup.model, sharding.get("sharding"), None, setup.precision,  # DeepSpeed's defaults
                               sharding.get("world_size", 1), offload)
    events, categories, _ = shard_events(base.events, base.categories, setup.model,
                                         dtype=float_dtype_for(setup.precision), **terms, **sharding)
    if base.device.startswith("cuda"):
        events = round_events(events)
    return summarize_events(events, categories)[0]


def _offload(setup: _Setup) -> list[tuple[str, Suggestion]]:
    """ZeRO-Offload: the optimizer state and its step on the CPU (DeepSpeed ``offload_optimizer``), on top of
    ZeRO-2 over the available GPUs (one GPU included)."""
    base = setup.baseline
    if base.world_size > 1:
        return []  # already planned per rank
    n = setup.world_size
    peak = _per_rank_peak(setup, world_size=n, sharding="zero2", offload_optimizer=True)
    if peak >= base.peak_bytes:
        return []
    text = (f"ZeRO-Offload (DeepSpeed ZeRO-2 with offload_optimizer: cpu) on {n} GPU(s): the optimizer state and "
            f"its step move to the CPU: {setup.versus(peak)} per GPU. Every allocation of the traced run rescaled "
            "(not a trace of the offloaded run)")
    cost = ("the optimizer step runs on the CPU: host memory for the state, gradients copied over PCIe every "
            "step, and a slower step (ZeRO-Offload, arXiv:2101.06840)")
    change = {"offload_optimizer": True, "zero_stage": 2, "world_size": n}  # DeepSpeed's names
    changed = setup.run.replace(parallel=ParallelPlan(n, "zero2", offload_optimizer=True,
                                                      source="preflight.advise's ZeRO-Offload option"))
    return [("offload", Suggestion(change, text, peak, peak <= setup.limit, cost, changed))]


def _allocator(setup: _Setup) -> list[tuple[str, Suggestion]]:
    base = setup.baseline
    reserved = getattr(base, "peak_reserved_bytes", None)
    if reserved is None or reserved <= (1 + _RESERVED_GAP) * base.peak_bytes:
        return []
    from preflight.allocator import AllocatorConfig, simulate

    expandable = simulate(base.events, AllocatorConfig(expandable_segments=True)).peak_reserved_bytes
    if expandable >= reserved:
        return []
    text = (f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the simulated reserved peak goes from "
            f"{format_bytes(reserved)} to {format_bytes(expandable)} (allocated peak {format_bytes(base.peak_bytes)}, "
            f"unchanged); {'fits' if expandable <= setup.limit else 'still over'} the budget")
    cost = "an environment variable set before CUDA starts; no change to training"
    changed = setup.run.replace(target=dataclasses.replace(setup.run.target, allocator="expandable_segments:True"))
    return [("allocator", Suggestion({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, text, expandable,
                                     expandable <= setup.limit, cost, changed))]


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
