"""The ``preflight`` command: plan a run from a model config, or dry-run the user's own training script.

    preflight estimate --hf-config config.json --batch 8 --seq 2048 --gpu H100-80GB [--json out.json]
    preflight check --gpu A100-80GB -- python train.py --lr 3e-4 && sbatch job.sh

Exit status: 0 the run fits (or there is no budget to compare with), 3 it does not, 4 no verdict (the model
could not be traced and its lower bound is under the budget), 2 bad input (unknown GPU, malformed size, missing
file, unknown option), 1 an unexpected error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from preflight._budget import DEFAULT_HEADROOM, check_headroom, resolve_budget, usable_bytes
from preflight._dryrun import EXIT_DOES_NOT_FIT, EXIT_FITS, EXIT_NO_VERDICT, EXIT_USAGE
from preflight._gpus import known_gpus
from preflight._sharding import SHARDING_CHOICES
from preflight._steps import PRECISIONS
from preflight._units import format_bytes

__all__ = ["main"]

TASKS = ("causal-lm", "seq-cls", "masked-lm", "seq2seq-lm", "image-cls")
OPTIMIZERS = ("adamw", "adamw8bit", "sgd", "adafactor")


class UsageError(Exception):
    """Bad input: reported in one line, exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)  # exits 2 on unknown options, with argparse's message
    try:
        if args.command == "estimate":
            return _estimate(args)
        return _check(args)
    except UsageError as err:
        print(f"preflight: error: {err}", file=sys.stderr)
        return EXIT_USAGE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="preflight", description="Predict the peak GPU memory of training.")
    sub = parser.add_subparsers(dest="command", required=True)

    est = sub.add_parser("estimate", help="plan a run of a transformers model from its config (no weights)")
    est.add_argument("--hf-config", required=True, metavar="PATH",
                     help="a config.json file or a folder holding one (local; nothing is downloaded)")
    est.add_argument("--batch", type=int, required=True, help="micro-batch size per device")
    est.add_argument("--seq", type=int, default=None, help="tokens per sequence (text models)")
    est.add_argument("--task", choices=TASKS, default="causal-lm")
    est.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    est.add_argument("--precision", choices=[p for p in PRECISIONS if p], default=None)
    est.add_argument("--lora-r", type=int, default=None, help="train LoRA adapters of this rank instead")
    est.add_argument("--lora-targets", default="all-linear", help="LoRA target modules (comma-separated)")
    est.add_argument("--checkpointing", action="store_true", help="activation (gradient) checkpointing")
    _add_plan_options(est)
    est.add_argument("--offload-optimizer", action="store_true", help="optimizer state on the CPU (ZeRO-Offload)")
    est.add_argument("--offload-params", action="store_true", help="parameter shards on the CPU (ZeRO-3 / FSDP)")
    est.add_argument("--deepspeed-config", metavar="PATH",
                     help="read the ZeRO stage and offload settings from a DeepSpeed config (JSON)")
    est.add_argument("--json", metavar="PATH", help="also write the estimate and verdict as JSON")

    chk = sub.add_parser("check", help="dry-run your training script: `preflight check [options] -- python train.py`")
    _add_plan_options(chk)
    chk.add_argument("script", nargs=argparse.REMAINDER, help="the command after --")
    return parser


def _add_plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", help=f"plan for this GPU: {', '.join(known_gpus())}")
    p.add_argument("--budget", help="memory budget, e.g. 24GiB or 80GB (default: the GPU's memory)")
    p.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                   help=f"fraction of the budget kept free (default {DEFAULT_HEADROOM})")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks")
    p.add_argument("--sharding", choices=SHARDING_CHOICES, default=None)


def _budget(args: argparse.Namespace) -> int | None:
    try:
        check_headroom(args.headroom)
        return resolve_budget(args.budget, gpu=args.gpu)
    except ValueError as err:
        raise UsageError(str(err)) from None


# ---- preflight estimate ---------------------------------------------------------------------------------------

