"""The step's trainer additions: gradient clipping and a loss scaler, traced as they run."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from conftest import lm_batch, make_gpt2

import preflight
from preflight._steps import Loop
from preflight.trace import trace_steps


@pytest.mark.parametrize("bad", [0, -1.0, True, "1", float("nan"), float("inf")])
def test_max_grad_norm_is_checked(bad):
    # nan and inf too (issue 24, item 10: nan was accepted as a clipping norm).
    with pytest.raises(ValueError, match=f"`max_grad_norm` should be a positive, finite number.*got {bad!r}"):
        Loop(max_grad_norm=bad)


def _ops(schedule: Loop, target: str = "cpu") -> list[str]:
    model = make_gpt2(n_layer=1)
    names = ("_foreach_norm", "linalg_vector_norm", "_amp_foreach_non_finite_check_and_unscale_",
             "_amp_update_scale_", "_foreach_mul_")
    result = trace_steps(model, torch.optim.AdamW(model.parameters()), lm_batch(2, 16), step=None, precision=None,
                         trace_device=torch.device("cpu"), target_device=torch.device(target), steps=1,
                         schedule=schedule, record_op=lambda f, args: f.__name__.split(".")[0] in names)
    assert result.error is None
    return [func.__name__.split(".")[0] for _, _, func, _, _ in result.op_log]


def test_clipping_and_scaler_run_torch_ops_in_order():
    assert _ops(Loop()) == []
    n_params = len(list(make_gpt2(n_layer=1).parameters()))
    assert _ops(Loop(max_grad_norm=1.0)) == ["_foreach_norm", "linalg_vector_norm", "_foreach_mul_"]
    ops = _ops(Loop(max_grad_norm=1.0, grad_scaler=True))
    assert ops == ["_amp_foreach_non_finite_check_and_unscale_", "_foreach_norm", "linalg_vector_norm",
                   "_foreach_mul_", "_amp_update_scale_"]
    assert n_params > 1


@pytest.mark.parametrize("kw", [{"max_grad_norm": 1.0}, {"grad_scaler": True},
                                pytest.param({"max_grad_norm": 0.5, "grad_scaler": True, "accumulate": 2},
                                             marks=pytest.mark.slow)])
def test_prediction_matches_measurement_with_clipping_and_scaler(kw):
    model = make_gpt2(n_layer=2)
    batch = lm_batch(2, 32)
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, preflight.Run(loop=preflight.Loop(**kw)))
    plain = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                               run=preflight.Run(loop=preflight.Loop(accumulate=kw.get("accumulate", 1))))
    m = preflight.measure(model, torch.optim.AdamW(model.parameters()), batch, preflight.Run(loop=preflight.Loop(**kw)))
    # Within a few scalars, on this model with or without clipping and scaler (4 B, 8 B and 48 B here): a Python
    # number in an operator is an 8-byte CPU tensor that autograd may save (GPT-2's gelu_new saves three per layer,
    # `0.5 * x` and the like) and a CPU kernel may cast (4 B, AdamW's `exp_avg_sq.sqrt() / bias_correction2_sqrt`);
    # the trace does not count these, which never live on a GPU.
    assert 0 <= m.peak_bytes - est.peak_bytes <= 64
    assert est.peak_bytes >= plain.peak_bytes


def test_a_closure_optimizer_is_stepped_with_a_closure_and_labelled_a_lower_bound():
    """LBFGS needs step(closure), as the user's loop passes it: traced (not blamed on the user), the figure a
    labelled lower bound since how often it evaluates the closure depends on parameter values."""
    import preflight
    from preflight._steps import needs_closure

    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.LBFGS(model.parameters(), history_size=5, max_iter=4)
    assert needs_closure(opt) and not needs_closure(torch.optim.SGD(model.parameters(), lr=0.1))
    batch = torch.randn(8, 16)
    step = lambda m, b: m(b).pow(2).mean()  # noqa: E731
    with pytest.warns(RuntimeWarning, match="LBFGS.step\\(closure\\)"):
        est = preflight.estimate(model, opt, batch, step=step)
    measured = preflight.measure(model, opt, batch, step=step)
    assert est.coverage.traced and est.coverage.lower_bound and "LBFGS" in est.coverage.reason
    assert 0 < est.peak_bytes <= measured.peak_bytes
    assert est.breakdown["activations"] > 0  # the closure's forward was traced, not the analytic fallback


def test_a_loss_without_gradient_says_why_not_include_labels():
    import preflight
    from preflight._steps import LossNotFoundError

    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randn(4, 8)
    step = lambda m, b: m(b).sum()  # noqa: E731
    plain = preflight.estimate(model, opt, batch, step=step).peak_bytes
    # The caller's mode is not the training step's: estimated as a training step.
    with torch.no_grad():
        assert preflight.estimate(model, opt, batch, step=step).peak_bytes == plain
    with torch.inference_mode():
        assert preflight.estimate(model, opt, batch, step=step).peak_bytes == plain

    def under_no_grad(m, b):
        with torch.no_grad():
            return m(b).sum()

    with pytest.raises(LossNotFoundError, match="records no gradient: no parameter that requires grad reached it"):
        preflight.estimate(model, opt, batch, step=under_no_grad)
    frozen = nn.Linear(8, 1).requires_grad_(False)
    with pytest.raises(LossNotFoundError, match="all frozen") as caught:
        preflight.estimate(frozen, torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1), batch, step=step)
    assert "labels" not in str(caught.value)


def test_an_optimizer_without_the_implementation_is_refused_by_name():
    from preflight._steps import with_optimizer_impl

    params = [nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="LBFGS does not take `fused=`"):
        with_optimizer_impl(torch.optim.LBFGS(params), "fused")
    opt = torch.optim.AdamW(params, foreach=False)
    assert with_optimizer_impl(opt, "for-loop") is opt and with_optimizer_impl(opt, None) is opt
    fused = with_optimizer_impl(opt, "fused")
    assert fused is not opt and fused.param_groups[0]["fused"] and not opt.param_groups[0].get("fused")


class _FrozenBackbone(nn.Module):
    """A backbone the user leaves in eval mode (dropout off, BatchNorm on running statistics) under a trained head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.Dropout(0.5), nn.Linear(256, 256),
                                      nn.Dropout(0.5))
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(256, 8))
        self.backbone.eval()

    def forward(self, x):
        return self.head(self.backbone(x))


