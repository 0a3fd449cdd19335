"""A GAN in Lightning's manual optimization (two optimizers, each stepped in `training_step`), with preflight's
callback: the step as written is traced on fake tensors before step one, then measured over the first steps.

Runs on CPU in seconds:      python examples/lightning_gan.py
"""

try:
    import lightning.pytorch as pl  # the `lightning` package
except ImportError:
    import pytorch_lightning as pl  # the standalone `pytorch-lightning`: the callback works the same
import torch
from torch import nn

from preflight import Run, Target, format_bytes
from preflight.integrations.lightning import PreflightCallback

LATENT = 64  # size of the generator's noise
IMAGE = 28 * 28  # flattened image size (MNIST-like)
BATCH_SIZE = 64
STEPS = 4  # batches to train (each steps both optimizers; preflight measures the first 2)
RUN = Run(target=Target(budget="1GiB"))  # on a GPU leave the budget out to use the device's capacity


class GAN(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False  # training_step steps the optimizers itself
        self.gen = nn.Sequential(nn.Linear(LATENT, 512), nn.ReLU(), nn.Linear(512, IMAGE), nn.Tanh())
        self.disc = nn.Sequential(nn.Linear(IMAGE, 512), nn.LeakyReLU(0.2), nn.Linear(512, 1))

    def training_step(self, batch, batch_idx):
        bce = nn.functional.binary_cross_entropy_with_logits
        real = batch[0]
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        opt_g, opt_d = self.optimizers()
        fake = self.gen(torch.randn(len(real), LATENT))
        self.toggle_optimizer(opt_g)  # the generator's update: the discriminator's weights get no gradients
        self.manual_backward(bce(self.disc(fake), ones))
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)  # the discriminator's update, on the same fakes, detached
        d_loss = (bce(self.disc(real), ones) + bce(self.disc(fake.detach()), zeros)) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.log("d_loss", d_loss)

    def configure_optimizers(self):
        return [torch.optim.Adam(self.gen.parameters(), lr=2e-4, betas=(0.5, 0.999)),
                torch.optim.Adam(self.disc.parameters(), lr=2e-4, betas=(0.5, 0.999))]


torch.manual_seed(0)
images = torch.utils.data.TensorDataset(torch.rand(256, IMAGE) * 2 - 1)  # random stand-ins for real images
callback = PreflightCallback(RUN, verify_steps=2)
trainer = pl.Trainer(max_steps=2 * STEPS, accelerator="cpu", devices=1, callbacks=[callback], logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(GAN(), torch.utils.data.DataLoader(images, batch_size=BATCH_SIZE))

r = callback.report
print(f"\npredicted training peak {format_bytes(r.predicted_peak_bytes)} at {r.peak_phase} "
      f"(both optimizers' state: {format_bytes(r.predicted_breakdown['optimizer_state'])})")
print(f"measured over the first {r.steps_measured} steps: {format_bytes(r.measured_peak_bytes)} "
      f"(error {r.relative_error:+.3%})")
