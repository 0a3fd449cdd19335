"""`estimate`: predict the peak memory of training steps from a fake trace, with an analytic fallback."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from preflight._analytic import model_state, sparse_gradient_parameters
from preflight.trace._library_kernels import PAGED_MIN_NUMEL
from preflight._device import (cuda_recurrent_note, held_tensors, model_device, resolve_device, trace_device_for,
                              unmodelled_device_note)
from preflight._errors import StepWouldFailError
from preflight._gpus import GPU, with_context
from preflight._guard import untouched
from preflight._loading import LOAD_PHASE, Loading
from preflight._result import Category, Coverage, Estimate, Event, PhaseEstimate, TimelinePoint
from preflight._warnings import warn
from preflight._scratch import KERNEL_OPS, Calibrator, scratch_ops
from preflight._sharding import hf_hidden_size, read_deepspeed_config, shard_breakdown
from preflight._run import Run, check_run, pinned
from preflight._steps import Evaluation, LossNotFoundError, StepFn, check_step, modes_note, with_optimizer_impl
from preflight._target import (add_workspaces, check_sharding, cuda_terms, deepspeed_save_events, per_rank_breakdown,
                               resolve_gpu, round_events, shard_events)
from preflight._units import format_bytes
from preflight.allocator import AllocatorConfig
from preflight.cuda import CudaTarget, cudnn_workspace_note
from preflight.cuda._nccl import rank_nccl_buffers
from preflight.parallel import (FSDP1Plan, FSDP2Plan, ProcessGroupInUseError, WrappedFSDP1, WrappedFSDP2,
                                fsdp1_rank_groups, rank_groups, read_fsdp1, read_fsdp2)
from preflight.parallel import read_ddp, read_zero, trace_fsdp1, trace_fsdp2, zero_plan
from preflight.parallel._context import CPPlan, cp_rank_groups, sequence_tensors, trace_cp
from preflight.parallel._expert import EPLayout, check_ep_model, ep_rank_groups, read_ep, trace_ep
from preflight.parallel._deepspeed import deepspeed_precision, deepspeed_save, deepspeed_settings, deepspeed_terms
from preflight.parallel._pipeline import (JobPipeline, PPPlan, StageMetasError, gather_over, job_stage_metas, read_pp,
                                         stage_rank_groups, trace_pp, trace_pp_in_job)
from preflight.parallel._tensor import (TPPlan, WrappedTP, closed_form_activations, read_tp, tp_mesh, tp_rank_groups,
                                        trace_tp, unmatched_styles, uses_sequence_parallel)
from preflight.trace import TraceResult, device_mismatch, float_dtype_for, is_user_error, trace_composed, trace_steps
from preflight.trace._run import EVAL_NOT_TRACED, EVAL_PHASE, SAVE_NOT_TRACED, SAVE_PHASE
from preflight.trace._step_checks import library_optimizer_over_dtensors

__all__ = ["check_plan", "estimate", "estimate_evaluating", "read_plan_off_ddp", "summarize_events"]

_TIMELINE_POINTS = 2000  # enough for a plot, small enough for a JSON report


@untouched()
def estimate(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    run: Run | None = None,
    *,
    step: StepFn | None = None,
) -> Estimate:
    """Predict the peak memory of training ``model`` with ``optimizer`` on ``batch``, without running it.

    The user's model runs for ``steps`` training steps (forward, backward, ``optimizer.step()``,
    ``zero_grad(set_to_none=True)``) on fake tensors: shapes and dtypes only, no memory. Every allocation and
    free of a tensor storage is recorded; the peak of live bytes, including the parameters, buffers, batch and
    existing optimizer state alive before the step, is the prediction. Nothing of the user's changes: weights,
    gradients, optimizer state, module attributes, hooks and RNG streams are as before.

    Args:
        model: the model as built: real weights on CPU or GPU, or on the meta device; PEFT-wrapped, frozen
            parts, tied weights and half-precision parameters are fine. A model ``fully_shard`` (FSDP2) or
            ``FullyShardedDataParallel`` (FSDP1; the wrapper, or the module it wraps with its wrapped units) already
            wrapped inside a job has its plan read off it (`preflight.parallel.read_fsdp2` / ``read_fsdp1``) and each
            rank traced on an unsharded fake copy; ``world_size``, ``sharding`` and ``fsdp`` may be left out, and
            a value that contradicts the read plan is a ValueError. One of torch's pipeline schedules built inside a
            job (``Schedule1F1B(stage, ...)``) is read as its pipeline (`preflight.parallel._pipeline.read_pp`): call
            it on every rank at once; each traces its own stages, ``per_rank_peak_bytes`` is gathered from the ranks
            and ``peak_bytes`` is this rank's (docs/pipeline-parallel.md).
        optimizer: the optimizer instance, not yet stepped (torch.optim, bitsandbytes 8-bit and paged
            variants, or anything implementing the torch Optimizer interface).
        batch: one batch as the dataloader yields it (a tensor or nested dict/list/tuple of tensors). Shapes and
            dtypes set the prediction; the values of small integer tensors (token ids, masks) are used only to
            take the same code path as the real run.
        run: how the run trains (`preflight.Run`): precision, the loop (accumulation, where gradients are freed,
            clipping, GradScaler, simulated steps), the target (device or catalog GPU, allocator settings), the
            parallel plan and the MoE routing assumed; None: the defaults (as the tensors are, one device, the
            model's own). With ``run.parallel`` spanning several ranks, ``peak_bytes`` and ``breakdown`` are one
            rank's: ``"ddp"`` (DDP's buckets counted), ``"zero1"``/``"zero2"``/``"zero3"`` (one single-device trace
            rescaled per category, DeepSpeed's buffers sized from the plan's config), ``"fsdp2"``, ``"fsdp-full"``,
            ``"fsdp-grad-op"`` (each rank's own step traced through ``fully_shard`` or ``FullyShardedDataParallel``
            under a fake process group of the world size, ``per_rank_peak_bytes`` and ``peak_rank`` filled, the
            engine's all-gather and reduce-scatter buffers in ``communication``). Inside a real job the fake group
            is made beside the job's, which is left as it was. Where a rank cannot be traced (offloading, a paged
            optimizer, a program FSDP cannot run) it is rescaled per category and ``coverage.notes`` says why.
        step: ``step(model, batch) -> loss``. Default: ``model(**batch)`` for a mapping, ``model(batch)``
            otherwise, taking ``.loss``, ``["loss"]``, a scalar output, or the first element of a tuple.

    Returns:
        An `Estimate`. When the trace fails (data-dependent operators, kernels without fake implementations),
        ``coverage.lower_bound`` is True, ``coverage.failed_op`` names the operator (or Python error) and the line of
        the model that stopped the trace, ``peak_bytes`` is the
        analytic lower bound parameters + buffers + gradients + optimizer state + batch, and one warning is
        emitted.

    Raises:
        ValueError: a wrong argument (unknown precision, steps < 1, accumulate < 1, unknown zero_grad, no loss found
            in the model's output).
        StepWouldFailError: the real step would raise at step one: operands of different dtypes or devices, or
            indices out of range (token ids >= the vocabulary, sequences longer than the position table, labels
            beyond the classes); the message has the real kernel's error, the operator, the line and the tensors.
        TypeError: ``steps`` not an integer, a ``step`` that cannot be called as ``step(model, batch)``.
        Exception: an exception of the user's own code in the step (``raise ValueError`` in ``forward``, a batch of
            the wrong type), re-raised as it is with a note naming the line: the real step raises it too. Only
            what the trace itself cannot do gives the lower bound (`preflight.trace._blame` states the rule).

    Example:
        >>> est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch)  # doctest: +SKIP
        >>> print(est)  # doctest: +SKIP

    Known limitations (blind spots):
        - Memory outside tensor storages: the CUDA context, cuBLAS/cuDNN handles and NCCL buffers are not in
          ``peak_bytes`` (see ``device_total_bytes`` when a GPU target is simulated).
        - Kernel-internal scratch is measured only for convolutions and CPU low-precision matrix products
          (``coverage.calibrated``); other kernels that allocate internally are unseen.
        - Custom CUDA kernels without fake (meta) implementations stop the trace: the result is then a lower bound.
        - Data-dependent control flow on values computed from parameters stops the trace, except for
          mixture-of-experts routing, which follows ``routing``, and two stated assumptions named in the notes
          (``x.all()`` is True; values handed to NumPy are zeros).
        - Planning for CUDA from a CPU-only machine applies CUDA's autocast lists, attention-kernel choice and
          fused dropout (`preflight.cuda`); other kernels keep the fake (meta) implementations' outputs.
        - ``torch.compile``: modules compiled with inductor are traced as AOTAutograd and inductor's partitioner
          split them, with inductor's fusion approximated; other backends and graphs that cannot be captured are
          traced eagerly (the eager peak, an upper bound for activations), as ``coverage.notes`` says. Dynamo is
          kept out of the trace, so nothing about the user's compilation changes.
    """
    return _estimate(model, optimizer, batch, run, step=step, evaluation=None)


@untouched()
def estimate_evaluating(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, run: Run | None = None, *,
                        step: StepFn | None = None, evaluation: Evaluation) -> Estimate:
    """`estimate`, with the trainer's ``evaluation`` traced after the steps where each rank is traced under tensor or
    expert parallelism (a plan's or a laid-out model's): its phase ``"evaluation"`` (`Estimate.phase`) holds each rank's
    evaluation peak with that rank's training state alive. Elsewhere there is no such phase: the caller predicts the
    evaluation on one device (`preflight.estimate_eval`) and takes the rank's share."""
    return _estimate(model, optimizer, batch, run, step=step, evaluation=evaluation)


def check_initialized(model: nn.Module) -> None:
    """Refuse a model with parameters or buffers of lazy modules not yet initialized (`nn.LazyLinear` and the like):
    their shapes come from the first forward, which preflight does not run on the user's model.

    Raises:
        ValueError: naming them and how to initialize them.
    """
    if not isinstance(model, nn.Module):  # a pipeline schedule, or an argument error said later
        return
    lazy = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if is_lazy(t)]
    if lazy:
        shown = ", ".join(lazy[:3]) + (f" and {len(lazy) - 3} more" if len(lazy) > 3 else "")
        raise ValueError(f"{len(lazy)} parameter(s) or buffer(s) of lazy modules are not initialized yet ({shown}): "
                         "their shapes come from the first forward. Run one forward on a batch first "
                         "(`model(batch)`, as torch's LazyModuleMixin asks before training), then estimate.")


def _estimate(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, run: Run | None, *,
              step: StepFn | None, evaluation: Evaluation | None) -> Estimate:
    run = check_run(run)
    check_initialized(model)
    est = _estimated(model, optimizer, batch, run, step=step, evaluation=evaluation)
    loading = est.phase("loading")
    if loading is not None and torch.device(est.device).type != "cpu":  # the host is another memory than the device
        held = run.loading.placement == "host" or run.loading.from_rank0
        host = _whole_model_bytes(model, optimizer, run.precision) if held else 0
        est = dataclasses.replace(est, phases=tuple(dataclasses.replace(p, host_bytes=host) if p is loading else p
                                                    for p in est.phases))
    sparse = None
    if sparse_gradient_parameters(model) and torch.device(est.device).type == "cuda" and not est.coverage.lower_bound:
        sparse = ("sparse gradients on a CUDA target: sized as torch's CPU kernels make them (a coalesce or a sum of "
                  "two allocates for every entry of its inputs), not read from the CUDA kernels")
    added = [n for n in (*cuda_recurrent_note(model, torch.device(est.device)), modes_note(model, run.loop), sparse)
             if n is not None and n not in est.coverage.notes]
    if added:  # every path: one device, or each rank of a plan
        est = dataclasses.replace(est, coverage=dataclasses.replace(est.coverage,
                                                                    notes=(*est.coverage.notes, *added)))
    if run.loading is not None and est.phase("loading") is None:
        why = ("the steps could not be traced (the figure is a lower bound)" if est.coverage.lower_bound else
               "the model is already wrapped, laid out or partitioned in this job, so its loading is over")
        est = dataclasses.replace(est, coverage=dataclasses.replace(
            est.coverage, notes=(*est.coverage.notes, f"loading: not predicted: {why}")))
    return est


