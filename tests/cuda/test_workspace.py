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
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), lm_batch(2, 16), gpu="H100-80GB")
    ws = [e for e in est.events if e.uid in WORKSPACE_UIDS]
    assert [(e.nbytes, e.phase) for e in ws] == [(32 * 2**20, "step1/forward"), (32 * 2**20, "step1/backward")]
    assert not any(e.uid in WORKSPACE_UIDS and e.nbytes < 0 for e in est.events)
    assert est.breakdown["temporaries"] >= 2 * 32 * 2**20
    cpu = preflight.estimate(model, torch.optim.AdamW(model.parameters()), lm_batch(2, 16))
    assert not any(e.uid in WORKSPACE_UIDS for e in cpu.events)