def _estimate(args: argparse.Namespace) -> int:
    budget = _budget(args)
    if args.batch < 1:
        raise UsageError(f"--batch should be at least 1, got {args.batch}.")
    if args.world_size < 1:
        raise UsageError(f"--world-size should be at least 1, got {args.world_size}.")
    import preflight

    with _progress("building the model on the meta device"):
        model, optimizer, batch = _build(args)
    sharding, offload = _sharding(args)
    with _progress("tracing 2 training steps on fake tensors"):
        est = preflight.estimate(model, optimizer, batch, precision=args.precision, gpu=args.gpu,
                                 device="cuda" if args.gpu else "cpu", world_size=args.world_size,
                                 sharding=sharding, **offload)
    print(est)
    verdict = _verdict(est.required_bytes, budget, args.headroom, lower_bound=est.coverage.lower_bound)
    print(verdict["text"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**est.to_dict(), **{k: v for k, v in verdict.items() if k != "text"}}, f, indent=2)
    if verdict["fits"] is None:
        return EXIT_NO_VERDICT if budget is not None else EXIT_FITS
    return EXIT_FITS if verdict["fits"] else EXIT_DOES_NOT_FIT


def _sharding(args: argparse.Namespace) -> tuple[str | None, dict[str, bool]]:
    """The sharding and offload settings: the flags, or a DeepSpeed config's ZeRO section (flags win)."""
    sharding = args.sharding
    offload = {"offload_optimizer": args.offload_optimizer, "offload_params": args.offload_params}
    if args.deepspeed_config:
        from preflight._sharding import read_deepspeed_config

        if not os.path.exists(args.deepspeed_config):
            raise UsageError(f"DeepSpeed config not found: {args.deepspeed_config!r}")
        try:
            ds = read_deepspeed_config(args.deepspeed_config)
        except (ValueError, OSError) as err:
            raise UsageError(f"cannot read the DeepSpeed config {args.deepspeed_config!r}: {err}") from None
        sharding = sharding or ds["sharding"]
        offload = {k: offload[k] or ds[k] for k in offload}
    return sharding, offload


def _verdict(required: int, budget: int | None, headroom: float, *, lower_bound: bool) -> dict[str, Any]:
    if budget is None:
        return {"fits": None, "budget_bytes": None, "usable_bytes": None,
                "text": "verdict: no budget (pass --gpu or --budget to get one)"}
    usable = usable_bytes(budget, headroom)
    fits: bool | None = required <= usable
    need = f"needs {format_bytes(required)}{' at least' if lower_bound else ''} of {format_bytes(usable)} usable " \
           f"({format_bytes(budget)} budget, {headroom:.0%} headroom)"
    if fits and lower_bound:  # a lower bound under the budget says nothing about the real peak
        fits = None
        text = f"verdict: NO VERDICT: the model could not be traced, and its lower bound {need}"
    else:
        text = f"verdict: {'FITS' if fits else 'DOES NOT FIT'}: {need}"
    return {"fits": fits, "budget_bytes": budget, "usable_bytes": usable, "text": text}


def _build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    import torch

    try:
        import transformers
    except ImportError as err:
        raise UsageError("`preflight estimate --hf-config` needs transformers: pip install "
                         "'preflight-memory[hf]'") from err
    config = _load_config(args.hf_config, transformers)
    if args.task == "seq-cls" and getattr(config, "pad_token_id", 0) is None:
        # transformers' classifiers find the last token through the pad token and refuse batches > 1 without one.
        config.pad_token_id = 0
    classes = {
        "causal-lm": transformers.AutoModelForCausalLM, "seq-cls": transformers.AutoModelForSequenceClassification,
        "masked-lm": transformers.AutoModelForMaskedLM, "seq2seq-lm": transformers.AutoModelForSeq2SeqLM,
        "image-cls": transformers.AutoModelForImageClassification,
    }
    try:
        with torch.device("meta"):
            model = classes[args.task].from_config(config)
    except ValueError as err:
        raise UsageError(f"cannot build a {args.task} model from {args.hf_config}: {err}".splitlines()[0]) from None
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora_r:
        model = _lora(model, args)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(args.optimizer, params)
    return model, optimizer, _batch(args, config)


def _load_config(path: str, transformers: Any) -> Any:
    if not os.path.exists(path):
        raise UsageError(f"config not found: {path!r} (pass a local config.json or a folder holding one)")
    try:
        if os.path.isdir(path):
            return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        with open(path) as f:
            data = json.load(f)
        if "model_type" not in data:
            raise UsageError(f"{path} has no `model_type`; transformers needs it to pick the model class")
        return transformers.AutoConfig.for_model(**data)
    except (OSError, ValueError, json.JSONDecodeError) as err:
        raise UsageError(f"cannot read the config {path!r}: {err}".splitlines()[0]) from None


