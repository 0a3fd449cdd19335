"""A hand-written accelerate training loop, checked by preflight before the first step and verified during it.

Runs on CPU in under a minute: python examples/accelerate_loop.py
"""

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

from preflight import Run, Target, format_bytes
from preflight.integrations.accelerate import StepVerifier, preflight_check

BATCH_SIZE = 8  # sequences per micro-batch
ACCUMULATION = 2  # micro-batches per optimizer step
SEQ_LEN = 256  # tokens per sequence
STEPS = 3  # optimizer steps to run and measure
BUDGET = "2GiB"  # memory the run may use; on a GPU leave it out to use the device's capacity
# How the run trains, beyond what the trainer says: here only the target. Target(gpu="H100-80GB") plans
# for a GPU you don't have (its memory becomes the budget).
RUN = Run(target=Target(budget=BUDGET))
# A small GPT-2 from its config (random weights, nothing downloaded).
CONFIG = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000, n_positions=SEQ_LEN, bos_token_id=0,
                    eos_token_id=0)


class Blocks(torch.utils.data.Dataset):
    def __len__(self):
        return BATCH_SIZE * ACCUMULATION * STEPS

    def __getitem__(self, i):
        ids = torch.randint(0, CONFIG.vocab_size, (SEQ_LEN,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


torch.manual_seed(0)
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
model = GPT2LMHeadModel(CONFIG)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
loader = torch.utils.data.DataLoader(Blocks(), batch_size=BATCH_SIZE, shuffle=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

report = preflight_check(accelerator, model, optimizer, loader, RUN, report_path="out/accelerate_loop.json")
verifier = StepVerifier(accelerator, model, optimizer, report, steps=STEPS, report_path="out/accelerate_loop.json")
model.train()
for batch in loader:
    with verifier.step(batch), accelerator.accumulate(model):
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()

print(f"\npredicted {format_bytes(report.predicted_peak_bytes)} at {report.peak_phase}; measured "
      f"{format_bytes(report.measured_peak_bytes)} over {report.steps_measured} optimizer steps "
      f"(error {report.relative_error:+.3%})")
