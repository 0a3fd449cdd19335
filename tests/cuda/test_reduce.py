"""CUDA reductions' staging buffers (`preflight.cuda._reduce`), against the blocks an H200 recorded."""

from __future__ import annotations

import pytest
import torch

from preflight._gpus import get_gpu
from preflight.cuda import ReduceDevice, reduce_device, reduce_scratch
from preflight.trace import TensorSpec

H200 = ReduceDevice(132, 2048)
SUM = torch.ops.aten.sum.dim_IntList


def _rows(rows: int, cols: int, dtype: torch.dtype = torch.float32) -> TensorSpec:
    return TensorSpec((rows, cols), (cols, 1), dtype)


def test_bias_gradients_as_an_h200_recorded_them():
    # (staging buffer, semaphores) that torch.cuda.memory._record_memory_history recorded on an H200 (torch 2.11) for
    # the bias gradients of GPT-2 and BERT, 2,048 tokens by 512, 1,536 and 2,048 features and an 8,000-word head
    # (benchmarks/results/snapshots).
    recorded = {512: (8_388_608, 16), 1536: (25_165_824, 48), 2048: (33_554_432, 64), 8000: (131_072_000, 252)}
    for features, blocks in recorded.items():
        assert reduce_scratch(SUM, [_rows(2048, features), [0]], {}, H200) == blocks, features
    # The same gradient as (batch, tokens, features) summed over both leading dims: the iterator merges them.
    grad = TensorSpec((8, 256, 1536), (256 * 1536, 1536, 1), torch.float32)
    assert reduce_scratch(SUM, [grad, [0, 1]], {}, H200) == (25_165_824, 48)


def test_the_split_follows_the_multiprocessors():
    # Fewer multiprocessors, fewer blocks per output: an A100's 108 at 2,048 threads give 4 x 1,536 x 32 x 128 B too
    # (the cap there is 16 values left to each thread), a T4's 40 at 1,024 threads fill the GPU with 27 blocks.
    assert reduce_scratch(SUM, [_rows(2048, 1536), [0]], {}, reduce_device(get_gpu("a100-80gb"))) == (25_165_824, 48)
    t4 = reduce_device(get_gpu("t4"))
    assert (t4.sm_count, t4.threads_per_sm) == (40, 1024)
    assert reduce_scratch(SUM, [_rows(2048, 1536), [0]], {}, t4) == (4 * 1536 * 27 * 128, 48)


def test_reductions_within_a_block_allocate_nothing():
    # Along the last dim each output's inputs are contiguous: one block reduces them (a mean over features).
    assert reduce_scratch(torch.ops.aten.mean.dim, [_rows(2048, 1536), [-1]], {}, H200) == ()
    # Few inputs per output: no split across blocks.
    assert reduce_scratch(SUM, [_rows(64, 1536), [0]], {}, H200) == ()
    # A whole-tensor sum splits across blocks and stages one fp32 value per block (block-x reduced).
    assert reduce_scratch(torch.ops.aten.sum.default, [_rows(2048, 1536)], {}, H200) == (384 * 4, 4)


def test_casts_accumulators_and_layouts_as_recorded_on_an_h200():
    # Each recorded on an H200 (torch 2.11) as the blocks the operator allocated after its output.
    x = _rows(2048, 1536)
    assert reduce_scratch(SUM, [_rows(2048, 1536, torch.bfloat16), [0]], {}, H200) == (25_165_824, 48)
    # The input is first cast to the output's dtype (make_reduction_from_out_ty): a copy the kernel reads, freed
    # when the operator returns, and the accumulator of that dtype: fp64 (8 bytes), int64 for an int32 sum.
    assert reduce_scratch(SUM, [x, [0]], {"dtype": torch.float64}, H200) == (25_165_824, 50_331_648, 48)
    assert reduce_scratch(SUM, [_rows(2048, 1536, torch.int32), [0]], {}, H200) == (25_165_824, 50_331_648, 48)
    assert reduce_scratch(SUM, [_rows(2048, 1536, torch.int32), [0]], {"dtype": torch.float32}, H200) == (
        12_582_912, 25_165_824, 48)
    # A non-dense input's copy is contiguous, so the kernel vectorizes over it where the view would not.
    sliced = TensorSpec((2048, 512), (513, 1), torch.int32, 1)
    assert reduce_scratch(SUM, [sliced, [0]], {}, H200) == (8_388_608, 16_777_216, 16)
    # A storage offset of 2 floats loads two outputs at a time; complex128 accumulates 16 bytes in 256-thread blocks.
    assert reduce_scratch(SUM, [TensorSpec((2048, 1536), (1536, 1), torch.float32, 2), [0]], {}, H200) == (
        6_291_456, 96)
    assert reduce_scratch(SUM, [_rows(2048, 1536, torch.complex128), [0]], {}, H200) == (201_326_592, 48)
    # Without keepdim every reduced dim has output stride 0, a size-1 one too, which reorders an expanded input.
    expanded = TensorSpec((7, 1, 512, 2048), (1, 1, 0, 7), torch.float32)
    assert reduce_scratch(SUM, [expanded, [1, 2, 3]], {}, H200) == (2_128, 28)
    assert reduce_scratch(SUM, [expanded, [1, 2, 3], True], {}, H200) == (29_568, 8)


def test_not_modelled():
    assert reduce_scratch(torch.ops.aten.amax.default, [_rows(2048, 1536), [0]], {}, H200) is None
    # 2**31 bytes or more in an operand: the kernel splits it into 32-bit-indexable parts, each with its own buffers.
    assert reduce_scratch(SUM, [_rows(2**20, 640), [0]], {}, H200) is None
    assert reduce_scratch(torch.ops.aten.mean.dim, [_rows(64, 64, torch.int32), [0]], {}, H200) is None  # raises
    assert reduce_scratch(SUM, [_rows(64, 64), [2]], {}, H200) is None  # raises


def test_real_tensors_are_read_like_specs():
    x = torch.empty(2048, 1536)
    assert reduce_scratch(SUM, [x, [0]], {}, H200) == reduce_scratch(SUM, [TensorSpec.of(x), [0]], {}, H200)
    # A view whose start is not 16-byte aligned loads one output at a time: 512-thread blocks, 128 values per thread
    # after the split across warps, too few to split across blocks.
    offset = torch.empty(2049, 1536)[1:, 1:]
    assert reduce_scratch(SUM, [offset, [0]], {}, H200) == ()
    assert reduce_scratch(SUM, [torch.empty(2048, 1535), [0]], {}, H200) == ()


@pytest.mark.requires_cuda
def test_the_model_matches_the_device():  # pragma: no cover - needs a GPU
    # The sizes the caching allocator was asked for inside the operator, after its output: the recorded history.
    device = torch.device("cuda")
    gpu = reduce_device(None, device)
    for features in (512, 1536, 8000):
        x = torch.randn(2048, features, device=device)
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=1000)
        try:
            x.sum(0)
            torch.cuda.synchronize()
            trace = torch.cuda.memory._snapshot()["device_traces"][0]
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        asked = [e["size"] for e in trace if e["action"] == "alloc"]
        assert tuple(asked[1:]) == reduce_scratch(SUM, [x, [0]], {}, gpu), features
