"""`advise`: what to change when a run does not fit, each option with a peak traced from the changed set-up.

A suggestion is the run's description changed (`Suggestion.run`: precision, loop, target or parallel plan), plus,
where the change is to the model, the optimizer or the batch, what to change there (`Suggestion.change`).
Every option is applied to a trace, never to the user's objects for good (`preflight.advice._setup`): a smaller
micro-batch is traced with gradient accumulation, activation checkpointing is switched on for the trace and
switched back (every module's attributes and hook tables restored, then checked), an 8-bit optimizer is built over
the same parameters, LoRA is traced on a copy of the architecture built on the meta device (no weights copied),
and precisions are the trace's own option. ZeRO-Offload is predicted as `preflight.estimate` predicts that plan
(every traced allocation rescaled to one rank's share, `preflight._target.shard_events`), and says so.

Under a data-parallel plan (``run.parallel``, a `preflight.ParallelPlan`, as the callbacks read it off the
trainer), the current set-up and every option are predicted per rank as `preflight.estimate` predicts that plan
(FSDP traced through its own program for each rank, ZeRO rescaled with DeepSpeed's buffers from the config), and
the sharding options become the stronger shardings of the same engine.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from preflight._autotune import max_batch_size, split_global_batch
from preflight._budget import check_headroom, usable_bytes
from preflight._device import resolve_device
from preflight._errors import StepWouldFailError
from preflight._estimate import estimate, read_plan_off_ddp
from preflight._guard import untouched
from preflight._run import Run, check_run, pinned, run_budget
from preflight._steps import StepFn
from preflight._units import format_bytes
from preflight._warnings import warn
from preflight.advice._combine import combine, drop_unneeded, suggestion_of
from preflight.advice._setup import (
    COST_ORDER, LORA_RANK, Suggestion, _Setup, _adapters_refused, available_moves, batch_size_of, checkpointing_how,
    Move, checkpointing_move, eight_bit, eight_bit_move, fsdp_param_dtype_move, impl_moves, lora_move, meta_init_move,
    micro_batch_move, more_gpus_move, need,
    offload_activations_move, offload_move, pipeline_micro_move, precision_moves, qlora_move, repeated_blocks,
    resize_batch,
)
from preflight.parallel._pipeline import refuse_job_pipeline
from preflight.trace import NotRestoredError

__all__ = ["Suggestion", "advise", "resize_batch", "batch_size_of", "repeated_blocks"]

_LITTLE_SAVING = 0.05  # checkpointing that saves less than this fraction of the peak is flagged as saving little
_RESERVED_GAP = 0.10  # reserved this far above allocated: fragmentation worth an allocator setting


def ranking(s: Suggestion) -> tuple[bool, int, int, int]:
    """Fits first; then what the costliest change costs; then fewer changes; then the lower figure."""
    return (not s.fits, max(COST_ORDER.index(k) for k in s.changes), len(s.changes), s.predicted_peak_bytes)


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
      a PEFT model, with AdamW over the adapters; under mixed precision the frozen base weights are in the
      compute dtype, as users load them (``from_pretrained(..., dtype=torch.bfloat16)``).
    - ``bf16-mixed`` and ``bf16-true``: for fp32 parameters.
    - ``offload``: ZeRO-Offload (ZeRO-2 with the optimizer state and step on the CPU) on one GPU.
    - ``offload_activations``: on a CUDA target, the saved activations offloaded to host memory as TRL's
      ``activation_offloading`` and torchtune's ``enable_activation_offloading`` offload them
      (`preflight.Loop.offload_activations` ``"streams"``).
    - ``fsdp_param_dtype``: under an FSDP2 plan with autocast (``*-mixed``) and no policy casting parameters,
      FSDP2's ``MixedPrecisionPolicy(param_dtype=<the autocast dtype>, reduce_dtype=torch.float32)``: autocast
      caches its cast of every gathered parameter until the forward ends, FSDP2's cast is freed at each reshard.
    - Under ``run.parallel``: the stronger shardings of the plan's engine over its ranks,
      each predicted as `preflight.estimate` predicts it: DDP -> FSDP ``SHARD_GRAD_OP`` and FSDP2
      (``fully_shard``), traced per rank; ``SHARD_GRAD_OP`` -> ``FULL_SHARD``; ZeRO-1 -> ZeRO-2 -> ZeRO-3 (the
      plan's DeepSpeed config with the stage changed).
    - ``allocator``: ``expandable_segments:True`` when the estimate simulates the CUDA allocator and its
      reserved peak is more than 10% above the allocated peak.
    - ``more_gpus``: for a run on one CUDA GPU that no change keeping what it trains makes fit, DeepSpeed ZeRO-3
      over the fewest GPUs (a power of two) that fit, with the single-GPU changes it still needs (`_more_gpus`).
    - ``fused`` and ``for-loop``: the optimizer step's implementation (`preflight.Loop.optimizer_impl`), when the
      optimizer's class takes it and it lowers the peak (torch's default on CUDA, foreach, holds temporaries the
      size of every parameter it updates).
    - A combination of the changes above (`preflight.advice._combine`), when no single change fits, or when
      cheaper changes together fit where only a costlier single one does: the changes are added cheapest first
      while each lowers the peak, the ones found unneeded are dropped, and a micro-batch among them is raised to
      the largest that fits. Its description says how many set-ups were traced and how long it took.

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
        Suggestions ranked: those that fit first, then by what the costliest of their changes costs (cheapest
        first: allocator setting, a fused optimizer step, micro-batch, a for-loop optimizer step, bf16-mixed,
        FSDP2's parameter dtype, ZeRO-1/2, checkpointing, activation offloading, ZeRO-3, 8-bit AdamW, optimizer
        offload, pure bf16, LoRA, QLoRA, more GPUs),
        then by the number of changes, then by peak. A suggestion's figure is what the verdict compares
        (`Suggestion.predicted_peak_bytes`). An option whose trace fails is left out with a ``RuntimeWarning``
        saying why.

    Raises:
        ValueError: a bad option, or no budget on a machine without CUDA.
        RuntimeError: the current set-up cannot be traced (there is nothing to compare the options with), or an
            option changed the user's model and it could not be restored (never expected; a bug to report).

    Example:
        >>> for s in preflight.advise(model, opt, batch, Run(target=Target(budget="24GiB"))):  # doctest: +SKIP
        ...     print(s.fits, format_bytes(s.predicted_peak_bytes), s.description)

    Known limitations:
        - The combination search is greedy (cheapest first, then pruned), not exhaustive: a set-up of costlier
          changes that fits with fewer of them may exist.
        - ZeRO-Offload's number rescales the single-GPU peak's categories; the offloaded run's peak may fall at
          another moment (see `preflight._sharding`).
        - Generic checkpointing wraps only the children of the largest ``nn.ModuleList``; models whose blocks
          live in ``nn.Sequential`` or are called in a custom loop get no checkpointing suggestion.
        - LoRA's suggestion uses r=16 on every linear layer but the output head; other ranks and targets differ.
        - Optimizer CPU offload and FSDP wrapping options are not suggested yet.
        - A step that runs its own optimizers (`Loop(manual=True)`, Lightning's manual optimization) gets only the
          options that leave its model and optimizers as they are: a smaller batch (its loop does not accumulate:
          keeping the updates is the step's to write), bf16 precision, the allocator setting, and their
          combinations; no plan for more GPUs (such a step is traced on one device).
    """
    run = check_run(run)
    refuse_job_pipeline(model, "advise")
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
    if run.parallel is not None and run.parallel.sharding is None and run.parallel.world_size > 1 and \
            run.parallel.tp is None and run.parallel.pp is None and run.parallel.cp is None:
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
    ranked: list[Suggestion] = []
    for name, option in OPTIONS if not run.loop.manual else [o for o in OPTIONS if o[0] in _MANUAL_OPTIONS]:
        try:
            ranked.extend(dataclasses.replace(s, changes=(key,)) for key, s in option(setup))
        except NotRestoredError:
            raise
        except Exception as err:  # noqa: BLE001 - one option failing must not hide the others (reported below)
            reason = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            warn(f"preflight.advise left out the {name} option: {reason}", RuntimeWarning)
    # Searched over what the single options found: combinations, then (where one GPU cannot do it) more GPUs.
    searches = (("combination option", _combination), ("plan for more GPUs", _more_gpus))
    for name, search in searches if not run.loop.manual else searches[:1]:
        try:
            ranked.extend(search(setup, ranked))
        except NotRestoredError:
            raise
        except Exception as err:  # noqa: BLE001 - as above
            reason = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            warn(f"preflight.advise left out the {name}: {reason}", RuntimeWarning)
    ranked.sort(key=ranking)
    return [dataclasses.replace(s, run_changes=s.run.changes_from(run)) for s in ranked]


