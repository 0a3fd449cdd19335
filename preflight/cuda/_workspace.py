"""The cuBLAS workspaces a CUDA training step holds in the caching allocator.

torch gives every cuBLAS handle a workspace per (handle, stream), allocated from the CUDA caching allocator the
first time the handle runs a GEMM on that stream (``getCurrentCUDABlasHandle`` and ``getNewWorkspace`` in
``aten/src/ATen/cuda/CublasHandlePool.cpp``; ROCm was brought in line with "cublas behavior with respect to setting
the workspace to an allocation from the caching allocator", pytorch/pytorch#138791), so it counts in
``torch.cuda.memory_allocated()``: a single ``nn.Linear(1, 1)`` forward on an A10G left 8,519,680 B allocated
(pytorch/pytorch#95668, torch 2.0). Handles are per thread (``DeviceThreadHandlePool``), and the backward runs on
the autograd engine's device thread, so a training step holds two: one from the first forward GEMM, one from the
first backward GEMM. The cuBLASLt workspace shares the cuBLAS one on open-source CUDA builds
(``TORCH_CUBLASLT_UNIFIED_WORKSPACE``, the note in ``torch.backends.cuda.blas_workspace_size``'s docstring, torch
2.13), so it adds nothing.

Size: ``CUBLAS_WORKSPACE_CONFIG`` when set (``:SIZE_KiB:COUNT`` pairs, summed, as ``parseChosenWorkspaceSize``
reads it), else torch's default for the architecture (`preflight._gpus`: 4096 KiB x 2 + 16 KiB x 8 = 8,519,680 B;
32 MiB from Hopper on, pytorch/pytorch#120925).

cuDNN convolution workspaces are not counted from a CPU host, and `cudnn_workspace_note` says so in the
coverage. Each convolution call allocates one from the caching allocator, sized by the algorithm (v7 API) or
engine plan (v8 API) cuDNN picks on the device, which a CPU host cannot know. It cannot cause an out-of-memory
error on its own: when the allocation fails, torch tries the next algorithm (``AlgoIterator::try_all`` in
``aten/src/ATen/native/cudnn/Conv_v7.cpp`` catches ``OutOfMemoryError``), or halves the workspace limit and drops
the plans that need more (``generate_and_filter_plans`` in ``Conv_v8.cpp``). Where memory is free it still
raises ``max_memory_allocated`` above ``peak_bytes``, by at most ``CUDNN_CONV_WSCAP_DBG`` MiB per call when that
is set.

Known limitations: a workspace set at run time with ``torch.backends.cuda.cublas_workspace_size`` is not seen;
extra streams (``torch.cuda.Stream``) or threads add workspaces.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

from preflight._result import Event

__all__ = ["WORKSPACE_UIDS", "cublas_workspace_bytes", "cudnn_workspace_note", "with_workspaces"]

_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8  # 8,519,680 B
_HOPPER = 4096 * 8 * 1024  # 33,554,432 B

# uids of the two workspaces (the tracker's uids are >= 0; calibrated scratch and sharding use other negatives).
WORKSPACE_UIDS = (-(2**62) + 16, -(2**62) + 17)


def cublas_workspace_bytes(compute_capability: tuple[int, int], env: Mapping[str, str] | None = None) -> int:
    """One cuBLAS workspace's size on a GPU of ``compute_capability``, under ``env`` (default ``os.environ``).

    Example:
        >>> cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
        33554432
    """
    env = os.environ if env is None else env
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":(\d+):(\d+)", config)
        if pairs:
            return sum(int(size) * int(count) for size, count in pairs) * 1024
    return _HOPPER if compute_capability[0] >= 9 else _DEFAULT


def with_workspaces(events: Sequence[Event], nbytes: int) -> list[Event]:
    """``events`` with one workspace allocated at the first traced operator the calling thread runs (a step's
    forward, or ``generate``'s first operator) and one where the first backward phase starts (both held to the
    end: the allocator keeps them for the life of the handle). A pipeline schedule runs its backwards inside its
    step (phase ``stepN/pipeline``), on the autograd thread too: that workspace is placed where the step starts,
    an upper bound for the moments before its first backward."""
    out = list(events)
    backward = next((i for i, e in enumerate(out) if e.op >= 0 and e.phase.endswith("/backward")), None)
    if backward is None:
        backward = next((i for i, e in enumerate(out) if e.op >= 0 and e.phase.endswith("/pipeline")), None)
    forward = next((i for i, e in enumerate(out) if e.op >= 0 and e.phase != "setup"
                    and not e.phase.endswith("/backward")), None)
    placed = [(at, uid) for uid, at in zip(WORKSPACE_UIDS, (forward, backward)) if at is not None]
    for at, uid in sorted(placed, reverse=True):  # the later position first: the earlier one stays valid
        out.insert(at, Event(uid, nbytes, out[at].op, out[at].phase))
    return out


def cudnn_workspace_note(convolutions: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The coverage note for convolution configurations (labels) whose cuDNN workspace a CPU host cannot size.

    Example:
        >>> cudnn_workspace_note(["convolution[(8, 3, 224, 224)]"], {})[:52]
        'cuDNN convolution workspace not counted for 1 config'
    """
    env = os.environ if env is None else env
    cap = env.get("CUDNN_CONV_WSCAP_DBG")
    bound = (f"at most {cap} MiB per call (CUDNN_CONV_WSCAP_DBG)" if cap and cap.strip().isdigit()
             else "by the workspace of the algorithm cuDNN picks (CUDNN_CONV_WSCAP_DBG=<MiB> caps it)")
    shown = ", ".join(convolutions[:3]) + (", ..." if len(convolutions) > 3 else "")
    return (f"cuDNN convolution workspace not counted for {len(convolutions)} configuration(s) ({shown}): its size "
            "depends on the algorithm cuDNN picks on the GPU. It cannot cause an out-of-memory error by itself "
            "(torch falls back to algorithms needing less workspace when the allocation fails), but where memory "
            f"is free max_memory_allocated can exceed peak_bytes during a convolution, {bound}")
