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


def test_a_tensor_without_a_storage_stays_on_the_device():
    hooks = StashedOffload(None, pin_memory=False)
    sparse = torch.eye(64).to_sparse()
    packed = hooks.pack_hook(sparse)
    assert packed[0] == "kept" and hooks.unpack_hook(packed) is sparse


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(64, 64)  # reentrant checkpointing needs an input that requires grad
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(lambda y, b=block: b(y).sin(), x, use_reentrant=True)
        return x.square().mean()


def test_the_stream_hooks_cover_the_backward_as_trls_training_step_does():
    # Reentrant checkpointing recomputes each block's forward inside the backward: those saved tensors pass through
    # the hooks too, and the trace of such a run equals its measured peak on CPU.
    import preflight
    from preflight import Loop, Run

    torch.manual_seed(0)
    model = _Checkpointed()
    hooks = StashedOffload(model, pin_memory=False)
    in_backward = []
    pack = hooks.pack_hook
    hooks.pack_hook = lambda t: in_backward.append(torch._C._current_graph_task_id() != -1) or pack(t)
    with hooks:
        model(torch.randn(256, 64, requires_grad=True)).backward()
    assert in_backward.count(True) == 3 * 3  # each block's recomputed Linear input, weight and sin input
    model.zero_grad(set_to_none=True)

    run = Run(loop=Loop(offload_activations="streams"))
    batch = torch.randn(256, 64)
    measured = preflight.measure(model, torch.optim.AdamW(model.parameters()), batch, run,
                                 step=lambda m, b: m(b))
    predicted = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, run, step=lambda m, b: m(b))
    assert predicted.peak_bytes == measured.peak_bytes


def test_stream_offloading_is_refused_under_a_pipeline_schedule():
    import pytest

    from preflight._steps import Loop, run_steps

    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="not traced under a pipeline schedule"):
        run_steps(model, torch.optim.SGD(model.parameters()), None, step=None, precision=None, device_type="cpu",
                  steps=1, schedule=Loop(offload_activations="streams"), drive=lambda batch: None)
