"""One training run through one preflight entry point, in a fresh process: prints what a user's run could see of
process-wide state afterwards (the next draws of every random stream, the trained weights, warning filters and
logging configuration) as JSON, so `tests/test_side_effects.py` compares it with the same run without preflight.

    python tests/side_effects.py ENTRY [--without]

The dataset crops with ``random.random()`` and shuffles with numpy, the model has dropout (torch's stream), as in
the issue that found ``rich``'s import consuming ``random``: preflight's first printed report is inside the run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import sys
import warnings

import numpy as np
import torch
from torch import nn

import preflight  # imported in both runs: only what a call does is compared

ENTRY, WITHOUT = sys.argv[1], "--without" in sys.argv
FEATURES, STEPS = 16, 3


class Cropping(torch.utils.data.Dataset):
    """Random crops decided by Python's and numpy's streams, as user datasets do."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(FEATURES, generator=g)
        x = x * (0.5 + random.random()) + float(np.random.rand())
        return {"x": x, "labels": torch.tensor(i % 2)}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 2))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.body(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def plain_loop(model: nn.Module, optimizer: torch.optim.Optimizer, loader) -> None:
    for i, batch in enumerate(loader):
        if i == STEPS:
            break
        model(**batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()


def run() -> nn.Module:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(Cropping(), batch_size=4, shuffle=True)
    if ENTRY in ("estimate", "check", "check-over"):
        batch = next(iter(torch.utils.data.DataLoader(Cropping(), batch_size=4)))
        if not WITHOUT:
            if ENTRY == "estimate":
                preflight.estimate(model, optimizer, batch)
            else:  # check-over: does not fit, so advise runs (and imports bitsandbytes for its 8-bit option)
                preflight.check(model, optimizer, batch, run=preflight.Run(target=preflight.Target(budget="1GiB" if ENTRY == "check" else "1KiB")), on_overflow="warn")
        plain_loop(model, optimizer, loader)
    elif ENTRY == "cli":
        if not WITHOUT:
            from preflight._cli import main

            main(["estimate", "--hf-config", sys.argv[2], "--batch", "1", "--seq", "8", "--budget", "1GiB"])
        plain_loop(model, optimizer, loader)
    elif ENTRY == "accelerate":
        from accelerate import Accelerator
        from preflight.integrations.accelerate import StepVerifier, preflight_check

        accelerator = Accelerator(cpu=True)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        report = None if WITHOUT else preflight_check(accelerator, model, optimizer, loader, run=preflight.Run(target=preflight.Target(budget="1GiB")))
        verifier = None if WITHOUT else StepVerifier(accelerator, model, optimizer, report, steps=2)
        for i, batch in enumerate(loader):
            if i == STEPS:
                break
            with (verifier.step(batch) if verifier else _nothing()):
                accelerator.backward(model(**batch)["loss"])
                optimizer.step()
                optimizer.zero_grad()
    elif ENTRY == "lightning":
        import lightning.pytorch as pl

        from preflight.integrations.lightning import PreflightCallback

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = model

            def training_step(self, batch, batch_idx):
                return self.net(**batch)["loss"]

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=1e-2)

            def train_dataloader(self):
                return loader

        trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[] if WITHOUT else [PreflightCallback(run=preflight.Run(target=preflight.Target(budget="1GiB")), verify_steps=2)])
        trainer.fit(Module())
    elif ENTRY == "hf":
        from transformers import Trainer, TrainingArguments

        from preflight.integrations.hf import PreflightCallback

        args = TrainingArguments(output_dir=sys.argv[2], max_steps=STEPS, per_device_train_batch_size=4,
                                 report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                                 disable_tqdm=True, seed=0, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=Cropping(),
                          callbacks=[] if WITHOUT else [PreflightCallback(run=preflight.Run(target=preflight.Target(budget="1GiB")), verify_steps=2)])
        trainer.train()
    else:
        raise SystemExit(f"unknown entry {ENTRY!r}")
    return model


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def logging_state() -> dict[str, list]:
    """Every logger configured beyond the defaults (a logger merely created by an import is not configuration)."""
    loggers = {"": logging.root, **{n: lg for n, lg in logging.Logger.manager.loggerDict.items()
                                   if isinstance(lg, logging.Logger)}}
    out = {}
    for name, lg in sorted(loggers.items()):
        state = [lg.level, [f"{type(h).__name__}:{h.level}" for h in lg.handlers], len(lg.filters), lg.propagate,
                 lg.disabled]
        if name == "" or state != [logging.NOTSET, [], 0, True, False]:
            out[name] = state
    out["<disable>"] = [logging.root.manager.disable]
    return out


if __name__ == "__main__":
    trained = run()
    weights = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in trained.parameters())).hexdigest()
    print("SIDE_EFFECTS " + json.dumps({
        "random": random.random(), "numpy": float(np.random.rand()), "torch": float(torch.rand(1)),
        "weights": weights, "warnings": [repr(f) for f in warnings.filters], "logging": logging_state(),
        "grad": torch.is_grad_enabled(), "dtype": str(torch.get_default_dtype()),
    }))
