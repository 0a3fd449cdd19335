"""The CUDA target's semantics, applied to a trace that runs on a CPU host.

Users plan GPU jobs from laptops and login nodes, where a CUDA target is traced on CPU fake tensors. What a GPU
would do differently is reproduced here, each piece from the installed torch's own rules: CUDA's autocast op lists
and weight cast cache (`_autocast`), the attention kernel `scaled_dot_product_attention` picks for the target GPU
and the fused dropout kernel CUDA uses, with the scratch the memory-efficient attention's backward allocates
(`_kernels`). `emulate_cuda` switches all of it on for one trace. What kernels allocate and free inside one call is
modelled too, for the estimate to insert: reductions' staging buffers (`_reduce`) and other kernels' temporaries
(`_temporaries`), and cuBLAS's workspaces (`_workspace`). Nothing here knows about traces, estimates or trainers;
`preflight.trace` calls in.
"""

from preflight.cuda._autocast import CUDA_POLICIES, cuda_autocast
from preflight.cuda._emulate import CudaTarget, Emulation, emulate_cuda
from preflight.cuda._kernels import (SDPA_BACKENDS, SdpaChoices, choose_sdpa_backend, cuda_kernels,
                                     device_backward_scratch, efficient_backward_workspace)
from preflight.cuda._reduce import REDUCE_OPS, ReduceDevice, reduce_device, reduce_scratch
from preflight.cuda._temporaries import MODELLED_OPS, kernel_temporaries
from preflight.cuda._workspace import WORKSPACE_UIDS, cublas_workspace_bytes, cudnn_workspace_note, with_workspaces

__all__ = ["CUDA_POLICIES", "MODELLED_OPS", "REDUCE_OPS", "SDPA_BACKENDS", "WORKSPACE_UIDS", "CudaTarget", "Emulation",
           "ReduceDevice", "SdpaChoices", "choose_sdpa_backend", "cublas_workspace_bytes", "cuda_autocast",
           "cuda_kernels", "cudnn_workspace_note", "device_backward_scratch", "efficient_backward_workspace",
           "emulate_cuda", "kernel_temporaries", "reduce_device", "reduce_scratch", "with_workspaces"]
