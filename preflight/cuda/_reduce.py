"""The staging buffers of CUDA reductions: memory ``sum`` and ``mean`` allocate inside the kernel.

ATen's CUDA reductions (``gpu_reduce_kernel`` in ``aten/src/ATen/native/cuda/Reduce.cuh``) split a long reduction
over several thread blocks when few outputs would leave the GPU idle: each block writes a partial result to a
staging buffer in global memory, and the last block of each output combines them. The buffer and its semaphores come
from the caching allocator for the kernel call and are freed after it, so they count in ``max_memory_allocated`` and
shape the reserved segments, but they are no operator's output and no dispatch mode sees them. A bias gradient is
such a reduction (the output gradient summed over the tokens): on an H200, GPT-2's (2,048 x 1,536) bias gradient
took a 25,165,824-byte buffer and a BERT masked-LM head's 8,000-word bias one of 131,072,000 B, 8 bytes per logit of
the batch.

`reduce_scratch` computes the buffer and semaphore sizes from the operator's input layout as the kernel does:
TensorIterator's geometry for a reduction (``reorder_dimensions`` puts the reduced dimensions first and orders the
others by stride, ``coalesce_dimensions`` merges the contiguous ones; ``aten/src/ATen/TensorIterator.cpp``), then
``setReduceConfig``'s block shape, vectorization and split of the inputs across blocks, which reads the GPU's
multiprocessor count and threads per multiprocessor (`ReduceDevice`). Modelled operators: ``sum``, ``nansum`` and
``mean`` (their accumulator is fp32 for 16- and 32-bit inputs, fp64 for fp64 and int64 for integers and booleans).
Read from the headers torch 2.13's wheel installs (``torch/include/ATen/native/cuda/Reduce.cuh``; ``sum`` of
16-bit inputs loads 8 values per vector, ``ReduceSumProdKernel.cu``), and checked against the allocator history
recorded on an H200 (``benchmarks/results/snapshots``; tests/cuda/test_reduce.py).

An input of another dtype than the kernel reads (an integer sum, ``dtype=`` other than a 16-bit input's fp32) is
first cast inside the operator (``make_reduction_from_out_ty``): the copy is counted too, before the buffer, in the
input's layout where that is dense and contiguous otherwise. Besides the H200's own recordings, a review session
recorded these cases on an H200 (torch 2.11) and the model matched each: casts to fp64 and from int32, a non-dense
int32 input, a storage offset, complex128, an expanded input with and without ``keepdim``, reductions over the last
dim, over several dims and of transposed inputs; tests/cuda/test_reduce.py holds the recorded figures of the casts,
the layouts, complex128 and ``keepdim``.

Known limitations: a reduction whose operands reach 2**31 bytes (which the kernel splits into 32-bit-indexable
parts, each with buffers of its own) is not modelled; other reductions (``amax``, ``norm``, ``var``, ``argmax``)
and kernels with buffers of their own (LayerNorm's and embedding's backward) are not counted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["REDUCE_OPS", "ReduceDevice", "reduce_device", "reduce_scratch"]

_aten = torch.ops.aten
# The reductions modelled (their CUDA kernels are ``gpu_reduce_kernel`` instantiations).
REDUCE_OPS = frozenset({_aten.sum.default, _aten.sum.dim_IntList, _aten.mean.default, _aten.mean.dim,
                        _aten.nansum.default})
_WARP = 32
_MAX_THREADS = 512  # mnt_wrapper<T>::MAX_NUM_THREADS (256 for complex double)
_MIN_VALUES_PER_THREAD = 16  # CUDA's; ROCm's is 128
_MAX_VALUES_PER_THREAD = 256
_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class ReduceDevice:
    """What ``setReduceConfig`` reads of the GPU (``cudaDeviceProp``), and where the figures came from."""

    sm_count: int  # multiProcessorCount
    threads_per_sm: int  # maxThreadsPerMultiProcessor
    source: str = ""


@dataclasses.dataclass
class _Config:
    """``ReduceConfig`` (Reduce.cuh): the launch shape of one reduction kernel."""

    element_size: int
    num_outputs: int
    num_inputs: int
    step_input: int = 1
    step_output: int = 1
    ctas_per_output: int = 1
    block_x_reduce: bool = False  # input_mult[BLOCK_X] != 0
    warp_split: bool = False  # input_mult[BLOCK_Y] != 0
    global_reduce: bool = False  # input_mult[CTA] != 0
    block_width: int = 1
    block_height: int = 1
    output_vec_size: int = 1
    max_threads: int = _MAX_THREADS  # mnt_wrapper<scalar_t>::MAX_NUM_THREADS

    def set_block_dimension(self, dim0: int, dim1: int) -> None:
        most = self.max_threads // self.output_vec_size
        dim0_pow2 = _last_pow2(dim0) if dim0 < most else most
        dim1_pow2 = _last_pow2(dim1) if dim1 < most else most
        self.block_width = min(dim0_pow2, _WARP)
        self.block_height = min(dim1_pow2, most // self.block_width)
        self.block_width = min(dim0_pow2, most // self.block_height)

    @property
    def num_threads(self) -> int:
        return self.block_width * self.block_height

    def values_per_thread(self) -> int:
        return _div_up(self.num_inputs, self.step_input)

    def grid_x(self) -> int:
        return _div_up(self.num_outputs // self.output_vec_size, self.step_output)

    def global_memory_size(self) -> int:
        if not self.global_reduce:
            return 0
        size = self.element_size * self.num_outputs * self.ctas_per_output
        if not self.block_x_reduce:
            size *= self.block_width * self.output_vec_size
        return size

    def semaphore_size(self) -> int:
        return 4 * self.grid_x() if self.global_reduce else 0


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _last_pow2(n: int) -> int:
    """floor(log2(n)) as a power of two, at least 1 (Reduce.cuh's ``last_pow2``)."""
    return max(1, 1 << (int(n).bit_length() - 1)) if n > 0 else 1


def _geometry(shape: Sequence[int], in_strides: Sequence[int], out_strides: Sequence[int]
              ) -> tuple[list[int], list[int], list[int]]:
    """TensorIterator's shape and byte strides of (output, input) after ``reorder_dimensions`` and
    ``coalesce_dimensions``, fastest dimension first."""
    ndim = len(shape)
    operands = (list(out_strides), list(in_strides))  # outputs first, as the iterator holds them
    perm = list(range(ndim - 1, -1, -1))

    def should_swap(dim0: int, dim1: int) -> int:
        for arg, strides in enumerate(operands):
            stride0, stride1 = strides[dim0], strides[dim1]
            if arg == 0 and (stride0 == 0) != (stride1 == 0):  # a reduction's output: reduced dims to the front
                return 1 if stride1 == 0 else -1
            if stride0 == 0 or stride1 == 0:
                continue
            if stride0 != stride1:
                return -1 if stride0 < stride1 else 1
            if shape[dim0] > shape[dim1]:  # equal strides: the smaller size goes first
                return 1
        return 0

    if ndim > 1:
        for i in range(1, ndim):
            dim1 = i
            for dim0 in range(i - 1, -1, -1):
                comparison = should_swap(perm[dim0], perm[dim1])
                if comparison > 0:
                    perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                    dim1 = dim0
                elif comparison < 0:
                    break
    else:
        perm = list(range(ndim))
    sizes = [shape[p] for p in perm]
    strides = [[s[p] for p in perm] for s in operands]
    if ndim:
        prev = 0
        for dim in range(1, ndim):
            mergeable = sizes[prev] == 1 or sizes[dim] == 1 or all(
                sizes[prev] * s[prev] == s[dim] for s in strides)
            if mergeable:
                if sizes[prev] == 1:
                    for s in strides:
                        s[prev] = s[dim]
                sizes[prev] *= sizes[dim]
            else:
                prev += 1
                if prev != dim:
                    for s in strides:
                        s[prev] = s[dim]
                    sizes[prev] = sizes[dim]
        sizes = sizes[:prev + 1]
        strides = [s[:prev + 1] for s in strides]
    return sizes, strides[0], strides[1]


def _output_vec_size(sizes: list[int], in_strides: list[int], num_reduce_dims: int, itemsize: int,
                     storage_offset: int) -> int:
    """``get_output_vec_size``: 4 values per load unless the address, the first output dim or a stride says less."""
    vec = 4

    def update(n: int) -> None:
        nonlocal vec
        while n % vec:
            vec //= 2

    update(storage_offset)  # the caching allocator's blocks start 512-byte aligned
    update(sizes[num_reduce_dims])
    for j, stride in enumerate(in_strides):
        if j != num_reduce_dims:
            update(stride // itemsize)
    return vec


def _config(sizes: list[int], in_strides: list[int], out_strides: list[int], itemsize: int, acc_size: int,
            input_vec_size: int, storage_offset: int, device: ReduceDevice, max_threads: int = 512) -> _Config:
    """``setReduceConfig`` (Reduce.cuh) for a TensorIterator of ``sizes`` and byte strides."""
    ndim = len(sizes)
    numel = math.prod(sizes)
    num_reduce_dims = sum(1 for s in out_strides if s == 0)
    num_outputs = 1
    for size, stride in zip(sizes, out_strides):
        if stride != 0:
            num_outputs *= size
    config = _Config(acc_size, num_outputs, numel // num_outputs, max_threads=max_threads)
    if ndim > 0:
        fastest = num_reduce_dims == ndim or in_strides[0] < in_strides[num_reduce_dims]
        if fastest:
            dim0, dim1, moving = config.num_inputs, num_outputs, in_strides[0]
        else:
            dim0, dim1, moving = num_outputs, config.num_inputs, in_strides[num_reduce_dims]
    else:
        fastest, moving, dim0, dim1 = True, itemsize, 1, 1
    if moving == itemsize:
        if fastest and dim0 >= 128 and num_reduce_dims == 1:  # vectorize along the input
            dim0 //= input_vec_size
        elif not fastest:  # vectorize along the output
            config.output_vec_size = _output_vec_size(sizes, in_strides, num_reduce_dims, itemsize, storage_offset)
            dim0 //= config.output_vec_size
    config.set_block_dimension(dim0, dim1)
    if ndim == 0 or fastest:
        config.block_x_reduce = True
        config.step_input *= config.block_width
    else:
        config.step_output *= config.block_width
    if config.values_per_thread() >= min(config.block_height * 16, _MAX_VALUES_PER_THREAD):
        config.warp_split = True
        config.step_input *= config.block_height
    else:
        config.step_output *= config.block_height
    target_grid = device.sm_count * (device.threads_per_sm // config.num_threads)
    grid = config.grid_x()
    if config.warp_split and config.values_per_thread() >= _MAX_VALUES_PER_THREAD and grid <= target_grid:
        values = config.values_per_thread()
        config.ctas_per_output = max(min(_div_up(target_grid, grid), _div_up(values, _MIN_VALUES_PER_THREAD)),
                                     _div_up(values, _MAX_VALUES_PER_THREAD))
        if config.ctas_per_output > 1:
            config.global_reduce = True
            config.step_input *= config.ctas_per_output
    return config


def _accumulator_size(dtype: torch.dtype) -> int:
    """sizeof(arg_t) of the kernel reducing ``dtype`` (the input as cast for the kernel)."""
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return 4  # at::opmath_type: fp32
    if dtype == torch.complex64:
        return 8
    if dtype == torch.complex128:
        return 16
    if dtype == torch.float64 or not dtype.is_floating_point:
        return 8  # fp64, or int64 for integers and booleans
    return dtype.itemsize


def _reduced_dims(func: Any, args: Sequence[Any], kwargs: dict[str, Any], ndim: int) -> set[int] | None:
    if func in (_aten.sum.default, _aten.mean.default):
        return set(range(ndim))  # nansum.default takes an optional ``dim``, as the dim_IntList overloads do
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return set(range(ndim))  # sum(dim=[]) reduces every dim
    dims = [dim] if isinstance(dim, int) else list(dim)
    if ndim == 0:
        return set() if all(d in (0, -1) for d in dims) else None
    if any(not -ndim <= d < ndim for d in dims):
        return None  # the operator raises
    return {d % ndim for d in dims}


def _keepdim(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    if func in (_aten.sum.default, _aten.mean.default):
        return False
    return bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))


def _dtypes(func: Any, dtype: torch.dtype, asked: torch.dtype | None) -> tuple[torch.dtype, torch.dtype] | None:
    """(the output's dtype, the dtype the kernel reads) as ``make_reduction_from_out_ty`` sets them: the input is
    cast to the output's dtype first, except a 16-bit input summed into fp32, which the kernel reads as it is. None:
    the operator raises (``mean`` of an integer tensor)."""
    integral = not dtype.is_floating_point and not dtype.is_complex
    if func in (_aten.mean.default, _aten.mean.dim) and integral and asked is None:
        return None
    out = asked or (torch.int64 if integral else dtype)
    read = dtype if dtype in (torch.float16, torch.bfloat16) and out == torch.float32 else out
    return out, read


def _dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Non-overlapping and dense: some permutation of the dims is contiguous (``.to`` then keeps the layout)."""
    dims = sorted((s, n) for s, n in zip(stride, shape) if n != 1)
    expected = 1
    for step, size in dims:
        if step != expected:
            return False
        expected *= size
    return True


def _fits_32bit_indexing(shape: Sequence[int], *strides_bytes: Sequence[int]) -> bool:
    """``TensorIteratorBase::can_use_32bit_indexing``: the element count and every operand's furthest byte offset
    fit an int32."""
    if math.prod(shape) > _INT32_MAX:
        return False
    return all(1 + sum((size - 1) * step for size, step in zip(shape, strides)) <= _INT32_MAX
               for strides in strides_bytes)


def reduce_device(gpu: Any, device: torch.device | None = None) -> ReduceDevice:
    """The multiprocessors of the target: the catalog GPU's (`preflight._gpus.GPU`), else the local CUDA device's
    properties, else an A100's (108 of 2,048 threads; the architecture `preflight.cuda` assumes for an unnamed GPU)."""
    if gpu is not None and getattr(gpu, "sm_count", None):
        return ReduceDevice(gpu.sm_count, gpu.threads_per_sm, f"{gpu.name}'s {gpu.sm_count} multiprocessors")
    if device is not None and device.type == "cuda" and torch.cuda.is_available():  # pragma: no cover - needs a GPU
        props = torch.cuda.get_device_properties(device)
        return ReduceDevice(props.multi_processor_count, props.max_threads_per_multi_processor,
                            f"the local {props.name}'s {props.multi_processor_count} multiprocessors")
    return ReduceDevice(108, 2048, "an A100's 108 multiprocessors, assumed for an unnamed GPU")


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def reduce_scratch(func: Any, args: Sequence[Any], kwargs: dict[str, Any], device: ReduceDevice
                   ) -> tuple[int, ...] | None:
    """The blocks a `REDUCE_OPS` call allocates inside its CUDA operator after its output, in allocation order (the
    cast copy of its input where there is one, the staging buffer, then its semaphores; freed in the reverse order),
    or ``()`` when it needs none.
    ``args`` hold tensors or `preflight.trace.TensorSpec`s (shape, stride, dtype, storage offset). None: not
    modelled (see the module docstring).

    Example:
        >>> from preflight.trace import TensorSpec
        >>> grad = TensorSpec((2048, 1536), (1536, 1), torch.float32)  # GPT-2's fused QKV bias gradient
        >>> reduce_scratch(torch.ops.aten.sum.dim_IntList, [grad, [0]], {}, ReduceDevice(132, 2048))  # an H200
        (25165824, 48)
    """
    if func not in REDUCE_OPS or not args:
        return None
    x = args[0]
    shape = tuple(x.shape)
    stride = tuple(x.stride() if callable(getattr(x, "stride", None)) else x.stride)
    offset = x.storage_offset() if callable(getattr(x, "storage_offset", None)) else getattr(x, "storage_offset", 0)
    numel = math.prod(shape)
    reduced = _reduced_dims(func, args, kwargs, len(shape))
    dtypes = _dtypes(func, x.dtype, kwargs.get("dtype"))
    if reduced is None or dtypes is None:
        return None
    if numel == 0:
        return ()
    out_dtype, read = dtypes
    blocks: tuple[int, ...] = ()
    if read != x.dtype:  # self.to(in_dtype) inside the operator: a copy the kernel reads, freed when it returns
        blocks = (numel * read.itemsize,)
        if not _dense(shape, stride):
            stride = tuple(_contiguous_strides(shape))
        offset = 0
    itemsize = read.itemsize
    keepdim = _keepdim(func, args, kwargs)
    out_elem = _contiguous_strides([1 if d in reduced else size for d, size in enumerate(shape)])
    # Reduced dims have output stride 0 (review_reduce_result); with keepdim a reduced dim of size 1 keeps its own.
    out_strides = [0 if d in reduced and (not keepdim or shape[d] != 1) else out_elem[d] * out_dtype.itemsize
                   for d in range(len(shape))]
    in_strides = [s * itemsize for s in stride]
    sizes, out_s, in_s = _geometry(shape, in_strides, out_strides)
    if not _fits_32bit_indexing(sizes, out_s, in_s):
        return None  # split into 32-bit-indexable parts, each with a config and buffers of its own: not modelled
    is_sum = func in (_aten.sum.default, _aten.sum.dim_IntList)
    input_vec_size = 8 if is_sum and itemsize == 2 else 4  # sum_functor: vt0 4, and 8 values per load for 16 bits
    most = 256 if read == torch.complex128 else _MAX_THREADS  # mnt_wrapper<c10::complex<double>>
    config = _config(sizes, in_s, out_s, itemsize, _accumulator_size(read), input_vec_size, offset, device, most)
    if not config.global_reduce:
        return blocks
    return (*blocks, config.global_memory_size(), config.semaphore_size())
