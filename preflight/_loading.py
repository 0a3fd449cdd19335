"""`Loading`: how the model comes to each rank's device, the loading section of a `preflight.Run`.

A run's loading is a phase of its own (``"loading"`` in `preflight.Estimate.phases`): on one device it holds the
model's parameters and buffers; under a sharding engine it can be the run's peak, because a rank may hold the whole
model before the engine shards it (the published misses of multi-GPU runs whose peak came from loading). Where the
model comes from decides it, read from the engines' source (torch 2.13):

- ``"device"``: each rank holds the whole model on its device before the engine wraps it
  (``from_pretrained(..., device_map=...)``, ``model.to(device)`` before ``fully_shard`` or FSDP1). The engine's
  wrapping is traced on the rank's fake copy with every parameter and buffer alive: ``fully_shard`` copies each
  parameter's shard (padded) while the full tensors it replaces are freed unit by unit; FSDP1 concatenates each
  unit's parameters into its flat parameter before it keeps its shard.
- ``"host"``: the whole model is on the host and the engine moves it to the device as it wraps each unit: FSDP2
  moves a unit's parameters and buffers inside ``fully_shard`` (``_fsdp_init._move_states_to_device``), FSDP1 inside
  its constructor with ``device_id`` (``_init_utils._move_module_to_device``); the trace counts each tensor from the
  moment the engine moves it. Engines that do not move the model themselves (DDP, ZeRO, tensor, pipeline, context
  and expert parallelism as preflight traces them) get the ``"device"`` figure, labelled an upper bound. On a CPU
  target the host is the device: ``"host"`` is ``"device"``.
- ``"meta"``: built on the meta device, each rank materialises only its own shards (``to_empty``) and fills them in
  place (a distributed checkpoint, ``reset_parameters``): torchtitan, Lightning's ``ModelParallelStrategy``, a
  model built under ``init_module(empty_init=True)`` and wrapped by FSDP, DeepSpeed's ``zero.Init``. The phase is
  the rank's resident parameters and buffers as the training trace holds them.

What is not traced: reading the checkpoint's files (host memory: safetensors maps them, ``torch.load`` reads them),
a conversion on the device from the checkpoint's dtype (transformers converts on the host, then copies), the
merging of per-expert checkpoint tensors that transformers' weight converters do for mixture-of-experts models.
A full state dict rank 0 broadcasts into a meta-built model (``Loading("meta", from_rank0=True)``) is traced through
torch's ``set_model_state_dict`` under FSDP2: each rank holds its shards and one full tensor at a time, and rank 0
moves each of its host tensors to the device first (on a CPU target its whole state dict is device memory). Under
FSDP1 it is ``sync_module_states=True`` (accelerate's ``cpu_ram_efficient_loading``): rank 0 holds the model on its
host, the others build it on meta, and FSDP1 broadcasts each unit's states from rank 0 as it wraps the unit, traced
through torch's ``_broadcast_coalesced``. The notes say what was not traced.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["LOAD_PHASE", "PLACEMENTS", "Loading"]

PLACEMENTS = ("device", "host", "meta")

LOAD_PHASE = "load"  # the `Event.phase` of a loading trace's events, and the loading phase's `where`


@dataclasses.dataclass(frozen=True)
class Loading:
    """How the model comes to each rank's device: the loading section of a `preflight.Run` (module docstring). A
    `Run` without one predicts no loading phase.

    Attributes:
        placement: ``"device"`` (each rank holds the whole model on its device before the engine wraps it: the
            default of ``from_pretrained`` with a ``device_map`` and of ``model.to(device)``), ``"host"`` (the model
            is on the host and FSDP moves it to the device unit by unit as it wraps it: FSDP1 with ``device_id``,
            ``fully_shard`` of a CPU model; accelerate's and Lightning's FSDP of a model loaded on the CPU) or
            ``"meta"`` (built on meta; each rank materialises its own shards and loads into them).
        from_rank0: with ``"meta"``, the shards are filled from a full state dict rank 0 holds on its host and
            broadcasts one tensor at a time: torch's ``set_model_state_dict(model, full, StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))``, traced through torch's own code (accelerate's
            ``cpu_ram_efficient_loading`` broadcasts each tensor the same way and cuts it with ``distribute_tensor``,
            which is not run); under FSDP1, ``sync_module_states=True``: rank 0 broadcasts each unit's states as
            FSDP1 wraps it. False: each rank reads its own
            shards in place (a distributed checkpoint, ``reset_parameters``).
    """

    placement: str = "device"
    from_rank0: bool = False

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"`Loading.placement` should be one of {PLACEMENTS}, got {self.placement!r}: 'device' "
                             "(the whole model on each rank's device before the engine wraps it), 'host' (the engine "
                             "moves it from the host unit by unit) or 'meta' (each rank materialises its own shards).")
        if not isinstance(self.from_rank0, bool):
            raise TypeError(f"`Loading.from_rank0` should be True or False, got {self.from_rank0!r}.")
        if self.from_rank0 and self.placement != "meta":
            raise ValueError("`Loading(from_rank0=True)` fills the shards of a model built on meta from rank 0's full "
                             "state dict: use it with placement='meta'.")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
