"""The attention backend a CUDA target picks (torch's sdp_utils rules) and the tensors each backend keeps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from preflight import known_gpus
from preflight._gpus import get_gpu
from preflight.cuda import choose_sdpa_backend, cuda_kernels

B, H, L, D = 2, 4, 64, 64

# Per catalog GPU: (fp16, bf16, fp32) backends for causal self-attention with head dim 64 and no mask, training.
_EXPECTED = {(7, 0): ("efficient", "math", "efficient"), (7, 5): ("efficient", "math", "efficient"),
             (8, 0): ("flash", "flash", "efficient"), (8, 6): ("flash", "flash", "efficient"),
             (8, 9): ("flash", "flash", "efficient"), (9, 0): ("flash", "flash", "efficient")}


@pytest.mark.parametrize("name", known_gpus())
def test_backend_per_catalog_gpu(name):
    cc = get_gpu(name).compute_capability
    got = tuple(choose_sdpa_backend(cc, q, q, q, is_causal=True).backend
                for q in (torch.empty(B, H, L, D, dtype=dt, requires_grad=True)
                          for dt in (torch.float16, torch.bfloat16, torch.float32)))
    assert got == _EXPECTED[cc]


def test_filters():
    q16 = torch.empty(B, H, L, D, dtype=torch.float16, requires_grad=True)
    mask = torch.ones(L, L, dtype=torch.bool)
    assert choose_sdpa_backend((8, 0), q16, q16, q16, mask).backend == "efficient"  # flash takes no mask
    odd = torch.empty(B, H, L, 36, dtype=torch.float16)
    assert choose_sdpa_backend((8, 0), odd, odd, odd).backend == "flash"  # flash pads the head dim
    assert choose_sdpa_backend((8, 0), odd, odd, odd, mask).backend == "math"  # 36 % 8 != 0 for efficient
    big = torch.empty(B, H, L, 256, dtype=torch.float16, requires_grad=True)
    assert choose_sdpa_backend((8, 0), big, big, big).backend == "flash"
    assert choose_sdpa_backend((8, 9), big, big, big, dropout_p=0.1).backend == "efficient"  # sm_86..89 training
    with torch.no_grad():
        assert choose_sdpa_backend((8, 9), big, big, big, dropout_p=0.1).backend == "flash"
    short_q = torch.empty(B, H, 8, D, dtype=torch.float16)
    assert choose_sdpa_backend((9, 0), short_q, q16, q16, is_causal=True).backend == "efficient"
    kv = torch.empty(B, 2, L, D, dtype=torch.float16)
    assert choose_sdpa_backend((8, 0), q16, kv, kv).backend == "math"  # head counts differ without enable_gqa
    assert choose_sdpa_backend((8, 0), q16, kv, kv, enable_gqa=True).backend == "flash"
    q32, kv32 = q16.float(), kv.float()
    assert choose_sdpa_backend((8, 0), q32, kv32, kv32, enable_gqa=True).backend == "math"  # efficient: no GQA
    # cuDNN first only where torch prefers it (runtime cuDNN > 9.15 on sm_90), and only in (B, S, H, D) layout
    bshd = torch.empty(B, L, H, D, dtype=torch.float16).transpose(1, 2)
    assert choose_sdpa_backend((9, 0), bshd, bshd, bshd, cudnn_version=91501).backend == "cudnn"
    assert choose_sdpa_backend((9, 0), bshd, bshd, bshd).backend == "flash"
    assert choose_sdpa_backend((8, 0), bshd, bshd, bshd, cudnn_version=91501).backend == "flash"
    assert choose_sdpa_backend((9, 0), q16, q16, q16, cudnn_version=91501).backend == "flash"


def test_runtime_switches_are_respected():
    q = torch.empty(B, H, L, D, dtype=torch.float16)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        assert choose_sdpa_backend((9, 0), q, q, q).backend == "math"


class _Saved(TorchDispatchMode):
    """Bytes of every storage an op creates, by op name."""

    def __init__(self):
        self.out: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.out.append((func.__name__, t.dtype, t.untyped_storage().nbytes()))
        return out


def _forward(cc, dtype, **kw):
    with FakeTensorMode(), cuda_kernels(cc) as sdpa, _Saved() as saved:
        q = torch.empty(B, H, L, D, dtype=dtype, requires_grad=True)
        out = F.scaled_dot_product_attention(q, q, q, **kw)
    return sdpa.calls, saved.out, out


def test_flash_keeps_output_and_fp32_logsumexp():
    calls, saved, out = _forward((8, 0), torch.bfloat16, is_causal=True)
    assert calls == {"flash": 1} and out.dtype == torch.bfloat16
    assert [s for s in saved if s[0].startswith("_scaled")] == [
        ("_scaled_dot_product_flash_attention.default", torch.bfloat16, B * H * L * D * 2),
        ("_scaled_dot_product_flash_attention.default", torch.float32, B * H * L * 4),
        ("_scaled_dot_product_flash_attention.default", torch.uint64, 16),  # philox seed and offset
        ("_scaled_dot_product_flash_attention.default", torch.uint64, 8),
        ("_scaled_dot_product_flash_attention.default", torch.bfloat16, 0)]  # no debug mask


def test_efficient_pads_logsumexp_to_32_queries():
    with FakeTensorMode(), cuda_kernels((7, 0)), _Saved() as saved:
        q = torch.empty(B, H, 40, D, dtype=torch.float16, requires_grad=True)
        F.scaled_dot_product_attention(q, q, q)
    lse = [s for s in saved.out if s[0].startswith("_scaled") and s[1] == torch.float32]
    assert lse == [("_scaled_dot_product_efficient_attention.default", torch.float32, B * H * 64 * 4)]


def test_math_keeps_fp32_probabilities_and_a_bool_dropout_mask():
    calls, saved, _ = _forward((7, 0), torch.bfloat16, dropout_p=0.1)
    assert calls == {"math": 1}
    probs = [s for s in saved if s[0] == "_safe_softmax.default"]
    assert probs == [("_safe_softmax.default", torch.float32, B * H * L * L * 4)]
    masks = [s for s in saved if s[0] == "native_dropout.default" and s[1] == torch.bool]
    assert masks == [("native_dropout.default", torch.bool, B * H * L * L)]


def test_dropout_is_fused_with_a_bool_mask():
    with FakeTensorMode(), cuda_kernels((8, 0)):
        x = torch.empty(16, 32, requires_grad=True)
        with _Saved() as saved:
            F.dropout(x, 0.1, training=True)
            F.dropout(x, 0.1, training=False)
    assert saved.out == [("native_dropout.default", torch.float32, 16 * 32 * 4),
                         ("native_dropout.default", torch.bool, 16 * 32)]


def test_kernels_are_unregistered_afterwards():
    with cuda_kernels((8, 0)):
        pass
    with FakeTensorMode(), _Saved() as saved:
        x = torch.empty(16, 32)
        F.dropout(x, 0.1, training=True)
    assert all(name != "native_dropout.default" for name, _, _ in saved.out)


def _backward(cc, dtype, masked=False):
    """The storages the backward of GPT-2-shaped attention creates under `cuda_kernels`: (batch 8, 256 tokens, 8 heads,
    head dim 64) projections, viewed as (B, H, L, D) as models do, the output transposed back."""
    with FakeTensorMode(), cuda_kernels(cc):
        leaf = torch.empty(8, 256, 8, 64, dtype=dtype, requires_grad=True)
        query = leaf.transpose(1, 2)
        mask = torch.ones(256, 256, dtype=torch.bool) if masked else None
        out = F.scaled_dot_product_attention(query, query, query, attn_mask=mask)
        loss = (out.transpose(1, 2) * torch.ones(8, 256, 8, 64, dtype=dtype)).sum()
        with _Saved() as saved:
            loss.backward()
    return saved.out


def test_efficient_backward_holds_delta_and_its_workspace():
    # GPT-2's attention on an H200 in fp32: the device recorded, inside the backward, the fp32 product grad_out * out
    # (4 MiB), its sum over the head dim and that sum's transposed copy (64 KiB each), and a 4,198,400-byte workspace,
    # freed when the kernel returns (benchmarks/results/snapshots/GPT_2_fp32_AdamW.pickle.gz).
    made = _backward((9, 0), torch.float32, masked=True)
    assert ("_scaled_dot_product_efficient_attention_backward.default", torch.float32, 8 * 8 * 256 * 64 * 4) in made
    assert ("mul.Tensor", torch.float32, 8 * 256 * 8 * 64 * 4) in made
    assert ("sum.dim_IntList", torch.float32, 8 * 8 * 256 * 4) in made  # delta, then its (B, H, L) copy
    assert any(name in ("contiguous.default", "clone.default") and n == 8 * 8 * 256 * 4 for name, _, n in made)
    assert ("empty.memory_format", torch.uint8, 4_198_400) in made
    # 16-bit kernels compute delta themselves: only the fp32 (B, H, L) tensor, and no product; their workspace holds
    # the query gradient's fp32 tiles (4 blocks of 64 queries x (4 + 64 x 64) floats per batch and head).
    made16 = _backward((8, 0), torch.float16, masked=True)
    assert ("empty.memory_format", torch.float32, 8 * 8 * 256 * 4) in made16
    assert ("empty.memory_format", torch.uint8, 8 * 8 * 4 * (4 + 64 * 64) * 4) in made16
    assert not any(name == "mul.Tensor" and n == 8 * 256 * 8 * 64 * 4 for name, _, n in made16)


def test_efficient_backward_workspace_follows_the_kernel_table():
    from preflight.cuda import efficient_backward_workspace

    # Measured on an H200: GPT-2 (8, 8, 256, 64) and a ViT (32, 6, 197, 64), fp32.
    assert efficient_backward_workspace((9, 0), torch.float32, 8, 8, 256, 256, 64, 64) == 4_198_400
    assert efficient_backward_workspace((9, 0), torch.float32, 32, 6, 197, 197, 64, 64) == 12_595_200
    # Head dim 128 in fp16: the 128 x 128 kernel holds dK and dV in registers; the query tiles' workspace only:
    # 16 query blocks x 1 column x (4 + 128 x 128) floats per (batch, head).
    assert efficient_backward_workspace((8, 0), torch.float16, 4, 32, 2048, 2048, 128, 128) == 4 * 32 * 16 * (
        4 + 128 * 128) * 4
    # Head dim 256 in fp16 takes the 128 x 64 kernel for any head dim, which accumulates dK and dV in fp32 too.
    big = efficient_backward_workspace((8, 0), torch.float16, 1, 1, 512, 512, 256, 256)
    assert big == (8 * 64 * 256 * 2 + 4 * 4 * (4 + 128 * 64)) * 4  # 8 key splits x 64 x 256, twice; then dQ's tiles


def test_fp16_softmax_into_fp32_makes_no_fp32_copy_of_its_input():
    # CUDA autocast asks softmax for fp32; ATen then runs the fp16 input through the kernel with half_to_float.
    for dtype, copies in ((torch.float16, 0), (torch.bfloat16, 1)):
        with FakeTensorMode(), cuda_kernels((8, 0)):
            x = torch.empty(4, 8, 64, 64, dtype=dtype, requires_grad=True)
            with _Saved() as saved:
                y = torch.softmax(x, -1, dtype=torch.float32)
                y.sum().backward()
        assert y.dtype == torch.float32
        casts = [s for s in saved.out if s[0] == "_to_copy.default" and s[1] == torch.float32]
        assert len(casts) == copies, dtype
        # fp16: the backward hands back fp16 gradients itself; bf16: fp32 ones, cast back by the copy's backward.
        backward = next(s for s in saved.out if s[0] == "_softmax_backward_data.default")
        assert backward[1] == (torch.float16 if dtype == torch.float16 else torch.float32)


def test_the_device_trace_registers_the_backward_scratch_and_takes_it_back():
    # On a GPU host the trace runs on the device's own fake tensors: only the efficient backward's scratch is
    # registered (for AutogradCUDA), and unregistered after; CPU tensors are untouched meanwhile.
    from preflight.cuda import device_backward_scratch

    with device_backward_scratch(torch.device("cuda")):
        made = _backward((9, 0), torch.float32, masked=True)
    assert ("empty.memory_format", torch.uint8, 4_198_400) in made  # the CPU emulation's, inside cuda_kernels
    with FakeTensorMode(), device_backward_scratch(torch.device("cuda")):
        q = torch.empty(2, 4, 64, 32, requires_grad=True)
        out = F.scaled_dot_product_attention(q, q, q)
        with _Saved() as saved:
            out.sum().backward()
    assert not any(s[1] == torch.uint8 for s in saved.out)  # CPU tensors take CPU's kernels: no workspace


@pytest.mark.requires_cuda
def test_the_device_trace_holds_the_efficient_backward_scratch():  # pragma: no cover - needs a GPU
    from preflight.cuda import device_backward_scratch

    with FakeTensorMode(), device_backward_scratch(torch.device("cuda")):
        leaf = torch.empty(8, 256, 8, 64, device="cuda", requires_grad=True)
        q = leaf.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(256, 256, dtype=torch.bool, device="cuda"))
        with _Saved() as saved:
            (out.transpose(1, 2) * torch.ones(8, 256, 8, 64, device="cuda")).sum().backward()
    assert ("empty.memory_format", torch.uint8, 4_198_400) in saved.out  # the H200's workspace for this shape
