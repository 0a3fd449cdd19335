"""Benchmark `max_batch_size` against the measured truth and against Lightning's BatchSizeFinder.

For each model and budget:
  * preflight: the micro-batch `preflight.max_batch_size` chooses, the traces it used and its wall time;
  * truth: the largest batch whose *measured* peak (`preflight.measure`, two real training steps on CPU) fits the
    budget, found by measuring every batch size from 1 up to the first that does not fit;
  * BatchSizeFinder: what Lightning's `BatchSizeFinder` in its default "power" mode (init_val=2,
    steps_per_trial=3, max_trials=25) would answer and how many full training steps it would run, emulated
    from the same measurements: a trial "OOMs" when the measured peak exceeds the budget. The emulation follows
    lightning.pytorch.tuner.batch_size_scaling._run_power_scaling: double after a passing trial, halve after a
    failing one, stop at the first failure after a success and keep the last size that passed.

Run from the repository root: ``python benchmarks/autotune.py`` (a few minutes on 2 CPU cores). Prints a Markdown
table and writes it to benchmarks/results/autotune.md.
"""

from __future__ import annotations

import copy
import datetime
import pathlib
import platform
import time

import torch
from torch import nn

import preflight
from preflight._autotune import max_batch_size

MiB = 2**20
VOCAB = 2000  # small vocabularies and sequences keep the real CPU steps of the ground truth quick
SEQ = 64
IMAGE = 32
BSF_INIT, BSF_STEPS, BSF_MAX_TRIALS, BSF_MAX_VAL = 2, 3, 25, 8192  # Lightning's BatchSizeFinder defaults
OUT = pathlib.Path(__file__).parent / "results" / "autotune.md"


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0))


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def cnn() -> nn.Module:
    def block(c_in: int, c_out: int, stride: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())

    torch.manual_seed(0)
    return nn.Sequential(block(3, 32, 1), block(32, 32, 1), block(32, 64, 2), block(64, 64, 1), block(64, 128, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))


def lm_batch(b: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (b, SEQ), generator=torch.Generator().manual_seed(b))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def image_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(b)
    return torch.randn(b, 3, IMAGE, IMAGE, generator=gen), torch.randint(0, 10, (b,), generator=gen)


def image_step(model: nn.Module, batch) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


# (name, model factory, make_batch, step, budgets in MiB): budgets put the answer near 8 and near 24 samples.
CASES = [
    (f"GPT-2 (4 layers, d=128, seq {SEQ})", gpt2, lm_batch, None, (64, 160)),
    (f"Llama (4 layers, d=128, GQA, seq {SEQ})", llama, lm_batch, None, (48, 112)),
    (f"CNN (5 conv-BN-ReLU, {IMAGE}x{IMAGE})", cnn, image_batch, image_step, (12, 32)),
]


class Measured:
    """Measured peaks by batch size, each from two real training steps on a fresh copy of the model."""

    def __init__(self, template: nn.Module, make_batch, step) -> None:
        self.template, self.make_batch, self.step = template, make_batch, step
        self.peaks: dict[int, int] = {}

    def __call__(self, b: int) -> int:
        if b not in self.peaks:
            model = copy.deepcopy(self.template)
            opt = torch.optim.AdamW(model.parameters())
            self.peaks[b] = preflight.measure(model, opt, self.make_batch(b), step=self.step).peak_bytes
        return self.peaks[b]

    def true_max(self, budget: int) -> int:
        b = 0
        while self(b + 1) <= budget:  # every size from 1 up, until one does not fit
            b += 1
        return b


def batch_size_finder(fits) -> tuple[int, int, int]:
    """Lightning's power scaling on ``fits(b) -> bool``: (answer, full training steps run, trials that OOMed).

    Mirrors lightning.pytorch.tuner.batch_size_scaling._run_power_scaling (Lightning 2.x).
    """
    size, any_success, steps, ooms = BSF_INIT, False, 0, 0
    for i in range(BSF_MAX_TRIALS):
        if size >= BSF_MAX_VAL or size < 1:
            break
        if fits(size):
            steps += BSF_STEPS
            if i + 1 >= BSF_MAX_TRIALS:  # the last trial passed: keep it
                break
            size, any_success = size * 2, True
        else:
            ooms += 1  # the trial dies in its first step: not a full step
            size = int(size * 0.5)
            if any_success:
                break
    return size, steps, ooms


def main() -> None:
    rows = []
    notes: list[str] = []  # anything beyond "model fitted": confirmations that failed, caps
    for name, factory, make_batch, step, budgets in CASES:
        template = factory()
        measured = Measured(template, make_batch, step)
        for budget_mib in budgets:
            budget = budget_mib * MiB
            opt = torch.optim.AdamW(template.parameters())
            start = time.perf_counter()
            result = max_batch_size(template, opt, make_batch, run=preflight.Run(target=preflight.Target(budget=budget)), step=step)
            seconds = time.perf_counter() - start
            truth = measured.true_max(budget)
            chosen_peak = measured(result.batch_size) if result.batch_size else None
            answer, steps, ooms = batch_size_finder(lambda b: measured(b) <= budget)
            rows.append((name, budget_mib, truth, result.batch_size, chosen_peak, result.traces, seconds,
                         answer, steps, ooms))
            notes.extend(f"{name}, {budget_mib} MiB: {note}" for note in result.notes[1:])
            print(f"{name}, {budget_mib} MiB: preflight {result.batch_size} ({result.traces} traces, {seconds:.1f} s), "
                  f"measured max {truth}, BatchSizeFinder {answer} after {steps} steps", flush=True)

    header = ("| model | budget | largest that fits (measured) | preflight's choice | measured peak at choice | "
              "traces | preflight wall time | BatchSizeFinder's answer | its full training steps | its OOM trials |")
    lines = [header, "|" + " --- |" * 10]
    for name, budget_mib, truth, chosen, peak, traces, seconds, answer, steps, ooms in rows:
        verdict = "=" if chosen == truth else ("below" if chosen < truth else "**over**")
        peak_text = f"{peak / MiB:.2f} MiB" if peak is not None else "-"
        lines.append(f"| {name} | {budget_mib} MiB | {truth} | {chosen} ({verdict}) | {peak_text} | {traces} | "
                     f"{seconds:.1f} s | {answer} | {steps} | {ooms} |")
    table = "\n".join(lines)
    preamble = (
        "# Auto-tuned micro-batch vs measured truth vs Lightning's BatchSizeFinder\n\n"
        f"Generated by `python benchmarks/autotune.py` on {datetime.date.today()}: torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, CPU only.\n\n"
        "Budgets are tensor-storage bytes. Truth: every batch size from 1 up measured with `preflight.measure` "
        "(two real training steps, AdamW). preflight runs no real step: fake traces only (wall time includes them). "
        "BatchSizeFinder (power mode, init_val=2, steps_per_trial=3) is emulated on the same measurements; "
        "its full training steps do not count the step of each trial that runs out of memory, nor the validation "
        "batches it also runs per trial. Its answer is a power of two by construction.\n\n"
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    remarks = "".join(f"- {note}\n" for note in notes)
    if remarks:
        remarks = "\nNotes from `max_batch_size`:\n\n" + remarks
    OUT.write_text(preamble + table + "\n" + remarks)
    print()
    print(table)
    print(remarks)


if __name__ == "__main__":
    main()
