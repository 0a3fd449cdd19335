"""Activation offloading by saved-tensor hooks (`preflight.cuda._offload`): traced as it runs on a CPU target, and on
a CUDA target the offloaded tensors leave the device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import preflight
from preflight import Loop, Run, Target


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.ReLU())], nn.Linear(256, 1))


def _batch() -> torch.Tensor:
    return torch.randn(1024, 256)


def _offloaded(pin_memory: bool):
    def step(model, batch):
        with torch.autograd.graph.save_on_cpu(pin_memory=pin_memory):
            return model(batch).square().mean()
    return step


def _plain(model, batch):
    return model(batch).square().mean()


def _estimate(step, target: str):
    model = _model()
    return preflight.estimate(model, torch.optim.AdamW(model.parameters()), _batch(),
                              Run(target=Target(device=target)), step=step)


def test_save_on_cpu_on_a_cpu_target_is_traced_as_it_runs():
    # pin_memory=True allocates a host copy of every saved tensor: on the CPU that is the device, and the copies count.
    for pin_memory in (False, True):
        model = _model()
        measured = preflight.measure(model, torch.optim.AdamW(model.parameters()), _batch(),
                                     step=_offloaded(pin_memory))
        assert _estimate(_offloaded(pin_memory), "cpu").peak_bytes == measured.peak_bytes, pin_memory


def test_on_a_cuda_target_the_saved_tensors_leave_the_device_and_come_back_one_node_at_a_time():
    # What the hooks see, counted on a real CPU forward: every tensor autograd saves, its bytes.
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.untyped_storage().nbytes()) or t,
                                                  lambda t: t):
        _plain(_model(), _batch())
    plain, offloaded = _estimate(_plain, "cuda"), _estimate(_offloaded(True), "cuda")
    note = next(n for n in offloaded.coverage.notes if n.startswith("saved-tensor hooks moved"))
    steps = 2  # the traced steps
    assert f"moved {steps * len(saved)} saved tensor(s) of the traced steps ({steps * sum(saved):,} B in all)" in note
    assert f"({steps * len(saved)} copies)" in note
    # Without offloading the peak holds the forward's activations (each ReLU's 1 MiB output, saved by it and by the
    # next Linear): the peak is in the backward, at a bias gradient's reduction (its 2 MiB staging buffer,
    # preflight.cuda._reduce), with five of the six still held; with offloading, none of them.
    assert plain.breakdown["activations"] >= 5 * 2**20
    assert offloaded.breakdown["activations"] < 2**20
    assert offloaded.peak_bytes < plain.peak_bytes - 3 * 2**20  # traced: 32,540,160 B -> 28,349,952 B
    # No pinned memory, no copy: `.cpu()` of a device tensor is a copy on a GPU; the same figure.
    assert _estimate(_offloaded(False), "cuda").peak_bytes == offloaded.peak_bytes
    assert not any(n.startswith("saved-tensor hooks") for n in plain.coverage.notes)


def test_the_hooks_are_put_back_after_the_trace():
    enter = torch.autograd.graph.saved_tensors_hooks.__enter__
    _estimate(_offloaded(True), "cuda")
    assert torch.autograd.graph.saved_tensors_hooks.__enter__ is enter


def _described(offload: str | None, target: str, model: nn.Module | None = None, step=_plain):
    model = model if model is not None else _model()
    return preflight.estimate(model, torch.optim.AdamW(model.parameters()), _batch(),
                              Run(target=Target(device=target), loop=Loop(offload_activations=offload)), step=step)


def _measured(offload: str | None, model: nn.Module, step=_plain) -> int:
    return preflight.measure(model, torch.optim.AdamW(model.parameters()), _batch(),
                             Run(loop=Loop(offload_activations=offload)), step=step).peak_bytes


def test_a_run_described_with_save_on_cpu_traces_its_forward_under_it():
    # The step the user wrote without hooks, run as if its forward were wrapped in save_on_cpu. On a CPU target it
    # is measured as it runs (`measure` takes the same description).
    assert _described("save_on_cpu", "cpu").peak_bytes == _measured("save_on_cpu", _model())
    # On a CUDA target: the same figure and note as the step that enters save_on_cpu itself, and below the plain run.
    described, written = _described("save_on_cpu", "cuda"), _estimate(_offloaded(torch.cuda.is_available()), "cuda")
    assert described.peak_bytes == written.peak_bytes
    assert [n for n in described.coverage.notes if n.startswith("saved-tensor hooks")] == \
        [n for n in written.coverage.notes if n.startswith("saved-tensor hooks")] != []
    assert described.peak_bytes < _described(None, "cuda").peak_bytes - 3 * 2**20


class _Sin(nn.Module):
    def forward(self, x):
        return x.sin()


def _sin_model() -> nn.Module:
    # Every activation is saved once: a Linear saves its input, sin saves its input (the Linear's output).
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), _Sin())], nn.Linear(256, 1))


def test_stream_offloading_keeps_what_trls_stashes_keep():
    # On a CPU target the hooks run as they are, and the trace equals the measured peak.
    assert _described("streams", "cpu", _sin_model()).peak_bytes == _measured("streams", _sin_model())
    streams, synchronous = _described("streams", "cuda", _sin_model()), _described("save_on_cpu", "cuda", _sin_model())
    # Offloaded per step: the 7 Linear inputs (the batch's among them), the 6 sin inputs, the squared output (4 KB);
    # not the 6 weights the Linears save (parameters stay on the device), which save_on_cpu copies too.
    note = next(n for n in streams.coverage.notes if n.startswith("saved-tensor hooks"))
    assert "moved 28 saved tensor(s)" in note
    assert "moved 40 saved tensor(s)" in next(n for n in synchronous.coverage.notes if n.startswith("saved-tensor"))
    # Both peak at the first Linear's bias gradient in step 2's backward. save_on_cpu has released that node's copy
    # of its input by then; the stream version still holds it and the previous node's copy (the sin's input), kept
    # until the next node that brings tensors back has run: two 1 MiB activations more.
    assert streams.peak_phase == synchronous.peak_phase == "step2/backward"
    assert streams.peak_bytes - synchronous.peak_bytes == 2 * 1024 * 256 * 4


def test_offload_activations_names_a_mode():
    with pytest.raises(ValueError, match="`offload_activations` should be one of"):
        Loop(offload_activations=True)


def test_advise_offers_offloading_on_a_cuda_target_only():
    def advice(target: Target):
        model = _sin_model()
        return preflight.advise(model, torch.optim.AdamW(model.parameters()), _batch(), Run(target=target),
                                step=_plain)

    # A budget between the offloaded figure and the plain one: offloading fits.
    plain, offloaded = _described(None, "cuda", _sin_model()), _described("streams", "cuda", _sin_model())
    assert offloaded.run_required_bytes < plain.run_required_bytes
    budget = (plain.run_required_bytes + offloaded.run_required_bytes) // 2
    found = [s for s in advice(Target(device="cuda", budget=budget)) if s.changes == ("offload_activations",)]
    assert len(found) == 1
    assert found[0].fits and found[0].predicted_peak_bytes == offloaded.run_required_bytes
    assert found[0].run.loop.offload_activations == "streams"
    assert found[0].run.cli_flags()[-2:] == ["--offload-activations", "streams"]
    # On the CPU the host is the device: nothing to offload to.
    assert not any("offload_activations" in s.changes for s in advice(Target(device="cpu", budget=budget)))
