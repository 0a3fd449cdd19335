"""preflight's callbacks inside real DeepSpeed ZeRO runs of the HF Trainer and Lightning, on CPU processes, per rank.

By the time a callback runs, DeepSpeed has replaced the optimizer with its ZeRO optimizer and, at stage 3,
partitioned every parameter; the callback reads both back (`preflight.parallel.read_zero`), predicts the rank under
the config the trainer applied, then measures its first steps (the verification: the profiler's allocator
events plus the bytes alive at the step's start, DeepSpeed's partitions and flat buffers included) and, in the
Lightning runs, a validation batch between them against the evaluation prediction. The table is
each rank's prediction against its own measurement, over 3 fresh 2-process runs per configuration.

- HF Trainer: ``TrainingArguments(deepspeed=config)``, ZeRO-1/2/3, fp32 (the Trainer refuses bf16 / fp16 on a CPU
  unless ``use_cpu``, which turns DeepSpeed off), ``torchrun`` with 2 processes.
- accelerate: a hand-written loop with ``DeepSpeedPlugin``, ``preflight_check`` and ``StepVerifier``, ZeRO-2/3,
  fp32.
- Lightning: ``DeepSpeedStrategy(config=...)`` with 2 CPU devices, ZeRO-2/3 at ``32-true``, ``bf16-mixed`` and
  ``16-mixed``. Lightning allows DeepSpeed on CUDA devices only: a subclass skips its two CUDA checks and gives
  DeepSpeed a device index (``CPUDeepSpeed`` below); the strategy is otherwise Lightning's own.

The model is a GPT-2 (2 layers, hidden 64, vocab 500), batch 2 x 32 tokens (HF) or 4 x 32 (Lightning), AdamW,
``reduce_bucket_size`` 1e6. DeepSpeed is a dev dependency (``pip install -e ".[dev]"``); its CPU accelerator talks
gloo when oneCCL is absent (``DS_ACCELERATOR=cpu``); the runs skip building its shared-memory kernel, which
serves only inference all-reduce (`PROLOGUE`).

Run: python benchmarks/deepspeed_trainers.py          (about 4 minutes on 2 CPU cores)
Writes benchmarks/results/deepspeed_trainers.md and prints the same table. ``--runs 1`` for a quick look.
``run_config`` is what tests/integrations/test_hf.py and test_lightning.py run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "deepspeed_trainers.md"
HF_CONFIGS = [("hf", stage, "32-true") for stage in (1, 2, 3)]
ACCELERATE_CONFIGS = [("accelerate", stage, "32-true") for stage in (2, 3)]
LIGHTNING_CONFIGS = [("lightning", stage, precision) for precision in ("32-true", "bf16-mixed", "16-mixed")
                     for stage in (2, 3)]

PROLOGUE = """
import os
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import importlib
# DeepSpeed's shared-memory all-reduce kernel serves only TorchBackend.inference_all_reduce; the training's
# collectives are torch.distributed's (gloo) with or without it. It is built just in time (minutes on 2 cores)
# under a file lock in ~/.cache/torch_extensions that a run killed mid-build leaves behind, and every later run
# then waits on that lock forever: these runs do without it.
# (deepspeed.comm.torch, written as an attribute, is the torch package that deepspeed.comm re-exports.)
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
"""

HF_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist, transformers
from transformers import Trainer, TrainingArguments
import preflight
from preflight.verdict import Options, lower_bound_report
from preflight.integrations.hf import PreflightCallback
from preflight import Run, Target
from preflight.parallel import deepspeed_optimizer, held_tensors, read_zero
stage, with_callback = int(sys.argv[1]), sys.argv[3] == "with"
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=500,
                                                             n_positions=64))
ids = torch.randint(0, 500, (16, 32), generator=torch.Generator().manual_seed(0))
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": stage, "reduce_bucket_size": 1e6},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}}
args = TrainingArguments(output_dir="out", deepspeed=config, max_steps=3, per_device_train_batch_size=2, seed=0,
                         weight_decay=0.1, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)
callback = PreflightCallback(Run(target=Target(budget="2GiB")), verify_steps=2, suggest=False)
trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": i, "labels": i} for i in ids],
                  callbacks=[callback] if with_callback else [])
trainer.train()
out = {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
       "weights": [float(p.ds_tensor.double().sum()) if hasattr(p, "ds_tensor") else float(p.double().sum())
                   for p in model.parameters()]}
if with_callback:
    r = callback.report
    zero = read_zero(model, trainer.optimizer)  # what the callback read, read again after training
    # estimate() given DeepSpeed's objects directly, and a failed prediction's lower bound
    hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
    direct = preflight.estimate(model, trainer.optimizer, {"input_ids": ids[:2], "labels": ids[:2]},
                                Run(parallel=preflight.deepspeed_plan(config, world_size=dist.get_world_size())))
    bound = lower_bound_report(model, trainer.optimizer, Options(), Run(target=Target(budget="2GiB")),
                               device=torch.device("cpu"), reason="a test").predicted_breakdown
    held = {t.untyped_storage().data_ptr(): t for t in held_tensors(model, trainer.optimizer)}
    out.update(fits=r.fits, error=r.relative_error, notes=r.coverage["notes"], predicted=r.predicted_peak_bytes,
               measured=r.measured_peak_bytes,
               direct_notes=direct.coverage.notes, direct=direct.peak_bytes, direct_world=direct.world_size,
               hooks_kept=sum(len(m._forward_pre_hooks) for m in model.modules()) == hooks, bound=bound,
               held=sum(t.untyped_storage().nbytes() for t in held.values()),
               shapes=[list(p.shape) for p in zero.model.parameters()],
               devices=sorted({p.device.type for p in zero.model.parameters()}),
               optimizer=type(zero.optimizer).__name__,
               groups=[{k: v for k, v in g.items() if k != "params"} for g in zero.optimizer.param_groups],
               inner=[{k: v for k, v in g.items() if k != "params"}
                      for g in deepspeed_optimizer(trainer.optimizer).optimizer.param_groups],
               sizes=[sum(p.numel() for p in g["params"]) for g in zero.optimizer.param_groups],
               stand_in_hooks=sum(len(m._forward_pre_hooks) for m in zero.model.modules()),
               model_hooks=sum(len(m._forward_pre_hooks) for m in model.modules()),
               own_shapes=[list(getattr(p, "ds_shape", p.shape)) for p in model.parameters()],
               partitioned=sum(hasattr(p, "ds_tensor") for p in model.parameters()))
with open(f"rank{dist.get_rank()}.json", "w") as f:
    json.dump(out, f)
torch.distributed.destroy_process_group()  # gloo's threads otherwise may abort the exit (pytorch#190489)
"""