# ---- options ------------------------------------------------------------------------------------------------


def _lowering(setup: _Setup, move: Move | None) -> int | None:
    """What the set-up needs with ``move`` made, traced, when there is such a move and it lowers the need."""
    if move is None:
        return None
    figure = need(setup.trace_moves([move]))
    return figure if _lowered(setup, figure) else None


def _lowered(setup: _Setup, figure: int) -> bool:
    return figure < need(setup.baseline)


def _optimizer_impl(setup: _Setup) -> list[tuple[str, Suggestion]]:
    """The optimizer step as a fused kernel, or one parameter at a time, when that lowers the peak: torch's default
    on CUDA (foreach) allocates temporaries the size of all the parameters it updates."""
    out = []
    for move in impl_moves(setup):
        try:
            figure = need(setup.trace_moves([move]))
        except StepWouldFailError:  # fused or foreach over a group mixing DTensors and plain tensors: not an option
            continue
        if not _lowered(setup, figure):
            continue
        argument = {"fused": "fused=True", "for-loop": "foreach=False"}[move.key]
        text = (f"optimizer step {move.key} ({type(setup.optimizer).__name__}({argument})): "
                f"{setup.versus(figure)}")
        out.append((move.key, Suggestion(move.change, text, figure, figure <= setup.limit, move.cost,
                                         setup.with_loop(optimizer_impl=move.key))))
    return out


