"""The saved-tensor hooks a run described as offloading its activations runs under (`preflight._activation_offload`),
on real CPU tensors: which tensors TRL's stream-based offloading copies to the host and which it keeps."""

from __future__ import annotations

import torch
from torch import nn

from preflight._activation_offload import StashedOffload, offloading, output_head


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(64, 64)
        self.lm_head = nn.Linear(64, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x).sin()
        h = h * h  # one tensor saved twice by one operator
        return self.lm_head(h).logsumexp(-1).mean()


def _packed_kinds(model: nn.Module, x: torch.Tensor) -> list[tuple[str, int]]:
    hooks = StashedOffload(model, pin_memory=False)
    kinds: list[tuple[str, int]] = []
    pack = hooks.pack_hook

    def recording(t: torch.Tensor):
        packed = pack(t)
        kinds.append(("raw", t.nbytes) if isinstance(packed, torch.Tensor) else (packed[0], t.nbytes))
        return packed

    hooks.pack_hook = recording
    with hooks:
        loss = model(x)
    loss.backward()
    return kinds


def test_what_the_stream_hooks_offload_and_keep():
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(32, 64)
    kinds = _packed_kinds(model, x)
    assert kinds == [
        ("offloaded", 32 * 64 * 4),  # the body's input (the batch), for its weight's gradient
        ("offloaded", 32 * 64 * 4),  # sin's input
        ("offloaded", 32 * 64 * 4),  # h * h: h, copied once ...
        ("kept", 32 * 64 * 4),       # ... and kept on the device the second time (its storage is offloaded already)
        ("raw", 32 * 64 * 4),        # the head's input and weight: the output head is not offloaded
        ("raw", 100 * 64 * 4),
        ("offloaded", 32 * 100 * 4),  # logsumexp's input (the logits) ...
        ("kept", 32 * 4),             # ... and its result: under 1024 bytes
    ]
    # The gradients are those of the run without hooks, and the head's hooks are gone.
    torch.manual_seed(0)
    plain = _Net()
    plain(x).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters()))
    assert not model.lm_head._forward_pre_hooks and not model.lm_head._forward_hooks


def test_the_output_head_is_found_as_trl_finds_it():
    class Wrapped(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.module = inner

    net = _Net()
    assert output_head(net) is net.lm_head and output_head(Wrapped(net)) is net.lm_head
    plain = nn.Sequential(nn.Linear(2, 2))
    assert output_head(plain) is None
    assert isinstance(offloading("streams", plain), StashedOffload)
    assert isinstance(offloading("save_on_cpu", plain), torch.autograd.graph.save_on_cpu)


def test_a_saved_tensor_read_outside_the_backward_comes_back():
    # Code may read a node's saved tensor in the forward (grad_fn._saved_self): no backward to clean up after.
    x = torch.randn(64, 64, requires_grad=True)
    with StashedOffload(None, pin_memory=False):
        y = x.sin()
        assert torch.equal(y.grad_fn._saved_self, x)
    y.sum().backward()
    assert torch.allclose(x.grad, x.cos())
