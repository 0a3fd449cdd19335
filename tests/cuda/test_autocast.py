"""CUDA's autocast applied to CPU fake tensors: lists, policies and the weight cast cache match torch's CUDA rules."""

from __future__ import annotations

import gc
import os
import re
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from preflight.cuda import CUDA_POLICIES, cuda_autocast

_HEADER = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "autocast_mode.h")


def test_table_covers_exactly_the_ops_the_installed_torch_autocasts_on_cuda():
    registered = {name.removeprefix("aten::")
                  for name in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")}
    assert set(CUDA_POLICIES) == registered


@pytest.mark.skipif(not os.path.exists(_HEADER), reason="this torch build ships no ATen headers")
def test_policies_match_the_installed_headers_lists():
    text = open(_HEADER).read()

    def macro(name: str) -> set[str]:
        body = re.search(rf"#define {name}\(_\)(.*?)\n\n", text, re.S).group(1)
        return {".".join(p.strip() for p in m.split(",")) for m in re.findall(r"_\(([^()]*)\)", body)}

    for macro_name, policy in (("AT_FORALL_LOWER_PRECISION_FP", "lower_precision_fp"), ("AT_FORALL_FP32", "fp32"),
                               ("AT_FORALL_FP32_SET_OPT_DTYPE", "fp32_set_opt_dtype"),
                               ("AT_FORALL_PROMOTE", "promote")):
        assert macro(macro_name) <= {n for n, p in CUDA_POLICIES.items() if p == policy}, macro_name


def _fake(*shape, dtype=torch.float32, grad=False):
    t = torch.randn(*shape, dtype=dtype)
    return t.requires_grad_(grad) if grad else t


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_each_op_family_gets_cudas_dtype(low):
    with cuda_autocast(), FakeTensorMode(), torch.autocast("cpu", dtype=low):
        x = _fake(4, 8)
        w = _fake(8, 8, grad=True)
        h = F.linear(x, w)
        assert h.dtype == low                                                   # lower_precision_fp
        assert (h @ h.T).dtype == low and torch.bmm(h[None], h.T[None]).dtype == low
        assert F.conv1d(x.T[None], w[:, :, None]).dtype == low
        assert torch.softmax(h, -1).dtype == torch.float32                     # fp32_set_opt_dtype
        assert torch.log_softmax(h, -1).dtype == torch.float32
        assert h.sum().dtype == torch.float32 and h.cumsum(0).dtype == torch.float32
        assert torch.softmax(h, -1, dtype=low).dtype == low                    # an explicit dtype is kept
        assert F.layer_norm(h, (8,)).dtype == torch.float32                    # fp32
        assert F.group_norm(h[None], 2).dtype == torch.float32
        assert h.pow(2).dtype == torch.float32 and h.exp().dtype == torch.float32
        assert F.mse_loss(h, h).dtype == torch.float32
        assert F.cross_entropy(h, torch.zeros(4, dtype=torch.long)).dtype == torch.float32
        assert h.norm().dtype == torch.float32                                 # fp32_append_dtype
        assert torch.addcmul(h, h, x).dtype == torch.float32                   # promote: widest
        assert torch.addcmul(h, h, h).dtype == low
        # CPU autocast lists avg_pool3d (fp32) and cat (promote); CUDA lists neither.
        assert F.avg_pool3d(h.reshape(1, 1, 4, 2, 4), 2).dtype == low
        assert torch.cat([h, x]).dtype == torch.float32  # ordinary type promotion
        assert (h + 1).dtype == low                                            # unlisted: untouched


def test_cpu_autocast_is_restored_afterwards():
    before = torch.amp.autocast_mode.autocast.__init__
    with cuda_autocast():
        assert torch.amp.autocast_mode.autocast.__init__ is not before
    assert torch.amp.autocast_mode.autocast.__init__ is before
    with FakeTensorMode(), torch.autocast("cpu", dtype=torch.bfloat16):
        x = _fake(4, 8)
        assert torch.softmax(x @ x.T, -1).dtype == torch.bfloat16  # CPU: softmax is not listed
        assert F.avg_pool3d(x.reshape(1, 1, 4, 2, 4), 2).dtype == torch.float32


def test_eager_attention_probabilities_are_fp32_and_twice_the_cpu_bytes():
    def probs(emulate: bool) -> torch.Tensor:
        ctx = cuda_autocast() if emulate else torch.autocast("cpu", enabled=False)
        with ctx, FakeTensorMode(), torch.autocast("cpu", dtype=torch.float16):
            q = _fake(2, 4, 32, 16)
            return torch.softmax(q @ q.transpose(-1, -2) / 4, dim=-1)

    cuda, cpu = probs(True), probs(False)
    assert cuda.dtype == torch.float32 and cpu.dtype == torch.float16
    assert cuda.untyped_storage().nbytes() == 2 * cpu.untyped_storage().nbytes() == 2 * 2 * 4 * 32 * 32 * 2


def test_weight_cast_cache_casts_a_parameter_once_per_region_and_drops_it_on_exit():
    with cuda_autocast() as cache, FakeTensorMode():
        w = _fake(8, 8, grad=True)
        frozen = _fake(8, 8)
        x = _fake(4, 8)
        with torch.autocast("cpu", dtype=torch.float16):
            a, b = F.linear(x, w), F.linear(x, w)
            assert len(cache) == 1  # x does not require grad, frozen is not cached
            first = cache._casts[id(w)][1]
            ref = weakref.ref(first)
            F.linear(x, frozen), F.linear(x, frozen)
            assert len(cache) == 1
            with torch.autocast("cpu", dtype=torch.float16):  # nested: the cache survives the inner exit
                F.linear(x, w)
            assert len(cache) == 1
        assert len(cache) == 0
        del first, a, b
        gc.collect()
        assert ref() is None


def test_a_cached_weight_is_cast_once():
    casts = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                casts.append(args[0].shape)
            return func(*args, **(kwargs or {}))

    with cuda_autocast(), FakeTensorMode(), Count(), torch.autocast("cpu", dtype=torch.float16):
        w = _fake(8, 16, grad=True)
        x = _fake(4, 16, dtype=torch.float16)
        F.linear(x, w), F.linear(x, w), F.linear(x, w)
    assert casts == [torch.Size([8, 16])]


def test_user_cuda_autocast_is_emulated_and_answers_cuda_queries():
    with cuda_autocast(), FakeTensorMode():
        x = _fake(8, 8)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert F.linear(x, x).dtype == torch.bfloat16
            assert torch.softmax(x, -1).dtype == torch.float32
            assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
        with torch.autocast("cuda"):  # CUDA's default dtype
            assert F.linear(x, x).dtype == torch.float16
        with torch.autocast("cuda", dtype=torch.float16):
            with torch.autocast("cpu", enabled=False):  # code that derives device_type from its CPU tensors
                assert F.linear(x, x).dtype == torch.float32
                assert not torch.is_autocast_enabled("cuda")
        assert not torch.is_autocast_enabled("cuda")


def test_binary_cross_entropy_raises_as_on_cuda():
    with cuda_autocast(), FakeTensorMode(), torch.autocast("cpu", dtype=torch.float16):
        p = torch.rand(4)
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(p, p)


def test_backward_saves_the_cast_inputs():
    """The casts sit above autograd, as CUDA's: a linear's backward keeps the fp16 copies, not the fp32 inputs."""
    with cuda_autocast(), FakeTensorMode(), torch.autocast("cpu", dtype=torch.float16):
        w = _fake(8, 8, grad=True)
        x = _fake(4, 8, grad=True)
        y = F.linear(x, w)
        saved = [t for name in dir(y.grad_fn) if name.startswith("_saved_")
                 for t in [getattr(y.grad_fn, name)] if isinstance(t, torch.Tensor)]
        assert saved and all(t.dtype == torch.float16 for t in saved)
