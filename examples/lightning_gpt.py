"""Train a small GPT-2 with Lightning and preflight's callback: the peak is predicted before step one and
measured over the first steps.

Runs on CPU in under a minute:      python examples/lightning_gpt.py
Predict only, exit 0 (fits) or 3:   PREFLIGHT_DRY_RUN=1 python examples/lightning_gpt.py
"""

try:
    import lightning.pytorch as pl  # the `lightning` package
except ImportError:
    import pytorch_lightning as pl  # the standalone `pytorch-lightning`: the callback works the same
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from preflight import Run, Target, format_bytes
from preflight.integrations.lightning import PreflightCallback

BLOCK = 256  # tokens per training sequence (text packed into fixed-length blocks, as GPT pre-training does)
BATCH_SIZE = 8  # sequences per optimizer step
STEPS = 4  # optimizer steps to run (preflight measures the first 3)
BUDGET = "2GiB"  # memory the run may use; on a GPU leave it out to use the device's capacity
# How the run trains, beyond what the trainer says: here only the target. Target(gpu="H100-80GB") plans
# for a GPU you don't have (its memory becomes the budget).
RUN = Run(target=Target(budget=BUDGET))
# A small GPT-2 from its config (random weights, nothing downloaded).
CONFIG = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000, n_positions=BLOCK, bos_token_id=0, eos_token_id=0)


class Blocks(torch.utils.data.Dataset):
    """Random token blocks standing in for a packed text corpus."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, CONFIG.vocab_size, (BLOCK,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class GPT(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = GPT2LMHeadModel(CONFIG)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


torch.manual_seed(0)
loader = torch.utils.data.DataLoader(Blocks(), batch_size=BATCH_SIZE, shuffle=True)
val_loader = torch.utils.data.DataLoader(Blocks(), batch_size=2 * BATCH_SIZE)  # eval: no gradients, larger batch
callback = PreflightCallback(RUN, report_path="out/lightning_gpt.json", plot_path="out/lightning_gpt.png")
trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, callbacks=[callback], logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0, limit_val_batches=1)
trainer.fit(GPT(), loader, val_loader)

r = callback.report
print(f"\npredicted training peak {format_bytes(r.predicted_peak_bytes)} at {r.peak_phase}; "
      f"eval peak {format_bytes(r.eval_predicted_peak_bytes)}")
print(f"measured over the first {r.steps_measured} steps: {format_bytes(r.measured_peak_bytes)} "
      f"(error {r.relative_error:+.3%}); report in out/lightning_gpt.json, plot in out/lightning_gpt.png")
