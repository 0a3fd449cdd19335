"""benchmarks/gpu_validation.py runs in CPU mode: the CPU-host predictions, and a plain statement that the
measurements need a GPU; its reproduction of a published series' torch."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import preflight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU mode only; on a GPU the harness measures")
def test_quick_cpu_mode_prints_the_planned_column_and_says_measurements_need_a_gpu():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_validation.py"), "--quick",
                           "--no-write", "--gpu", "A100-80GB"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "planning for A100-80GB" in out
    assert "the on-device trace and the measurements need a GPU" in out
    rows = [line for line in out.splitlines() if line.startswith("| GPT-2") or line.startswith("| BERT")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        peak, allocated, reserved, total = (float(c.replace(",", "")) for c in cells[1:5])
        # the allocator's blocks hold the peak's tensors, reserved holds the blocks, the total adds the context
        assert 0 < peak <= allocated <= reserved < total
        assert not re.search("lower bound", row)


@pytest.mark.parametrize("precision", [None, "16-mixed"])
def test_their_torch_softmax_keeps_one_fp32_score_tensor_more_per_layer(precision):
    """Published series 1 is reproduced with softmax recorded as torch 1.10 did: its input saved beside its output.
    The prediction then holds exactly one more fp32 (batch, heads, seq, seq) tensor per attention layer, in fp32
    and under CUDA autocast alike (softmax is on its fp32 list), and the gradients are softmax's own."""
    import transformers

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from gpu_validation import torch_110_softmax
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                  vocab_size=100, max_position_embeddings=64, num_labels=2)
    cfg._attn_implementation = "eager"
    model = transformers.BertForSequenceClassification(cfg)
    batch = {"input_ids": torch.randint(0, 100, (3, 32)), "labels": torch.zeros(3, dtype=torch.long)}

    def predict():
        return preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, run=preflight.Run(precision=precision, target=preflight.Target(gpu="A100-80GB"))).peak_bytes

    now = predict()
    with torch_110_softmax():
        then = predict()
    assert then - now == 2 * (3 * 4 * 32 * 32) * 4

    x = torch.randn(2, 5, requires_grad=True)
    plain = torch.nn.functional.softmax
    with torch_110_softmax():
        y = torch.nn.functional.softmax(x, dim=-1)
    assert torch.nn.functional.softmax is plain  # put back
    assert [t.shape for t in y.grad_fn.saved_tensors] == [x.shape, x.shape]  # the input and the output
    (grad,) = torch.autograd.grad((y * torch.arange(5.0)).sum(), x)
    x2 = x.detach().requires_grad_()
    (expected,) = torch.autograd.grad((torch.softmax(x2, -1) * torch.arange(5.0)).sum(), x2)
    torch.testing.assert_close(grad, expected)


def test_a_part_it_does_not_have_is_a_usage_error():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_validation.py"), "--part",
                           "zoo,bogus", "--no-write"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert proc.returncode == 2 and "--part: unknown ['bogus']; choose from zoo, generation, hf, peft" in proc.stderr


def test_the_snapshot_reader_replays_the_allocators_trace_to_its_peak(tmp_path, capsys):
    """benchmarks/gpu_snapshot.py --read: the blocks live at the peak of a recorded history, with where each was
    allocated (a frame outside torch's own files), from a snapshot in torch.cuda.memory._snapshot's layout."""
    import gzip
    import pickle

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import gpu_snapshot
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    frames = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
              {"filename": "/y/model.py", "line": 7, "name": "forward"}]
    trace = [{"action": "alloc", "addr": 1, "size": 4096, "frames": frames},
             {"action": "alloc", "addr": 2, "size": 1024, "frames": []},
             {"action": "free_requested", "addr": 1, "size": 4096},
             {"action": "free_completed", "addr": 1, "size": 4096},
             {"action": "alloc", "addr": 3, "size": 512, "frames": frames}]
    snapshot = {"device_traces": [trace], "segments": []}
    assert gpu_snapshot.peak_blocks(snapshot) == (5120, [(4096, "model.py:7 forward"), (1024, "?")])
    path = tmp_path / "s.pickle.gz"
    with gzip.open(path, "wb") as f:
        pickle.dump(snapshot, f)
    assert gpu_snapshot.main(["--read", str(path)]) == 0
    out = capsys.readouterr().out
    assert "peak of the recorded trace: 5,120 B" in out and "model.py:7 forward" in out


def test_the_snapshot_replay_feeds_the_recorded_sequence_to_the_allocator_model():
    """--replay: the recorded allocations through preflight.allocator.simulate, beside the recorded segments."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import gpu_snapshot
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    mib = 2**20
    trace = [{"action": "segment_alloc", "addr": 0, "size": 20 * mib},
             {"action": "alloc", "addr": 0, "size": 3 * mib},
             {"action": "alloc", "addr": 3 * mib, "size": 5 * mib},
             {"action": "free_completed", "addr": 0, "size": 3 * mib},
             {"action": "alloc", "addr": 0, "size": int(2.5 * mib)}]  # reuses the 3 MiB block unsplit
    got = gpu_snapshot.replay({"device_traces": [trace]})
    assert got == {"recorded_reserved": 20 * mib, "simulated_reserved": 20 * mib, "simulated_allocated": 8 * mib,
                   "simulated_segments": 1}


def test_the_recorded_h200_snapshots_replay_to_their_measured_reserved_peak():
    """The allocator model given the H200's own sequence reserves what the H200 reserved (docs/cuda-target.md)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import gzip
        import pickle

        import gpu_snapshot
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    folder = os.path.join(ROOT, "benchmarks", "results", "snapshots")
    measured = {"GPT_2_fp32_AdamW": 1_371_537_408, "BERT_eager_16_mixed_GradScaler": 1_136_656_384}
    for name, reserved in measured.items():
        with gzip.open(os.path.join(folder, name + ".pickle.gz"), "rb") as f:
            got = gpu_snapshot.replay(pickle.load(f))
        assert got["recorded_reserved"] == got["simulated_reserved"] == reserved
