"""A catalog of common NVIDIA GPUs: the memory a training process can plan against, and what CUDA takes.

``get_gpu("h100")`` returns a `GPU` whose ``memory_bytes`` is what
``torch.cuda.get_device_properties(i).total_memory`` reports on that card (``cudaDeviceProp.totalGlobalMem``,
the same total ``cudaMemGetInfo`` and torch's out-of-memory message use). That is less than the
``memory.total`` nvidia-smi prints (e.g. 40,339 MiB against nvidia-smi's 40,960 MiB on an A100 40GB) because
the driver keeps part of the memory for itself, and it moves by a few MiB between driver versions (the same
A100 80GB PCIe read 85,097,971,712 B and, after a driver restart, 85,094,825,984 B). Figures below come from
public ``deviceQuery`` printouts (exact bytes) or torch's ``_CudaDeviceProperties`` repr (whole MiB, rounded
down); each carries its source. A figure marked *nominal* was not measured.

Known limitations:
    * One board per name: ``H100-80GB`` is the SXM5 HBM3 board; the PCIe H100 and the 94 GB NVL differ.
    * ``context_bytes`` is approximate (see `_CONTEXT_BYTES`): Hopper's was measured after two training steps;
      the others are bare contexts from published reports, and a context grows as kernels are loaded lazily
      during the run (by 224 MiB on the H200 measured); NCCL adds its own buffers under distributed training.
    * ECC, MIG partitions, and other processes on the card reduce what is available further.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["GPU", "get_gpu", "known_gpus"]

_MiB = 2**20


@dataclasses.dataclass(frozen=True)
class GPU:
    """One GPU model.

    Attributes:
        name: the catalog name, e.g. ``"A100-80GB"``.
        memory_bytes: total device memory as torch reports it (``get_device_properties().total_memory``).
        arch: architecture generation: ``"volta"``, ``"turing"``, ``"ampere"``, ``"ada"`` or ``"hopper"``.
        compute_capability: ``(major, minor)``, e.g. ``(8, 0)``.
        bf16: native bfloat16 tensor-core support (compute capability 8.0 and later). Older cards can run
            bfloat16 only through slow emulation.
        cublas_workspace_bytes: torch's default cuBLAS workspace, allocated once per (cuBLAS handle, stream)
            through the caching allocator, so it counts in ``torch.cuda.memory_allocated()``. Handles are
            per thread, and the backward runs on the autograd engine's device thread, so a training step can
            hold two (not measured here).
        context_bytes: approximate CUDA context size with lazy module loading (outside the allocator, seen
            only by nvidia-smi), or the size the user gave (``context_given``, `with_context`).
        nccl_buffers: NCCL's buffers per communicator as the user measured them (`preflight.Target.nccl_buffers`,
            `with_context`); None: modelled (`preflight.cuda._nccl`).
        sm_count: streaming multiprocessors (``multiProcessorCount``), from NVIDIA's datasheets; CUDA reductions
            size their staging buffers by it (`preflight.cuda._reduce`). None where not known.

    Example:
        >>> get_gpu("h100_80gb").compute_capability
        (9, 0)
    """

    name: str
    memory_bytes: int
    arch: str
    compute_capability: tuple[int, int]
    bf16: bool
    cublas_workspace_bytes: int
    context_bytes: int
    context_given: bool = False  # context_bytes is the user's (Target.cuda_context), not the catalog's figure
    nccl_buffers: int | None = None
    sm_count: int | None = None

    @property
    def threads_per_sm(self) -> int:
        """Resident threads per multiprocessor (``maxThreadsPerMultiProcessor``) for the compute capability: the CUDA
        C++ Programming Guide's table of technical specifications (2048 on sm_70, sm_80 and sm_90; 1024 on sm_75;
        1536 on sm_86 and sm_89)."""
        return _THREADS_PER_SM.get(self.compute_capability, 2048)


_THREADS_PER_SM = {(7, 5): 1024, (8, 6): 1536, (8, 7): 1536, (8, 9): 1536}


# torch's default cuBLAS workspace size, parseChosenWorkspaceSize() in
# aten/src/ATen/cuda/CublasHandlePool.cpp (pytorch/pytorch): ":4096:2:16:8" (2 x 4096 KiB + 8 x 16 KiB)
# unless CUBLAS_WORKSPACE_CONFIG says otherwise, and 32 MiB on Hopper. Older versions test for sm_90
# exactly, newer ones for major 9, 10, 11, 12 (Hopper and Blackwell); the cards here agree under both.
# Unified with the cuBLASLt workspace by default on open-source CUDA builds (torch 2.13 docstring of
# torch.backends.cuda.blas_workspace_size), so no separate Lt workspace is counted.
_CUBLAS_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8  # 8,519,680 B
_CUBLAS_HOPPER = 4096 * 8 * 1024  # 33,554,432 B

# CUDA context with lazy module loading (torch sets CUDA_MODULE_LOADING=LAZY since 1.13, pytorch/pytorch#86509;
# CUDA enables it by default on Linux since 12.2). All approximate: the context depends on the driver, the
# CUDA version and the kernels loaded, more than on the card.
_CONTEXT_BYTES = {
    # No Volta measurement with lazy loading found. ptrblck's general figure, "around 400MB if CUDA >= 11.7
    # is used and lazy module loading enabled" (pytorch/pytorch#109888). Eager loading took about 1 GB
    # (Titan V, PyTorch 1.3, pytorch/pytorch#28394).
    "volta": 400 * _MiB,
    # No Turing measurement found; the same general figure (pytorch/pytorch#109888).
    "turing": 400 * _MiB,
    # 256 MiB for a bare context on an RTX 3090, torch 2.7.1+cu128 (invoke-ai/InvokeAI#9413); 287,047,680 B
    # in use after a first small tensor with lazy loading (pytorch/pytorch#86509); "~300MB"
    # (pytorch/pytorch#107667).
    "ampere": 300 * _MiB,
    # 426 MiB in nvidia-smi after torch.cuda.mem_get_info on an RTX 6000 Ada, torch 2.10.0+cu130
    # (unslothai/unsloth-zoo#1053).
    "ada": 426 * _MiB,
    # Measured on an H200 (torch 2.11.0+cu130, driver 580.159.04, benchmarks/results/gpu_validation_h200.md):
    # 526.8 MiB in use after the first torch.cuda.mem_get_info (the bare context), and 750.8 MiB outside the
    # caching allocator (in use minus reserved) after two training steps of a fresh process: the kernels loaded
    # lazily and cuBLAS's handles. The device total is read at the step's peak, so the figure after the steps is
    # the one used (it was 500 MiB, unmeasured, before).
    "hopper": 751 * _MiB,
}


def _gpu(name: str, memory_bytes: int, arch: str, cc: tuple[int, int], sm_count: int) -> GPU:
    return GPU(
        name=name,
        memory_bytes=memory_bytes,
        arch=arch,
        compute_capability=cc,
        bf16=cc >= (8, 0),
        cublas_workspace_bytes=_CUBLAS_HOPPER if cc[0] >= 9 else _CUBLAS_DEFAULT,
        context_bytes=_CONTEXT_BYTES[arch],
        sm_count=sm_count,
    )


# nvidia-smi totals quoted for comparison come from modal-labs/modal-client#2797. Multiprocessor counts (the last
# figure) from NVIDIA's datasheets and architecture whitepapers: A100 108, H100 SXM5 and H200 132, L4 58, L40S 142,
# A10G 80, RTX 3090 82, RTX 4090 128, V100 80, T4 40.
_CATALOG: tuple[GPU, ...] = (
    # deviceQuery, "NVIDIA A100-SXM4-40GB", driver CUDA 12.2 (bottlerocket-os/bottlerocket#3873).
    # nvidia-smi: 40,960 MiB.
    _gpu("A100-40GB", 42_298_834_944, "ampere", (8, 0), 108),
    # torch total_memory on "NVIDIA A100-SXM4-80GB" in several public run logs (torch 2.7.1+cu126 and others);
    # an A100 80GB PCIe read the same after a driver restart, 85,097,971,712 B before it. nvidia-smi: 81,920 MiB.
    _gpu("A100-80GB", 85_094_825_984, "ampere", (8, 0), 108),
    # deviceQuery, "NVIDIA H100 80GB HBM3" (SXM5), driver CUDA 12.8 (public podman/CDI walkthrough);
    # 85,045,477,376 B under driver 12.7, 85,017,755,648 B under 13.0; torch repr 81,089 MiB
    # (stas00/ml-engineering, torch 2.7 / CUDA 12.8). nvidia-smi: 81,559 MiB.
    _gpu("H100-80GB", 85_028_896_768, "hopper", (9, 0), 132),
    # torch repr "NVIDIA H200 ... total_memory=143156MB" in a public vLLM-on-Modal example: whole MiB,
    # so exact to within 1 MiB (rounded down). Nominal 141 GB.
    _gpu("H200", 143_156 * _MiB, "hopper", (9, 0), 132),
    # deviceQuery, "NVIDIA L4", driver CUDA 12.0 (public setup guide). nvidia-smi: 23,034 MiB.
    _gpu("L4", 23_612_293_120, "ada", (8, 9), 58),
    # deviceQuery, "NVIDIA L40S", driver CUDA 12.4, ECC on (alvarobartt/cuda-device-query README).
    # nvidia-smi: 46,068 MiB.
    _gpu("L40S", 47_576_711_168, "ada", (8, 9), 142),
    # torch repr "NVIDIA A10G ... total_memory=22723MB" in a public YOLOv3 training log: whole MiB, rounded
    # down. (nvidia-smi shows 23,028 MiB for the A10, a different board.)
    _gpu("A10G", 22_723 * _MiB, "ampere", (8, 6), 80),
    # deviceQuery, "NVIDIA GeForce RTX 3090", two public Linux reports (drivers CUDA 11.3 and 11.8);
    # 25,206,325,248 B was seen on an eGPU that also drives displays.
    _gpu("RTX-3090", 25_447_170_048, "ampere", (8, 6), 82),
    # deviceQuery, "NVIDIA GeForce RTX 4090", 8-GPU Linux server, driver CUDA 12.4; 25,250,627,584 B under
    # driver 13.0; 24,146,083,840 B on Windows (WDDM keeps more).
    _gpu("RTX-4090", 25_386_352_640, "ada", (8, 9), 128),
    # deviceQuery, "Tesla V100-SXM2-16GB", driver CUDA 12.4; 16,911,433,728 B under driver 11.0 (Marconi-100).
    _gpu("V100-16GB", 16_928_342_016, "volta", (7, 0), 80),
    # deviceQuery, "Tesla V100-SXM2-32GB", SDSC Expanse, drivers CUDA 11.6 and 13.0; 34,072,559,616 B
    # under 12.9.
    _gpu("V100-32GB", 34_089_926_656, "volta", (7, 0), 80),
    # deviceQuery, "Tesla T4", drivers CUDA 12.4 and 12.5 (two public reports). Varies more than most:
    # 15,835,660,288 B on Colab (driver 12.2). nvidia-smi: 15,360 MiB.
    _gpu("T4", 15_642_329_088, "turing", (7, 5), 40),
)

_BY_NAME = {gpu.name: gpu for gpu in _CATALOG}

# How names are matched: the model (e.g. "a100") and the memory size in GB when the catalog has one, plus
# the names torch.cuda.get_device_name() returns, so get_gpu(torch.cuda.get_device_name()) works.
_MODEL_AND_SIZE = {
    "A100-40GB": ("a100", 40),
    "A100-80GB": ("a100", 80),
    "H100-80GB": ("h100", 80),
    "H200": ("h200", 141),
    "L4": ("l4", 24),
    "L40S": ("l40s", 48),
    "A10G": ("a10g", 24),
    "RTX-3090": ("rtx3090", 24),
    "RTX-4090": ("rtx4090", 24),
    "V100-16GB": ("v100", 16),
    "V100-32GB": ("v100", 32),
    "T4": ("t4", 16),
}
_DEVICE_NAMES = {
    "A100-40GB": ("a100sxm440gb", "a100pcie40gb"),
    "A100-80GB": ("a100sxm480gb", "a10080gbpcie"),
    "H100-80GB": ("h10080gbhbm3",),
    "RTX-3090": ("3090",),
    "RTX-4090": ("4090",),
    "V100-16GB": ("v100sxm216gb", "v100pcie16gb"),
    "V100-32GB": ("v100sxm232gb", "v100pcie32gb"),
}
# Vendor words dropped before matching: "NVIDIA GeForce RTX 3090" -> "rtx3090", "Tesla T4" -> "t4".
_VENDOR_WORDS = frozenset({"nvidia", "tesla", "geforce"})


def _normalize(name: str) -> str:
    words = re.split(r"[^a-z0-9]+", name.lower())
    return "".join(w for w in words if w and w not in _VENDOR_WORDS)


def _build_index() -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    exact: dict[str, str] = {}
    by_model: dict[str, list[str]] = {}
    for name, (model, gb) in _MODEL_AND_SIZE.items():
        for key in (_normalize(name), f"{model}{gb}gb", f"{model}{gb}g", f"{model}{gb}",
                    *_DEVICE_NAMES.get(name, ())):
            exact[key] = name
        by_model.setdefault(model, []).append(name)
    return exact, {model: tuple(names) for model, names in by_model.items()}


_EXACT, _BY_MODEL = _build_index()


def known_gpus() -> tuple[str, ...]:
    """The catalog names, e.g. ``("A100-40GB", "A100-80GB", ...)``."""
    return tuple(_BY_NAME)


def with_context(gpu: GPU | None, context: int | float | str | None,
                 nccl_buffers: int | float | str | None = None) -> GPU | None:
    """``gpu`` with the CUDA context the user measured (`preflight.Target.cuda_context`) in place of the catalog's,
    and NCCL's buffers per communicator they measured (`preflight.Target.nccl_buffers`)."""
    if gpu is None:
        return gpu
    from preflight._units import parse_bytes

    if context is not None:
        gpu = dataclasses.replace(gpu, context_bytes=parse_bytes(context, name="cuda_context"), context_given=True)
    if nccl_buffers is not None:
        gpu = dataclasses.replace(gpu, nccl_buffers=parse_bytes(nccl_buffers, name="nccl_buffers"))
    return gpu


