"""estimate() against measure() on CPU, for each supported kind of model, optimizer and precision."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from conftest import (classify_step, image_batch, lm_batch, make_depthwise_cnn, make_gpt2, make_llama,
                      make_resnet_like, Stack)
from torch import nn

import preflight
from preflight._result import Category

TRANSFORMER_TOL = 0.005  # issue 2: within 0.5% for transformer models
CNN_TOL = 0.03  # and 3% for CNNs


def relative_error(model, optimizer, batch, run=None, step=None):
    est = preflight.estimate(model, optimizer, batch, run, step=step)
    measured = preflight.measure(model, optimizer, batch, run, step=step)
    assert est.coverage.traced and not est.coverage.lower_bound
    assert sum(est.breakdown.values()) == est.peak_bytes
    return (est.peak_bytes - measured.peak_bytes) / measured.peak_bytes, est


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.01),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.9, centered=True),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.01),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_torch_optimizers_on_gpt2(name):
    model = make_gpt2()
    err, _ = relative_error(model, OPTIMIZERS[name](model.parameters()), lm_batch())
    assert abs(err) < TRANSFORMER_TOL


# The class names Lightning and accelerate users write, and the configurations HF builds (issue 10: AdamW with
# optim_bits=8 is 8-bit state whatever the class is called).
BNB_8BIT = {"AdamW8bit": {}, "PagedAdamW8bit": {}, "AdamW": {"optim_bits": 8},
            "PagedAdamW": {"optim_bits": 8}}


@pytest.mark.parametrize("cls_name", sorted(BNB_8BIT))
def test_bitsandbytes_8bit(cls_name):
    bnb = pytest.importorskip("bitsandbytes")
    model = make_gpt2()
    optimizer = getattr(bnb.optim, cls_name)(model.parameters(), lr=1e-3, **BNB_8BIT[cls_name])
    err, est = relative_error(model, optimizer, lm_batch())
    assert abs(err) < TRANSFORMER_TOL
    # uint8 state1/state2 + fp32 absmax per 256-element block; fp32 states below 4096 elements; qmaps are
    # built at construction (outside the trace), so the traced state is exactly the per-parameter tensors.
    expected = 0
    for p in model.parameters():
        n = p.numel()
        expected += 2 * (n + 4 * -(-n // 256)) if n >= 4096 else 2 * 4 * n
    assert est.breakdown["optimizer_state"] == expected


@pytest.mark.parametrize("cls_name", ["AdamW8bit", "PagedAdamW", "Lion8bit", "Lion"])
def test_bitsandbytes_cpu_updates_are_traced_with_their_fp32_temporaries(cls_name):
    # A short batch puts the peak in the optimizer step, where bitsandbytes' CPU kernels (torch code in
    # backends/cpu/ops.py) dequantize 8-bit states into fp32 tensors of the parameter's size, or hold the update in
    # fp32: run as they are, not as their fake implementations (which return nothing), they are counted.
    bnb = pytest.importorskip("bitsandbytes")
    model = make_gpt2()
    optimizer = getattr(bnb.optim, cls_name)(model.parameters(), lr=1e-4)
    err, est = relative_error(model, optimizer, lm_batch(2, 32))
    assert est.peak_phase.endswith("optimizer") and abs(err) < 1e-5, (est.peak_phase, err)


@pytest.mark.parametrize("cls_name, options", [("SGD8bit", {"lr": 0.1, "momentum": 0.9, "min_8bit_size": 1024}),
                                                ("LARS", {"lr": 0.1, "momentum": 0.9}), ("LAMB", {})])
def test_bitsandbytes_momentum_and_norm_clipped_optimizers_are_traced(cls_name, options):
    """bitsandbytes' SGD and LARS keep momentum as ``betas`` (rebuilt without it, the clone refused momentum=0: a
    lower bound, -48%); LAMB and LARS clip the update by the parameter's norm, which bitsandbytes hands its kernel as
    a Python float and reads back with ``.item()`` on the CPU (placeholders, noted: before, a lower bound at -41%)."""
    bnb = pytest.importorskip("bitsandbytes")
    from conftest import predicted_and_measured

    est, measured = predicted_and_measured(_mlp, lambda ps: getattr(bnb.optim, cls_name)(ps, **options),
                                           torch.randn(64, 64), step=_mlp_step)
    assert not est.coverage.lower_bound and 0 <= measured - est.peak_bytes <= 16, est.coverage
    if cls_name != "SGD8bit":
        assert any(n.startswith("bitsandbytes' update-norm clipping (max_unorm: LAMB, LARS)") for n in
                   est.coverage.notes)


@pytest.mark.parametrize("maker", [make_gpt2, make_llama], ids=["gpt2", "llama"])
def test_lora(maker):
    peft = pytest.importorskip("peft")
    target = ["c_attn"] if maker is make_gpt2 else ["q_proj", "v_proj"]
    model = peft.get_peft_model(maker(), peft.LoraConfig(r=8, target_modules=target))
    trainable = [p for p in model.parameters() if p.requires_grad]
    err, est = relative_error(model, torch.optim.AdamW(trainable), lm_batch())
    assert abs(err) < TRANSFORMER_TOL
    # AdamW state for the adapters only: exp_avg + exp_avg_sq (fp32) and a 4-byte step per tensor.
    assert est.breakdown["optimizer_state"] == sum(2 * p.numel() * 4 + 4 for p in trainable)


@pytest.mark.parametrize(
    "maker, kwargs",
    [
        (lambda: make_gpt2().to(torch.bfloat16), {}),
        (make_gpt2, {"precision": "bf16-mixed"}),
        (make_llama, {"precision": "bf16-mixed"}),
        (make_gpt2, {"precision": "bf16-true"}),
        (lambda: make_llama("eager"), {}),
        (lambda: make_llama("sdpa"), {}),
        (lambda: make_gpt2(attn_implementation="eager"), {}),
    ],
    ids=["gpt2-bf16-params", "gpt2-bf16-mixed", "llama-bf16-mixed", "gpt2-bf16-true", "llama-eager",
         "llama-sdpa", "gpt2-eager"],
)
def test_precisions_and_attention(maker, kwargs):
    model = maker()
    err, _ = relative_error(model, torch.optim.AdamW(model.parameters()), lm_batch(), preflight.Run(**kwargs))
    assert abs(err) < TRANSFORMER_TOL


@pytest.mark.parametrize(
    "maker, precision, reentrant",
    [(make_gpt2, None, False), (make_gpt2, None, True),
     pytest.param(make_llama, "bf16-mixed", False, marks=pytest.mark.slow)],
    ids=["gpt2", "gpt2-reentrant", "llama-bf16-mixed"],
)
def test_gradient_checkpointing(maker, precision, reentrant):
    # Not here: GPT-2 + checkpointing + bf16-mixed on CPU is 1.7% low, because its peak falls inside a
    # oneDNN bf16 matmul whose packing scratch no dispatch mode sees (README, known limitations).
    model = maker()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    err, _ = relative_error(model, torch.optim.AdamW(model.parameters()), lm_batch(), run=preflight.Run(precision=precision))
    assert abs(err) < TRANSFORMER_TOL


@pytest.mark.slow
def test_padded_batch_takes_the_real_mask_path():
    # With padding the real run builds a 4-D mask; without it, sdpa skips the mask. Value shadows of the
    # attention mask make the fake trace take the same branch in both cases.
    model = make_llama()
    err_full, est_full = relative_error(model, torch.optim.AdamW(model.parameters()), lm_batch())
    err_pad, est_pad = relative_error(model, torch.optim.AdamW(model.parameters()), lm_batch(pad=10))
    assert err_full == pytest.approx(0.0, abs=1e-5) and err_pad == pytest.approx(0.0, abs=1e-5)
    assert est_pad.peak_bytes > est_full.peak_bytes


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(500, 64)
        self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.head = nn.Linear(64, 500, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.body(self.emb(ids)))


def test_tied_weights_counted_once():
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, 500, (8, 64))

    def step(m, b):
        return nn.functional.cross_entropy(m(b).flatten(0, 1), b.flatten())

    err, est = relative_error(model, torch.optim.AdamW(model.parameters()), ids, step=step)
    assert abs(err) < TRANSFORMER_TOL
    assert est.breakdown["parameters"] == sum(p.numel() * 4 for p in model.parameters())  # unique params


@pytest.mark.parametrize("maker", [make_resnet_like, make_depthwise_cnn], ids=["resnet", "depthwise"])
def test_cnns_with_calibrated_scratch(maker):
    model = maker()
    err, est = relative_error(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), image_batch(),
                              step=classify_step)
    assert abs(err) < CNN_TOL
    assert est.coverage.calibrated  # convolution scratch was measured, not assumed zero


def test_meta_device_model_matches_real_model():
    with torch.device("meta"):
        meta = make_gpt2()
    real = make_gpt2()
    batch = lm_batch()
    est_meta = preflight.estimate(meta, torch.optim.AdamW(meta.parameters()), batch)
    est_real = preflight.estimate(real, torch.optim.AdamW(real.parameters()), batch)
    assert est_meta.device == "cpu"
    assert est_meta.peak_bytes == est_real.peak_bytes


def _snapshot(model, optimizer):
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "opt": copy.deepcopy(optimizer.state_dict()),
        "attrs": [(m, dict(vars(m))) for m in model.modules()],
        "torch_rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
        "np_rng": np.random.get_state()[1].copy(),
    }


def test_estimate_has_no_side_effects():
    model = make_gpt2(resid_pdrop=0.1)  # dropout draws random numbers in the forward
    model.eval()  # estimate traces in train mode; the user's mode must come back
    optimizer = torch.optim.AdamW(model.parameters())
    hook_calls = []
    model.transformer.h[0].register_forward_hook(lambda *a: hook_calls.append(1))
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(7)
    before = _snapshot(model, optimizer)
    preflight.estimate(model, optimizer, lm_batch())
    after = _snapshot(model, optimizer)

    assert hook_calls == [1, 1]  # the user's hooks ran in the trace (once per step) ...
    assert all(torch.equal(before["params"][k], v) for k, v in after["params"].items())
    assert after["grads"] == before["grads"]
    assert after["requires_grad"] == before["requires_grad"]
    assert after["opt"] == before["opt"] and not optimizer.state
    assert torch.equal(before["torch_rng"], after["torch_rng"])
    assert before["py_rng"] == after["py_rng"]
    assert np.array_equal(before["np_rng"], after["np_rng"])
    for (m, attrs), (_, attrs_after) in zip(before["attrs"], after["attrs"]):
        assert attrs.keys() == attrs_after.keys()
        assert all(attrs[k] is attrs_after[k] for k in attrs), type(m).__name__  # ... and are still there
    assert not model.training


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 1)

    def forward(self, x):
        h = self.a(x)
        if h.mean() > 0:  # control flow on a value computed from parameters: a fake tensor cannot answer
            h = h * 2
        return self.b(h).mean()


def test_untraceable_model_gives_a_labelled_lower_bound():
    torch.manual_seed(0)
    model = DataDependent()
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 32)
    with pytest.warns(RuntimeWarning, match="lower bound") as record:
        est = preflight.estimate(model, optimizer, x)
    assert len(record) == 1
    assert not est.coverage.traced and est.coverage.lower_bound
    assert "local_scalar_dense" in est.coverage.failed_op or "is_nonzero" in est.coverage.failed_op
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    # parameters + gradients + AdamW state (2 x params + a 4-byte step per tensor) + batch
    expected = param_bytes + param_bytes + 2 * param_bytes + 4 * 4 + x.numel() * 4
    assert est.peak_bytes == expected
    assert est.peak_bytes < preflight.measure(model, optimizer, x).peak_bytes


def test_argument_errors():
    model = make_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="precision"):
        preflight.estimate(model, opt, lm_batch(), run=preflight.Run(precision="fp8"))
    with pytest.raises(ValueError, match="steps"):
        preflight.estimate(model, opt, lm_batch(), run=preflight.Run(loop=preflight.Loop(steps=0)))
    with pytest.raises(TypeError, match="optimizer"):
        preflight.estimate(model, "adamw", lm_batch())
    with pytest.raises(TypeError, match="nn.Module"):
        preflight.estimate(lambda x: x, opt, lm_batch())
    no_labels = {k: v for k, v in lm_batch().items() if k != "labels"}
    with pytest.raises(ValueError, match="Pass `step="):
        preflight.estimate(model, opt, no_labels)


@pytest.mark.slow
def test_custom_step_and_existing_optimizer_state():
    model = make_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    batch = lm_batch()
    preflight.measure(model, opt, batch, run=preflight.Run(loop=preflight.Loop(steps=1)))  # the optimizer now has state, as when resuming
    err, est = relative_error(model, opt, batch, step=lambda m, b: m(**b).loss * 1.0)
    assert abs(err) < TRANSFORMER_TOL
    assert est.breakdown["optimizer_state"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("accumulate, zero_grad", [(3, "after_step"), (1, "before_backward"), (2, "before_backward"),
                                                   (1, "in_place")])
def test_schedules_gradient_accumulation_and_lightning_zero_grad(accumulate, zero_grad):
    # "in_place": zero_grad(set_to_none=False), measured by a real loop doing exactly that
    model = make_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    err, est = relative_error(model, opt, lm_batch(), run=preflight.Run(loop=preflight.Loop(accumulate=accumulate, zero_grad=zero_grad)))
    assert abs(err) < TRANSFORMER_TOL
    model.zero_grad(set_to_none=True)  # the measured steps left gradients: a plain run starts without
    plain = preflight.estimate(model, opt, lm_batch())
    assert est.peak_bytes > plain.peak_bytes  # gradients alive across a forward
    with pytest.raises(ValueError, match="zero_grad"):
        preflight.estimate(model, opt, lm_batch(), run=preflight.Run(loop=preflight.Loop(zero_grad="sometimes")))


@pytest.mark.slow
def test_batch_encoding_batches_are_traced_like_dicts():
    from transformers import BatchEncoding  # what the HF Trainer's padding collators return

    model = make_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    plain = preflight.estimate(model, opt, lm_batch())
    wrapped = preflight.estimate(model, opt, BatchEncoding(lm_batch()))
    assert not wrapped.coverage.lower_bound
    assert wrapped.peak_bytes == plain.peak_bytes and wrapped.breakdown["inputs"] == plain.breakdown["inputs"] > 0
    assert preflight.measure(model, opt, BatchEncoding(lm_batch())).peak_bytes == pytest.approx(
        wrapped.peak_bytes, rel=TRANSFORMER_TOL)


def test_a_step_writing_into_its_batch_does_not_change_the_users_batch():
    model = make_gpt2()
    batch = lm_batch()
    # Its own labels tensor: lm_batch's labels are its input_ids, and -100 in the ids fails the real step.
    batch["labels"] = batch["labels"].clone()
    batch["labels"][0, :5] = 0
    before = {k: v.clone() for k, v in batch.items()}

    def step(m, b):
        labels = b["labels"]
        labels[labels == 0] = -100  # runs for real on the value shadow of the labels
        return m(**b).loss

    preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, step=step)
    assert all(torch.equal(before[k], batch[k]) for k in batch)


def test_an_optimizer_that_cannot_be_rebuilt_gets_the_analytic_lower_bound():
    class Scaled(torch.optim.SGD):  # its constructor needs an argument that is not in `defaults`
        def __init__(self, params, scale, lr=0.1):
            super().__init__(params, lr=lr)
            self.scale = scale

    model = nn.Linear(32, 32)
    with pytest.warns(RuntimeWarning, match="lower bound"):
        est = preflight.estimate(model, Scaled(model.parameters(), 2.0), torch.randn(4, 32),
                                 step=lambda m, b: m(b).sum())
    assert est.coverage.lower_bound and "Scaled" in est.coverage.failed_op and "scale" in est.coverage.reason


def test_lower_bound_is_per_rank_when_sharded():
    torch.manual_seed(0)
    model = DataDependent()
    x = torch.randn(16, 32)
    with pytest.warns(RuntimeWarning):
        single = preflight.estimate(model, torch.optim.AdamW(model.parameters()), x)
    with pytest.warns(RuntimeWarning):
        sharded = preflight.estimate(model, torch.optim.AdamW(model.parameters()), x, run=preflight.Run(target=preflight.Target(gpu="A100-80GB"), parallel=preflight.ParallelPlan(4, "zero2")))
    assert sharded.coverage.lower_bound and sharded.world_size == 4 and sharded.gpu == "A100-80GB"
    assert sharded.unsharded_peak_bytes == single.peak_bytes
    # The rank's share of the optimizer state, plus DeepSpeed's fp32 copy of its parameter partition (4 bytes for each
    # of its quarter of the parameters: stage_1_and_2.py __init__, `weights_partition`).
    params = sum(p.numel() for p in model.parameters())
    assert sharded.breakdown["optimizer_state"] == -(-single.breakdown["optimizer_state"] // 4) + 4 * -(-params // 4)
    # DeepSpeed's gradient reduction buffer is its default reduce_bucket_size in fp32, whatever the model's size;
    # everything else is this rank's share of the bound.
    assert sharded.breakdown["communication"] == 500_000_000 * 4
    assert sharded.peak_bytes - sharded.breakdown["communication"] < single.peak_bytes


def test_zero3_counts_deepspeeds_own_terms():
    # Two linear layers of 64 x 64 over 2 ranks; biases (64 elements) under the persistence threshold stay whole.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000,
                                    "stage3_param_persistence_threshold": 64}}
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), torch.randn(8, 64), run=preflight.Run(parallel=preflight.deepspeed_plan(config, world_size=2)), step=lambda m, x: m(x).square().mean())
    alive = {}
    for e in est.events:  # what each category holds after the second step
        category = est.categories.get(e.uid, Category.TEMPORARIES).value
        alive[category] = alive.get(category, 0) + e.nbytes
    # The reduction buffer (1000 fp32 elements), the persistent biases and both weights, gathered whole (DeepSpeed's
    # default reuse distance keeps them from forward to backward).
    assert alive["communication"] == 1000 * 4 + 2 * 64 * 4 + 2 * 64 * 64 * 4
    # The rank's gradient partitions, half of every parameter in fp32; the full gradients were transients.
    assert alive["gradients"] == (64 * 64 + 64) * 4
    assert "fp32 partition copy 16,640 B" in " ".join(est.coverage.notes)


def _hf_optimizer_names():
    try:
        from transformers.training_args import OptimizerNames
    except ImportError:
        return []
    return [name.value for name in OptimizerNames]


# HF choices that cannot run here, with why (the rest are skipped only when HF itself says a package is missing).
_HF_CANNOT_RUN = {
    "adamw_torch_xla": "needs torch_xla",
    "adamw_torch_npu_fused": "needs torch_npu (Ascend NPU)",
    # bitsandbytes' AdEMAMix allocates its paged double buffer with cget_managed_ptr even off CUDA, which the
    # CPU build of bitsandbytes lacks: measure() cannot run it here (estimate() does).
    "paged_ademamix_8bit": "bitsandbytes' paged AdEMAMix needs CUDA managed memory, even on CPU",
    "paged_ademamix_32bit": "bitsandbytes' paged AdEMAMix needs CUDA managed memory, even on CPU",
}


@pytest.fixture()
def _bnb_overrides_restored():
    """HF's create_optimizer registers 32-bit overrides for embeddings in bitsandbytes' process-wide
    GlobalOptimManager (by module, parameter id and (group, index) position); left there, they would apply to
    the optimizers of later tests. Restore the manager as it was."""
    try:
        from bitsandbytes.optim import GlobalOptimManager
    except ImportError:
        yield
        return
    mng = GlobalOptimManager.get_instance()
    saved = (list(mng.module_weight_config_triple), dict(mng.pid2config), dict(mng.index2config))
    yield
    mng.module_weight_config_triple[:] = saved[0]
    mng.pid2config.clear()
    mng.pid2config.update(saved[1])
    mng.index2config.clear()
    mng.index2config.update(saved[2])


@pytest.mark.usefixtures("_bnb_overrides_restored")
@pytest.mark.parametrize("optim", _hf_optimizer_names())
def test_every_hf_optimizer_choice(optim, tmp_path):
    """issue 10: each TrainingArguments(optim=...) that builds on CPU, as Trainer.create_optimizer() builds it.

    HF's "adamw_bnb_8bit" is ``bnb.optim.AdamW(..., optim_bits=8)``: its 8-bit state must be predicted from that
    configuration, not from a class name.

    Known limitation, kept out of this comparison by the batch size: bitsandbytes' CPU optimizer kernels are
    Python functions behind one custom op (``bitsandbytes::optimizer_update_32bit``/``_8bit_blockwise``), so the
    trace sees the op's fake implementation and not their fp32 copies of each gradient and parameter. On CUDA
    those kernels are fused and allocate nothing; on CPU a step whose peak is in ``optimizer.step`` is
    underestimated by up to about two fp32 copies of the largest parameter.
    """
    transformers = pytest.importorskip("transformers")
    if optim in _HF_CANNOT_RUN:
        pytest.skip(_HF_CANNOT_RUN[optim])
    model = make_gpt2(n_layer=1)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), optim=optim, report_to=[], use_cpu=True)
    try:
        optimizer = transformers.Trainer(model=model, args=args).create_optimizer()
    except (ImportError, ValueError) as err:
        if "install" not in str(err).lower() and "import" not in str(err).lower():
            raise
        pytest.skip(f"HF cannot build it here: {str(err).splitlines()[0]}")
    err, _ = relative_error(model, optimizer, lm_batch())
    assert abs(err) < TRANSFORMER_TOL, f"{optim} ({type(optimizer).__module__}.{type(optimizer).__name__})"


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 96), nn.GELU(), nn.Linear(96, 10))


def _mlp_step(m, b):
    return nn.functional.cross_entropy(m(b), torch.zeros(b.shape[0], dtype=torch.long))


def test_low_precision_matmul_scratch_is_calibrated_on_cpu(monkeypatch):
    # oneDNN's bf16 matrix products hold fp32 accumulators and reordered operands beyond their outputs on some CPUs
    # (the one this test was written on) and nothing more on others (an AVX2-only CPU): the calibration runs them.
    model, batch = _mlp(), torch.randn(128, 64)
    err, est = relative_error(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, step=_mlp_step,
                              run=preflight.Run(precision="bf16-mixed"))
    assert abs(err) < 0.005
    assert any(label.startswith(("addmm", "mm")) for label in est.coverage.calibrated)
    # The term is this CPU's: without it the prediction is under the measured peak by the scratch the kernels hold,
    # and the same where they hold none.
    from preflight import _scratch

    monkeypatch.setattr(_scratch, "_needs_calibration", lambda func, args, device: False)
    uncalibrated = preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, step=_mlp_step,
                                      run=preflight.Run(precision="bf16-mixed"))
    measured = preflight.measure(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, step=_mlp_step,
                                 run=preflight.Run(precision="bf16-mixed")).peak_bytes
    assert uncalibrated.peak_bytes <= est.peak_bytes
    assert abs(uncalibrated.peak_bytes - measured) >= abs(est.peak_bytes - measured)


def test_fp32_matmuls_are_not_calibrated():
    model = _mlp()
    est = preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(128, 64),
                             step=_mlp_step)
    assert not est.coverage.calibrated


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeeds_optimizer_state_is_fp32_for_a_16_bit_model(stage):
    # DeepSpeed's optimizer steps the fp32 copy of the rank's partition: a bf16 model's AdamW state is fp32, as an
    # fp32 model's is (measured on real DeepSpeed ZeRO-2/3 under bf16 and fp16: -5% to -6% before, within 0.4% after,
    # tests/integrations/test_lightning.py). The two differ only by AdamW's fp32 `step` scalars, counted twice.
    states = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = Stack(depth=2, width=64).to(dtype)
        est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), torch.randn(4, 64, dtype=dtype),
                                 step=lambda m, b: m(b), run=preflight.Run(parallel=preflight.deepspeed_plan({"zero_optimization": {"stage": stage, "reduce_bucket_size": 1000}}, world_size=2)))
        states[dtype] = est.breakdown["optimizer_state"]
        scaled = [n for n in est.coverage.notes if "fp32 copy of the partition" in n]
        assert scaled == ([] if dtype is torch.float32 else [scaled[0]]) and (not scaled or "(x2)" in scaled[0])
    n_tensors = len(list(Stack(depth=2, width=64).parameters()))
    assert 0 <= states[torch.bfloat16] - states[torch.float32] <= 4 * n_tensors


@pytest.mark.parametrize("section, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_deepspeeds_16_bit_modes_trace_the_model_as_deepspeed_casts_it(section, dtype):
    # DeepSpeed's bf16 / fp16 modes cast the module to 16 bits before training: an fp32 model planned with such a
    # config is traced as the cast model (against real Lightning DeepSpeed runs, benchmarks/deepspeed_trainers.py's
    # bf16 ZeRO-2 / ZeRO-3 rows: +12.7% / +9.1% before, +0.08% / -0.02% after).
    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}, section: {"enabled": True}}
    torch.manual_seed(0)
    model = Stack(depth=2, width=64)
    x = torch.randn(4, 64)
    planned = preflight.estimate(model, torch.optim.AdamW(model.parameters()), x, step=lambda m, b: m(b),
                                 run=preflight.Run(parallel=preflight.deepspeed_plan(config, world_size=2)))
    cast = Stack(depth=2, width=64).to(dtype)
    as_run = preflight.estimate(cast, torch.optim.AdamW(cast.parameters()), x.to(dtype), step=lambda m, b: m(b),
                                run=preflight.Run(parallel=preflight.deepspeed_plan(config, world_size=2)))
    assert planned.peak_bytes == as_run.peak_bytes
    assert any(f"DeepSpeed's {section} mode: the model traced in {dtype}" in n for n in planned.coverage.notes)
    assert all(p.dtype is torch.float32 for p in model.parameters())  # the user's model is not cast


def test_a_device_preflight_does_not_model_is_named():
    # Issue 24, item 10: device="mps" got a number with no word that MPS is not modelled.
    model = torch.nn.Linear(8, 8)
    run = preflight.Run(target=preflight.Target(device="mps"))
    est = preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 8), run,
                             step=lambda m, b: m(b).sum())
    ev = preflight.estimate_eval(model, torch.randn(2, 8), run)
    for notes in (est.coverage.notes, ev.coverage.notes):
        assert any(n.startswith("mps is not modelled (only CPU and CUDA are)") for n in notes), notes
    cpu = preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 8),
                             step=lambda m, b: m(b).sum())
    assert not any("not modelled" in n for n in cpu.coverage.notes)


@pytest.mark.parametrize("precision", [None, "bf16-true"])
def test_gradients_held_before_the_run_are_counted_from_the_start(precision):
    # A backward ran before preflight (a warm-up step, a notebook cell) and no zero_grad since: the run starts with
    # every parameter's .grad on the device, and its first backward accumulates into them.
    model, batch = make_gpt2(n_layer=2, n_embd=64), lm_batch(batch_size=2, seq=32)
    optimizer = torch.optim.AdamW(model.parameters())
    run = preflight.Run(precision=precision)
    fresh = preflight.estimate(model, optimizer, batch, run)
    model(**batch).loss.backward()
    held = {name: (p.grad, p.grad.clone()) for name, p in model.named_parameters()}
    est = preflight.estimate(model, optimizer, batch, run)
    for name, p in model.named_parameters():  # the user's gradients are as they were
        assert p.grad is held[name][0] and torch.equal(p.grad, held[name][1])
    grad_bytes = sum(p.numel() * (2 if precision else 4) for p in model.parameters())
    assert est.peak_bytes - fresh.peak_bytes == grad_bytes  # each held gradient is on top of the fresh run's peak
    assert any(f"held a .grad before the run ({grad_bytes:,} B)" in n for n in est.coverage.notes)
    # A step traced again after real steps (the callbacks' verification) starts with the gradients held when the
    # run began: none here.
    from preflight.trace import gradients_held_by

    with gradients_held_by([]):
        assert preflight.estimate(model, optimizer, batch, run).peak_bytes == fresh.peak_bytes
    # An evaluation holds them too, unless the caller's resident state already says what training left.
    plain_eval = preflight.estimate_eval(model, batch, run, resident={})
    assert preflight.estimate_eval(model, batch, run).peak_bytes - plain_eval.peak_bytes == grad_bytes
    measured = preflight.measure(model, optimizer, batch, run)  # trains the model: last
    assert abs(est.peak_bytes - measured.peak_bytes) / measured.peak_bytes < TRANSFORMER_TOL


def test_a_lazy_module_not_yet_initialized_is_refused_with_how_to_initialize_it():
    model = nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.LazyLinear(4))
    batch = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"4 parameter\(s\) or buffer\(s\) of lazy modules are not initialized yet "
                                         r"\(0.weight, 0.bias, 2.weight and 1 more\).*Run one forward"):
        preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, step=lambda m, b: m(b).sum())
    model(batch)  # as the message says: then it is estimated, to the measured peak
    est = preflight.estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, step=lambda m, b: m(b).sum())
    measured = preflight.measure(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, step=lambda m, b: m(b).sum())
    assert est.peak_bytes == measured.peak_bytes


def test_an_evaluation_step_counts_the_memory_its_kernels_hold():
    # Convolutions hold workspace inside the kernel (oneDNN on CPU): measured once per configuration, as the
    # training estimate does. Before, the evaluation step left it out: 1,054,848 B under this CNN's measured peak.
    from preflight._device import live_storages
    from preflight._measure import cpu_profiled_peak

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(32, 32, 7, padding=3, groups=32), torch.nn.Flatten(),
                                torch.nn.Linear(32 * 32 * 32, 10)).eval()
    x = torch.randn(8, 3, 32, 32)

    def evaluate():
        with torch.no_grad():
            model(x)

    resident = live_storages([list(model.parameters()), [x]], torch.device("cpu"))
    peak, _ = cpu_profiled_peak(evaluate, resident=resident)
    est = preflight.estimate_eval(model, x)
    assert est.peak_bytes == sum(resident.values()) + peak
    assert len(est.coverage.calibrated) == 2 and all(c.startswith("convolution") for c in est.coverage.calibrated)
