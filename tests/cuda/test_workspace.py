"""cuBLAS workspaces: their size per architecture and CUBLAS_WORKSPACE_CONFIG, and where a CUDA estimate holds them."""

from __future__ import annotations

import torch
from conftest import lm_batch, make_gpt2

import preflight
from preflight.cuda import WORKSPACE_UIDS, cublas_workspace_bytes


def test_size_per_architecture_and_environment():
    assert cublas_workspace_bytes((7, 0), {}) == cublas_workspace_bytes((8, 9), {}) == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert cublas_workspace_bytes((9, 0), {}) == 32 * 2**20
    assert cublas_workspace_bytes((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * 2**20
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024  # deterministic mode
    assert cublas_workspace_bytes((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}) == 8_519_680


def test_a_cuda_estimate_holds_two_workspaces_from_the_first_forward_and_backward(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    model = make_gpt2(n_layer=1)
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), lm_batch(2, 16), run=preflight.Run(target=preflight.Target(gpu="H100-80GB")))
    ws = [e for e in est.events if e.uid in WORKSPACE_UIDS]
    assert [(e.nbytes, e.phase) for e in ws] == [(32 * 2**20, "step1/forward"), (32 * 2**20, "step1/backward")]
    assert not any(e.uid in WORKSPACE_UIDS and e.nbytes < 0 for e in est.events)
    assert est.breakdown["temporaries"] >= 2 * 32 * 2**20
    cpu = preflight.estimate(model, torch.optim.AdamW(model.parameters()), lm_batch(2, 16))
    assert not any(e.uid in WORKSPACE_UIDS for e in cpu.events)


class _ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3))).sum()


def test_cudnn_convolution_workspace_is_a_stated_assumption_on_a_cuda_target(monkeypatch):
    # A CPU host cannot size it (cuDNN picks the algorithm on the device); the coverage says so, and how it is
    # bounded. The CPU target calibrates its convolution scratch instead and says nothing of cuDNN.
    model, batch = _ConvNet(), torch.randn(2, 3, 16, 16)
    monkeypatch.delenv("CUDNN_CONV_WSCAP_DBG", raising=False)
    est = preflight.estimate(model, torch.optim.SGD(model.parameters()), batch, run=preflight.Run(target=preflight.Target(gpu="A100-80GB")))
    [note] = [n for n in est.coverage.notes if "cuDNN" in n]
    # forward, and backward (input and weight gradients in one call)
    assert note.startswith("cuDNN convolution workspace not counted for 2 configuration(s) (convolution[")
    assert "cannot cause an out-of-memory error by itself" in note and "CUDNN_CONV_WSCAP_DBG=<MiB> caps it" in note
    assert not any("kernel scratch not calibrated" in n for n in est.coverage.notes)
    monkeypatch.setenv("CUDNN_CONV_WSCAP_DBG", "256")
    est = preflight.estimate(model, torch.optim.SGD(model.parameters()), batch, run=preflight.Run(target=preflight.Target(gpu="A100-80GB")))
    assert any("at most 256 MiB per call (CUDNN_CONV_WSCAP_DBG)" in n for n in est.coverage.notes)
    cpu = preflight.estimate(model, torch.optim.SGD(model.parameters()), batch)
    assert not any("cuDNN" in n for n in cpu.coverage.notes)


def test_generation_on_a_cuda_target_holds_the_forward_threads_workspace(monkeypatch):
    # generate runs no backward: one workspace, from its first operator (measured on an H200: a fresh process's
    # generate held its 32 MiB beside the model; benchmarks/gpu_validation.py --part generation)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    model = make_gpt2(n_layer=1).eval()
    ids = torch.randint(3, 1000, (2, 8))
    run = preflight.Run(target=preflight.Target(gpu="H200"), generation={"max_new_tokens": 2, "pad_token_id": 0})
    est = preflight.estimate_generation(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, run)
    ws = [e for e in est.events if e.uid in WORKSPACE_UIDS]
    assert [(e.nbytes, e.phase) for e in ws] == [(32 * 2**20, "generate")]
    assert any(n.startswith("one cuBLAS workspace of 33,554,432 B") for n in est.coverage.notes)
    assert est.peak_bytes >= 32 * 2**20


def test_no_workspace_and_a_note_that_says_so_when_nothing_ran():
    from preflight._result import Event
    from preflight._target import add_workspaces

    events, note = add_workspaces([Event(1, 512, -1, "setup")], None)
    assert not any(e.uid in WORKSPACE_UIDS for e in events)
    assert note == "no cuBLAS workspace counted: no operator was traced"


def test_a_pipeline_step_holds_both_threads_workspaces_from_its_start():
    # A pipeline schedule runs forwards and backwards inside one phase (stepN/pipeline); its backwards run on the
    # autograd thread, whose handle gets a workspace too: both are placed where the step starts.
    from preflight._result import Event
    from preflight.cuda import with_workspaces

    events = [Event(1, 512, -1, "setup"), Event(2, 1024, 0, "step1/pipeline"), Event(2, -1024, 1, "step1/pipeline")]
    out = with_workspaces(events, 4096)
    assert sorted((e.uid, e.phase) for e in out if e.uid in WORKSPACE_UIDS) == [
        (WORKSPACE_UIDS[0], "step1/pipeline"), (WORKSPACE_UIDS[1], "step1/pipeline")]
    assert [e.uid for e in out][:1] == [1] and [e.uid for e in out][-2:] == [2, 2]