LIGHTNING_SCRIPT = """
import json, os, sys
import torch
import lightning.pytorch as pl
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from transformers import GPT2Config, GPT2LMHeadModel
from preflight.integrations.lightning import PreflightCallback
from preflight import Run, Target
stage, precision, with_callback = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "with"

class CPUDeepSpeed(DeepSpeedStrategy):
    # Lightning allows DeepSpeed on CUDA devices only; DeepSpeed itself runs on CPU processes (gloo). These three
    # overrides skip Lightning's CUDA checks and give DeepSpeed a device index; the strategy is otherwise Lightning's.
    def setup_environment(self):
        DDPStrategy.setup_environment(self)

    def setup_distributed(self):
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @property
    def root_device(self):
        return torch.device("cpu", self.local_rank)

class Blocks(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = torch.randint(0, 500, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}

class GPT(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=64))

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4)

config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage, "reduce_bucket_size": 1e6}}
callback = PreflightCallback(Run(target=Target(budget="2GiB")), verify_steps=3, suggest=False)
# A validation batch (8 samples) after step 2, inside the measured steps: measured and compared too.
trainer = pl.Trainer(max_steps=4, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0,
                     accelerator="cpu", devices=2, callbacks=[callback] if with_callback else [], logger=False,
                     strategy=CPUDeepSpeed(config=config, process_group_backend="gloo"), enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, precision=precision)
trainer.fit(GPT(), torch.utils.data.DataLoader(Blocks(), batch_size=4),
            torch.utils.data.DataLoader(Blocks(), batch_size=8))
r = callback.report
out = {"steps": trainer.global_step}
if with_callback:
    out.update(fits=r.fits, error=r.relative_error, notes=r.coverage["notes"], predicted=r.predicted_peak_bytes,
               measured=r.measured_peak_bytes, eval_predicted=r.eval_predicted_peak_bytes,
               eval_measured=r.eval_measured_peak_bytes, eval_error=r.eval_relative_error)
with open(f"rank{trainer.global_rank}.json", "w") as f:
    json.dump(out, f)
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()  # gloo's threads otherwise may abort the exit (pytorch#190489)
"""