def _frozen_step(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def test_module_modes_is_checked():
    with pytest.raises(ValueError, match="`module_modes` should be one of \\('train', 'as_set'\\), got 'eval'"):
        Loop(module_modes="eval")


@pytest.mark.parametrize("modes", ["train", "as_set"])
def test_modules_train_in_the_modes_the_loop_gives_them_predicted_as_measured(modes):
    from conftest import predicted_and_measured

    batch = (torch.randn(128, 64), torch.randint(0, 8, (128,)))
    run = preflight.Run(loop=Loop(module_modes=modes))
    est, measured = predicted_and_measured(_FrozenBackbone, torch.optim.AdamW, batch, run, step=_frozen_step)
    assert 0 <= measured - est.peak_bytes <= 12  # AdamW's CPU scalars (see the test above)
    torch.manual_seed(0)
    model = _FrozenBackbone()
    other = preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch,
                               preflight.Run(loop=Loop(module_modes="as_set" if modes == "train" else "train")),
                               step=_frozen_step)
    # The dropout masks of the backbone: saved only where it trains.
    assert (est.peak_bytes > other.peak_bytes) == (modes == "train")
    assert [m.training for m in model.modules()] == [True, False, False, False, False, False, False, True, True, True]
    noted = [n for n in est.coverage.notes if "module(s) in eval mode" in n]
    assert noted == ([] if modes == "as_set" else [
        "6 module(s) in eval mode (backbone) were traced in train mode, as `model.train()` before the steps sets them "
        "(the HF Trainer calls it at every step); if your loop keeps them in eval, as Lightning does, say "
        "Loop(module_modes=\"as_set\")"])


def test_a_model_wholly_in_eval_mode_is_one_the_loop_trains_without_a_note():
    model = make_gpt2(n_layer=1).eval()  # as `from_pretrained` leaves it: the loop's `model.train()` sets it
    est = preflight.estimate(model, torch.optim.AdamW(model.parameters()), lm_batch(2, 16))
    assert not any("eval mode" in n for n in est.coverage.notes) and not model.training


def test_a_data_parallel_rank_keeps_the_modes_the_loop_gives_them():
    torch.manual_seed(0)
    model = _FrozenBackbone()
    batch = (torch.randn(128, 64), torch.randint(0, 8, (128,)))
    ranks = {modes: preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, step=_frozen_step,
                                       run=preflight.Run(loop=Loop(module_modes=modes),
                                                         parallel=preflight.ParallelPlan(2, "ddp")))
             for modes in ("train", "as_set")}
    single = {modes: preflight.estimate(model, torch.optim.AdamW(model.parameters()), batch, step=_frozen_step,
                                        run=preflight.Run(loop=Loop(module_modes=modes)))
              for modes in ("train", "as_set")}
    # The same difference (the backbone's dropout masks) on a rank as on one device.
    assert ranks["train"].peak_bytes - ranks["as_set"].peak_bytes == \
        single["train"].peak_bytes - single["as_set"].peak_bytes > 0


@pytest.mark.parametrize("cache", [True, False])
def test_autocasts_cache_of_casts_is_traced_as_the_run_has_it(cache):
    # Under bf16 autocast an evaluation forward keeps a copy of every weight it cast until the region ends when the
    # cache is on (torch's default, accelerate's); Lightning's precision plugins turn it off. Before, the cache was
    # always traced on: +4.2% on a Lightning bf16-mixed validation step.
    from preflight._device import live_storages
    from preflight._measure import cpu_profiled_peak

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)]).eval()
    x = torch.randn(8, 512)

    def evaluate():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            model(x)

    resident = live_storages([list(model.parameters()), [x]], torch.device("cpu"))
    peak, _ = cpu_profiled_peak(evaluate, resident=resident)
    run = preflight.Run(precision="bf16-mixed", loop=Loop(autocast_cache=cache))
    est = preflight.estimate_eval(model, x, run)
    assert est.peak_bytes == sum(resident.values()) + peak
    # The training step takes it too: a step that runs its backward inside the region keeps the copies through it.
    opt = torch.optim.SGD(model.parameters())

    def step(m, b):
        m(b).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    manual = preflight.Run(precision="bf16-mixed", loop=Loop(manual=True, autocast_cache=cache))
    measured = preflight.measure(model, opt, x, manual, step=step)
    assert abs(preflight.estimate(model, opt, x, manual, step=step).peak_bytes - measured.peak_bytes) <= 16