def _micro_batch(setup: _Setup) -> list[tuple[str, Suggestion]]:
    if need(setup.baseline) <= setup.limit:
        return []  # the current batch fits: no need for a smaller one
    if setup.run.pipelined:
        return _pipeline_micro_batch(setup)
    micro = batch_size_of(setup.batch)
    if micro is None:
        raise ValueError("no tensor with a batch dimension in the batch; pass make_batch=")
    if micro < 2:
        return []
    current = micro * setup.run.loop.accumulate  # the global batch to keep
    manual = setup.run.loop.manual  # a loop that does not accumulate: the batch alone
    found = largest_micro_batch(setup, [], micro - 1)
    if found is None:
        one = micro_batch_move(setup, 1)
        assert one is not None
        figure = need(setup.trace_moves([one]))
        change = {"micro_batch_size": 1} if manual else {"micro_batch_size": 1, "accumulate_grad_batches": current}
        text = (f"{'a batch of 1' if manual else f'micro-batch 1 with {current} gradient-accumulation steps'} does "
                f"not fit either: {setup.versus(figure)}; combine it with another option")
        return [("micro_batch", Suggestion(change, text, figure, False, one.cost,
                                           setup.run if manual else setup.with_loop(accumulate=current)))]
    move, figure, note = found
    text = f"{note}: {setup.versus(figure)}"
    run = setup.run if manual else setup.with_loop(accumulate=move.change["accumulate_grad_batches"])
    return [("micro_batch", Suggestion(move.change, text, figure, figure <= setup.limit, move.cost, run))]


def _pipeline_micro_batch(setup: _Setup) -> list[tuple[str, Suggestion]]:
    """Under a pipeline plan: more, smaller micro-batches of the same step batch (`pipeline_micro_move`), the
    largest that fits, or the smallest's figure when none does."""
    found = largest_pipeline_micro_batch(setup, [], batch_size_of(setup.batch) or 0)
    if found is not None:
        move, figure, note = found
        return [("micro_batch", Suggestion(move.change, f"{note}: {setup.versus(figure)}", figure, True, move.cost,
                                           _moved_run(setup, move)))]
    one = pipeline_micro_move(setup, 1)
    if one is None:
        return []
    figure = need(setup.trace_moves([one]))
    text = f"{one.words} does not fit either: {setup.versus(figure)}; combine it with another option"
    return [("micro_batch", Suggestion(one.change, text, figure, False, one.cost, _moved_run(setup, one)))]