ACCELERATE_SCRIPT = """
import json, os, sys
import torch
from accelerate import Accelerator, DeepSpeedPlugin
from transformers import GPT2Config, GPT2LMHeadModel
from preflight.integrations.accelerate import StepVerifier, preflight_check
from preflight import Run, Target
stage, with_callback = int(sys.argv[1]), sys.argv[3] == "with"

class Blocks(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(0, 500, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}

torch.manual_seed(0)
plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                       "zero_optimization": {"stage": stage, "reduce_bucket_size": 1e6}})
accelerator = Accelerator(deepspeed_plugin=plugin)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=64))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
loader = torch.utils.data.DataLoader(Blocks(), batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
report = preflight_check(accelerator, model, optimizer, loader, Run(target=Target(budget="2GiB")), suggest=False)
verifier = StepVerifier(accelerator, model, optimizer, report, steps=2)
model.train()
for i, batch in enumerate(loader):
    with verifier.step(batch), accelerator.accumulate(model):
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    if i == 2:
        break
with open(f"rank{torch.distributed.get_rank()}.json", "w") as f:  # accelerate counts one process here
    json.dump({"fits": report.fits, "error": report.relative_error, "notes": report.coverage["notes"],
               "predicted": report.predicted_peak_bytes, "measured": report.measured_peak_bytes, "steps": i + 1}, f)
torch.distributed.destroy_process_group()  # gloo's threads otherwise may abort the exit (pytorch#190489)
"""
TEARDOWN_ABORT = "terminate called without an active exception"
SCRIPTS = {"hf": HF_SCRIPT, "lightning": LIGHTNING_SCRIPT, "accelerate": ACCELERATE_SCRIPT}
_NAMES = {"hf": "HF Trainer", "lightning": "Lightning", "accelerate": "accelerate loop"}


def unsupported(precision: str) -> str | None:
    """Why DeepSpeed's CPU accelerator cannot run ``precision`` on this machine, or None.

    It takes fp16 only where oneDNN has fp16 kernels (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: CPUs with
    AVX512-FP16 or AMX-FP16) and otherwise refuses in ``deepspeed.initialize`` ("Type fp16 is not supported on your
    device"); likewise bf16.
    """
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    accelerator = CPU_Accelerator()
    check = {"16-mixed": accelerator.is_fp16_supported, "bf16-mixed": accelerator.is_bf16_supported}.get(precision)
    if check is None or check():
        return None
    return f"DeepSpeed's CPU accelerator does not support {precision} on this CPU (no oneDNN kernels for it)"


