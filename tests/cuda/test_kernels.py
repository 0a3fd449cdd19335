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