def _moved_run(setup: _Setup, move: Any) -> Run:
    """The user's run with ``move`` made."""
    with setup.applied([move]) as c:
        return c.run


def largest_pipeline_micro_batch(setup: _Setup, others: list[Any], below: int) -> tuple[Any, int, str] | None:
    """The largest pipeline micro-batch below ``below`` (and below today's) that fits with the moves ``others``
    made, each size traced (sizes that divide the step batch, largest first); None when none fits."""
    tried = 0
    for size in range(min(below, batch_size_of(setup.batch) or 0), 0, -1):
        move = pipeline_micro_move(setup, size)
        if move is None:
            continue
        tried += 1
        figure = need(setup.trace_moves([*others, move]))
        if figure <= setup.limit:
            note = (f"{move.words} (the schedule's micro-batches, the same step batch; the largest that fits, "
                    f"{tried} size(s) traced)")
            return move, figure, note
    return None


def largest_micro_batch(setup: _Setup, others: list[Any], below: int) -> tuple[Any, int, str] | None:
    """The largest micro-batch up to ``below`` that fits with the moves ``others`` made (found with
    `max_batch_size`, then split with `split_global_batch` so the global batch is kept), as a micro-batch move with
    its traced figure and a note; None when even a micro-batch of 1 does not fit."""
    micro = batch_size_of(setup.batch)
    assert micro is not None
    current = micro * setup.run.loop.accumulate
    manual = setup.run.loop.manual  # its loop does not accumulate: the step at each batch size as it is
    with setup.applied(others) as c:
        search = c.run if manual else c.run.replace(loop=dataclasses.replace(c.run.loop, accumulate=2))
        search = pinned(search, setup.device)
        search = search.replace(target=dataclasses.replace(search.target, budget=setup.budget_bytes))
        result = max_batch_size(c.model, c.optimizer, setup.make, search, step=setup.step, max_batch=below,
                                headroom=setup.headroom)
    size = result.batch_size
    while manual and size >= 1:
        move = micro_batch_move(setup, size)
        assert move is not None
        figure = need(setup.trace_moves([*others, move]))
        if figure <= setup.limit:
            return move, figure, f"batch {size} (the largest that fits, found with {result.traces} traces)"
        size -= 1
    # The search compares the allocated peak; the verdict may compare more (a simulated GPU's reserved memory and
    # context): each size is confirmed by a trace of what the verdict compares, smaller ones until one fits.
    while size >= 1:
        plan = split_global_batch(current, size)
        move = micro_batch_move(setup, plan.micro_batch_size)
        assert move is not None
        move = dataclasses.replace(move, change={"micro_batch_size": plan.micro_batch_size,
                                                 "accumulate_grad_batches": plan.accumulation_steps},
                                   cost=move.cost.replace(f"{-(-current // plan.micro_batch_size)} forward",
                                                          f"{plan.accumulation_steps} forward")
                                   + ("" if plan.exact else f" (a global batch of {plan.global_batch_size} instead "
                                                            f"of {current})"))
        figure = need(setup.trace_moves([*others, move]))
        if figure <= setup.limit:
            note = (f"{plan.note} (gradient accumulation; the largest micro-batch that fits is {size}, found with "
                    f"{result.traces} traces)")
            return move, figure, note
        size = plan.micro_batch_size - 1
    return None


def _checkpointing(setup: _Setup) -> list[tuple[str, Suggestion]]:
    move = checkpointing_move(setup)
    if move is None:
        return []
    how = checkpointing_how(setup.model)
    figure = need(setup.trace_moves([move]))
    base = need(setup.baseline)
    saving = base - figure
    text = f"activation checkpointing ({how}): {setup.versus(figure)}"
    if saving < _LITTLE_SAVING * base:  # kept, unlike other options, to say it does not help here
        amount = f"saves little ({saving / base:.1%})" if saving > 0 else "does not lower the peak"
        phase = next((p for p in setup.baseline.phases if p.required_bytes == base), None)
        if base > setup.baseline.required_bytes and phase is not None:  # another phase than the training step's
            text += f". It {amount}: the run's peak is its {phase.name} phase, which it does not change"
        else:
            text += (f". It {amount}: the peak is in {setup.baseline.peak_phase}, where activations hold "
                     f"{format_bytes(setup.baseline.breakdown.get('activations', 0))} of it")
    return [("checkpointing", Suggestion(move.change, text, figure, figure <= setup.limit, move.cost, setup.run))]


