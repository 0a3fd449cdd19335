"""Predict the peak memory of an evaluation step: a forward under ``torch.no_grad()``, on fake tensors.

The same machinery as the training trace (`preflight.trace._run`: fake twins, storage tracker, real-run code
paths, the user's module reparametrized and restored), running one forward in eval mode with autograd off.
Evaluation during training keeps the training state alive (optimizer state, and under Lightning the last
step's gradients); pass those bytes as ``resident`` so the peak is the one the device will see.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from preflight._warnings import warn
from preflight._device import iter_tensors, resolve_device, trace_device_for, unmodelled_device_note
from preflight.parallel import read_ddp, read_zero
from preflight._estimate import _allocator_config, nccl_term, summarize_events, uncalibrated_notes
from preflight._generation import kv_cache_note
from preflight._units import format_bytes
from preflight._gpus import get_gpu, with_context
from preflight._guard import untouched
from preflight._result import Category, Coverage, Estimate, Event, TimelinePoint
from preflight._eval_loop import EvalLoop
from preflight._run import Run, check_run
from preflight._steps import autocast_for, check_step
from preflight._target import add_workspaces, cuda_terms, resolve_gpu, round_events
from preflight.cuda import CudaTarget
from preflight.parallel._pipeline import refuse_job_pipeline
from preflight._scratch import Calibrator, scratch_ops
from preflight.trace import FakeRun, Sweep, TraceResult, float_dtype_for, gradients_held_by, swept
from preflight.trace._run import op_logger

__all__ = ["EvalStepFn", "estimate_eval", "estimate_generation"]

EvalStepFn = Any  # eval_step(model, batch) -> anything (outputs are kept alive until the step returns)


@untouched()
def estimate_eval(
    model: nn.Module,
    batch: Any,
    run: Run | None = None,
    *,
    step: EvalStepFn | None = None,
    resident: Mapping[str, int] | None = None,
) -> Estimate:
    """Predict the peak of one evaluation step of ``model`` on ``batch`` without running it.

    Args:
        model: the model, as for `preflight.estimate`; traced in eval mode (dropout off), then restored.
        batch: one evaluation batch as the eval dataloader yields it.
        step: ``step(model, batch)`` running the evaluation forward (e.g. a LightningModule's
            ``validation_step``); its return value is alive at the end of the step. Default: ``model(**batch)``
            for a mapping, ``model(batch)`` otherwise. A step that generates (transformers' ``generate``) is
            traced to the longest generation (`preflight.estimate_generation`).
        run: how the run trains (`preflight.Run`), as for `preflight.estimate`: its precision (``*-mixed`` runs the
            forward under autocast) and target (device or catalog GPU: its attention kernels, cuBLAS workspace, CUDA
            context in ``device_total_bytes``, and the allocator settings). The loop does not apply (one forward,
            no gradients); a per-rank share under ``run.parallel`` is the caller's (`preflight.check` gives it),
            while its ranks' NCCL buffers are in ``device_total_bytes`` on a CUDA target, as `estimate` counts them.
        resident: bytes per `Category` value alive throughout the step besides parameters, buffers and the batch
            (e.g. ``{"optimizer_state": ..., "gradients": ...}`` during evaluation inside training). Given (even
            empty), it is all the training state there is: the ``.grad`` the parameters hold now is not counted
            again. Without it, gradients the parameters hold are counted, as the evaluation holds them.

    Returns:
        An `Estimate` with ``steps=1`` and phases ``eval/forward``. On a CUDA target, as for training: the
        forward thread's cuBLAS workspace, 512-byte blocks, the simulated reserved memory and (with ``gpu``) the
        device total. When the forward cannot be traced, a lower
        bound (parameters + buffers + batch + ``resident``) with ``coverage.lower_bound`` set.

    Outputs an evaluation loop keeps across batches (the HF Trainer with a ``compute_metrics`` keeps every
    batch's logits) are counted where ``run.evaluation`` says so (`preflight.EvalLoop`): the step is then predicted
    as the last kept batch, with the earlier batches' outputs (of the traced batch's shapes) and the concatenation.

    Known limitations: as `preflight.estimate`.
    """
    refuse_job_pipeline(model, "estimate_eval")
    return _estimate_forward(model, batch, check_run(run), step=step, resident=resident, phase="eval/forward")


@untouched()
def estimate_generation(model: nn.Module, inputs: Any, run: Run | None = None) -> Estimate:
    """Predict the peak of ``model.generate(**inputs, **run.generation)`` (prefill and every decoding step)
    without running it.

    Args:
        model: a model with transformers' ``generate`` (``GenerationMixin``), on its device or on meta; traced in
            eval mode, then restored.
        inputs: the prompts as ``generate`` takes them: ``{"input_ids": ..., "attention_mask": ...}`` (or an
            encoder-decoder's encoder inputs).
        run: `preflight.Run`: ``generation`` holds ``generate``'s keyword arguments (``max_new_tokens``,
            ``num_beams``, ``do_sample``, ``cache_implementation``, ...; over the model's ``generation_config``),
            ``precision`` (``*-mixed``: autocast) and ``target`` as for `estimate_eval`.

    Returns:
        An `Estimate` with ``steps=1`` and phase ``generate``: the parameters, the prompts, the KV cache and the
        decoding temporaries, traced to the longest generation (no sequence stops at an end-of-sequence token
        before ``max_new_tokens``: the worst case, said in ``coverage.notes``). The notes also give the KV cache
        by the closed form users compute (2 x layers x kv heads x head dim x tokens x sequences x bytes) beside
        the traced peak.
    """
    run = check_run(run)
    if not callable(getattr(model, "generate", None)):
        raise TypeError(f"`model` should have a generate method (a transformers model with GenerationMixin), "
                        f"got {type(model).__name__}; for a forward alone use preflight.estimate_eval.")
    kwargs = dict(run.generation or {})

    def generate(module: nn.Module, prompts: Any) -> Any:
        return module.generate(**prompts, **kwargs) if isinstance(prompts, Mapping) else \
            module.generate(prompts, **kwargs)

    est = _estimate_forward(model, inputs, run, step=generate, resident=None, phase="generate")
    compiled = _auto_compile_note(model, kwargs, est.device)
    if compiled:
        est = dataclasses.replace(est, coverage=dataclasses.replace(est.coverage,
                                                                    notes=(*est.coverage.notes, compiled)))
    closed = kv_cache_note(model, inputs, kwargs, run.precision)
    if closed is None:
        return est
    cache, note = closed
    held = sum(est.breakdown.get(k, 0) for k in ("parameters", "buffers", "inputs"))
    if not est.coverage.lower_bound:
        note += (f"; traced peak {format_bytes(est.peak_bytes)} = parameters, buffers and prompts "
                 f"{format_bytes(held)} + {format_bytes(est.peak_bytes - held)} of cache, sequences and decoding "
                 f"temporaries ({format_bytes(est.peak_bytes - held - cache)} beyond the formula's cache)")
    return dataclasses.replace(est, coverage=dataclasses.replace(est.coverage,
                                                                 notes=tuple(est.coverage.notes) + (note,)))


def _auto_compile_note(model: nn.Module, kwargs: Mapping[str, Any], device: str) -> str | None:
    """The note for a generation transformers will compile on the target: a static cache on a CUDA device makes
    ``generate`` compile the decoding forward (``GenerationMixin._valid_auto_compile_criteria``) unless
    ``disable_compile`` is set. The trace runs it eager."""
    config = getattr(model, "generation_config", None)
    implementation = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
    disabled = kwargs.get("disable_compile", getattr(config, "disable_compile", None))
    if not device.startswith("cuda") or disabled or implementation not in ("static", "offloaded_static"):
        return None
    return (f"cache_implementation={implementation!r} on a CUDA device: transformers compiles the decoding forward "
            "(torch.compile, GenerationMixin._valid_auto_compile_criteria) and the trace runs it eager, so the "
            "compiled graph's own buffers are not counted (measured on an H200 for a 6-layer Llama: "
            "max_memory_allocated 17% above the eager figure, benchmarks/gpu_validation.py); pass "
            "disable_compile=True to generate to run it as traced")


def _estimate_forward(model: nn.Module, batch: Any, run: Run, *, step: EvalStepFn | None,
                      resident: Mapping[str, int] | None, phase: str) -> Estimate:
    precision, gpu = run.precision, run.target.gpu
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` should be a torch.nn.Module, got {type(model).__name__}.")
    plan = run.parallel
    ddp = read_ddp(model)  # the module a DDP wrapper runs; its buckets are the caller's resident state
    if ddp is not None:
        model, plan = ddp[0], plan or ddp[1]
    check_step(step)
    # The training state the caller counted includes the gradients, or says they are freed: the .grad the model
    # holds now (the real steps' when a verification traces again) is not carried as well.
    carried = contextlib.nullcontext() if resident is None else gradients_held_by(())
    resident = {k: int(v) for k, v in (resident or {}).items() if v}
    unknown = set(resident) - {c.value for c in Category}
    if unknown:
        raise ValueError(f"`resident` keys should be category names {[c.value for c in Category]}, "
                         f"got {sorted(unknown)}.")
    gpu_info = with_context(get_gpu(gpu) if gpu else None, run.target.cuda_context, run.target.nccl_buffers)
    target = resolve_device(run.target.planned_device, model)  # a catalog GPU is a CUDA target, as for estimate
    zero = read_zero(model, None)  # DeepSpeed ZeRO-3 partitioned it: its unpartitioned stand-in runs instead
    if zero is not None:
        model = zero.model
    trace_device = trace_device_for(target)
    cuda = CudaTarget.of(gpu_info) if target.type == "cuda" and trace_device.type != "cuda" else None
    with carried:
        result = _trace_eval(model, batch, step=step, precision=precision, trace_device=trace_device,
                             layouts=target.type == trace_device.type == "cpu", cuda=cuda, phase=phase,
                             cache=run.loop.autocast_cache, target=target)
    notes = result.notes
    if target != trace_device:
        notes.append(f"traced on {trace_device.type} for a {target.type} target")
    notes.extend(unmodelled_device_note(target))
    if result.error is not None:
        return _lower_bound(model, batch, target, precision, resident, result.error, result.failed_op, notes,
                            result.seconds, phase)

    # Memory kernels hold of their own (convolutions' workspace, CPU low-precision matrix products, CUDA reductions'
    # staging), measured or modelled as the training estimate does.
    calibrator = Calibrator(target, can_run=(trace_device == target),
                            gpu=gpu_info if gpu_info is not None else resolve_gpu(None, target))
    result = calibrator.apply(result)
    notes.extend(uncalibrated_notes(calibrator.skipped, target))
    notes.extend(n for n in [calibrator.reduction_note()] if n)
    events = list(result.events)
    categories = dict(result.categories)
    if resident:  # alive before and after the step: one event each at the start
        base = max(categories, default=-1) + 1
        for i, (name, nbytes) in enumerate(sorted(resident.items())):
            categories[base + i] = Category(name)
            events.insert(0, Event(base + i, nbytes, -1, phase))
        notes.append("counts the training state alive during evaluation: " +
                     ", ".join(f"{k} {v} B" for k, v in sorted(resident.items())))
    kept = run.evaluation
    # One batch kept and moved off each step still leaves a NumPy view over it on a CPU target (`_kept_outputs`).
    if kept is not None and (kept.kept_batches > 1 or kept.moved_off) and phase != "generate":
        events, note = _kept_outputs(events, categories, run.evaluation, result.output_bytes, phase,
                                     host_is_device=target.type == "cpu")
        notes.append(note)
    reserved = total = allocated = None
    if target.type == "cuda":  # the training estimate's CUDA terms: workspace, 512-byte blocks, allocator, context
        events, note = add_workspaces(events, gpu_info)
        notes.append(note)
        events = round_events(events)
        # As for training: the job's communicators, made at its start, keep their buffers through evaluation.
        nccl = None if plan is None else nccl_term(gpu_info, plan.world_size, plan.sharding)
        terms = cuda_terms(events, gpu_info, _allocator_config(run.target.allocator), nccl)
        reserved, total, allocated = terms.peak_reserved_bytes, terms.device_total_bytes, terms.peak_allocated_bytes
        notes.extend(terms.notes)
    peak, breakdown, phase, timeline = summarize_events(events, categories)
    return Estimate(peak_bytes=peak, breakdown=breakdown, peak_phase=phase, device=str(target),
                    coverage=Coverage(traced=True, notes=tuple(notes), calibrated=tuple(calibrator.calibrated)),
                    timeline=timeline, steps=1,
                    trace_seconds=result.seconds, num_ops=result.num_ops, events=tuple(events),
                    peak_reserved_bytes=reserved, peak_allocated_bytes=allocated, device_total_bytes=total,
                    gpu=None if gpu_info is None else gpu_info.name)


@swept
def _trace_eval(model: nn.Module, batch: Any, *, step: EvalStepFn | None, precision: str | None,
                trace_device: torch.device, layouts: bool, cuda: CudaTarget | None, phase: str,
                sweep: Sweep, cache: bool, target: torch.device) -> TraceResult:
    """Trace one evaluation forward on fake tensors (the eval twin of `preflight.trace._run.trace_steps`), logging
    the operator calls whose kernels hold memory of their own on ``target`` (`preflight._scratch`), as shapes."""
    start = time.perf_counter()
    op_log: list[tuple[int, int, Any, Any, Any]] = []
    on_op = op_logger(scratch_ops(target), op_log, lambda: len(run.tracker.events))
    run = FakeRun(model, batch, precision=precision, trace_device=trace_device, sweep=sweep, layouts=layouts,
                  cuda=cuda, on_op=on_op)
    tracker = run.tracker
    run.what = "the generate call" if phase == "generate" else "the evaluation step"
    tracker.phase, tracker.phase_category = phase, Category.ACTIVATIONS
    with run.active(model):
        model.eval()
        with torch.no_grad(), autocast_for(precision, trace_device.type, cache):
            out = step(model, run.batch) if step is not None else _forward(model, run.batch)
        tracker.phase = phase.split("/")[0] + "/end"
        output_bytes = tracker.bytes_of(iter_tensors(out))
        del out
    run.finish()
    return TraceResult(events=tracker.events, categories=tracker.categories, num_ops=tracker.num_ops,
                       output_bytes=output_bytes, op_log=op_log,
                       seconds=time.perf_counter() - start, error=run.error, failed_op=run.failed_op,
                       notes=run.notes + tracker.assumption_notes() +
                       ([tracker.layouts.note()] if tracker.layouts is not None and tracker.layouts.note() else []))


def _kept_outputs(events: list[Event], categories: dict[int, Category], loop: EvalLoop, per_batch: int,
                  phase: str, *, host_is_device: bool) -> tuple[list[Event], str]:
    """The traced step as the last batch the evaluation loop keeps (`preflight._eval_loop`): the earlier batches'
    kept outputs (and the previous batch's, freed as the step returns) alive from its start, then, with the step's
    outputs alive, their gathered copy and the concatenation into the new kept tensor, after which the old kept
    tensor is dropped."""
    if not per_batch:
        return events, "kept outputs: the evaluation step returned no tensor, so the loop keeps nothing of it"
    earlier, previous, gathered, concatenated = loop.kept_bytes(per_batch)
    viewed = loop.kept_batches * per_batch * loop.ranks if loop.moved_off and host_is_device else 0
    earlier += viewed  # the first group moved off, a NumPy view over its storage while the second is kept
    base = max(categories, default=-1) + 1
    kept, prior, gather, new = range(base, base + 4)
    for uid in (kept, prior, gather, new):
        categories[uid] = Category.ACTIVATIONS
    last = max((e.op for e in events), default=-1)
    end = phase.split("/")[0] + "/end"
    # The step has returned where its end phase starts: its outputs are alive until the frees recorded there.
    returned = next((i for i, e in enumerate(events) if e.phase == end), len(events))
    before = [Event(kept, earlier, -1, phase)] + ([Event(prior, previous, -1, phase)] if previous else [])
    after = [Event(prior, -previous, last, end)] if previous else []
    after += [Event(gather, gathered, last, end)] if gathered else []
    after += [Event(new, concatenated, last, end), Event(kept, -(earlier - viewed), last, end)] if concatenated else []
    gone = [Event(uid, -nbytes, last, end) for uid, nbytes in
            ((gather, gathered), (new, concatenated), (kept, viewed if concatenated else earlier)) if nbytes]
    note = (f"kept outputs: the evaluation loop keeps every batch's outputs ({per_batch:,} B a batch, what the step "
            "returns" + (f", gathered from {loop.ranks} ranks" if loop.ranks > 1 else "") + f") for "
            f"{loop.kept_batches} batches" + (", concatenated batch by batch" if loop.concatenated else ", in a list") +
            f": {earlier:,} B kept from the earlier batches during the last one" +
            (f", then {concatenated:,} B for the new concatenated tensor beside them" if concatenated else "") +
            (f"; {viewed:,} B of the first group moved off, a NumPy view over its storage on a CPU target"
             if viewed else "") +
            " (earlier batches assumed the traced batch's shapes: `preflight._eval_loop`)")
    return before + events[:returned] + after + events[returned:] + gone, note


def _forward(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, Mapping) else model(batch)


def _lower_bound(model: nn.Module, batch: Any, target: torch.device, precision: str | None,
                 resident: dict[str, int], error: BaseException, failed_op: str | None, notes: list[str],
                 seconds: float, phase: str) -> Estimate:

    dtype = float_dtype_for(precision)

    def nbytes(tensors: Any) -> int:
        unique = {id(t): t for t in tensors}.values()
        return sum(t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size())
                   for t in unique)

    breakdown = {c.value: 0 for c in Category}
    breakdown.update(parameters=nbytes(model.parameters()), buffers=nbytes(model.buffers()),
                     inputs=nbytes(iter_tensors(batch)))
    for name, nbytes in resident.items():
        breakdown[name] += nbytes
    reason = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    what = "generation" if phase == "generate" else "evaluation step"
    warn(f"preflight could not trace the {what} (stopped at {failed_op}: {reason}). The {what}'s "
         "estimate is a lower bound: parameters + buffers + batch, without activations.", RuntimeWarning)
    return Estimate(peak_bytes=sum(breakdown.values()), breakdown=breakdown, peak_phase="unknown",
                    device=str(target), coverage=Coverage(traced=False, lower_bound=True, failed_op=failed_op,
                                                          reason=reason, notes=tuple(notes)),
                    timeline=(TimelinePoint(-1, sum(breakdown.values()), phase),), steps=1,
                    trace_seconds=seconds)
