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


def _described(offload: bool, target: str, **kwargs):
    model = _model()
    return preflight.estimate(model, torch.optim.AdamW(model.parameters()), _batch(),
                              Run(target=Target(device=target), loop=Loop(offload_activations=offload)), step=_plain,
                              **kwargs)


def test_a_run_described_as_offloading_traces_the_forward_under_save_on_cpu():
    # `Loop(offload_activations=True)`: the step the user wrote without hooks, run as if its forward were wrapped in
    # save_on_cpu. On a CPU target it is measured as it runs (`measure` takes the same description).
    run = Run(loop=Loop(offload_activations=True))
    model = _model()
    measured = preflight.measure(model, torch.optim.AdamW(model.parameters()), _batch(), run, step=_plain)
    assert _described(True, "cpu").peak_bytes == measured.peak_bytes
    # On a CUDA target: the same figure and note as the step that enters save_on_cpu itself, and below the plain run.
    described, written = _described(True, "cuda"), _estimate(_offloaded(torch.cuda.is_available()), "cuda")
    assert described.peak_bytes == written.peak_bytes
    assert [n for n in described.coverage.notes if n.startswith("saved-tensor hooks")] == \
        [n for n in written.coverage.notes if n.startswith("saved-tensor hooks")] != []
    assert described.peak_bytes < _described(False, "cuda").peak_bytes - 3 * 2**20


def test_offload_activations_must_be_a_bool():
    with pytest.raises(ValueError, match="`offload_activations` should be True or False"):
        Loop(offload_activations="yes")


def test_advise_offers_offloading_on_a_cuda_target_only():
    def advice(target: Target):
        model = _model()
        return preflight.advise(model, torch.optim.AdamW(model.parameters()), _batch(), Run(target=target),
                                step=_plain)

    # A budget between the offloaded figure and the plain one: offloading fits.
    plain, offloaded = _described(False, "cuda"), _described(True, "cuda")
    budget = (plain.run_required_bytes + offloaded.run_required_bytes) // 2
    found = [s for s in advice(Target(device="cuda", budget=budget)) if s.changes == ("offload_activations",)]
    assert len(found) == 1
    assert found[0].fits and found[0].predicted_peak_bytes == offloaded.run_required_bytes
    assert found[0].run.loop.offload_activations is True
    assert found[0].run.cli_flags()[-1] == "--offload-activations"
    # On the CPU the host is the device: nothing to offload to.
    assert not any("offload_activations" in s.changes for s in advice(Target(device="cpu", budget=budget)))