def _offload_activations(setup: _Setup) -> list[tuple[str, Suggestion]]:
    """The saved activations offloaded as TRL and torchtune do it, traced (`preflight.Loop.offload_activations`
    ``"streams"``), when that lowers the peak."""
    move = offload_activations_move(setup)
    figure = _lowering(setup, move)
    if move is None or figure is None:
        return []
    text = (f"activations offloaded to host memory (TRL's SFTConfig(activation_offloading=True), torchtune's "
            f"enable_activation_offloading=True): {setup.versus(figure)}")
    return [("offload_activations", Suggestion(move.change, text, figure, figure <= setup.limit, move.cost,
                                               setup.with_loop(offload_activations="streams")))]


def _adamw8bit(setup: _Setup) -> list[tuple[str, Suggestion]]:
    move = eight_bit_move(setup)
    if move is None:
        return []
    est = setup.trace_moves([move])
    figure = need(est)
    if not _lowered(setup, figure):
        return []
    found = eight_bit(setup.optimizer)
    assert found is not None
    before = setup.baseline.breakdown.get("optimizer_state", 0)
    after = est.breakdown.get("optimizer_state", 0)
    text = (f"{found[2]}; optimizer state at the peak {format_bytes(before)} -> {format_bytes(after)}: "
            f"{setup.versus(figure)}")
    return [("adamw8bit", Suggestion(move.change, text, figure, figure <= setup.limit, move.cost, setup.run))]


def _lora(setup: _Setup) -> list[tuple[str, Suggestion]]:
    _refuse_adapters(setup)
    move = lora_move(setup)
    return [] if move is None else _adapters(setup, move, f"LoRA (peft, r={LORA_RANK}, all linear layers but the "
                                             f"output head, base weights in {move.change['base_dtype']})")


def _qlora(setup: _Setup) -> list[tuple[str, Suggestion]]:
    _refuse_adapters(setup)
    move = qlora_move(setup)
    return [] if move is None else _adapters(setup, move, f"QLoRA (peft LoRA r={LORA_RANK} on all linear layers but "
                                             "the output head, over base weights in NF4 with double quantization, "
                                             "bitsandbytes; the other weights in fp32 as "
                                             "prepare_model_for_kbit_training leaves them)")


def _refuse_adapters(setup: _Setup) -> None:
    """Raise the reason adapters are not planned under the run's parallel plan (advise warns it left the option
    out)."""
    reason = _adapters_refused(setup)
    if reason is not None:
        raise ValueError(reason)


def _adapters(setup: _Setup, move: Move, what: str) -> list[tuple[str, Suggestion]]:
    """Training adapters instead (``move``: LoRA or QLoRA), described as ``what``, where it lowers the peak."""
    figure = need(setup.trace_moves([move]))
    if not _lowered(setup, figure):
        return []
    with setup.applied([move]) as c:
        n_train = sum(p.numel() for p in c.model.parameters() if p.requires_grad)
        n_all = sum(_weights(p) for p in c.model.parameters())
    text = (f"{what} with AdamW over the adapters: trains {n_train:,} of {n_all:,} parameters "
            f"({n_train / n_all:.2%}); {setup.versus(figure)}")
    return [(move.key, Suggestion(move.change, text, figure, figure <= setup.limit, move.cost, setup.run))]


def _weights(p: torch.Tensor) -> int:
    """How many weights ``p`` holds: a 4-bit bitsandbytes weight packs two in each byte of its storage, and its
    ``quant_state.shape`` is the unpacked one."""
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    return math.prod(shape) if shape is not None else p.numel()


