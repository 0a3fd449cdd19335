"""What DeepSpeed itself holds on one rank, beside the traced step: the ZeRO plan's own terms as the per-rank rescale
(`preflight._target.shard_events`, `per_rank_breakdown`) takes them.

ZeRO's gradient reduction buffers (`zero_buffers_for`), ZeRO-3's fp32 partition copy, gradient partitions and
gathered / persistent parameters (`zero3_terms_for`), the fp32 optimizer state DeepSpeed steps for a 16-bit model
(`deepspeed_terms`' ``state_scale``), what a checkpoint save adds (`deepspeed_save`), and the precision DeepSpeed
casts the model to (`deepspeed_precision`). The formulas are `preflight._sharding`'s, from DeepSpeed's source; this
module applies them to a model and a config read by `preflight._sharding.read_deepspeed_config`.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
from torch import nn

from preflight._sharding import (Zero3Terms, ZeroBuffers, read_deepspeed_config, zero3_consolidation, zero3_terms,
                                 zero_buffers)
from preflight._steps import half_dtype
from preflight.trace import float_dtype_for

__all__ = ["DeepSpeedSave", "deepspeed_precision", "deepspeed_save", "deepspeed_settings", "deepspeed_terms",
           "zero3_terms_for", "zero_buffers_for"]


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
    ds, given = _config_or_defaults(ds, sharding)
    low = _half_dtype(ds, precision, given)
    dtypes = {low if low is not None and p.is_floating_point() else p.dtype
              for p in model.parameters() if p.requires_grad}
    return zero_buffers(ds, sorted(d.itemsize for d in dtypes), given=given)


def _config_or_defaults(ds: dict[str, Any] | None, sharding: str) -> tuple[dict[str, Any], bool]:
    """``ds``, or DeepSpeed's defaults at the stage of a ``zero*`` ``sharding`` where no config was given; and
    whether one was."""
    if ds is not None:
        return ds, True
    return read_deepspeed_config({"zero_optimization": {"stage": int(sharding[-1])}}), False


def _param_itemsize(model: nn.Module, ds: dict[str, Any], precision: str | None, given: bool) -> int:
    """Bytes per element of ``model``'s parameters as DeepSpeed holds them: its 16-bit dtype first, else the traced
    one (4 for a model without floating parameters)."""
    dtype = _half_dtype(ds, precision, given) or _traced_dtype(model, precision)
    return dtype.itemsize if dtype is not None else 4


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
    ds, given = _config_or_defaults(ds, sharding)
    params = [(id(p), p.numel(), p.requires_grad) for p in model.parameters()]  # shared parameters once
    modules = [[id(p) for p in m.parameters(recurse=False)] for m in model.modules()]
    itemsize = _param_itemsize(model, ds, precision, given)
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


@dataclasses.dataclass(frozen=True)
class DeepSpeedSave:
    """What a checkpoint save under DeepSpeed adds on a rank's device, after the training state (`deepspeed_save`).

    Attributes:
        rank0: rank 0's allocations and frees in order, ``(key, nbytes)`` as `preflight._sharding.zero3_consolidation`
            gives them (``nbytes < 0``: the free of that key's allocation).
        others: the same on every other rank.
        consolidates: ZeRO-3's 16-bit consolidation, between ``checkpoint_event_prologue`` (every gathered
            parameter, the persistent ones too, partitioned first) and ``_epilogue`` (the persistent ones gathered
            again).
        how: what was counted, for the coverage note.
    """

    rank0: tuple[tuple[int, int], ...]
    others: tuple[tuple[int, int], ...]
    consolidates: bool
    how: str

    def note(self) -> str:
        return f"the checkpoint save under DeepSpeed: {self.how}"


def deepspeed_save(model: nn.Module, sharding: str | None, ds: dict[str, Any] | None, precision: str | None,
                   world_size: int, *, state_dict: str, host_is_device: bool) -> DeepSpeedSave | None:
    """What a checkpoint save adds on the device under a ZeRO ``sharding`` of ``model`` (DeepSpeed 0.19.8,
    accelerate 1.15, transformers 5.24 read), beside each rank's partitioned checkpoint (``save_checkpoint``,
    which writes the partitions and the optimizer's state as they are, copying nothing on the device); None for
    other shardings, and for a sharded save at stages 1 and 2, which adds nothing. At stage 3 every save starts from
    the state the step leaves (`preflight._target.deepspeed_save_events`).

    ``state_dict="full"``: the HF Trainer's ``save_model`` also consolidates the model through accelerate's
    ``get_state_dict`` on every rank:

    * ZeRO-1 and 2: ``clone_tensors_for_torch_save(model.state_dict())`` copies every entry (a tied weight once per
      key) to the host: nothing on the device on a GPU, a whole copy of the model's state on every rank where the
      host is the device (``.clone()``).
    * ZeRO-3 with ``stage3_gather_16bit_weights_on_model_save``: the 16-bit consolidation
      (`preflight._sharding.zero3_consolidation`), which rank 0 keeps whole where the host is the device. Without
      that option accelerate raises, and the Trainer saves the partitions alone.

    ``state_dict="sharded"`` (Lightning's ``DeepSpeedStrategy``, accelerate's ``save_state``): the partitions alone.
    """
    if sharding not in ("zero1", "zero2", "zero3") or (state_dict != "full" and sharding != "zero3"):
        return None
    if state_dict != "full":
        return DeepSpeedSave((), (), False, "each rank's partitions (save_checkpoint), from the state the step "
                             "leaves (the non-persistent parameters released)")
    ds, given = _config_or_defaults(ds, sharding)
    if sharding != "zero3":
        if not host_is_device:
            return DeepSpeedSave((), (), False, "the HF Trainer's save_model clones the model's state dict to the "
                                 "host (accelerate's get_state_dict, clone_tensors_for_torch_save): nothing on the "
                                 "device")
        half = _half_dtype(ds, precision, given)
        sizes = [t.numel() * (half.itemsize if half is not None and t.is_floating_point() else t.element_size())
                 for t in model.state_dict().values() if isinstance(t, torch.Tensor)]
        copy = tuple((i, n) for i, n in enumerate(sizes) if n)
        return DeepSpeedSave(copy, copy, False,
                             f"the HF Trainer's save_model clones the model's state dict on every rank "
                             f"(accelerate's get_state_dict, clone_tensors_for_torch_save: {len(sizes)} entries, "
                             f"{sum(sizes):,} B), on the device where the host is the device")
    gather = ds["stage3_gather_16bit_weights_on_model_save"]
    if not gather:
        return DeepSpeedSave((), (), False, "stage3_gather_16bit_weights_on_model_save is "
                             f"{'off' if gather is not None else 'auto (taken as off)'}: the model is not "
                             "consolidated, the HF Trainer saves the partitions alone, from the state the step "
                             "leaves (the non-persistent parameters released)")
    itemsize = _param_itemsize(model, ds, precision, given)
    params = [(id(p), p.numel()) for p in model.parameters()]
    walk = [[id(p) for p in m.parameters(recurse=False)] for m in _visited(model)]
    # Where the host is the device the run's process group is gloo's, which stages each all-gather's output.
    kept = zero3_consolidation(params, walk, world_size=world_size, itemsize=itemsize, keep=host_is_device,
                               staged=host_is_device)
    passing = zero3_consolidation(params, walk, world_size=world_size, itemsize=itemsize, keep=False,
                                  staged=host_is_device)
    # the largest module gathered: the peak of a walk that neither keeps nor stages
    largest = max(itertools.accumulate(n for _, n in zero3_consolidation(params, walk, world_size=world_size,
                                                                          itemsize=itemsize, keep=False)),
                  default=0)
    how = ("ZeRO-3's 16-bit consolidation (stage3_gather_16bit_weights_on_model_save; engine.py "
           "_zero3_consolidated_16bit_state_dict): every parameter partitioned first, each module's own gathered "
           f"in turn at its padded size (largest {largest:,} B) and partitioned again, the persistent ones gathered "
           "again after it; " + ("gloo stages each all-gather's output in a block of its own; " if host_is_device
                                 else ""))
    how += ("rank 0 keeps every gathered parameter until the save ends (.cpu() is the tensor itself where the host "
            "is the device)" if host_is_device else "rank 0 copies each to the host")
    return DeepSpeedSave(tuple(kept), tuple(passing), True, how)


def _visited(module: nn.Module) -> list[nn.Module]:
    """The modules ``_zero3_consolidated_16bit_state_dict`` visits, in its order: ``named_children`` depth first,
    the module before its children (a module reached twice is visited twice)."""
    out = [module]
    for _, child in module.named_children():
        if child is not None:
            out.extend(_visited(child))
    return out