def run_killing_group(args: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True)``, but a run past ``timeout`` is killed with every
    process it started (torchrun's and Lightning's ranks too), not just the launcher, before TimeoutExpired is
    raised: a rank left behind would hold its port and CPU through the runs that follow."""
    child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                             **kwargs)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        raise
    return subprocess.CompletedProcess(args, child.returncode, out, err)


def run_config(trainer: str, stage: int, precision: str, workdir: str | os.PathLike,
               callback: str = "with") -> list[dict]:
    """One fresh 2-process run of ``trainer`` (``"hf"``, ``"lightning"`` or ``"accelerate"``) at ZeRO ``stage`` and
    ``precision`` in ``workdir``; each rank's JSON record. ``callback="without"``: the run without preflight."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for old in workdir.glob("rank*.json"):
        old.unlink()
    script = workdir / f"{trainer}_deepspeed.py"
    script.write_text(PROLOGUE + SCRIPTS[trainer])
    env = {k: v for k, v in os.environ.items() if k not in ("PREFLIGHT_DRY_RUN", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
              if trainer != "lightning" else [sys.executable])
    done = run_killing_group([*launch, str(script), str(stage), precision, callback], env=env, timeout=400, cwd=workdir)
    written = all((workdir / f"rank{rank}.json").exists() for rank in (0, 1))
    # DeepSpeed runs on CPU processes sometimes abort at interpreter exit, after training, with or without preflight
    # (Lightning ZeRO-3 16-mixed: 3 of 30 runs without the callback here, 3 of 66 with it): such a run's records
    # stand, marked.
    teardown = done.returncode != 0 and written and TEARDOWN_ABORT in done.stderr
    if done.returncode != 0 and not teardown:
        raise RuntimeError(f"{trainer} ZeRO-{stage} {precision} failed:\n{done.stderr[-3000:]}")
    records = [json.loads((workdir / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    return [{**r, "teardown_abort": teardown} for r in records]


def main() -> int:
    import deepspeed
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh runs per configuration (default 3)")
    args = parser.parse_args()
    start = time.perf_counter()
    kib = 1 << 10
    lines = [f"preflight's callbacks in real DeepSpeed {deepspeed.__version__} ZeRO runs on 2 CPU processes (gloo), "
             f"GPT-2 2 layers, hidden 64, AdamW, reduce_bucket_size 1e6; each rank's prediction against its own "
             f"verification (the first 2 steps; Lightning: 3 steps and a validation batch of 8 after the second), "
             f"{args.runs} runs per configuration. Command: "
             f"`python benchmarks/deepspeed_trainers.py`. torch {torch.__version__}.", "",
             "| trainer | stage | precision | rank | predicted (KiB) | measured min-max (KiB) | error vs max | "
             "error vs min | eval predicted (KiB) | eval measured min-max (KiB) | eval error vs max |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    worst, eval_worst, aborts = 0.0, 0.0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for trainer, stage, precision in HF_CONFIGS + ACCELERATE_CONFIGS + LIGHTNING_CONFIGS:
            if (reason := unsupported(precision)) is not None:
                lines.append(f"| {_NAMES[trainer]} | ZeRO-{stage} | {precision} | both | not run: {reason} |"
                             + " |" * 6)
                continue
            runs = [run_config(trainer, stage, precision, Path(tmp) / f"{trainer}{stage}{precision}{i}")
                    for i in range(args.runs)]
            aborts += sum(r[0]["teardown_abort"] for r in runs)
            for rank in (0, 1):
                predicted = {r[rank]["predicted"] for r in runs}
                measured = [r[rank]["measured"] for r in runs]
                assert len(predicted) == 1, f"the prediction differs between runs: {predicted}"
                p = predicted.pop()
                high, low = (p - max(measured)) / max(measured), (p - min(measured)) / min(measured)
                worst = max(worst, abs(high))
                cells = ["n/a"] * 3
                if runs[0][rank].get("eval_measured"):
                    eval_p, eval_m = runs[0][rank]["eval_predicted"], [r[rank]["eval_measured"] for r in runs]
                    eval_worst = max(eval_worst, abs((eval_p - max(eval_m)) / max(eval_m)))
                    cells = [f"{eval_p / kib:,.1f}", f"{min(eval_m) / kib:,.1f}-{max(eval_m) / kib:,.1f}",
                             f"{(eval_p - max(eval_m)) / max(eval_m):+.2%}"]
                lines.append(f"| {_NAMES[trainer]} | ZeRO-{stage} | {precision} | "
                             f"{rank} | {p / kib:,.1f} | {min(measured) / kib:,.1f}-{max(measured) / kib:,.1f} | "
                             f"{high:+.2%} | {low:+.2%} | {' | '.join(cells)} |")
            print(f"  {trainer} ZeRO-{stage} {precision}: done", file=sys.stderr)
    lines += ["", f"Largest |error| against a rank's largest measurement: {worst:.2%} (training), {eval_worst:.2%} "
              f"(evaluation). Runs that aborted at "
              f"interpreter exit after training (`{TEARDOWN_ABORT}`): {aborts}.",
              "", f"({time.perf_counter() - start:.0f} s)"]
    text = "\n".join(lines)
    print(text)
    RESULTS.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
