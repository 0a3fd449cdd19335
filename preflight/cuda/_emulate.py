"""Switch the CUDA target's semantics on for one trace on a CPU host: autocast lists and kernel choices."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from preflight._gpus import GPU
from preflight.cuda._autocast import cuda_autocast
from preflight.cuda._kernels import cuda_kernels
from preflight.cuda._offload import HostTracker, Offloaded, host_offloading

__all__ = ["CudaTarget", "Emulation", "emulate_cuda"]

# A CUDA target named by no GPU (``device="cuda"`` on a machine without one): the choices that depend on the
# architecture (attention kernels) follow an A100's. Said in the notes.
_ASSUMED_CC = (8, 0)


@dataclasses.dataclass(frozen=True)
class CudaTarget:
    """The CUDA device a trace stands for.

    Attributes:
        compute_capability: ``(major, minor)``; decides the attention backend.
        name: the catalog name, or None when no GPU was named (then ``compute_capability`` is assumed).
        cudnn_version: the runtime cuDNN version (``torch.backends.cudnn.version()``), None when unknown.
    """

    compute_capability: tuple[int, int]
    name: str | None = None
    cudnn_version: int | None = None

    @staticmethod
    def of(gpu: GPU | None) -> CudaTarget:
        if gpu is None:
            return CudaTarget(_ASSUMED_CC)
        return CudaTarget(gpu.compute_capability, gpu.name)

    def describe(self) -> str:
        cc = f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"
        return f"{self.name} ({cc})" if self.name else f"an unnamed CUDA GPU ({cc} assumed)"


@dataclasses.dataclass
class Emulation:
    """What an emulated trace used: attention backends by call count, and what saved-tensor hooks moved to the host
    (filled while it runs)."""

    target: CudaTarget
    attention: dict[str, int] = dataclasses.field(default_factory=dict)
    offloaded: Offloaded = dataclasses.field(default_factory=Offloaded)

    def notes(self) -> list[str]:
        used = ", ".join(f"{backend} x{n}" for backend, n in sorted(self.attention.items()))
        notes = [f"CUDA semantics of torch {torch.__version__.split('+')[0]} applied on the CPU host for "
                 f"{self.target.describe()}: CUDA autocast lists and weight cast cache, fused dropout"
                 + (f", attention kernels {used}" if used else "")]
        return notes + ([self.offloaded.note()] if self.offloaded.tensors else [])


@contextlib.contextmanager
def emulate_cuda(target: CudaTarget, tracker: HostTracker) -> Iterator[Emulation]:
    """Run the block on CPU tensors as a CUDA device of ``target`` would: `cuda_autocast`, `cuda_kernels`, and
    activations offloaded by saved-tensor hooks taken off the device in ``tracker`` (`host_offloading`)."""
    emulation = Emulation(target)
    with cuda_autocast(), cuda_kernels(target.compute_capability, cudnn_version=target.cudnn_version) as sdpa, \
            host_offloading(tracker) as offloaded:
        emulation.attention = sdpa.calls  # the same dict, filled as calls happen
        emulation.offloaded = offloaded
        yield emulation
