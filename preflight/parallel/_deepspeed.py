"""What DeepSpeed itself holds on one rank, beside the traced step: the ZeRO plan's own terms as the per-rank rescale
(`preflight._target.shard_events`, `per_rank_breakdown`) takes them.

ZeRO's gradient reduction buffers (`zero_buffers_for`), ZeRO-3's fp32 partition copy, gradient partitions and
gathered / persistent parameters (`zero3_terms_for`), the fp32 optimizer state DeepSpeed steps for a 16-bit model
(`deepspeed_terms`' ``state_scale``), and the precision DeepSpeed casts the model to (`deepspeed_precision`). The
formulas are `preflight._sharding`'s, from DeepSpeed's source; this module applies them to a model and a config
read by `preflight._sharding.read_deepspeed_config`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from preflight._sharding import Zero3Terms, ZeroBuffers, read_deepspeed_config, zero3_terms, zero_buffers
from preflight._steps import half_dtype
from preflight.trace import float_dtype_for

__all__ = ["deepspeed_precision", "deepspeed_settings", "deepspeed_terms", "zero3_terms_for", "zero_buffers_for"]


def deepspeed_settings(ds: dict[str, Any], sharding: str | None,
                        offload: dict[str, bool]) -> tuple[str, dict[str, bool]]:
    """The sharding and offload a DeepSpeed config says; a ValueError where the arguments say otherwise."""
    said = []
    if sharding not in (None, ds["sharding"]):
        said.append(f"sharding={sharding!r} (the config's stage {ds['stage']} is {ds['sharding']!r})")
    said.extend(f"{name}=True" for name, on in offload.items() if on and not ds[name])
    if said:
        raise ValueError(f"`deepspeed_config` plans the run, but {', '.join(said)} says otherwise: drop those "
                         "arguments, or change the config.")
    return ds["sharding"], {name: ds[name] for name in offload}


def zero_buffers_for(model: nn.Module, sharding: str | None, ds: dict[str, Any] | None,
                     precision: str | None) -> ZeroBuffers | None:
    """ZeRO's gradient reduction buffers (`preflight._sharding.zero_buffers`) for a ``zero*`` sharding of
    ``model``: sized by ``ds`` (`read_deepspeed_config`'s output) or, without one, by DeepSpeed's defaults; the
    gradients are 16-bit where the config enables bf16 / fp16 (or, where it does not say, ``precision`` is a
    16-bit one). None for other shardings."""
    if sharding is None or not sharding.startswith("zero"):
        return None
    given = ds is not None
    if ds is None:
        ds = read_deepspeed_config({"zero_optimization": {"stage": int(sharding[-1])}})
    low = _half_dtype(ds, precision, given)
    dtypes = {low if low is not None and p.is_floating_point() else p.dtype
              for p in model.parameters() if p.requires_grad}
    return zero_buffers(ds, sorted(d.itemsize for d in dtypes), given=given)


def _half_dtype(ds: dict[str, Any], precision: str | None, given: bool) -> torch.dtype | None:
    """The 16-bit dtype DeepSpeed casts the model to under ``ds`` (its bf16 / fp16 sections, or, where the config
    does not say, ``precision``), or None."""
    if ds["bf16"] or ds["fp16"]:
        return torch.bfloat16 if ds["bf16"] else torch.float16
    if ds["bf16"] is None or ds["fp16"] is None or not given:  # "auto" or no config: the precision says
        return half_dtype(precision)  # DeepSpeed's bf16 / fp16 section for a 16-bit precision
    return None


def _traced_dtype(model: nn.Module, precision: str | None) -> torch.dtype | None:
    """The dtype the trace gives ``model``'s floating parameters: the precision's cast, else their own (the
    first's); None for a model without any."""
    return float_dtype_for(precision) or next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def deepspeed_precision(model: nn.Module, ds: dict[str, Any] | None, precision: str | None) -> str | None:
    """The precision ``model`` runs at under DeepSpeed config ``ds`` (`read_deepspeed_config`'s): DeepSpeed's bf16 /
    fp16 modes cast the module to 16 bits (engine.py ``_configure_distributed_model``; Lightning's and the HF
    Trainer's DeepSpeed precision cast the inputs) and step an fp32 copy of each partition, so an fp32 model is
    traced as that 16-bit model runs (``"bf16-true"`` / ``"16-true"``), its optimizer state counted at fp32
    (`deepspeed_terms`). ``precision`` otherwise."""
    half = None if ds is None else _half_dtype(ds, precision, given=True)
    floating = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if half is not None and floating == {torch.float32} and precision not in ("bf16-true", "16-true"):
        return "bf16-true" if half is torch.bfloat16 else "16-true"
    return precision


def deepspeed_terms(model: nn.Module, sharding: str | None, ds: dict[str, Any] | None, precision: str | None,
                    world_size: int, offload: dict[str, bool]) -> tuple[dict[str, Any], list[str]]:
    """What DeepSpeed itself holds on one rank under ``sharding`` (its gradient reduction buffers, ZeRO-3's own
    terms; None for other shardings), as the keyword arguments `preflight._target.shard_events` and
    `per_rank_breakdown` take, and the notes saying what of it is not counted (or how it was counted).

    DeepSpeed's optimizer steps the fp32 copy of the rank's partition (``stage_1_and_2.py``
    ``single_partition_of_fp32_groups``, ``stage3.py`` ``fp32_partitioned_groups_flat``; their dtype,
    ``master_weights_and_grads_dtype``, is fp32 unless bf16 master weights are asked for with offload), so its state
    and the step's temporaries are fp32 where a 16-bit model's trace made them 16-bit: ``state_scale`` scales them."""
    zero3, note = zero3_terms_for(model, sharding, ds, precision, world_size, offload)
    notes = [note] if note else []
    half = _half_dtype(ds, precision, True) if ds is not None else None
    if half is not None and precision in ("bf16-true", "16-true"):
        notes.append(f"DeepSpeed's {'bf16' if half is torch.bfloat16 else 'fp16'} mode: the model traced in {half} as "
                     "DeepSpeed casts it")
    scale = 1.0
    if sharding in ("zero1", "zero2", "zero3") and not offload["offload_optimizer"]:
        traced = _traced_dtype(model, precision)
        if traced is not None and traced.itemsize < 4:
            scale = 4 / traced.itemsize
            notes.append(f"DeepSpeed's optimizer steps the fp32 copy of the partition: the traced {traced} optimizer "
                         f"state and step counted at fp32 (x{scale:g})")
    return ({"zero_buffers": zero_buffers_for(model, sharding, ds, precision), "zero3": zero3, "state_scale": scale},
            notes)


def zero3_terms_for(model: nn.Module, sharding: str | None, ds: dict[str, Any] | None, precision: str | None,
                    world_size: int, offload: dict[str, bool]) -> tuple[Zero3Terms | None, str | None]:
    """DeepSpeed ZeRO-3's own terms (`preflight._sharding.zero3_terms`) for ``model`` under ``ds`` (DeepSpeed's
    defaults without one), and a note where they are not counted; (None, None) for other shardings."""
    if sharding != "zero3":
        return None, None
    given = ds is not None
    if ds is None:
        ds = read_deepspeed_config({"zero_optimization": {"stage": 3}})
    params = [(id(p), p.numel(), p.requires_grad) for p in model.parameters()]  # shared parameters once
    modules = [[id(p) for p in m.parameters(recurse=False)] for m in model.modules()]
    dtype = _half_dtype(ds, precision, given) or _traced_dtype(model, precision)  # DeepSpeed's 16-bit dtype first
    itemsize = dtype.itemsize if dtype is not None else 4
    terms = zero3_terms(ds, params, modules, world_size=world_size, param_itemsize=itemsize, grad_itemsize=itemsize)
    notes = [] if given else ["zero3: DeepSpeed's defaults size its own terms; pass the run's DeepSpeed config"]
    if offload["offload_optimizer"]:
        # stage3.py: under offload_optimizer the optimizer's device is the CPU (``self.device``), where the fp32
        # partitions, their gradient buffers and the flat gradient partitions are made; the parameters are still
        # gathered on the GPU, kept and prefetched up to stage3_max_live_parameters as without offload.
        terms = dataclasses.replace(terms, master_bytes=0, grad_partition_bytes=0, init_grad_bytes=0,
                                    step_grad_bytes=0)
    if any(offload.values()):
        notes.append("zero3 with offloading: the fp32 partitions, the optimizer's state and the gradient partitions "
                     "are host memory under offload_optimizer, the parameter partitions under offload_param; the "
                     "gathered parameters (kept from forward to backward within stage3_max_reuse_distance, "
                     "prefetched up to stage3_max_live_parameters) and the persistent ones stay on the device, as "
                     "DeepSpeed's stage3.py and partitioned_param_coordinator.py keep them; not measured on a GPU")
    return terms, "; ".join(notes) or None