def _lora(model: Any, args: argparse.Namespace) -> Any:
    try:
        import peft
    except ImportError as err:
        raise UsageError("--lora-r needs peft: pip install 'preflight-memory[hf]'") from err
    targets = args.lora_targets if args.lora_targets == "all-linear" else args.lora_targets.split(",")
    return peft.get_peft_model(model, peft.LoraConfig(r=args.lora_r, target_modules=targets))


def _optimizer(name: str, params: list) -> Any:
    import torch

    if name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as err:
            raise UsageError("--optimizer adamw8bit needs bitsandbytes: pip install 'preflight-memory[bnb]'") from err
        return bnb.optim.AdamW8bit(params, lr=1e-4)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2)
    return torch.optim.AdamW(params, lr=1e-4)


def _batch(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    import torch

    b = args.batch
    if args.task == "image-cls":
        size = getattr(config, "image_size", 224)
        size = size if isinstance(size, int) else size[0]
        channels = getattr(config, "num_channels", 3)
        return {"pixel_values": torch.zeros(b, channels, size, size), "labels": torch.zeros(b, dtype=torch.long)}
    if args.seq is None:
        raise UsageError(f"--seq is required for the {args.task} task")
    ids = torch.zeros(b, args.seq, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if args.task == "seq-cls":
        batch["labels"] = torch.zeros(b, dtype=torch.long)
    else:
        batch["labels"] = ids
    return batch


@contextlib.contextmanager
def _progress(what: str) -> Iterator[None]:
    """Say what is happening on stderr; on a terminal, keep the elapsed time ticking."""
    start = time.perf_counter()
    done = threading.Event()
    if sys.stderr.isatty():
        def spin() -> None:
            frames = "|/-\\"
            i = 0
            while not done.wait(0.2):
                print(f"\rpreflight: {what} {frames[i % 4]} {time.perf_counter() - start:5.1f} s",
                      end="", file=sys.stderr, flush=True)
                i += 1

        thread = threading.Thread(target=spin, daemon=True)
        thread.start()
    else:
        print(f"preflight: {what} ...", file=sys.stderr, flush=True)
        thread = None
    try:
        yield
    finally:
        done.set()
        if thread is not None:
            thread.join()
            print("\r", end="", file=sys.stderr)
        print(f"preflight: {what}: done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


# ---- preflight check -- python train.py -----------------------------------------------------------------------

def _check(args: argparse.Namespace) -> int:
    command = list(args.script)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("give the command to check after --, e.g. `preflight check --gpu A100-80GB -- "
                         "python train.py`")
    _budget(args)  # validate the sizes and GPU name before starting anything
    if args.world_size < 1:
        raise UsageError(f"--world-size should be at least 1, got {args.world_size}.")
    with tempfile.TemporaryDirectory(prefix="preflight-") as tmp:
        report_path = os.path.join(tmp, "report.json")
        env = dict(os.environ, PREFLIGHT_DRY_RUN="1", PREFLIGHT_REPORT=report_path)
        for key, value in (("PREFLIGHT_GPU", args.gpu), ("PREFLIGHT_BUDGET", args.budget),
                           ("PREFLIGHT_WORLD_SIZE", args.world_size if args.world_size > 1 else None),
                           ("PREFLIGHT_SHARDING", args.sharding), ("PREFLIGHT_HEADROOM", args.headroom)):
            if value is not None:
                env[key] = str(value)
        try:
            code = subprocess.call(command, env=env)
        except FileNotFoundError:
            raise UsageError(f"command not found: {command[0]!r}") from None
        report = None
        if os.path.exists(report_path):
            with open(report_path) as f:
                report = json.load(f)
    if report is None:
        if code == 0:
            print("preflight: the script finished without reaching a preflight check. Add the callback "
                  "(preflight.integrations.lightning / .hf) or call preflight.check(...) before training.",
                  file=sys.stderr)
            return EXIT_USAGE
        print(f"preflight: the script exited with status {code} before a preflight check reported.",
              file=sys.stderr)
        return code
    fits = report.get("fits")
    need = report.get("predicted_required_bytes") or report.get("predicted_peak_bytes")
    word = {True: "FITS", False: "DOES NOT FIT"}.get(fits, "NO VERDICT" if report.get("budget_bytes") else "NO BUDGET")
    print(f"preflight check: {word}: predicted {format_bytes(need)} against a budget of "
          f"{format_bytes(report.get('budget_bytes'))}")
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