def _whole_model_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, precision: str | None) -> int:
    """The bytes of ``model``'s parameters and buffers as the run loads them (floating ones in the dtype ``precision``
    casts them to, `preflight._analytic.model_state`'s count), with a quantised weight's state."""
    state = model_state(model, optimizer, None, torch.device("cpu"), param_dtype=float_dtype_for(precision))
    # Held on storages of their own; one on its parameter's (an 8-bit weight's ``CB``) is counted with it.
    own = {p.untyped_storage()._cdata for p in model.parameters()}
    held = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for p in model.parameters()
            for _, t in held_tensors(p) if t.untyped_storage()._cdata not in own}
    return state.parameters + state.buffers + sum(held.values())


def _estimated(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, run: Run, *,
               step: StepFn | None, evaluation: Evaluation | None) -> Estimate:
    # A pipeline schedule built inside a job: each rank holds its own stages, and traces them.
    job = read_pp(model)
    if job is not None:
        if run.parallel is not None:
            raise ValueError(f"`model` is a {type(model).__name__} running inside this job, which is its own "
                             "pipeline plan: leave `run.parallel` out.")
        model = job.modules
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` should be a torch.nn.Module, got {type(model).__name__}.")
    # A model and optimizer DeepSpeed ZeRO has taken over: its unpartitioned stand-ins are predicted (never the
    # partitioned model, whose hooks gather over the job's group), under the ZeRO plan its objects show unless the
    # run gives one. A ValueError says what does not map back.
    zero = read_zero(model, optimizer)
    if zero is not None:
        planned = pinned(run, resolve_device(None, model))  # the partitioned model's device, not the stand-in's
        est = estimate(zero.model, zero.optimizer, batch,
                       planned.replace(parallel=run.parallel or zero_plan(zero, None), loading=None), step=step)
        return dataclasses.replace(est, coverage=dataclasses.replace(
            est.coverage, notes=(*est.coverage.notes, zero.note())))
    # A DDP model is its own parallel plan: the module it wraps is traced, DDP's buckets counted per rank.
    model, run, ddp_note = read_plan_off_ddp(model, run)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"`optimizer` should be a torch.optim.Optimizer instance, got {type(optimizer).__name__}. "
            "Pass the optimizer you will train with, built over the model's parameters."
        )
    check_step(step)
    optimizer = with_optimizer_impl(optimizer, run.loop.optimizer_impl)  # the step as the run will take it
    precision, schedule, steps, routing, fast = run.precision, run.loop, run.loop.steps, run.routing, run.fast
    device, gpu, allocator = run.target.device, run.target.gpu, run.target.allocator
    plan_kwargs = run.parallel.estimate_kwargs() if run.parallel is not None else {}
    world_size, sharding = plan_kwargs.get("world_size", 1), plan_kwargs.get("sharding")
    offload_optimizer = plan_kwargs.get("offload_optimizer", False)
    offload_params = plan_kwargs.get("offload_params", False)
    fsdp, deepspeed_config = plan_kwargs.get("fsdp"), plan_kwargs.get("deepspeed_config")
    gradient_as_bucket_view = plan_kwargs.get("gradient_as_bucket_view", False)
    offload = {"offload_optimizer": offload_optimizer, "offload_params": offload_params}
    ds = None
    if deepspeed_config is not None:
        ds = read_deepspeed_config(deepspeed_config, hidden_size=hf_hidden_size(model))
        sharding, offload = deepspeed_settings(ds, sharding, offload)
        precision = deepspeed_precision(model, ds, precision)
    # A ValueError names a wrapping the per-rank trace does not follow.
    # A model parallelize_module laid out (then perhaps wrapped by fully_shard over another mesh dim) is traced as
    # its layout says: its FSDP2 plan, where it has one, is read over FSDP2's own dims.
    # A model transformers laid out with expert parallelism (inside its job) is traced as its layout says.
    ep_read = read_ep(model) if job is None else None  # a job's pipeline stages: `read_pp` read their layout
    laid_out = read_tp(model) if ep_read is None and job is None else None
    wrapped: WrappedFSDP2 | WrappedFSDP1 | None = None
    read_tp_fsdp = None
    if ep_read is not None:
        given, given_tp = plan_kwargs.get("ep"), plan_kwargs.get("tp")
        if given not in (None, ep_read.plan) or world_size not in (1, ep_read.world_size) \
                or sharding not in (None, "fsdp2") or given_tp not in (None, TPPlan(ep_read.tp)) \
                or getattr(fsdp, "replicate", ep_read.replicate) != ep_read.replicate:
            raise ValueError(f"The model is already laid out by transformers' expert parallelism "
                             f"({ep_read.describe()}), which is its plan: leave `run.parallel` out.")
        world_size, sharding = ep_read.world_size, "fsdp2"
    elif laid_out is not None:
        read_tp_fsdp = read_fsdp2(model, tensor_parallel=True) if laid_out.fsdp_dims is not None else None
    elif job is None:
        wrapped = read_fsdp2(model) or read_fsdp1(model)
    traced_model = model
    if wrapped is not None:
        world_size, sharding, fsdp = _wrapped_plan(wrapped, world_size, sharding, fsdp, offload)
        if isinstance(wrapped, WrappedFSDP1):  # the outermost FSDP1 wrapper, whose copy is the unwrapped model
            traced_model = wrapped.root
    sharding = check_plan(world_size, sharding, **offload)
    gpu_info = resolve_gpu(gpu, torch.device("cuda")) if gpu is not None else None
    if gpu_info is not None and device is None:
        device = "cuda"
    allocator = _allocator_config(allocator)
    target = resolve_device(device, model)  # CUDA for a catalog GPU: `Target` refuses a gpu with another device
    if gpu_info is None:
        gpu_info = resolve_gpu(None, target)
    gpu_info = with_context(gpu_info, run.target.cuda_context, run.target.nccl_buffers)
    trace_device = trace_device_for(target)
    options = dict(step=step, precision=precision, trace_device=trace_device, target_device=target, steps=steps,
                   schedule=schedule, record_op=scratch_ops(target), routing=routing,
                   cuda=CudaTarget.of(gpu_info) if target.type == "cuda" else None, checkpoint=run.checkpoint,
                   loading=run.loading)
    if any(x is not None for x in (wrapped, laid_out, ep_read, ddp_note, job)):
        options["loading"] = None  # its loading is over: the model is already wrapped or laid out in this job
    tp, pp = plan_kwargs.get("tp"), plan_kwargs.get("pp")
    ranked = any(plan_kwargs.get(k) is not None for k in ("tp", "pp", "cp", "ep", "fsdp", "deepspeed_config"))
    if schedule.manual and (world_size > 1 or sharding is not None or ranked
                            or any(x is not None for x in (wrapped, laid_out, ep_read, job))):
        raise ValueError("`Loop(manual=True)` is traced on one device: a step that runs its own optimizers is not "
                         "traced per rank yet. Leave `run.parallel` out (data-parallel replicas hold what one device "
                         "does, plus DDP's gradient buckets: a copy of the gradients).")
    if schedule.manual and step is None:
        raise ValueError("`Loop(manual=True)` needs `step=`: the function that runs the step's forwards, backward "
                         "passes and optimizer steps (step(model, batch)).")
    if schedule.manual and fast:
        fast = False  # the shallow models would have to be met by the user's own optimizers: traced whole
    if job is not None:
        return _pp_job_estimate(job, optimizer, batch, options, fast=fast, gpu_info=gpu_info, allocator=allocator)
    if pp is not None:
        if laid_out is not None or wrapped is not None:
            raise ValueError("`run.parallel.pp` plans pipeline parallelism for a whole model, but the model is "
                             "already parallelized or wrapped: call preflight on the model before it is cut and "
                             "wrapped.")
        fsdp_pp = fsdp_trace_plan(fsdp, sharding)
        if isinstance(fsdp_pp, FSDP1Plan) or (fsdp_pp is not None and fsdp_pp.replicate != 1):
            raise ValueError("pipeline parallelism is traced with FSDP2 (fully_shard) over one data-parallel dim: "
                             "pass sharding='fsdp2' without hybrid sharding.")
        return _pp_estimate(model, optimizer, batch, pp, fsdp_pp, world_size, options, fast=fast, gpu_info=gpu_info,
                            allocator=allocator, tp=tp, cp=plan_kwargs.get("cp"))
    ep = plan_kwargs.get("ep") if ep_read is None else ep_read.plan
    if ep is not None:
        if laid_out is not None or wrapped is not None:
            raise ValueError("`run.parallel.ep` plans transformers' expert parallelism for a whole model, but the "
                             "model is already laid out or wrapped: call preflight on the model before it is.")
        layout = ep_read or EPLayout(ep, world_size, tp.degree if tp is not None else 1, getattr(fsdp, "replicate", 1))
        return _ep_estimate(model, optimizer, batch, layout, options, fast=fast, gpu_info=gpu_info,
                            allocator=allocator, laid_out=ep_read is not None, evaluation=evaluation)
    cp = plan_kwargs.get("cp")
    if cp is not None:
        if laid_out is not None or isinstance(wrapped, WrappedFSDP1):
            raise ValueError("`run.parallel.cp` plans context parallelism with FSDP2 or alone, but the model is "
                             "laid out by tensor parallelism or wrapped by FSDP1: call preflight on the model "
                             "before it is wrapped.")
        if wrapped is not None and tp is not None:
            raise ValueError("`run.parallel.tp` plans tensor parallelism beside the ring for a model not yet laid "
                             "out, but the model is already wrapped by FSDP: call preflight before wrapping it.")
        # A model fully_shard wrapped (accelerate's prepare): its plan was read above, over every rank.
        fsdp_cp = fsdp_trace_plan(fsdp, sharding)
        if isinstance(fsdp_cp, FSDP1Plan) or (fsdp_cp is not None and fsdp_cp.replicate != 1):
            raise ValueError("context parallelism is traced with FSDP2 (fully_shard) over every rank: pass "
                             "sharding='fsdp2' without hybrid sharding.")
        est = _cp_estimate(model, optimizer, batch, cp, fsdp_cp, world_size, options, fast=fast, gpu_info=gpu_info,
                           allocator=allocator, tp=tp)
        if wrapped is not None:
            est = dataclasses.replace(est, coverage=dataclasses.replace(
                est.coverage, notes=(*est.coverage.notes, wrapped.note())))
        return est
    if laid_out is not None:
        if world_size not in (1, laid_out.world_size) or tp is not None or sharding not in (None, "fsdp2") or fsdp:
            raise ValueError(f"The model was already parallelized with DTensor over {laid_out.world_size} rank(s), "
                             "which is its plan: leave `run.parallel` out (or give only its world size).")
        tp, world_size = laid_out, laid_out.world_size
        sharding, fsdp = ("fsdp2", read_tp_fsdp.plan) if read_tp_fsdp is not None else (None, None)
    if tp is not None:
        if wrapped is not None:
            raise ValueError("`run.parallel.tp` plans tensor parallelism for a model not yet parallelized, but the "
                             "model is already wrapped by FSDP: call preflight before wrapping it.")
        return _tp_estimate(model, optimizer, batch, tp, fsdp_trace_plan(fsdp, sharding), world_size, options,
                            fast=fast, gpu_info=gpu_info, allocator=allocator, evaluation=evaluation)
    plan = fsdp_trace_plan(fsdp, sharding)
    # The ranks one rank's state is cut among: under hybrid sharding one shard group's (a ValueError where they do
    # not divide the world), which a rescaled estimate divides by.
    shard_ranks = world_size if plan is None else plan.shard_size(world_size)
    composed_note = None
    ranks = rank_note = None
    if plan is not None:
        # The module a wrapper holds (what the callbacks pass): each step runs through the root wrapper's forward.
        through_root = isinstance(wrapped, WrappedFSDP1) and wrapped.root is not model
        ranks, rank_note = _trace_ranks(traced_model, optimizer, batch, world_size, plan, sharding, offload,
                                        options, fast=fast, wrapped=wrapped is not None, through_root=through_root)
    if wrapped is not None:
        if ranks is None:  # a single-device trace of the wrapped model would run FSDP's hooks on the user's groups
            engine = "fully_shard" if isinstance(wrapped, WrappedFSDP2) else "FullyShardedDataParallel"
            raise ValueError(f"The model is already wrapped by {engine}, and its ranks could not be traced "
                             f"({rank_note}). Call preflight before {engine}, with world_size= and "
                             f"sharding={sharding!r}, to get the rescaled figure.")
        rank_note = f"{wrapped.note()}; {rank_note}"
    if ranks is not None:
        return _per_rank_estimate(ranks, rank_note, target=target, trace_device=trace_device, gpu_info=gpu_info,
                                  allocator=allocator, steps=steps, world_size=world_size, sharding=sharding,
                                  saves=run.checkpoint is not None, loading=options["loading"])
    calibrator = Calibrator(target, can_run=(trace_device == target), gpu=gpu_info)
    traced = {k: v for k, v in options.items() if k != "loading"}  # one device's loading is counted, not traced
    if fast:  # the shallow traces are calibrated before they are composed
        result, composed_note = trace_composed(model, optimizer, batch, scratch=calibrator.apply, **traced)
    else:
        result = trace_steps(model, optimizer, batch, **traced)
    notes = list(result.notes) + ([composed_note] if composed_note else []) + ([rank_note] if rank_note else [])
    if schedule.manual:
        notes.append("manual optimization: the step's own forwards, backward passes and optimizer steps traced as it "
                      "runs them, every block of the model (fast composition does not apply)")
    if ddp_note:
        notes.append(ddp_note)
    if target != trace_device:
        notes.append(f"traced on {trace_device.type} for a {target.type} target")
    notes.extend(unmodelled_device_note(target))
    # bitsandbytes falls back to ordinary memory for paged optimizers off CUDA.
    paged = bool(getattr(optimizer, "is_paged", False)) and target.type == "cuda"

    if result.error is not None and device_mismatch(result.error) and model_device(model) == target == trace_device:
        # The model's own tensors are where the real run has them: operands on two devices fail there too.
        raise StepWouldFailError(
            f"The training step would fail at its first step: {result.error} (in {result.failed_op}). Fix: create "
            "tensors in the step on the device of the tensors they meet (e.g. `device=x.device`), or move them "
            "with `.to(...)`. No memory was predicted: a step that fails has no peak.") from result.error
    if result.error is not None:
        return _fallback(model, optimizer, batch, target, precision, steps, result, notes,
                         gpu=gpu_info, world_size=world_size, shard_ranks=shard_ranks, sharding=sharding,
                         offload=offload, ds=ds)

    scratch = calibrator(result.events, result.op_log)
    notes.extend(uncalibrated_notes(calibrator.skipped, target))
    notes.extend(n for n in [calibrator.reduction_note()] if n)
    categories = {**result.categories, **scratch.categories}
    events = scratch.events
    managed = 0
    if paged:  # paged state lives in CUDA managed memory, outside the caching allocator
        managed_uids = result.paged
        managed = sum(e.nbytes for e in events if e.uid in managed_uids and e.nbytes > 0 and e.op >= -1)
        events = [e for e in events if e.uid not in managed_uids]
        notes.append(f"paged optimizer state ({managed} bytes: state1 and state2 of the parameters of "
                     f"{PAGED_MIN_NUMEL:,} elements or more, as bitsandbytes pages them) is in CUDA managed memory, "
                     "outside peak_bytes; the rest of the optimizer state is in the allocator" if managed else
                     f"the paged optimizer pages nothing here: no parameter has {PAGED_MIN_NUMEL:,} elements or "
                     "more, so bitsandbytes keeps all its state in the allocator")
    if target.type == "cuda":  # per rank: a temporaries-category event, which sharding leaves whole
        events, note = add_workspaces(events, gpu_info)
        notes.append(note)
    unsharded = None
    whole = events  # the model as one device holds it, before a sharding rescales it
    others = None  # the other ranks' events, where a save under DeepSpeed makes rank 0's differ
    if sharding is not None:
        unsharded = summarize_events(round_events(events) if target.type == "cuda" else events, categories)[0]
        terms, terms_notes = deepspeed_terms(model, sharding, ds, precision, shard_ranks, offload)
        events, categories, note = shard_events(events, categories, model, world_size=shard_ranks, sharding=sharding,
                                                dtype=float_dtype_for(precision), **offload, **terms,
                                                gradient_as_bucket_view=gradient_as_bucket_view)
        notes.extend([note, *terms_notes])
        saved = None if run.checkpoint is None else deepspeed_save(
            model, sharding, ds, precision, shard_ranks, state_dict=run.checkpoint.state_dict,
            host_is_device=target.type == "cpu")
        if saved is not None:  # DeepSpeed's own save: counted from its source after the rescaled steps
            notes.append(saved.note())
            if saved.rank0 != saved.others and world_size > 1:
                others = deepspeed_save_events(events, categories, saved, terms["zero3"], rank0=False)[0]
            events, categories = deepspeed_save_events(events, categories, saved, terms["zero3"], rank0=True)
    reserved = total = allocated = None
    if target.type == "cuda":
        events = round_events(events)
        others = None if others is None else round_events(others)
    nccl = nccl_term(gpu_info, world_size, sharding) if target.type == "cuda" else None
    events, saving = _saving(events, categories, saves=run.checkpoint is not None, target=target, gpu_info=gpu_info,
                             allocator=allocator, nccl=nccl, notes=notes)
    if others is not None and saving is not None:  # rank 0 keeps what it gathers, the others what rank 0 does not
        other = _saving(others, categories, saves=True, target=target, gpu_info=gpu_info, allocator=allocator,
                        nccl=nccl, notes=notes)[1]
        saving = dataclasses.replace(saving, per_rank_peak_bytes=(saving.peak_bytes,) + (other.peak_bytes,) * (
            world_size - 1), peak_rank=0)
    loading = None
    if options["loading"] is not None:
        loading, note = _counted_loading(options["loading"], events,
                                         round_events(whole) if target.type == "cuda" else whole, categories,
                                         sharding=sharding, target=target, gpu_info=gpu_info, allocator=allocator,
                                         nccl=nccl)
        notes.append(note)
    if target.type == "cuda":
        terms = cuda_terms(events, gpu_info, allocator, nccl)
        reserved, total = terms.peak_reserved_bytes, terms.device_total_bytes
        allocated = terms.peak_allocated_bytes
        notes.extend(terms.notes)
    peak, breakdown, phase, timeline = summarize_events(events, categories)
    return Estimate(
        peak_bytes=peak,
        breakdown=breakdown,
        peak_phase=phase,
        device=str(target),
        coverage=_traced_coverage(result, calibrator.skipped, calibrator.calibrated, notes),
        timeline=timeline,
        steps=steps,
        trace_seconds=result.seconds,
        num_ops=result.num_ops,
        managed_bytes=managed,
        peak_reserved_bytes=reserved,
        peak_allocated_bytes=allocated,
        device_total_bytes=total,
        gpu=None if gpu_info is None else gpu_info.name,
        world_size=world_size,
        sharding=sharding,
        unsharded_peak_bytes=unsharded,
        events=tuple(events),
        categories=categories,
        phases=tuple(p for p in (loading, saving) if p is not None),
        outside_parameter_bytes=result.outside_bytes,
    )


def _own_share(est: Estimate, model: nn.Module) -> Estimate:
    """A lower bound counted over whole tensors (`_fallback`) cut to the share of them this rank holds: its
    parameters, gradients and optimizer state scaled by the bytes of its parameters' local shards (a DTensor's
    ``_local_tensor``, laid out by tensor parallelism or sharded by FSDP2) over their whole bytes; nothing added
    (a sharded engine's gathered units are not counted: a lower bound)."""
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    local = sum(getattr(p, "_local_tensor", p).numel() * p.element_size() for p in model.parameters())
    if not whole or local == whole:
        return est
    breakdown = dict(est.breakdown)
    for key in ("parameters", "gradients", "optimizer_state"):
        breakdown[key] = breakdown.get(key, 0) * local // whole
    return dataclasses.replace(est, breakdown=breakdown, peak_bytes=sum(breakdown.values()))


def _counted_loading(loading: Loading, events: Sequence[Event], whole: Sequence[Event],
                     categories: dict[int, Category], *, sharding: str | None, target: torch.device,
                     gpu_info: GPU | None, allocator: AllocatorConfig | None,
                     nccl: tuple[int, str] | None) -> tuple[PhaseEstimate, str]:
    """The loading phase where no engine's wrapping is traced (one device, DDP, ZeRO and the rescaled FSDP plans),
    and its note: the parameters and buffers alive before the steps, as the rank holds them (``events``: a
    ``"meta"`` loading materialises only the rank's partitions) or, where the model comes whole to the device,
    as one device holds them (``whole``: the events before a sharding rescaled them)."""
    partitioned = sharding is not None and _resident_bytes(events, categories) < _resident_bytes(whole, categories)
    if loading.placement == "meta" or not partitioned:
        phase = _resident_phase(events, categories, how="counted", target=target, gpu_info=gpu_info,
                                allocator=allocator, nccl=nccl)
        return phase, (f"loading ({loading.placement}): the parameters and buffers the rank holds before its first "
                       "step, each counted as it comes to the device (reading the checkpoint, a conversion from its "
                       "dtype and a broadcast from rank 0 are not traced: `preflight._loading`)")
    phase = _resident_phase(whole, categories, how="counted (upper bound)" if loading.placement == "host" else
                            "counted", target=target, gpu_info=gpu_info, allocator=allocator, nccl=nccl)
    return phase, (f"loading ({loading.placement}): every rank holds the whole model ({phase.peak_bytes:,} B of "
                   f"parameters and buffers) before {sharding} partitions it; its partitioning is not traced here"
                   + ("; the engine moving it from the host unit by unit holds less (an upper bound)"
                      if loading.placement == "host" else ""))


def _resident_bytes(events: Sequence[Event], categories: dict[int, Category]) -> int:
    """The bytes of the parameters and buffers alive before the steps (registered, op -1) in ``events``."""
    return sum(e.nbytes for e in _resident(events, categories))


def _resident(events: Sequence[Event], categories: dict[int, Category]) -> list[Event]:
    return [e for e in events if e.op < 0 and e.nbytes > 0 and
            categories.get(e.uid) in (Category.PARAMETERS, Category.BUFFERS)]


def _resident_phase(events: Sequence[Event], categories: dict[int, Category], *, how: str, target: torch.device,
                    gpu_info: GPU | None, allocator: AllocatorConfig | None,
                    nccl: tuple[int, str] | None) -> PhaseEstimate:
    """A loading phase of the parameters and buffers alive before the steps in ``events``."""
    return _loading_phase(_resident(events, categories), categories, how=how, target=target, gpu_info=gpu_info,
                          allocator=allocator, nccl=nccl)


def _loading_phase(events: Sequence[Event], categories: dict[int, Category], *, how: str, target: torch.device,
                   gpu_info: GPU | None, allocator: AllocatorConfig | None,
                   nccl: tuple[int, str] | None) -> PhaseEstimate:
    """The `PhaseEstimate` ``"loading"`` of ``events`` (a loading trace's, or the resident state's), with the device
    total on a CUDA target."""
    peak, breakdown, _, _ = summarize_events(events, categories)
    total = cuda_terms(events, gpu_info, allocator, nccl).device_total_bytes if target.type == "cuda" else None
    return PhaseEstimate("loading", peak, breakdown, LOAD_PHASE, device_total_bytes=total, how=how)


def _saving(events: Sequence[Event], categories: dict[int, Category], *, saves: bool, target: torch.device,
            gpu_info: GPU | None, allocator: AllocatorConfig | None, nccl: tuple[int, str] | None = None,
            notes: Sequence[str] = ()) -> tuple[list[Event], PhaseEstimate | None]:
    """``events`` split at a checkpoint save traced after the steps (the phase `SAVE_PHASE`; ``saves``: the run
    saves): the training step's events alone, and the save's `PhaseEstimate` (its peak with everything alive at the
    time, and on a CUDA target the reserved memory while it runs, which keeps what training reserved), or None
    without a save. ``notes``: the trace's, which say when the save could not be traced (then its figure is a
    labelled lower bound: the training state the steps leave)."""
    if not saves:
        return list(events), None
    # A save that allocates nothing (one device: the state dicts are views) leaves no event of its own.
    start = next((i for i, e in enumerate(events) if e.phase == SAVE_PHASE), len(events))
    peak, breakdown, _, _ = summarize_events(events, categories, start=start)
    total = None
    if target.type == "cuda":
        total = cuda_terms(events, gpu_info, allocator, nccl).device_total_bytes
    how = "labelled lower bound" if any(n.startswith(SAVE_NOT_TRACED) for n in notes) else "traced"
    return list(events[:start]), PhaseEstimate("saving", peak, breakdown, SAVE_PHASE, device_total_bytes=total,
                                               how=how)


def _evaluating(events: Sequence[Event], categories: dict[int, Category], *, evaluates: bool, target: torch.device,
                gpu_info: GPU | None, allocator: AllocatorConfig | None, nccl: tuple[int, str] | None,
                failed: bool) -> PhaseEstimate | None:
    """The `PhaseEstimate` of an evaluation traced after the steps (the phase `EVAL_PHASE`, up to a save after it):
    its peak with the training state the steps left alive, and on a CUDA target the device total while it runs
    (the allocator keeps what training reserved). None where the run does not evaluate, or where the trace or the
    evaluation stopped before it ended (`EVAL_NOT_TRACED`: no figure rather than a partial one)."""
    start = next((i for i, e in enumerate(events) if e.phase == EVAL_PHASE), None)
    if not evaluates or failed or start is None:
        return None
    end = next((i for i, e in enumerate(events) if i > start and e.phase == SAVE_PHASE), len(events))
    window = list(events[:end])
    peak, breakdown, _, _ = summarize_events(window, categories, start=start)
    total = cuda_terms(window, gpu_info, allocator, nccl).device_total_bytes if target.type == "cuda" else None
    return PhaseEstimate("evaluation", peak, breakdown, EVAL_PHASE, device_total_bytes=total)


def read_plan_off_ddp(model: nn.Module, run: Run) -> tuple[nn.Module, Run, str | None]:
    """For a ``DistributedDataParallel`` model: the module it wraps, ``run`` with the wrapper's plan as its parallel
    section, and a note; any other model comes back as it is. A plan in ``run`` that contradicts the wrapper (another
    world size or a sharding other than DDP) is a ValueError naming both."""
    ddp = read_ddp(model)
    if ddp is None:
        return model, run, None
    module, plan = ddp
    given = run.parallel
    if given is not None and (given.world_size != plan.world_size or given.sharding not in (None, "ddp")):
        raise ValueError(f"The model is wrapped in DistributedDataParallel over {plan.world_size} rank(s), but "
                         f"`run.parallel` says {given.sharding!r} over {given.world_size}: leave `run.parallel` out "
                         "(the wrapper is the plan), or pass the module it wraps (`model.module`).")
    if given is not None:  # the wrapper's own option, whatever the run said
        plan = dataclasses.replace(given, sharding="ddp", gradient_as_bucket_view=plan.gradient_as_bucket_view)
    return module, run.replace(parallel=plan), f"per-rank plan read from the model's DistributedDataParallel: " \
        f"ddp over {plan.world_size} rank(s)" + (", gradients as bucket views" if plan.gradient_as_bucket_view else "")


def _wrapped_plan(wrapped: WrappedFSDP2 | WrappedFSDP1, world_size: int, sharding: str | None, fsdp: Any,
                  offload: dict[str, bool]) -> tuple[int, str, FSDP2Plan | FSDP1Plan]:
    """The plan of a model ``fully_shard`` or ``FullyShardedDataParallel`` already wrapped; a ValueError where the
    arguments say otherwise."""
    fsdp2 = isinstance(wrapped, WrappedFSDP2)
    own, engine = ("fsdp2", "fully_shard") if fsdp2 else (wrapped.sharding, "FullyShardedDataParallel")
    said = []
    if world_size not in (1, wrapped.world_size):
        said.append(f"world_size={world_size}")
    if sharding not in (None, own):
        said.append(f"sharding={sharding!r}")
    if fsdp is not None and fsdp != wrapped.plan:
        said.append(f"fsdp={fsdp!r}")
    said.extend(f"{name}=True" for name, on in offload.items() if on)
    if said:
        raise ValueError(f"The model is already wrapped by {engine} over {wrapped.world_size} rank(s), so its plan "
                         f"is read from it ({own}, {wrapped.plan!r}), but {', '.join(said)} says otherwise. Drop "
                         "those arguments, or call preflight before wrapping.")
    return wrapped.world_size, own, wrapped.plan


def check_plan(world_size: int, sharding: str | None, *, offload_optimizer: bool = False,
               offload_params: bool = False) -> str | None:
    """The sharding a plan uses (offloading alone implies ZeRO), or a ValueError for a combination that does not
    exist (``offload_params`` with ZeRO-1, an unknown sharding, ``world_size < 1``); checked before any trace."""
    sharding = check_sharding(world_size, sharding)
    offload = {"offload_optimizer": offload_optimizer, "offload_params": offload_params}
    if any(offload.values()) and world_size == 1 and sharding is None:
        sharding = "zero3" if offload_params else "zero2"  # offloading is a ZeRO / FSDP feature
    if sharding is not None:
        shard_breakdown({k.value: 0 for k in Category}, world_size=world_size, sharding=sharding, **offload)
    return sharding


# FSDP1 rank groups traced at most (the ranks' distinct shard cuts); beyond, only the rank holding the most is
# traced, and its figure bounds the others'.
_MAX_RANK_TRACES = 4
# The FSDP1 sharding strategy each per-rank sharding name traces (`preflight.parallel.FSDP1Plan`), and its hybrid one.
_FSDP1_STRATEGIES = {"fsdp-full": "FULL_SHARD", "fsdp-grad-op": "SHARD_GRAD_OP"}
_FSDP1_HYBRID = {"fsdp-full": "HYBRID_SHARD", "fsdp-grad-op": "_HYBRID_SHARD_ZERO2"}


def fsdp_trace_plan(fsdp: Any, sharding: str | None) -> FSDP1Plan | FSDP2Plan | None:
    """The plan the per-rank trace of ``sharding`` follows (``fsdp``, or the engine's defaults), or None where the
    sharding is not traced per rank; a ValueError for a plan of the other engine."""
    if fsdp is not None and not isinstance(fsdp, (FSDP1Plan, FSDP2Plan)):
        raise TypeError("`fsdp` should be a preflight.parallel.FSDP2Plan (fully_shard) or FSDP1Plan "
                        f"(FullyShardedDataParallel) or None, got {type(fsdp).__name__}.")
    if sharding == "fsdp2":
        if isinstance(fsdp, FSDP1Plan):
            raise ValueError("`fsdp` is an FSDP1Plan (FullyShardedDataParallel), but `sharding` is 'fsdp2' "
                             "(fully_shard): pass sharding='fsdp-full' or 'fsdp-grad-op', or an FSDP2Plan.")
        return fsdp or FSDP2Plan()
    if sharding in _FSDP1_STRATEGIES:
        if isinstance(fsdp, FSDP2Plan):
            raise ValueError(f"`fsdp` is an FSDP2Plan (fully_shard), but `sharding` is {sharding!r} "
                             "(FullyShardedDataParallel): pass sharding='fsdp2', or an FSDP1Plan.")
        plan = fsdp or FSDP1Plan()
        strategy = (_FSDP1_HYBRID if plan.hybrid else _FSDP1_STRATEGIES)[sharding]
        if plan.sharding_strategy not in (None, strategy):
            raise ValueError(f"`fsdp` says sharding_strategy={plan.sharding_strategy!r}, but `sharding` is "
                             f"{sharding!r} ({strategy}): leave the plan's strategy to `sharding`, or make them "
                             "agree.")
        return dataclasses.replace(plan, sharding_strategy=strategy)
    if fsdp is not None:
        raise ValueError(f"`fsdp` says how FSDP wraps the model, but `sharding` is {sharding!r}: pass "
                         "sharding='fsdp2', 'fsdp-full' or 'fsdp-grad-op'.")
    return None


def _trace_ranks(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, world_size: int,
                 plan: FSDP1Plan | FSDP2Plan, sharding: str, offload: dict[str, bool], options: dict[str, Any], *,
                 fast: bool, wrapped: bool = False,
                 through_root: bool = False) -> tuple[list[tuple[list[int], Any]] | None, str]:
    """Each distinct rank's sharded trace as ``[(ranks, TraceResult), ...]`` and a note, or None and the reason the
    caller rescales a single-device trace instead. ``wrapped``: the plan was read off the model (its units are
    its own, named without the wrappers' prefixes); ``through_root``: FSDP1's steps run through the root wrapper's
    forward (`preflight.parallel._fsdp1.through_root_step`)."""
    fsdp1 = isinstance(plan, FSDP1Plan)
    engine = f"FullyShardedDataParallel({plan.sharding_strategy})" if fsdp1 else "fully_shard"
    shard = plan.shard_size(world_size)
    hybrid = shard != world_size or getattr(plan, "hybrid", False)
    rescaled = f"rescaled as {'fsdp-full' if sharding == 'fsdp2' else sharding} from a single-device trace" + (
        f" over the {shard} ranks of one shard group (the all-reduce across groups not counted)" if hybrid else "")
    if not fsdp1 and (any(offload.values()) or getattr(optimizer, "is_paged", False)):
        failure = library_optimizer_over_dtensors(optimizer, engine)  # the trace that would say so is not run
        if failure is not None:
            raise StepWouldFailError(failure)
    if any(offload.values()):
        return None, f"{sharding}: CPU offload is not traced per rank yet; {rescaled}"
    if getattr(optimizer, "is_paged", False):
        return None, f"{sharding}: paged optimizers are not traced per rank; {rescaled}"
    cuda = options["cuda"]
    if cuda is None and options["target_device"].type == "cuda":
        cuda = CudaTarget.of(None)
    for name in () if wrapped else plan.units or ():
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"`fsdp.units` names {name!r}, which is not a submodule of the model. Use names from "
                             "`model.named_modules()`, e.g. 'model.layers.0'.") from None
    trace = trace_fsdp1 if fsdp1 else trace_fsdp2
    traced: list[tuple[list[int], Any]] = []
    bounded = None
    try:
        block = 512 if options["target_device"].type == "cuda" else 1  # the CUDA allocator's rounding
        groups = _rank_zero_alone(fsdp1_rank_groups(model, plan, world_size, block=block) if fsdp1
                                  else rank_groups(model, world_size, plan.replicate), options)
    except ProcessGroupInUseError as err:
        return None, f"{sharding}: {err}; {rescaled}"
    except Exception as err:  # noqa: BLE001 - FSDP1 could not wrap the copy to read the ranks' shards
        reason = f"{type(err).__name__}: {err}".splitlines()[0][:200]
        return None, f"{sharding}: {engine} could not wrap the model ({reason}); {rescaled}"
    try:
        if fsdp1 and len(groups) > _MAX_RANK_TRACES:
            # Many ways to cut the parameters into shards (a large world): the rank that holds the most is traced,
            # and each other rank, holding less of the same program, gets its figure as an upper bound.
            most = groups[0][0]
            bounded = (f"rank {most} traced (it holds the most); {world_size - len(groups[0])} rank(s) cut their "
                       f"shards {len(groups) - 1} other ways and hold less: they get rank {most}'s figure as an "
                       "upper bound")
            groups = _rank_zero_alone([[most] + [rank for rank in range(world_size) if rank != most]], options)
        for group in groups:
            result = trace(model, optimizer, batch, world_size=world_size, rank=group[0], plan=plan,
                           step=options["step"], precision=options["precision"], steps=options["steps"],
                           schedule=options["schedule"], record_op=options["record_op"], routing=options["routing"],
                           cuda=cuda, checkpoint=options["checkpoint"], loading=options["loading"],
                           **({"through_root": True} if through_root else {}))
            if result.error is not None:
                reason = f"{type(result.error).__name__}: {result.error}".splitlines()[0][:200]
                return None, f"{sharding}: the sharded trace of rank {group[0]} stopped at {result.failed_op} " \
                             f"({reason}); {rescaled}"
            traced.append((group, result))
    except ProcessGroupInUseError as err:
        return None, f"{sharding}: {err}; {rescaled}"
    if bounded:
        shared = bounded
    elif len(groups) == 1:
        shared = f"every rank holds equally padded shards of the same shapes: one trace stands for all {world_size}"
    else:
        shared = "ranks with equal shard shapes share a trace: " + "; ".join(_ranks_text(g) for g in groups)
    if getattr(plan, "unit_types", None):
        wrapped = "every " + ", ".join(t.__name__ for t in plan.unit_types)
    elif plan.units is not None:
        wrapped = f"{len(plan.units)} unit(s)"
    else:
        wrapped = "each entry of the largest nn.ModuleList"
    world = (f"a fake 2-D mesh of {world_size // shard} x {shard} ranks (hybrid sharding: each rank's shards cut "
             f"among the {shard} ranks of its shard group, its gradient shards all-reduced across the "
             f"{world_size // shard} group(s))" if hybrid else f"a fake process group of {world_size} ranks")
    note = f"{sharding}: each rank's step traced through {engine} ({wrapped}, then the root) under {world}; {shared}"
    if not fsdp1 and options["precision"] in ("bf16-mixed", "16-mixed") and plan.param_dtype is None:
        note += (f"; under autocast ({options['precision']}) each parameter fully_shard gathers is cast, and "
                 "autocast's cache keeps the cast (of a leaf that requires grad) until the forward ends, so every "
                 "unit's cast parameters are alive together: MixedPrecisionPolicy(param_dtype=...) casts them as "
                 "FSDP2 gathers them and frees them at each reshard (preflight.advise traces it)")
    if fast:
        note += "; fast=True does not apply to the sharded trace (traced in full)"
    return traced, note


def _tp_estimate(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, tp: TPPlan | WrappedTP,
                 fsdp: FSDP2Plan | None, world_size: int, options: dict[str, Any], *, fast: bool, gpu_info: GPU,
                 allocator: AllocatorConfig | None, evaluation: Evaluation | None = None) -> Estimate:
    """Each distinct rank of a tensor-parallel run (with FSDP2 over the data-parallel dim where ``fsdp``) traced
    through ``parallelize_module`` (`preflight.parallel.trace_tp`); the estimate of the rank that peaks highest. Where
    a rank cannot be traced, the analytic lower bound with everything divided among the ranks, labelled. ``tp``: a
    plan, or the layout of a model already parallelized (`preflight.parallel.read_tp`); ``evaluation``: traced on
    each rank after the steps (the phase ``"evaluation"``)."""
    target, traced_as = options["target_device"], _rank_options(options)
    read = isinstance(tp, WrappedTP)
    shape, names = tp.mesh if read else tp_mesh(tp, world_size, fsdp)
    mesh = " x ".join(f"{n} {d}" for d, n in zip(shape, names)) if names else " x ".join(map(str, shape))
    over = " over replicate x shard (HSDP)" if fsdp is not None and fsdp.replicate > 1 else " over dp"
    engine = ("the model's own DTensor layout and hooks" if read else "parallelize_module") + (
        f" then fully_shard{over}" if fsdp is not None else "")
    if read:  # the ranks of the mesh dims FSDP2 does not shard over
        sizes = dict(zip(names or (), shape))
        degree = world_size // math.prod(sizes[d] for d in tp.fsdp_dims or ())
    else:
        degree = tp.degree
    # One word per mesh dim (NCCL makes a communicator for each: `preflight.cuda._nccl.rank_nccl_buffers`).
    replicate = 1 if fsdp is None else fsdp.replicate
    sharding = f"tp{degree}" + (" x fsdp2" if fsdp is not None else "") + (
        f" x replicate{replicate}" if replicate > 1 else "")
    # A ValueError where neither the plan nor the model has styles.
    skipped = [] if read else unmatched_styles(model, tp)
    def trace(rank: int) -> TraceResult:
        return trace_tp(model, optimizer, batch, world_size=world_size, rank=rank, plan=tp, fsdp=fsdp,
                        evaluation=evaluation, **traced_as)

    groups, traced, failed = _traced_groups(
        lambda: _rank_zero_alone(tp_rank_groups(model, tp, world_size, fsdp), options), trace, engine)
    if failed is not None:
        return _divided_lower_bound(model, optimizer, batch, options, failed, gpu_info=gpu_info,
                                    world_size=world_size, sharding=sharding,
                                    note=f"tensor parallelism ({mesh}): the rank could not be traced")
    shared = (f"ranks with equal local shapes share a trace: {'; '.join(_ranks_text(g) for g in groups)}"
              if len(groups) > 1 else f"every rank holds parameters of the same local shapes: one trace stands for "
              f"all {world_size}")
    note = f"tensor parallelism: each rank's step traced through {engine} under a fake {mesh} mesh; {shared}"
    if read:
        note = f"{tp.note()}; {note}"
    sequence = uses_sequence_parallel(model, tp)
    formula = closed_form_activations(model, batch, degree, sequence)
    if formula is not None:  # the hand estimate, beside the traced `activations` category
        note += (f"; the closed form users compute by hand (Korthikanti et al. 2022, "
                 f"{'sequence' if sequence else 'tensor'} parallelism, GPT layers in 16-bit with dropout, nothing "
                 f"outside the layers) gives {format_bytes(formula)} of activations, where the trace holds this "
                 "model's layers in their dtypes, the logits and the loss as they run")
    if skipped:
        note += (f"; plan entr{'ies' if len(skipped) > 1 else 'y'} {', '.join(map(repr, skipped[:3]))} match no "
                 "module and were skipped, as parallelize_module skips them")
    if fast:
        note += "; fast=True does not apply to the per-rank trace (traced in full)"
    return _per_rank_estimate(traced, note, target=target, trace_device=options["trace_device"], gpu_info=gpu_info,
                              allocator=allocator, steps=options["steps"], world_size=world_size, sharding=sharding,
                              saves=options["checkpoint"] is not None, evaluates=evaluation is not None,
                              loading=options["loading"])


def _pp_estimate(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, pp: PPPlan,
                 fsdp: FSDP2Plan | None, world_size: int, options: dict[str, Any], *, fast: bool, gpu_info: GPU,
                 allocator: AllocatorConfig | None, tp: TPPlan | None = None,
                 cp: CPPlan | None = None) -> Estimate:
    """Each rank of a pipeline-parallel run (with FSDP2 over the data-parallel dim where ``fsdp``, each stage laid out
    by tensor parallelism where ``tp``, the steps inside a ring where ``cp``) traced through torch's own stages and
    schedule
    (`preflight.parallel.trace_pp`); the estimate of the rank that peaks highest. Where a rank cannot be traced, the
    analytic lower bound with the model's state divided among the ranks, labelled."""
    if options["step"] is not None:
        raise ValueError("under pipeline parallelism the schedule runs the step (each stage's forward and backward, "
                         "the last stage's loss from the plan's `loss_fn`): leave `step` out")
    target, traced_as = options["target_device"], _rank_options(options)
    degree, ring = (1 if tp is None else tp.degree), (1 if cp is None else cp.degree)
    world_size = pp.stages * degree * ring if fsdp is None else world_size
    dp = world_size // (pp.stages * degree * ring)
    sharding = (f"pp{pp.stages}" + (f" x cp{ring}" if cp is not None else "") + (f" x tp{degree}" if tp else "")
                + (f" x fsdp2 {dp}" if fsdp is not None else ""))
    skipped = [] if tp is None else unmatched_styles(model, tp)  # a ValueError where no styles are given or known

    shared: dict[str, Any] = {}  # the stages' metadata, inferred once for all the ranks

    def trace(rank: int) -> TraceResult:
        return trace_pp(model, optimizer, batch, rank=rank, plan=pp, fsdp=fsdp, world_size=world_size, tp=tp,
                        cp=cp, shared=shared, **traced_as)

    groups, traced, failed = _traced_groups(
        lambda: _rank_zero_alone(stage_rank_groups(model, pp, fsdp, world_size, tp, cp), options), trace,
        "torch.distributed.pipelining")
    if failed is not None:
        return _divided_lower_bound(model, optimizer, batch, options, failed, gpu_info=gpu_info,
                                    world_size=world_size, sharding=sharding,
                                    note=f"pipeline parallelism ({pp.label}): a rank could not be traced")
    dims = [f"pp {pp.stages}"] + ([f"dp {dp}"] if fsdp is not None else []) + ([f"cp {ring}"] if cp else []) + (
        [f"tp {degree}"] if tp else [])
    laid = (", each stage laid out by parallelize_module over the tp dim (the plan's modules the stage holds)"
            if tp is not None else "")
    wrapped = (f", each stage wrapped by fully_shard over the {dp * ring} data-parallel" +
               (" and ring" if cp is not None else "") + " rank(s)" if fsdp is not None else "")
    if cp is not None:
        wrapped += (f", the steps inside torch's context_parallel over the cp dim ({cp.label}), the batch's sequence "
                    "cut in place before the first stage cuts it into micro-batches")
    mesh = f" of a fake ({' x '.join(dims)}) mesh" if len(dims) > 1 else ""
    shared_note = (f"; ranks with equal local shapes share a trace: {'; '.join(_ranks_text(g) for g in groups)}"
                   if len(dims) > 1 else "")
    note = (f"pipeline parallelism ({pp.label}): each rank's two steps traced through torch's own PipelineStage "
            f"and schedule under a fake process group, the micro-batches in flight as the schedule keeps them"
            f"{laid}{wrapped}{mesh}{shared_note}; the shapes neighbouring stages exchange come from torch's metadata "
            "inference over all stages" + (" laid out as tensor-parallel rank 0" if tp is not None else "")
            + "; the batch (inputs, target) is held by every rank")
    note += _pp_closed_form(model, batch, pp, degree, ring, tp)
    if skipped:
        note += (f"; plan entr{'ies' if len(skipped) > 1 else 'y'} {', '.join(map(repr, skipped[:3]))} match no "
                 "module and were skipped, as parallelize_module skips them")
    if fast:
        note += "; fast=True does not apply to the per-rank trace (traced in full)"
    return _per_rank_estimate(traced, note, target=target, trace_device=options["trace_device"], gpu_info=gpu_info,
                              allocator=allocator, steps=options["steps"], world_size=world_size,
                              sharding=sharding, saves=options["checkpoint"] is not None, loading=options["loading"])


def _pp_job_estimate(job: JobPipeline, optimizer: torch.optim.Optimizer, batch: Any, options: dict[str, Any], *,
                     fast: bool, gpu_info: GPU, allocator: AllocatorConfig | None) -> Estimate:
    """This process's rank of a pipeline read off its job (`preflight.parallel._pipeline.read_pp`): the shapes its
    neighbours send inferred over the job's ranks as torch's first step infers them, then its own stages traced
    (`trace_pp_in_job`). Every rank's peak is gathered over the pipeline's group into ``per_rank_peak_bytes``;
    ``peak_bytes``, ``breakdown`` and ``events`` are this rank's own (each process holds only its own stages).
    Every rank makes the same exchanges whatever happens on it, so none is left waiting: a rank whose own code
    raises re-raises after the last one, and a rank that cannot be traced gives the labelled lower bound of its
    own stages."""
    if options["step"] is not None:
        raise ValueError("under pipeline parallelism the schedule runs the step (each stage's forward and backward, "
                         "the last stage's loss from the schedule's `loss_fn`): leave `step` out")
    target, traced_as = options["target_device"], _rank_options(options)
    ranks, me = job.world_size, job.global_rank
    sharding = (f"pp{job.plan.stages}" + (f" x tp{job.tp}" if job.layout is not None else "")
                + (f" x fsdp2 {job.dp}" if job.fsdp is not None else ""))
    note = (f"{job.note()}; the shapes neighbouring stages exchange inferred over the job's ranks by torch's own "
            "metadata inference; each rank's two steps traced through torch's own PipelineStage and schedule under a "
            f"fake process group of {ranks} ranks, the micro-batches in flight as the schedule keeps them; each "
            f"rank traces its own stages: peak_bytes, breakdown and events are rank {me}'s, every rank's peak is "
            "gathered from the ranks; the batch (inputs, target) is held by every rank")
    if fast:
        note += "; fast=True does not apply to the per-rank trace (traced in full)"
    raised: BaseException | None = None
    est = failure = None
    try:
        stage_metas = job_stage_metas(job, batch, options["precision"])
    except (StageMetasError, ImportError, AttributeError) as err:  # on every rank alike (`job_stage_metas`)
        failure = TraceResult(events=[], categories={}, num_ops=0, seconds=0.0, error=err,
                              failed_op="torch's metadata inference over the job's stages")
    except BaseException as err:  # noqa: BLE001 - this rank's user's own error: raised after the last exchange
        raised = err
    if failure is None and raised is None:
        try:
            result = trace_pp_in_job(job, optimizer, batch, stage_metas=stage_metas, **traced_as)
            if result.error is None:
                est = _per_rank_estimate([([me], result)], note, target=target,
                                         trace_device=options["trace_device"], gpu_info=gpu_info, allocator=allocator,
                                         steps=options["steps"], world_size=ranks, sharding=sharding,
                                         saves=options["checkpoint"] is not None)
            failure = result
        except BaseException as err:  # noqa: BLE001 - raised after the ranks' last exchange, below
            raised = err
    if est is None and raised is None:  # this rank's own stages hold at least their state (their shards)
        try:
            est = _own_share(_fallback(
                job.modules, optimizer, batch, target, options["precision"], options["steps"], failure,
                [f"{job.note()}; this rank could not be traced: the lower bound of its own stages (their local "
                 "shards' share of the parameters, gradients and optimizer state)"],
                gpu=gpu_info, world_size=1, shard_ranks=1, sharding=None,
                offload={"offload_optimizer": False, "offload_params": False}, ds=None), job.modules)
        except BaseException as err:  # noqa: BLE001 - raised after the ranks' last exchange, below
            raised = err
    mine = None if est is None else (est.peak_bytes, {**est.breakdown, "phase": est.peak_phase},
                                     est.coverage.lower_bound)
    gathered = gather_over(job, mine, world=True)
    if raised is not None:
        raise raised
    assert est is not None
    missing = [rank for rank, figure in enumerate(gathered) if figure is None]
    bounded = [rank for rank, figure in enumerate(gathered) if figure is not None and figure[2] and rank != me]
    per_rank = tuple(0 if figure is None else figure[0] for figure in gathered)
    events = [()] * ranks
    events[me] = tuple(est.events)
    notes = est.coverage.notes
    if missing:
        notes = (*notes, f"rank(s) {_ranks_text(missing)} raised in their own step: counted as 0 here")
    if bounded:
        notes = (*notes, f"rank(s) {_ranks_text(bounded)} could not be traced: their figures are lower bounds")
    return dataclasses.replace(
        est, world_size=ranks, sharding=sharding, per_rank_peak_bytes=per_rank,
        per_rank_breakdown=tuple({} if figure is None else figure[1] for figure in gathered),
        peak_rank=per_rank.index(max(per_rank)), rank_events=tuple(events),
        coverage=dataclasses.replace(est.coverage, notes=notes))


def _ep_estimate(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, layout: EPLayout,
                 options: dict[str, Any], *, fast: bool, gpu_info: GPU, allocator: AllocatorConfig | None,
                 laid_out: bool = False, evaluation: Evaluation | None = None) -> Estimate:
    """Each place on the ``ep`` dim of transformers' expert parallelism traced through its own layout and token
    exchange (`preflight.parallel.trace_ep`), its dense layers laid out by its tensor parallelism where
    ``layout.tp`` > 1, in each of ``layout.replicate`` replicas; the estimate of the rank that peaks highest. Where a
    rank cannot be traced, the analytic lower bound with the model's state divided among the ranks, labelled.
    ``evaluation``: traced on each rank after the steps (the phase ``"evaluation"``)."""
    target, traced_as = options["target_device"], _rank_options(options)
    ep, world_size, tp, replicate = layout
    sharding = f"ep{ep.degree}" + (f" x tp{tp}" if tp > 1 else "") + " x fsdp2" + (
        f" x replicate{replicate}" if replicate > 1 else "")

    def trace(rank: int) -> TraceResult:
        return trace_ep(model, optimizer, batch, layout=layout, rank=rank, laid_out=laid_out, evaluation=evaluation,
                        **traced_as)

    check_ep_model(model, ep)  # a ValueError naming a model transformers cannot lay out: the plan is wrong
    groups, traced, failed = _traced_groups(
        lambda: _rank_zero_alone(ep_rank_groups(ep, world_size), options), trace,
        "transformers' expert parallelism")
    if failed is not None:
        return _divided_lower_bound(model, optimizer, batch, options, failed, gpu_info=gpu_info,
                                    world_size=world_size, sharding=sharding,
                                    note=f"expert parallelism ({ep.label}): a rank could not be traced")
    config = layout.config()
    note = ("the model was already laid out by transformers' expert parallelism in this job: its plan was read "
            "from its config and each rank traced on a fake copy laid out again; " if laid_out else "")
    replicas = f"replicate {replicate} x " if replicate > 1 else ""
    dense = f"{replicas}fsdp {config.fsdp_size}" + (f" x tp {tp}, the model's own tp plan" if tp > 1 else "")
    note += (f"expert parallelism ({ep.label}): each place on the ep dim traced through transformers' own "
            f"maybe_distribute_model over fake meshes (dense {dense}, experts {replicas}efsdp "
            f"{config.efsdp_size} x ep {ep.degree}) and its token exchange, each rank's tokens routed as "
            f"routing={options['routing']!r} assumes and every rank assumed to route as this one (the counts a rank "
            f"receives from each rank are those it sends to itself); {_sharing(groups)}")
    if fast:
        note += "; fast=True does not apply to the per-rank trace (traced in full)"
    return _per_rank_estimate(traced, note, target=target, trace_device=options["trace_device"], gpu_info=gpu_info,
                              allocator=allocator, steps=options["steps"], world_size=world_size,
                              sharding=sharding, saves=options["checkpoint"] is not None,
                              evaluates=evaluation is not None, loading=options["loading"])


def _cp_estimate(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, cp: CPPlan,
                 fsdp: FSDP2Plan | None, world_size: int, options: dict[str, Any], *, fast: bool, gpu_info: GPU,
                 allocator: AllocatorConfig | None, tp: TPPlan | None = None) -> Estimate:
    """Each place in the ring of a context-parallel run (with FSDP2 over every rank where ``fsdp``, the model laid
    out by tensor parallelism over an innermost dim where ``tp``) traced through torch's ``context_parallel``
    (`preflight.parallel.trace_cp`); the estimate of the rank that peaks highest. Where a rank cannot be traced, the
    analytic lower bound with the model's state divided among the ranks, labelled."""
    target, traced_as = options["target_device"], _rank_options(options)
    shape, names = cp.mesh(world_size, tp)
    mesh = " x ".join(f"{n} {d}" for d, n in zip(shape, names))
    # One process group where the ring is the world (FSDP2 over it too); one more per further mesh dim, and one for
    # the dp and cp dims flattened (`rank_nccl_buffers` counts " x ").
    sharding = f"cp{cp.degree}" + (f" x tp{tp.degree}" if tp is not None else "")
    if fsdp is not None:
        sharding += " x fsdp2" if "dp" in names else " with fsdp2"
    skipped = [] if tp is None else unmatched_styles(model, tp)  # a ValueError where no styles are given or known

    def trace(rank: int) -> TraceResult:
        return trace_cp(model, optimizer, batch, world_size=world_size, rank=rank, plan=cp, fsdp=fsdp, tp=tp,
                        **traced_as)

    groups, traced, failed = _traced_groups(
        lambda: _rank_zero_alone(cp_rank_groups(cp, world_size, model, tp, fsdp), options), trace,
        "context_parallel")
    if failed is not None:
        return _divided_lower_bound(model, optimizer, batch, options, failed, gpu_info=gpu_info,
                                    world_size=world_size, sharding=sharding,
                                    note=f"context parallelism ({cp.label}): a rank could not be traced")
    engine = ("inside fully_shard over every rank, torchtitan's dp_shard_cp" if fsdp is not None else
              "the model replicated on each rank; its gradient all-reduce is in place")
    if tp is not None:
        engine = "the model laid out by parallelize_module over the tp dim, " + (
            "then inside fully_shard over the dp and cp dims" if fsdp is not None else
            "replicated over the ring; its gradient all-reduce is in place")
    kernel = ("the attention kernel the target picks" if traced_as["cuda"] is not None else
              "the CPU's fused attention kernel (torch 2.13 has no ring rule for it; preflight's "
              "cpu_ring_attention adds torch's own ring over it)")
    first, dim = sequence_tensors(batch, cp)[0]
    length = first.shape[dim]
    cut = ("with head-tail load balancing" if length % (2 * cp.degree) == 0 else
           f"in contiguous chunks (torch balances the load only where the sequence, {length}, divides into "
           f"2 x {cp.degree} chunks)")
    note = (f"context parallelism ({cp.label}): each place in the ring traced through torch's context_parallel "
            f"({engine}) under a fake {mesh} mesh, the batch's sequence tensors sharded in place {cut}, attention "
            f"through torch's ring over {kernel}; {_sharing(groups)}")
    formula = closed_form_activations(model, batch, 1 if tp is None else tp.degree, False)
    if formula is not None:
        parallel = "without tensor parallelism" if tp is None else f"with tensor parallelism of degree {tp.degree}"
        note += (f"; the closed form users compute by hand (Korthikanti et al. 2022 {parallel}, "
                 f"divided by the {cp.degree} ranks of the ring as Megatron's report divides it; GPT layers in "
                 f"16-bit with dropout, nothing outside the layers) gives {format_bytes(formula // cp.degree)} of "
                 "activations, where the trace holds this model's layers in their dtypes, the keys and values the "
                 "ring gathers, the logits and the loss as they run")
    if skipped:
        note += (f"; plan entr{'ies' if len(skipped) > 1 else 'y'} {', '.join(map(repr, skipped[:3]))} match no "
                 "module and were skipped, as parallelize_module skips them")
    if fast:
        note += "; fast=True does not apply to the per-rank trace (traced in full)"
    return _per_rank_estimate(traced, note, target=target, trace_device=options["trace_device"], gpu_info=gpu_info,
                              allocator=allocator, steps=options["steps"], world_size=world_size,
                              sharding=sharding, saves=options["checkpoint"] is not None, loading=options["loading"])


def nccl_term(gpu: GPU | None, world_size: int, sharding: str | None) -> tuple[int, str] | None:
    """NCCL's buffers on one rank of a CUDA job (`preflight.cuda._nccl.rank_nccl_buffers`), with the bytes per
    communicator the GPU's target gives, where it gives them."""
    return rank_nccl_buffers(world_size, sharding, None if gpu is None else gpu.nccl_buffers)


def _rank_options(options: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments every per-rank trace takes from the estimate's options; a CUDA target without a known
    GPU is traced with CUDA's semantics all the same."""
    cuda = options["cuda"]
    if cuda is None and options["target_device"].type == "cuda":
        cuda = CudaTarget.of(None)
    return {"step": options["step"], "precision": options["precision"], "steps": options["steps"],
            "schedule": options["schedule"], "record_op": options["record_op"], "routing": options["routing"],
            "cuda": cuda, "checkpoint": options["checkpoint"], "loading": options["loading"]}


def _sharing(groups: list[list[int]]) -> str:
    """Which ranks one trace stands for, for a note: ``each rank traced``, or the groups that share one."""
    if all(len(g) == 1 for g in groups):
        return "each rank traced"
    return f"ranks at the same place share a trace: {'; '.join(_ranks_text(g) for g in groups)}"


def _pp_closed_form(model: nn.Module, batch: Any, pp: PPPlan, degree: int, ring: int, tp: TPPlan | None) -> str:
    """The closed form of the first stage's activations users compute by hand under pipeline parallelism, as a note
    (empty where it does not apply): Megatron's theoretical memory report (``compute_activation_memory``) takes
    Korthikanti et al.'s per-layer activations of one micro-batch (`closed_form_activations`) for the first stage's
    layers times the micro-batches a 1F1B schedule keeps in flight there (as many as stages: the whole model's
    layers), times ``min(1, micro-batches / stages)``, or an interleaved schedule's penalty ``1 + (p - 1) / (p *
    v)`` instead; divided by a ring's ranks as for context parallelism. Other schedules are not in the report."""
    name = pp.schedule_class.__name__
    if name not in ("Schedule1F1B", "ScheduleInterleaved1F1B"):
        return ""
    ids = batch[0] if isinstance(batch, (tuple, list)) and batch else None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        return ""
    micro = ids[:max(1, ids.shape[0] // pp.n_microbatches)]
    sequence = tp is not None and uses_sequence_parallel(model, tp)
    per_micro = closed_form_activations(model, {"input_ids": micro}, degree, sequence)
    if per_micro is None:
        return ""
    p, v = pp.stages, pp.per_rank
    factor = (1 + (p - 1) / (p * v)) if v > 1 else min(1.0, pp.n_microbatches / p)
    formula = int(per_micro * factor) // ring
    parallel = f", tensor parallelism of degree {degree}" if tp else ""
    return (f"; the closed form users compute by hand for the first stage (Megatron's theoretical memory report: "
            f"Korthikanti et al. 2022 per layer and micro-batch{parallel}, the stage's layers times the micro-batches "
            f"{name} keeps in flight there" + (f", divided by the {ring} ranks of the ring" if ring > 1 else "")
            + f"; GPT layers in 16-bit with dropout, nothing outside the layers) gives {format_bytes(formula)} of "
            "activations, where the trace holds this model's layers in their dtypes, the micro-batches the schedule "
            "keeps, the logits and the loss as they run")


def _rank_zero_alone(groups: list[list[int]], options: dict[str, Any]) -> list[list[int]]:
    """``groups`` (ranks that run the same program) with rank 0 in a group of its own when the run saves a full state
    dict that rank 0 alone keeps (FSDP1's `preflight.Checkpoint.rank0_only`; DCP keeps it on rank 0 alone when it
    offloads), or loads one rank 0 broadcasts (`preflight.Loading.from_rank0`): its save or its loading differs from
    the other ranks' of its group (``options``: the estimate's, with its ``checkpoint`` and ``loading``)."""
    checkpoint, loading = options["checkpoint"], options["loading"]
    saves_alone = checkpoint is not None and checkpoint.state_dict == "full" and (checkpoint.rank0_only or
                                                                                  checkpoint.offload_to_cpu)
    if not saves_alone and not (loading is not None and loading.from_rank0):
        return groups
    out = []
    for group in groups:
        if 0 in group and len(group) > 1:
            out.append([0])
            out.append([r for r in group if r != 0])
        else:
            out.append(group)
    return out


def _traced_groups(groups: Callable[[], list[list[int]]], trace: Callable[[int], TraceResult], engine: str
                   ) -> tuple[list[list[int]], list[tuple[list[int], TraceResult]], TraceResult | None]:
    """``groups()`` (ranks that run the same program), and the first rank of each traced by ``trace(rank)``:
    ``(groups, [(group, result)], the result that failed or None)``. An engine that cannot be applied to the copy
    (not the user's own error) fails as a result naming ``engine``; the user's own error and the step's refusals
    are raised."""
    found: list[list[int]] = []
    traced: list[tuple[list[int], TraceResult]] = []
    try:
        found = groups()
        for group in found:
            result = trace(group[0])
            if result.error is not None:
                return found, traced, result
            traced.append((group, result))
    except (LossNotFoundError, StepWouldFailError):
        raise
    except Exception as err:  # noqa: BLE001 - the plan could not be applied to the copy: the labelled lower bound
        if is_user_error(err):
            raise
        return found, traced, TraceResult(events=[], categories={}, num_ops=0, seconds=0.0, error=err,
                                          failed_op=f"{engine} ({type(err).__name__}: {err})")
    return found, traced, None


def _divided_lower_bound(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, options: dict[str, Any],
                         failed: TraceResult, *, gpu_info: GPU, world_size: int, sharding: str, note: str) -> Estimate:
    """The labelled lower bound of a per-rank engine whose rank could not be traced: every category of the model's
    state divided among the ranks (a rank holds at least its share), as a full sharding divides it."""
    notes = [f"{note}; the lower bound divides the model's state among the {world_size} rank(s) (a rank holds at "
             "least its share)"]
    est = _fallback(model, optimizer, batch, options["target_device"], options["precision"], options["steps"], failed,
                    notes, gpu=gpu_info, world_size=world_size, shard_ranks=world_size, sharding="fsdp-full",
                    offload={"offload_optimizer": False, "offload_params": False}, ds=None)
    # The full sharding's own note is replaced by the one above.
    kept = tuple(n for n in est.coverage.notes if not n.startswith("per-rank figures for fsdp-full"))
    return dataclasses.replace(est, sharding=sharding, coverage=dataclasses.replace(est.coverage, notes=kept))


def _ranks_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``"0-2, 5, 7-8"``."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def _traced_coverage(result: TraceResult, skipped: list[str], calibrated: list[str], notes: list[str]) -> Coverage:
    """The coverage of a trace that ran to the end: a lower bound when the trace says so (`TraceResult.lower_bound`)
    or a kernel that allocates temporaries of its own on every device (`preflight._scratch.KERNEL_OPS`) could not
    be calibrated here."""
    kernels = sorted({str(op.overloadpacket.__name__) for op in KERNEL_OPS})
    unmeasured = [label for label in skipped if label.split("[", 1)[0] in kernels]
    reasons = [result.lower_bound] if result.lower_bound else []
    if unmeasured:
        reasons.append(f"the temporaries of {', '.join(unmeasured[:3])} inside the kernel could not be measured here "
                       "(they need the target device); the peak leaves them out")
    if reasons:
        warn(f"preflight: the prediction is a lower bound: {'; '.join(reasons)}.")
    return Coverage(traced=True, lower_bound=bool(reasons), reason="; ".join(reasons) or None,
                    calibrated=tuple(calibrated), notes=tuple(notes))


def uncalibrated_notes(skipped: list[str], target: torch.device) -> list[str]:
    """Coverage notes for kernel scratch that could not be measured here: on a CUDA target planned from a CPU host,
    cuDNN's convolution workspace (`preflight.cuda.cudnn_workspace_note`), otherwise the configurations."""
    if not skipped:
        return []
    if target.type == "cuda":
        convolutions = [label for label in skipped if label.startswith("convolution")]
        others = [label for label in skipped if not label.startswith("convolution")]
        notes = [cudnn_workspace_note(convolutions)] if convolutions else []
        return notes + uncalibrated_notes(others, torch.device("cpu"))
    return [f"kernel scratch not calibrated for {len(skipped)} configuration(s): {', '.join(skipped[:3])}"]


def _per_rank_estimate(ranks: list[tuple[list[int], Any]], note: str, *, target: torch.device,
                       trace_device: torch.device, gpu_info: GPU, allocator: AllocatorConfig | None, steps: int,
                       world_size: int, sharding: str, saves: bool = False, evaluates: bool = False,
                       loading: Loading | None = None) -> Estimate:
    """The `Estimate` of the rank that peaks highest, with every rank's peak (``ranks`` from `_trace_ranks`);
    ``saves``: the traces end with a checkpoint save, ``evaluates``: an evaluation runs after the steps, ``loading``:
    how the model comes to the device, traced before them (each phase per rank in ``phases``)."""
    figures = []
    loadings: list[tuple[list[int], PhaseEstimate | None]] = []
    savings: list[tuple[list[int], PhaseEstimate | None]] = []
    evaluations: list[tuple[list[int], PhaseEstimate | None]] = []
    for group, result in ranks:
        notes = list(result.notes)
        calibrator = Calibrator(target, can_run=(trace_device == target), gpu=gpu_info)
        scratch = calibrator(result.events, result.op_log)
        notes.extend(uncalibrated_notes(scratch.skipped, target))
        notes.extend(n for n in [calibrator.reduction_note()] if n)
        events = scratch.events
        reserved = total = allocated = None
        if target.type == "cuda":
            events, workspace_note = add_workspaces(events, gpu_info)
            notes.append(workspace_note)
            events = round_events(events)
        nccl = nccl_term(gpu_info, world_size, sharding) if target.type == "cuda" else None
        evaluation = _evaluating(events, result.categories, evaluates=evaluates, target=target, gpu_info=gpu_info,
                                 allocator=allocator, nccl=nccl, failed=result.error is not None or any(
                                     n.startswith(EVAL_NOT_TRACED) for n in notes))
        evaluations.append((group, evaluation))
        events, saving = _saving(events, result.categories, saves=saves, target=target, gpu_info=gpu_info,
                                 allocator=allocator, nccl=nccl, notes=notes)
        events = [e for e in events if e.phase != EVAL_PHASE]  # the steps' own events: evaluation runs after them
        if target.type == "cuda":
            terms = cuda_terms(events, gpu_info, allocator, nccl)
            reserved, total = terms.peak_reserved_bytes, terms.device_total_bytes
            allocated = terms.peak_allocated_bytes
            notes.extend(terms.notes)
        peak, breakdown, phase, timeline = summarize_events(events, result.categories)
        figures.append((peak, group, result, scratch, events, breakdown, phase, timeline, reserved, total, notes,
                        allocated))
        savings.append((group, saving))
        if loading is not None:
            loadings.append((group, _rank_loading(loading, result, events, target=target, gpu_info=gpu_info,
                                                  allocator=allocator, nccl=nccl, notes=notes)))
    per_rank = [0] * world_size
    rank_events: list[tuple[Event, ...]] = [()] * world_size
    rank_breakdown: list[dict[str, Any]] = [{}] * world_size
    for figure in figures:
        for rank in figure[1]:
            per_rank[rank], rank_events[rank] = figure[0], tuple(figure[4])
            rank_breakdown[rank] = {**figure[5], "phase": figure[6]}
    # The traced rank (first of its group) of the largest figure; of equal figures, the lowest rank's.
    highest = max(f[0] for f in figures)
    peak, group, result, scratch, events, breakdown, phase, timeline, reserved, total, notes, allocated = min(
        (f for f in figures if f[0] == highest), key=lambda f: f[1][0])
    peak_rank = group[0]
    if target != trace_device or trace_device.type != "cpu":
        notes.append(f"traced on cpu for a {target.type} target")
    return Estimate(
        peak_bytes=peak,
        breakdown=breakdown,
        peak_phase=phase,
        device=str(target),
        coverage=_traced_coverage(result, scratch.skipped, scratch.calibrated, [*notes, note]),
        timeline=timeline,
        steps=steps,
        trace_seconds=sum(f[2].seconds for f in figures),
        num_ops=result.num_ops,
        peak_reserved_bytes=reserved,
        peak_allocated_bytes=allocated,
        device_total_bytes=total,
        gpu=None if gpu_info is None else gpu_info.name,
        world_size=world_size,
        sharding=sharding,
        per_rank_peak_bytes=tuple(per_rank),
        per_rank_breakdown=tuple(rank_breakdown),
        peak_rank=peak_rank,
        events=tuple(events),
        categories=result.categories,
        rank_events=tuple(rank_events),
        phases=(_per_rank_phase(loadings, world_size) + _per_rank_phase(evaluations, world_size)
                + _per_rank_phase(savings, world_size)),
        outside_parameter_bytes=result.outside_bytes,
    )


def _rank_loading(loading: Loading, result: TraceResult, events: Sequence[Event], *, target: torch.device,
                  gpu_info: GPU | None, allocator: AllocatorConfig | None, nccl: tuple[int, str] | None,
                  notes: list[str]) -> PhaseEstimate:
    """One traced rank's loading phase: its loading trace (`preflight.parallel.trace_loading`), or for a model built
    on meta, the parameters and buffers it holds before its first step (``events``: its steps' events); a note for
    ``notes``. Where the engine could not wrap the loading copy, the resident state, labelled a lower bound."""
    loaded = result.loading
    if loaded is None:
        notes.append("loading (meta): the rank materialises its own shards and fills them in place: its parameters "
                     "and buffers before its first step (a full state dict broadcast from rank 0 would add its "
                     "largest tensor, not counted)")
        return _resident_phase(events, result.categories, how="counted", target=target, gpu_info=gpu_info,
                               allocator=allocator, nccl=nccl)
    notes.extend(loaded.notes)
    if loaded.error is not None:
        notes.append(f"loading ({loading.placement}): the engine could not wrap the loading copy ({loaded.failed_op}: "
                     f"{loaded.error})".splitlines()[0][:300] + "; the phase is the rank's resident state, a lower "
                     "bound")
        return _resident_phase(events, result.categories, how="labelled lower bound", target=target,
                               gpu_info=gpu_info, allocator=allocator, nccl=nccl)
    traced = round_events(loaded.events) if target.type == "cuda" else loaded.events
    return _loading_phase(traced, loaded.categories, how="traced (upper bound)" if loaded.upper_bound else "traced",
                          target=target, gpu_info=gpu_info, allocator=allocator, nccl=nccl)


def _per_rank_phase(phases: list[tuple[list[int], PhaseEstimate | None]], world_size: int
                    ) -> tuple[PhaseEstimate, ...]:
    """One `PhaseEstimate` of the traced ranks' ``(ranks, phase)``: the figures of the rank that peaks highest in it
    (the lowest such rank), with every rank's peak."""
    if not phases or any(p is None for _, p in phases):
        return ()
    per_rank = [0] * world_size
    for group, phase in phases:
        for rank in group:
            per_rank[rank] = phase.peak_bytes
    group, top = min(phases, key=lambda gp: (-gp[1].peak_bytes, gp[0][0]))
    return (dataclasses.replace(top, per_rank_peak_bytes=tuple(per_rank), peak_rank=group[0]),)


def _allocator_config(allocator: AllocatorConfig | str | None) -> AllocatorConfig | None:
    if isinstance(allocator, AllocatorConfig):
        return allocator
    if allocator is None:
        allocator = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
        if not allocator:
            return None
    if isinstance(allocator, str):
        return AllocatorConfig.from_env(allocator)
    raise TypeError(f"`allocator` should be an AllocatorConfig or a PYTORCH_CUDA_ALLOC_CONF string, got {allocator!r}.")


def summarize_events(
    events: Sequence[Event], categories: dict[int, Category], *, start: int = 0
) -> tuple[int, dict[str, int], str, tuple[TimelinePoint, ...]]:
    """Replay ``events``: the peak of live bytes, the breakdown by category at the peak, its phase, a timeline.
    ``start``: the peak of ``events[start:]`` alone, with what the events before it left alive counted."""
    live = peak = 0
    peak_index = -1
    for i, e in enumerate(events):
        live += e.nbytes
        if live > peak and i >= start:
            peak, peak_index = live, i
    if start and peak_index < 0:  # nothing allocated in the window: what the events before it left alive
        peak, peak_index = sum(e.nbytes for e in events[:start]), start - 1
    breakdown = {c.value: 0 for c in Category}
    sizes: dict[int, int] = {}
    for e in events[: peak_index + 1]:
        sizes[e.uid] = sizes.get(e.uid, 0) + e.nbytes
    for uid, nbytes in sizes.items():
        if nbytes:
            breakdown[categories.get(uid, Category.TEMPORARIES).value] += nbytes
    phase = events[peak_index].phase if peak_index >= 0 else "setup"
    return peak, breakdown, phase, _timeline(events)


def _timeline(events: Iterable[Event]) -> tuple[TimelinePoint, ...]:
    """Live bytes at the end of each operator, thinned to about `_TIMELINE_POINTS` points keeping local maxima."""
    points: list[TimelinePoint] = []
    live = 0
    for e in events:
        live += e.nbytes
        if points and points[-1].op == e.op:
            if live >= points[-1].live_bytes:
                points[-1] = TimelinePoint(e.op, live, e.phase)
        else:
            points.append(TimelinePoint(e.op, live, e.phase))
    if len(points) <= _TIMELINE_POINTS:
        return tuple(points)
    stride = -(-len(points) // _TIMELINE_POINTS)
    return tuple(max(points[i:i + stride], key=lambda p: p.live_bytes) for i in range(0, len(points), stride))


def _fallback(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, target: torch.device,
              precision: str | None, steps: int, result: Any, notes: list[str], *, gpu: GPU | None,
              world_size: int, shard_ranks: int, sharding: str | None, offload: dict[str, bool],
              ds: dict[str, Any] | None) -> Estimate:
    state = model_state(model, optimizer, batch, target, param_dtype=float_dtype_for(precision))
    breakdown = {c.value: 0 for c in Category}
    breakdown.update(parameters=state.parameters, buffers=state.buffers, gradients=state.gradients,
                     optimizer_state=state.optimizer_state or 0, inputs=state.inputs)
    if state.optimizer_state is None:
        notes.append(f"optimizer state of {type(optimizer).__name__} unknown: counted as 0")
    if sparse := sparse_gradient_parameters(model):
        notes.append(f"the sparse gradients of {len(sparse)} embedding table(s) (sparse=True) are not counted: they "
                     "hold the rows a batch looks up, which the trace stopped before")
    unsharded = None
    if sharding is not None:
        unsharded = sum(breakdown.values())
        terms, terms_notes = deepspeed_terms(model, sharding, ds, precision, shard_ranks, offload)
        breakdown, note = per_rank_breakdown(breakdown, model, world_size=shard_ranks, sharding=sharding,
                                             dtype=float_dtype_for(precision), **offload, **terms)
        notes.extend([note, *terms_notes])
    reason = f"{type(result.error).__name__}: {result.error}".splitlines()[0][:300]
    warn(f"preflight could not trace the training step (stopped at {result.failed_op}: {reason}). The estimate is a "
         "lower bound: parameters + gradients + optimizer state + batch, without activations.", RuntimeWarning)
    return Estimate(
        peak_bytes=sum(breakdown.values()),
        breakdown=breakdown,
        peak_phase="unknown",
        device=str(target),
        coverage=Coverage(traced=False, lower_bound=True, failed_op=result.failed_op, reason=reason,
                          notes=tuple(notes)),
        steps=steps,
        trace_seconds=result.seconds,
        num_ops=result.num_ops,
        managed_bytes=state.managed,
        gpu=None if gpu is None else gpu.name,
        world_size=world_size,
        sharding=sharding,
        unsharded_peak_bytes=unsharded,
    )
