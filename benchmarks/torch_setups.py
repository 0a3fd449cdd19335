"""preflight.estimate against the measured peak for training set-ups users write with torch alone, beyond the
model x optimizer x loop matrix of `benchmarks/torch_modules.py`: each a model, an optimizer and a step as a user
writes them.

Sparse gradients (``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True`` under SGD, momentum SGD, Nesterov,
Adagrad and ``SparseAdam``, with and without two accumulated micro-batches), quantization-aware training (torch's
fused fake-quantizers), BatchNorm's cumulative average (``momentum=None``, which reads ``num_batches_tracked``), a
forward reading its own integer flag buffer, a frozen backbone left in ``eval()`` (traced as Lightning keeps it,
``Loop(module_modes="as_set")``, and as the HF Trainer sets it), weight and spectral norm parametrizations, a
gradient penalty (double backward), CTC, a custom ``autograd.Function``, distillation from a frozen teacher, an FFT
filter with a complex parameter, re-entrant and non-re-entrant checkpointing, a ReLU written as a mask product, a
VAE written with torch.distributions (which validates its arguments), transformers' Adafactor, and bitsandbytes'
SGD8bit, LARS and LAMB (momentum kept as ``betas``; update-norm clipping).
Predicted: `preflight.estimate`; measured: `preflight.measure` (two real CPU steps, the profiler's allocator
events) on a fresh model and optimizer from the same seed.

Run: python benchmarks/torch_setups.py          (about 1 minute on 2 CPU cores)
Writes benchmarks/results/torch_setups.md and prints the same table.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import preflight
from preflight import Loop, Run
from torch_modules import report_table  # a sibling script: run from benchmarks/ or as its path

RESULTS = os.path.join(os.path.dirname(__file__), "results", "torch_setups.md")


class SparseTable(nn.Module):
    def __init__(self, bag: bool) -> None:
        super().__init__()
        self.bag = bag
        self.table = (nn.EmbeddingBag if bag else nn.Embedding)(50_000, 128, sparse=True)
        self.head = nn.Linear(128, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids) if self.bag else self.table(ids).mean(1))


def _qat() -> nn.Module:
    import torch.ao.quantization as quant

    model = nn.Sequential(quant.QuantStub(), nn.Flatten(), nn.Linear(3 * 32 * 32, 256), nn.ReLU(), nn.Linear(256, 10),
                          quant.DeQuantStub())
    model.qconfig = quant.get_default_qat_qconfig("x86")
    return quant.prepare_qat(model.train())


class Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(256, 512), nn.BatchNorm1d(512, momentum=None), nn.Linear(512, 10)
        self.register_buffer("warm", torch.tensor([1], dtype=torch.uint8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.up(x))
        if self.warm[0] == 1:
            h = torch.cat([h, h.detach()], 1)[:, :512]
        return self.down(torch.relu(h))


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Dropout(0.5),
                                      nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.3), nn.Linear(64 * 32 * 32, 10))
        self.backbone.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class Parametrized(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        wrap = getattr(nn.utils.parametrizations, kind)
        self.a, self.b = wrap(nn.Linear(256, 512)), nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.relu(self.a(x)))


class Swish(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(x)
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        x, s = ctx.saved_tensors
        return g * (s * (1 + x * (1 - s)))


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(256, 2048), nn.Linear(2048, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(Swish.apply(self.a(x)))


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(256, 2048), nn.Linear(2048, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.down(h * (h > 0))


class Speech(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.rnn, self.out = nn.Conv1d(80, 256, 5, padding=2), nn.GRU(256, 256, batch_first=True), \
            nn.Linear(256, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(self.conv(x).transpose(1, 2))[0])


class Distil(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Sequential(nn.Linear(256, 2048), nn.Dropout(0.1), nn.GELU(), nn.Linear(2048, 1000))
        self.teacher.eval().requires_grad_(False)
        self.student = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 1000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(x)


class Filter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(129, dtype=torch.cfloat) * 0.1)
        self.out = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.fft.irfft(torch.fft.rfft(x, dim=-1) * self.w, n=256, dim=-1))


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
                                    for _ in range(4))
        self.out = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_() if self.reentrant else x
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return self.out(x)


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.mu, self.log_var = nn.Linear(784, 400), nn.Linear(400, 20), nn.Linear(400, 20)
        self.dec = nn.Sequential(nn.Linear(20, 400), nn.ReLU(), nn.Linear(400, 784))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.enc(x))
        posterior = torch.distributions.Normal(self.mu(h), (0.5 * self.log_var(h)).exp())  # validates scale > 0
        z = posterior.rsample()
        prior = torch.distributions.Normal(torch.zeros_like(z), torch.ones_like(z))
        kl = torch.distributions.kl_divergence(posterior, prior).sum(-1).mean()
        return F.binary_cross_entropy_with_logits(self.dec(z), x, reduction="sum") / x.shape[0] + kl


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.LayerNorm(1024), nn.Linear(1024, 10))


def _bnb(name: str, **options: Any) -> Callable[[nn.Module], torch.optim.Optimizer]:
    def make(model: nn.Module) -> torch.optim.Optimizer:
        import bitsandbytes as bnb

        return getattr(bnb.optim, name)(model.parameters(), **options)

    return make


def _hf_adafactor(model: nn.Module) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    return Adafactor(model.parameters(), scale_parameter=True, relative_step=True, warmup_init=True, lr=None)


def _classify(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _penalty(model: nn.Module, batch: Any) -> torch.Tensor:
    x = batch[0].clone().requires_grad_(True)
    out = model(x)
    grad, = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.mean() + 10 * ((grad.norm(2, dim=1) - 1) ** 2).mean()


def _ctc(model: nn.Module, batch: Any) -> torch.Tensor:
    feats, targets, lengths = batch
    log_probs = model(feats).log_softmax(-1).transpose(0, 1)
    frames = torch.full((feats.shape[0],), log_probs.shape[0], dtype=torch.long)
    return F.ctc_loss(log_probs, targets, frames, lengths)


def _distil(model: nn.Module, batch: Any) -> torch.Tensor:
    with torch.no_grad():
        teacher = model.teacher(batch[0])
    return F.kl_div(F.log_softmax(model(batch[0]) / 2, -1), F.softmax(teacher / 2, -1), reduction="batchmean")


def _features() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(64, 256), torch.randint(0, 10, (64,))


def _images() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 500, (64, 32), generator=gen), torch.randint(0, 10, (64,), generator=gen)


def _speech() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 80, 200), torch.randint(1, 32, (8, 40), generator=gen), \
        torch.randint(10, 40, (8,), generator=gen)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])


SPARSE_OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "SGD": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "SGD momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "SGD Nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
    "Adagrad": lambda m: torch.optim.Adagrad(m.parameters()),
    "SparseAdam (table only)": lambda m: torch.optim.SparseAdam(list(m.table.parameters())),
}

# name -> (build, optimizer, batch, step, run)
Case = tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.optim.Optimizer], Callable[[], Any],
             Callable[[nn.Module, Any], torch.Tensor], Run | None]
SETUPS: dict[str, Case] = {}
for _bag in (False, True):
    for _name, _make in SPARSE_OPTIMIZERS.items():
        for _accumulate in (1, 2):
            SETUPS[f"{'EmbeddingBag' if _bag else 'Embedding'}(sparse=True), {_name}, accumulate {_accumulate}"] = (
                lambda bag=_bag: SparseTable(bag), _make, _ids, _classify, Run(loop=Loop(accumulate=_accumulate)))
SETUPS.update({
    "QAT (fused fake-quantizers), AdamW": (_qat, _adamw, _images, _classify, None),
    "QAT (fused fake-quantizers), AdamW, accumulate 2": (_qat, _adamw, _images, _classify,
                                                         Run(loop=Loop(accumulate=2))),
    "BatchNorm momentum=None + a flag buffer read in forward": (Flagged, _adamw, _features, _classify, None),
    "frozen backbone in eval(), as Lightning keeps it": (Frozen, _adamw, _images, _classify,
                                                         Run(loop=Loop(module_modes="as_set"))),
    "frozen backbone in eval(), as the HF Trainer sets it": (Frozen, _adamw, _images, _classify, None),
    "weight_norm parametrization": (lambda: Parametrized("weight_norm"), _adamw, _features, _classify, None),
    "spectral_norm parametrization": (lambda: Parametrized("spectral_norm"), _adamw, _features, _classify, None),
    "gradient penalty (double backward)": (lambda: nn.Sequential(nn.Linear(256, 512), nn.LeakyReLU(0.2),
                                                                 nn.Linear(512, 1)), _adamw, _features, _penalty,
                                           None),
    "CTC (Conv1d + GRU)": (Speech, _adamw, _speech, _ctc, None),
    "custom autograd.Function": (Custom, _adamw, _features, _classify, None),
    "ReLU as a mask product (float x bool)": (Gated, _adamw, _features, _classify, None),
    "distillation from a frozen teacher (KL)": (Distil, _adamw, _features, _distil, None),
    "FFT filter, complex parameter": (Filter, _adamw, _features, _classify, None),
    "checkpoint, use_reentrant=False": (lambda: Checkpointed(False), _adamw, _features, _classify, None),
    "checkpoint, use_reentrant=True": (lambda: Checkpointed(True), _adamw, _features, _classify, None),
    "VAE with torch.distributions (argument checks on)": (VAE, _adamw, lambda: torch.rand(128, 784),
                                                           lambda m, b: m(b), None),
    "transformers' Adafactor (relative step, warm-up)": (_mlp, _hf_adafactor, _features, _classify, None),
    "bitsandbytes SGD8bit, momentum": (_mlp, _bnb("SGD8bit", lr=0.1, momentum=0.9, min_8bit_size=1024), _features,
                                       _classify, None),
    "bitsandbytes LARS": (_mlp, _bnb("LARS", lr=0.1, momentum=0.9), _features, _classify, None),
    "bitsandbytes LAMB": (_mlp, _bnb("LAMB"), _features, _classify, None),
})


def _case(name: str) -> tuple[int, int, float, bool]:
    build, make_optimizer, data, step, run = SETUPS[name]
    torch.manual_seed(0)
    batch = data()
    model = build()
    start = time.perf_counter()
    est = preflight.estimate(model, make_optimizer(model), batch, run, step=step)
    seconds = time.perf_counter() - start
    torch.manual_seed(0)
    data()
    fresh = build()
    measured = preflight.measure(fresh, make_optimizer(fresh), batch, run, step=step)
    return est.peak_bytes, measured.peak_bytes, seconds, est.coverage.lower_bound


def main() -> None:
    warnings.filterwarnings("ignore")
    report_table((((name,), *_case(name)) for name in SETUPS), ("set-up",), "torch_setups.py", RESULTS)


if __name__ == "__main__":
    main()