def get_gpu(name: str) -> GPU:
    """Look a GPU up by name.

    Matching ignores case, separators and vendor words: ``"h100"``, ``"H100-80GB"``, ``"h100_80gb"`` and
    ``"NVIDIA H100 80GB HBM3"`` (what ``torch.cuda.get_device_name()`` returns) all give ``H100-80GB``. A model
    with several memory sizes needs the size: ``"a100"`` is ambiguous.

    Args:
        name: a catalog name, an alias, or a torch device name.

    Returns:
        The `GPU`.

    Raises:
        ValueError: the name is ambiguous (the message lists the variants) or unknown (it lists every name).

    Example:
        >>> get_gpu("a100-80gb").memory_bytes
        85094825984
    """
    if not isinstance(name, str):
        raise TypeError(f"A GPU name must be a string, got {name!r} of type {type(name).__name__}.")
    key = _normalize(name)
    if key in _EXACT:
        return _BY_NAME[_EXACT[key]]
    variants = _BY_MODEL.get(key, ())
    if len(variants) == 1:
        return _BY_NAME[variants[0]]
    if variants:
        raise ValueError(
            f"GPU name {name!r} is ambiguous: it matches {', '.join(variants)}. "
            f"Give the memory size too, e.g. {variants[-1]!r}."
        )
    raise ValueError(
        f"Unknown GPU {name!r}. Known GPUs: {', '.join(known_gpus())}. "
        "Use one of these names (case and separators do not matter)."
    )