def _bf16(setup: _Setup) -> list[tuple[str, Suggestion]]:
    out = []
    for move in precision_moves(setup):
        figure = need(setup.trace_moves([move]))
        if not _lowered(setup, figure):
            continue
        text = f"precision {move.key!r} instead of {setup.precision or 'fp32'}: {setup.versus(figure)}"
        out.append((move.key, Suggestion(move.change, text, figure, figure <= setup.limit, move.cost,
                                         setup.run.replace(precision=move.key))))
    return out


def _fsdp_param_dtype(setup: _Setup) -> list[tuple[str, Suggestion]]:
    """FSDP2 casting the parameters it gathers (`fsdp_param_dtype_move`), for an FSDP2 plan under autocast."""
    move = fsdp_param_dtype_move(setup)
    return _single(setup, move, lambda figure: (
        f"{move.words} in place of autocast's cached casts: autocast keeps its cast of each parameter FSDP2 gathers "
        f"until the forward ends, every unit's at once: {setup.versus(figure)} per GPU"))


def _offload(setup: _Setup) -> list[tuple[str, Suggestion]]:
    """ZeRO-Offload: the optimizer state and its step on the CPU (DeepSpeed ``offload_optimizer``), on top of
    ZeRO-2 over the available GPUs (one GPU included)."""
    return _single(setup, offload_move(setup), lambda figure: (
        f"ZeRO-Offload (DeepSpeed ZeRO-2 with offload_optimizer: cpu) on {setup.world_size} GPU(s): the optimizer "
        f"state and its step move to the CPU: {setup.versus(figure)} per GPU. Every allocation of the traced run "
        "rescaled (not a trace of the offloaded run)"))


def _single(setup: _Setup, move: Move | None, describe: Callable[[int], str]) -> list[tuple[str, Suggestion]]:
    """``move`` alone, offered where it lowers the peak: described by ``describe(its figure)``, its run the user's
    with the move made."""
    if move is None:
        return []
    figure = need(setup.trace_moves([move]))
    if not _lowered(setup, figure):
        return []
    return [(move.key, Suggestion(move.change, describe(figure), figure, figure <= setup.limit, move.cost,
                                  _moved_run(setup, move)))]


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
    out = []
    # A ring over a replicated model (context parallelism alone): FSDP2 over every rank, torchtitan's dp_shard_cp.
    stronger = (("fsdp2", "zero3"),) if plan.cp is not None and plan.sharding is None else \
        _STRONGER.get(plan.sharding or "", ())
    for sharding, cost_class in stronger:
        deepspeed, change = None, {"sharding": sharding, "world_size": plan.world_size}
        if plan.deepspeed is not None:  # the same config, at the new stage
            deepspeed = copy.deepcopy(dict(plan.deepspeed))
            deepspeed.setdefault("zero_optimization", {})["stage"] = int(sharding[-1])
            change["zero_stage"] = int(sharding[-1])
        # FSDP1's units carry over to FULL_SHARD
        fsdp = plan.fsdp if (plan.sharding or "").startswith("fsdp") else None
        other = dataclasses.replace(plan, sharding=sharding, fsdp=fsdp, deepspeed=deepspeed,
                                    offload_params=plan.offload_params and sharding in ("zero3", "fsdp-full"))
        changed = setup.run.replace(parallel=other)
        try:
            peak = need(setup.trace(run=changed))
        except StepWouldFailError:  # the engine's step fails with this optimizer (bitsandbytes over DTensors)
            continue
        if not _lowered(setup, peak):
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


