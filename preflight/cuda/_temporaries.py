"""Memory CUDA kernels allocate and free inside one operator call, modelled from ATen's source.

A dispatch mode sees an operator's outputs, not what its kernel allocates for itself. On a GPU those blocks come from
the caching allocator and count in ``max_memory_allocated`` while the kernel runs; a trace for a CUDA target runs
CPU kernels (or fake ones), which allocate differently or not at all. `kernel_temporaries` gives, for the operators
modelled here, the blocks the CUDA kernel holds beyond its outputs, in allocation order (freed in the reverse order
when it returns), from the operator's input shapes, strides and dtypes:

- reductions (``sum``, ``mean``, ``nansum``): the staging buffer and semaphores of a reduction split across thread
  blocks (`preflight.cuda._reduce`);
- ``_softmax_backward_data``: the product ``grad * output`` the kernel computes first (``softmax_backward_cuda_out``
  in ``aten/src/ATen/native/cuda/SoftMax.cu``), a tensor of the gradient's shape, freed when the kernel returns.
  ``log_softmax``'s backward has none.

The memory-efficient attention's backward holds scratch too; it is traced, not modelled here (`preflight.cuda.
_kernels`). Read from ATen's source (torch 2.13); checked against the allocator history recorded on an H200
(``benchmarks/results/snapshots``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from preflight.cuda._reduce import REDUCE_OPS, ReduceDevice, reduce_scratch

__all__ = ["MODELLED_OPS", "kernel_temporaries"]

_aten = torch.ops.aten
_SOFTMAX_BACKWARD = _aten._softmax_backward_data.default
MODELLED_OPS = REDUCE_OPS | {_SOFTMAX_BACKWARD}


def kernel_temporaries(func: Any, args: Sequence[Any], kwargs: dict[str, Any], device: ReduceDevice
                       ) -> tuple[int, ...] | None:
    """The blocks a `MODELLED_OPS` call allocates inside its CUDA kernel after its outputs, in allocation order
    (``()``: none; None: not modelled). ``args`` hold tensors or `preflight.trace.TensorSpec`s.

    Example:
        >>> from preflight.trace import TensorSpec
        >>> grad = TensorSpec((8, 8, 256, 256), (524288, 65536, 256, 1), torch.float32)
        >>> kernel_temporaries(torch.ops.aten._softmax_backward_data.default, [grad, grad, -1, torch.float16], {},
        ...                    ReduceDevice(132, 2048))
        (16777216,)
    """
    if func in REDUCE_OPS:
        return reduce_scratch(func, args, kwargs, device)
    if func is _SOFTMAX_BACKWARD and len(args) >= 2:
        grad, output = args[0], args[1]
        dtype = torch.promote_types(grad.dtype, output.dtype)
        numel = math.prod(grad.shape)
        return (numel * dtype.itemsize,) if numel else ()
    return None
