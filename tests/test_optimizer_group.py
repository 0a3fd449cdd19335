"""`preflight.OptimizerGroup` and `Loop(manual=True)`: a step that runs its own backward passes and optimizers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import preflight
from preflight import Loop, OptimizerGroup, Run
from preflight.verdict._predict import _without_state

bce = nn.functional.binary_cross_entropy_with_logits


def _gan(seed: int = 0) -> nn.ModuleDict:
    torch.manual_seed(seed)
    return nn.ModuleDict({"gen": nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 784), nn.Tanh()),
                          "disc": nn.Sequential(nn.Linear(784, 512), nn.LeakyReLU(0.2), nn.Linear(512, 1))})


def _gan_step(opt_g: torch.optim.Optimizer, opt_d: torch.optim.Optimizer):
    """A GAN's step as torch's DCGAN example takes it: the generator's update, then the discriminator's on the
    same fakes, detached."""

    def step(model: nn.Module, real: torch.Tensor) -> torch.Tensor:
        n = real.shape[0]
        fake = model["gen"](torch.randn(n, 64))
        g_loss = bce(model["disc"](fake), torch.ones(n, 1))
        g_loss.backward()
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
        d_loss = (bce(model["disc"](real), torch.ones(n, 1)) + bce(model["disc"](fake.detach()), torch.zeros(n, 1))) / 2
        d_loss.backward()
        opt_d.step()
        opt_d.zero_grad()
        return d_loss

    return step


def _optimizers(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    return torch.optim.Adam(model["gen"].parameters(), lr=2e-4), torch.optim.Adam(model["disc"].parameters(), lr=2e-4)


def test_the_group_reads_as_its_members():
    model = _gan()
    opt_g, opt_d = _optimizers(model)
    group = OptimizerGroup([opt_g, opt_d])
    assert group.param_groups == [*opt_g.param_groups, *opt_d.param_groups]
    real = torch.randn(8, 784)
    _gan_step(opt_g, opt_d)(model, real)
    assert len(group.state) == len(opt_g.state) + len(opt_d.state) == 8
    p = next(model["disc"].parameters())
    assert group.state[p] is opt_d.state[p]
    saved = group.state_dict()
    assert [len(s["state"]) for s in saved["optimizers"]] == [4, 4]
    other = OptimizerGroup(_optimizers(_gan()))
    other.load_state_dict(saved)
    assert len(other.state) == 8
    group.state[p] = {"marker": 1}  # written through to the member that trains it
    assert opt_d.state[p] == {"marker": 1}
    assert preflight.OptimizerGroup is OptimizerGroup


def test_the_group_checks_its_members():
    model = _gan()
    with pytest.raises(ValueError, match="at least one"):
        OptimizerGroup([])
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        OptimizerGroup([model])
    with pytest.raises(ValueError, match="trained by two optimizers"):
        OptimizerGroup([torch.optim.SGD(model.parameters()), torch.optim.SGD(model["gen"].parameters())])


def test_a_gan_step_with_two_optimizers_is_predicted_to_the_measured_peak():
    model = _gan()
    opt_g, opt_d = _optimizers(model)
    real = torch.randn(32, 784)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    groups = opt_g.param_groups
    rng = torch.get_rng_state()
    run = Run(loop=Loop(manual=True))
    est = preflight.estimate(model, OptimizerGroup([opt_g, opt_d]), real, run, step=_gan_step(opt_g, opt_d))
    # The user's objects as they were: no state, the same groups, the same weights and random stream.
    assert not opt_g.state and not opt_d.state and opt_g.param_groups is groups
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert torch.equal(torch.get_rng_state(), rng)
    # Adam's two moments of every parameter, and each one's step counter (a 0-dim float32 tensor on the CPU)
    assert est.breakdown["optimizer_state"] == 2 * 4 * sum(p.numel() for p in model.parameters()) + 8 * 4
    assert any(n.startswith("manual optimization") for n in est.coverage.notes)

    twin = copy.deepcopy(model)
    twin_g, twin_d = _optimizers(twin)
    measured = preflight.measure(twin, OptimizerGroup([twin_g, twin_d]), real, run, step=_gan_step(twin_g, twin_d))
    assert abs(est.peak_bytes - measured.peak_bytes) <= 16, (est.peak_bytes, measured.peak_bytes)


def test_one_optimizer_stepped_by_the_step_is_the_loops_own_step():
    # The same updates, stepped by the step or by the loop: the same peak.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 10))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 256)

    def manual(m: nn.Module, batch: torch.Tensor) -> None:
        m(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()

    by_step = preflight.estimate(model, opt, x, Run(loop=Loop(manual=True)), step=manual)
    by_loop = preflight.estimate(model, opt, x, step=lambda m, b: m(b).square().mean())
    assert by_step.peak_bytes == by_loop.peak_bytes and by_step.peak_phase == by_loop.peak_phase


def test_a_copy_without_state_points_the_step_at_its_own_clone():
    # After real steps, the verification traces a first step again on a stateless copy; the step still calls the
    # user's optimizers, which must step the copy's clone, not the real weights, and must not be left changed.
    model = _gan()
    opt_g, opt_d = _optimizers(model)
    real = torch.randn(8, 784)
    step = _gan_step(opt_g, opt_d)
    step(model, real)
    states = [dict(opt_g.state), dict(opt_d.state)]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    run = Run(loop=Loop(manual=True))
    again = preflight.estimate(model, _without_state(OptimizerGroup([opt_g, opt_d])), real, run, step=step)
    assert [dict(opt_g.state), dict(opt_d.state)] == states
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
    fresh = _gan()
    fresh_g, fresh_d = _optimizers(fresh)
    first = preflight.estimate(fresh, OptimizerGroup([fresh_g, fresh_d]), real, run, step=_gan_step(fresh_g, fresh_d))
    assert again.peak_bytes == first.peak_bytes


def test_a_manual_loop_leaves_the_loops_own_settings_to_the_step():
    with pytest.raises(ValueError, match="`accumulate`, `max_grad_norm`"):
        Loop(manual=True, accumulate=2, max_grad_norm=1.0)
    model = _gan()
    group = OptimizerGroup(_optimizers(model))
    with pytest.raises(ValueError, match="needs `step=`"):
        preflight.estimate(model, group, torch.randn(4, 784), Run(loop=Loop(manual=True)))
    with pytest.raises(ValueError, match="traced on one device"):
        preflight.estimate(model, group, torch.randn(4, 784),
                           Run(loop=Loop(manual=True), parallel=preflight.ParallelPlan(2, "ddp")),
                           step=_gan_step(*group.optimizers))


def test_the_users_optimizer_is_left_exactly_as_it_was():
    # Its gradients, its instance dict (the LR scheduler's step wrapper and the flag it sets), its own step hooks
    # (not run on the trace's steps, as the loop's own step runs none); with the step's implementation changed too.
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.Adam(model.parameters())
    torch.optim.lr_scheduler.StepLR(opt, 1)
    ran = []
    opt.register_step_post_hook(lambda *a: ran.append(1))
    x = torch.randn(4, 16)

    def step(m, b):
        m(b).sum().backward()
        opt.step()
        opt.zero_grad()

    model(x).sum().backward()
    grad = model.weight.grad.clone()
    before = dict(opt.__dict__)
    for impl in (None, "foreach"):
        est = preflight.estimate(model, opt, x, Run(loop=Loop(manual=True, optimizer_impl=impl)), step=step)
        assert est.breakdown["optimizer_state"] == 2 * 4 * (16 * 16 + 16) + 2 * 4  # traced on the clone
    assert torch.equal(model.weight.grad, grad) and not ran and not opt.state
    assert opt.__dict__.keys() == before.keys() and all(opt.__dict__[k] is v for k, v in before.items())
    with pytest.raises(ValueError, match="traced on one device"):
        preflight.estimate(model, opt, x, Run(loop=Loop(manual=True), parallel=preflight.ParallelPlan(1, "fsdp2")),
                           step=step)


def test_work_after_a_backward_is_counted_as_before_it():
    # A manual step runs its own code between a backward and the optimizer step (a no-grad sample, metrics):
    # counted as any forward is, not as the backward's gradient accumulation (which adds in place).
    def make():
        torch.manual_seed(0)
        model = nn.Linear(64, 64)
        opt = torch.optim.SGD(model.parameters())

        def step(m, b):
            m(b).sum().backward()
            with torch.no_grad():
                m(b) + m(b)
            opt.step()
            opt.zero_grad()

        return model, opt, step

    x = torch.randn(32, 64)
    run = Run(loop=Loop(manual=True))
    model, opt, step = make()
    predicted = preflight.estimate(model, opt, x, run, step=step).peak_bytes
    model, opt, step = make()
    measured = preflight.measure(model, opt, x, run, step=step).peak_bytes
    assert abs(predicted - measured) <= 16, (predicted, measured)


def test_a_manual_step_over_the_budget_is_told_the_largest_batch_that_fits():
    # Only the options that leave the step's model and optimizers as they are: the batch (no accumulation: the
    # manual loop has none), bf16, the allocator. The batch found fits when measured, the next one up does not.
    model = _gan()
    group = OptimizerGroup(_optimizers(model))
    real = torch.randn(512, 784)
    run = Run(loop=Loop(manual=True))
    step = _gan_step(*group.optimizers)
    whole = preflight.estimate(model, group, real, run, step=step).peak_bytes
    small = preflight.estimate(model, group, real[:64], run, step=step).peak_bytes
    budget = (whole + small) // 2
    found = preflight.advise(model, group, real, run.replace(target=preflight.Target(budget=budget)), step=step,
                             headroom=0.0)
    assert found and found[0].fits and found[0].changes == ("micro_batch",), [s.description for s in found]
    assert "micro_batch_size" in found[0].change and "accumulate_grad_batches" not in found[0].change
    assert "accumulate the gradients of" in found[0].cost
    assert {c for s in found for c in s.changes} <= {"micro_batch", "bf16-mixed", "bf16-true", "allocator"}
    size = found[0].change["micro_batch_size"]

    def measured(n: int) -> int:
        fresh = _gan()
        opts = _optimizers(fresh)
        batch = real[:n].clone()  # its own storage, as a loader makes it (a slice would hold all 512 rows)
        return preflight.measure(fresh, OptimizerGroup(list(opts)), batch, run, step=_gan_step(*opts)).peak_bytes

    assert measured(size) <= budget < measured(size + 1)
    assert abs(found[0].predicted_peak_bytes - measured(size)) <= 64