def _allocator(setup: _Setup) -> list[tuple[str, Suggestion]]:
    base = setup.baseline
    reserved = getattr(base, "peak_reserved_bytes", None)
    if reserved is None or reserved <= (1 + _RESERVED_GAP) * base.peak_bytes:
        return []
    from preflight.allocator import AllocatorConfig, simulate

    expandable = simulate(base.events, AllocatorConfig(expandable_segments=True)).peak_reserved_bytes
    if expandable >= reserved:
        return []
    # The context and workspaces stay; the training phase's reserve shrinks, the other phases are kept as they are.
    figure = max([base.required_bytes - reserved + expandable, *(p.required_bytes for p in base.phases)])
    text = (f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the simulated reserved peak goes from "
            f"{format_bytes(reserved)} to {format_bytes(expandable)} (allocated peak {format_bytes(base.peak_bytes)}, "
            f"unchanged); {setup.versus(figure)}")
    cost = "an environment variable set before CUDA starts; no change to training"
    changed = setup.run.replace(target=dataclasses.replace(setup.run.target, allocator="expandable_segments:True"))
    return [("allocator", Suggestion({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, text, figure,
                                     figure <= setup.limit, cost, changed))]


def _meta_init(setup: _Setup) -> list[tuple[str, Suggestion]]:
    """The model built on meta, where the run loads it whole on several ranks and that is what does not fit."""
    move = meta_init_move(setup)
    figure = _lowering(setup, move)
    if move is None or figure is None:
        return []
    loading = setup.baseline.phase("loading")
    held = "" if loading is None else f" (loading {format_bytes(loading.required_bytes)} now)"
    text = f"{move.words}{held}: {setup.versus(figure)}"
    return [("meta-init", Suggestion(move.change, text, figure, figure <= setup.limit, move.cost,
                                     _moved_run(setup, move)))]


def _combination(setup: _Setup, singles: list[Suggestion]) -> list[Suggestion]:
    """A combination of moves (`combine`), when no single change fits or cheaper ones together might."""
    if need(setup.baseline) <= setup.limit:
        return []  # nothing to search for
    fitting = [s for s in singles if s.fits]
    ceiling = min((ranking(s)[1] for s in fitting), default=None)
    moves = [m for m in available_moves(setup) if ceiling is None or m.rank < ceiling]
    pipeline = setup.run.pipelined
    found = combine(setup, moves, others=largest_pipeline_micro_batch if pipeline else largest_micro_batch)
    return [] if found is None else [found]


_MOST_GPUS = 1024  # the largest plan `_more_gpus` tries
_CHANGES_TRAINING = frozenset({"lora", "qlora"})  # changes to what is trained
_NO_FLOOR = 0.99  # doubling the GPUs must lower the per-GPU figure by more than 1%, else the rest is not sharded


def _more_gpus(setup: _Setup, ranked: list[Suggestion]) -> list[Suggestion]:
    """When one GPU cannot run the training as it is (a run on one CUDA GPU that does not fit, and no suggestion that
    keeps what it trains fits): the fewest GPUs, a power of two, over which DeepSpeed ZeRO-3 fits, with the
    single-GPU changes that keep the training and that it still needs there.

    The changes tried with it are those that lowered the peak alone (the lowest of each group). With all of them
    made, plans of 2 and 4 GPUs are traced; two plans ``n`` and ``2n`` give what ZeRO-3 shards and what it does not
    (``f(n) = U + S/n``), from which the next plan to trace is the power of two that would fit. The search stops
    at a plan that fits (and whose half was traced over), or where doubling lowers the figure by less than 1% (the
    plan is offered as still over), or at `_MOST_GPUS`. Then each change is dropped,
    costliest first, where the plan fits without it. Every figure is a trace of that set-up, predicted as
    `preflight.estimate` predicts a ZeRO-3 plan; the extrapolation only picks which plan to trace."""
    if setup.plan is not None or setup.baseline.world_size > 1 or need(setup.baseline) <= setup.limit or \
            not str(setup.baseline.device).startswith("cuda"):
        return []
    if any(s.fits and not _CHANGES_TRAINING & set(s.changes) for s in ranked):
        return []
    start, before = time.perf_counter(), len(setup.traced)
    by_key = {m.key: m for m in available_moves(setup)}
    lowest: dict[str, tuple[int, Move]] = {}  # group -> the single change of it that lowered the peak most
    for s in ranked:
        move = by_key.get(s.changes[0]) if len(s.changes) == 1 else None
        if move is None or move.key in _CHANGES_TRAINING or move.key in ("offload", "micro_batch", "meta-init"):
            continue
        if s.predicted_peak_bytes < lowest.get(move.group, (need(setup.baseline), move))[0]:
            lowest[move.group] = (s.predicted_peak_bytes, move)
    kept = sorted((move for _, move in lowest.values()), key=lambda m: m.rank)

    per_gpu: dict[int, int] = {}  # GPUs -> the per-GPU figure with every kept change made

    def at(n: int) -> int | None:
        if n not in per_gpu:
            found = setup.need_of([*kept, more_gpus_move(n)])
            if found is None:
                return None
            per_gpu[n] = found
        return per_gpu[n]

    if at(2) is None and kept:  # a change that ZeRO-3's trace does not take: the run as it is
        kept = []
    if at(2) is None:
        return []
    n = 2
    while (f := at(n)) is not None and f > setup.limit and 2 * n <= _MOST_GPUS:
        g = at(2 * n)
        if g is None:
            break
        n *= 2
        if g <= setup.limit:
            break
        if g > _NO_FLOOR * f:
            break
        # Were f = U + S/n and g = U + S/2n (U: what ZeRO-3 does not shard), the plan that fits would be S/(limit - U)
        # GPUs: trace from half of it. Only a guess of which plan to trace (the allocator's rounding, DeepSpeed's
        # buckets and sub-groups are not of this form): every figure offered is traced.
        floor = 2 * g - f
        if floor < setup.limit:
            want = 2 * (n // 2) * (f - g) / (setup.limit - floor)
            n = max(n, min(_MOST_GPUS // 2, 2 ** max(math.ceil(math.log2(want)) - 1, 1)))
    while n > 2 and (at(n) or setup.limit + 1) <= setup.limit and (at(n // 2) or setup.limit + 1) <= setup.limit:
        n //= 2  # the extrapolation overshot: fewer fit too
    best = at(n)
    if best is None:
        return []
    fits = best <= setup.limit
    full = " + ".join(m.words for m in kept) or "no other change"
    fewer = "" if n // 2 not in per_gpu or n < 4 else f"; on {n // 2} GPUs with {full}: " \
        f"{format_bytes(per_gpu[n // 2])} per GPU"
    if fits:
        kept, best = drop_unneeded(setup, kept, best, beside=(more_gpus_move(n),))
    chosen = [*kept, more_gpus_move(n)]
    with setup.applied(chosen) as c:
        run = c.run
    words = " + ".join(m.words for m in chosen)
    searched = f"{len(setup.traced) - before} set-ups traced in {time.perf_counter() - start:.0f} s"
    how = ("ZeRO-3's figure: every traced allocation rescaled to one rank's share, plus DeepSpeed's own terms; "
           f"FSDP's full sharding shards the same states: --sharding fsdp2 --world-size {n} traces it per rank")
    if fits:
        text = (f"one GPU cannot train this as it is (no change that keeps what it trains fits): {words}: "
                f"{setup.versus(best)} per GPU ({n} is the fewest GPUs, a power of two{fewer}; {searched}). {how}")
    else:
        stop = "the largest tried" if 2 * n > _MOST_GPUS else "doubling them lowered the figure by less than 1%"
        text = (f"one GPU cannot train this as it is, and no plan of up to {n} GPUs under ZeRO-3 fits ({stop}): "
                f"{words}: {setup.versus(best)} per GPU{fewer}; what ZeRO-3 does not shard (activations, "
                f"temporaries, the batch, DeepSpeed's buffers) is over the budget ({searched}). {how}")
    return [suggestion_of(chosen, text, best, fits, run)]


# The single options `advise` traces, in this order: (name in its warnings, the function listing its suggestions).
# The options that change neither the model nor the optimizer, which a step running its own optimizers calls as the
# user's objects (`Loop.manual`): the others would trace a copy the step never calls.
_MANUAL_OPTIONS = frozenset({"micro-batch", "bf16 precision", "allocator setting"})

OPTIONS: tuple[tuple[str, Callable[[_Setup], list[tuple[str, Suggestion]]]], ...] = (
    ("model built on meta", _meta_init),
    ("optimizer implementation", _optimizer_impl),
    ("micro-batch", _micro_batch),
    ("activation checkpointing", _checkpointing),
    ("activation offloading", _offload_activations),
    ("8-bit AdamW", _adamw8bit),
    ("LoRA", _lora),
    ("QLoRA", _qlora),
    ("bf16 precision", _bf16),
    ("FSDP2 parameter dtype", _fsdp_param_dtype),
    ("sharding", _sharding),
    ("optimizer offload", _offload),
    ("allocator setting", _allocator),
)
