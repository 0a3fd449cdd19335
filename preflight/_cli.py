"""The ``preflight`` command: plan a run from a model config, or dry-run the user's own training script.

    preflight estimate --hf-config config.json --batch 8 --seq 2048 --gpu H100-80GB [--json out.json]
    preflight check --gpu A100-80GB -- python train.py --lr 3e-4 && sbatch job.sh

Exit status: 0 the run fits (or there is no budget to compare with), 3 it does not, 4 no verdict (the model
could not be traced and its lower bound is under the budget), 5 the training step would fail at step one (check:
the script's step raised `preflight.StepWouldFailError`, e.g. token ids beyond the vocabulary; estimate: the
planned set-up's), 2 bad input (unknown
GPU, malformed size, missing file, unknown option), 1 an unexpected error; for ``check``, 124 when ``--timeout``
stopped the script, and 128 + N when signal N (SIGINT, SIGTERM, SIGHUP) was passed on to the script's process group.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from preflight._budget import DEFAULT_HEADROOM, check_headroom, resolve_budget, usable_bytes
from preflight.report._console import progress as _progress
from preflight._dryrun import EXIT_DOES_NOT_FIT, EXIT_FITS, EXIT_NO_VERDICT, EXIT_STEP_FAILS, EXIT_USAGE
from preflight._errors import StepWouldFailError
from preflight._gpus import known_gpus
from preflight._guard import untouched
from preflight._quantize import SCHEMES
from preflight._sharding import SHARDING_CHOICES
from preflight._steps import PRECISIONS
from preflight._units import format_bytes

__all__ = ["main"]

TASKS = ("causal-lm", "seq-cls", "masked-lm", "seq2seq-lm", "image-cls")
OPTIMIZERS = ("adamw", "adamw8bit", "paged-adamw", "paged-adamw8bit", "lion", "lion8bit", "sgd", "adafactor")
# --optimizer -> the bitsandbytes optimizer class it builds
_BNB_OPTIMIZERS = {"adamw8bit": "AdamW8bit", "paged-adamw": "PagedAdamW", "paged-adamw8bit": "PagedAdamW8bit",
                   "lion": "Lion", "lion8bit": "Lion8bit"}
PARAM_DTYPES = ("float32", "bfloat16", "float16")
# The parameter dtype each precision implies. Mixed precision (Lightning's "bf16-mixed", the HF Trainer's
# bf16=True, accelerate's mixed_precision="bf16") autocasts the compute and keeps fp32 master weights unless the
# user loads half-precision weights; only the "*-true" precisions cast the parameters themselves.
_PRECISION_PARAM_DTYPE = {"32-true": "float32", "bf16-true": "bfloat16", "16-true": "float16"}
_MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length")
_TOP_SUGGESTIONS = 5
# How each key of a suggestion's change is said in `preflight estimate`'s flags (the argument names it sets).
_CHANGE_FLAGS = {"precision": "precision", "sharding": "sharding", "world_size": "world_size",
                 "offload_optimizer": "offload_optimizer", "PYTORCH_CUDA_ALLOC_CONF": "allocator",
                 "optimizer_impl": "optimizer_impl", "micro_batch_size": "batch",
                 "accumulate_grad_batches": "accumulate",
                 "gradient_checkpointing": "checkpointing", "r": "lora_r", "target_modules": "lora_targets",
                 "base_dtype": "param_dtype", "quantize": "quantize", "double_quant": "double_quant",
                 "microbatches": "microbatches", "loading": "loading",
                 "offload_activations": "offload_activations", "fsdp_param_dtype": "fsdp_param_dtype"}
# Said by other keys of the same change, or by the flags' defaults.
_IMPLIED_CHANGES = {"peft": "r"}
_OPTIMIZER_FLAGS = {f"bitsandbytes.optim.{cls}": flag for flag, cls in _BNB_OPTIMIZERS.items()}
# Flags a rerun leaves out: they write files.
_RERUN_SKIPS = ("json", "plot")
EXIT_TIMEOUT = 124  # the `timeout` command's status when it stops the command
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_SIGNAL_EXITS = tuple(128 + sig for sig in _FORWARDED)  # the shell's convention for "ended by signal N"
# How long the script's group has to exit after SIGTERM/SIGINT (a trainer's shutdown) before SIGKILL.
_GRACE_SECONDS = 10.0


class UsageError(Exception):
    """Bad input: reported in one line, exit status 2."""


@untouched()
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
    except StepWouldFailError as err:  # the planned set-up's first step would raise: no peak, and the reason
        print(f"preflight: THE STEP WOULD FAIL: {err}", file=sys.stderr)
        return EXIT_STEP_FAILS


def _parser() -> argparse.ArgumentParser:
    from preflight import __version__

    parser = argparse.ArgumentParser(prog="preflight", description="Predict the peak GPU memory of training.")
    parser.add_argument("--version", action="version", version=f"preflight {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    est = sub.add_parser("estimate", help="plan a run of a transformers model from its config (no weights)")
    est.add_argument("--hf-config", required=True, metavar="PATH",
                     help="a config.json file or a folder holding one (local; nothing is downloaded)")
    est.add_argument("--batch", type=int, required=True, help="micro-batch size per device")
    est.add_argument("--seq", type=int, default=None, help="tokens per sequence (text models)")
    est.add_argument("--task", choices=TASKS, default="causal-lm")
    est.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    est.add_argument("--precision", choices=[p for p in PRECISIONS if p], default=None)
    est.add_argument("--param-dtype", choices=PARAM_DTYPES, default=None,
                     help="dtype of the trained parameters (default: float32, or the dtype a *-true precision "
                          "casts to; mixed precision keeps fp32 master weights). Not read from the config")
    est.add_argument("--lora-r", type=int, default=None, help="train LoRA adapters of this rank instead")
    est.add_argument("--lora-targets", default="all-linear", help="LoRA target modules (comma-separated)")
    est.add_argument("--quantize", choices=SCHEMES, default=None,
                     help="base weights quantized by bitsandbytes as from_pretrained(quantization_config=...) loads "
                          "them: nf4 or fp4 (QLoRA's 4-bit, computing in the precision's dtype) or int8 (LLM.int8); "
                          "prepared as peft's prepare_model_for_kbit_training does; needs --lora-r")
    est.add_argument("--double-quant", action="store_true",
                     help="with --quantize nf4/fp4: quantize the 4-bit statistics too (QLoRA's double quantization)")
    est.add_argument("--checkpointing", action="store_true", help="activation (gradient) checkpointing")
    est.add_argument("--offload-activations", choices=["streams", "save_on_cpu"], default=None,
                     help="offload the activations autograd saves to host memory: streams (TRL's "
                          "activation_offloading, torchtune's enable_activation_offloading) or save_on_cpu (torch's); "
                          "they leave a --gpu target's memory")
    est.add_argument("--accumulate", type=int, default=1, metavar="N",
                     help="gradient-accumulation micro-batches per optimizer step (--batch is one micro-batch)")
    est.add_argument("--optimizer-impl", choices=["for-loop", "foreach", "fused"], default=None,
                     help="how the optimizer step runs: foreach (torch's default on CUDA: a temporary the size of "
                          "the parameters it updates), fused (one kernel, no such temporary) or for-loop")
    est.add_argument("--cuda-context", metavar="SIZE", default=None,
                     help="the CUDA context you measured where the job runs (e.g. 1343MiB), added to the device "
                          "total in place of the GPU's approximate figure; needs --gpu")
    est.add_argument("--nccl-buffers", metavar="SIZE", default=None,
                     help="NCCL's buffers per communicator on a rank, as measured where the job runs (needs --gpu and "
                          "several ranks); default: modelled from NCCL's defaults and NCCL_* variables")
    est.add_argument("--allocator", metavar="CONF", default=None,
                     help="CUDA allocator settings for the reserved-memory simulation, as PYTORCH_CUDA_ALLOC_CONF "
                          "writes them (e.g. expandable_segments:True); default: the environment's")
    gen = est.add_argument_group("generation", "plan model.generate instead of training (--batch prompts of --seq "
                                               "tokens; precision and --param-dtype as for training)")
    gen.add_argument("--generate", action="store_true",
                     help="plan generation (prefill and every decoding step, the KV cache growing to its longest) "
                          "instead of training")
    gen.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                     help="tokens generated per sequence (needed with --generate)")
    gen.add_argument("--num-beams", type=int, default=1, metavar="K", help="beam search with K beams (default 1)")
    gen.add_argument("--do-sample", action="store_true", help="sample tokens (top-k/top-p as the model's "
                                                              "generation_config says) instead of greedy or beams")
    _add_plan_options(est)
    est.add_argument("--tp", type=int, default=None, metavar="N",
                     help="tensor parallelism of degree N with the model's own plan (its transformers tp plan, cut "
                          "with DTensor's styles); the world size defaults to N, and a larger --world-size needs "
                          "--sharding fsdp2 (FSDP2 over the other dim of an (world/N, N) mesh). Each distinct rank "
                          "traced")
    est.add_argument("--replicate", type=int, default=1, metavar="R",
                     help="with --sharding fsdp2: FSDP2's hybrid sharding (HSDP), the model replicated over R groups "
                          "of --world-size/R ranks that shard it (a (R, world/R) mesh; with --tp N the 3-D mesh (R, "
                          "world/(R*N), N); with --ep, transformers' dp_replicate_size=R). Each distinct rank traced")
    est.add_argument("--fsdp-param-dtype", choices=("bfloat16", "float16"), default=None,
                     help="with --sharding fsdp2: FSDP2 casts the parameters it gathers to this dtype "
                          "(MixedPrecisionPolicy(param_dtype=..., reduce_dtype=torch.float32), torchtitan's default); "
                          "without it, a *-mixed --precision casts them under autocast, whose cache keeps every "
                          "gathered parameter's cast until the forward ends")
    est.add_argument("--pp", type=int, default=None, metavar="N",
                     help="pipeline parallelism over N stage ranks (causal-lm): the model cut as transformers' own "
                          "pipeline parallelism cuts it, run by torch's schedule (--schedule), each step's batch "
                          "--batch x --microbatches sequences; with --tp M each stage is laid out by the model's "
                          "own tensor-parallel plan over M ranks; the world size defaults to N (x M), and a larger "
                          "--world-size needs --sharding fsdp2 (FSDP2 inside each stage). Each distinct rank traced")
    est.add_argument("--cp", type=int, default=None, metavar="N",
                     help="context parallelism (causal-lm): each sequence cut among N ranks, attention through torch's "
                          "ring (context_parallel; --cp-rotate); with --tp M the model is laid out by its own "
                          "tensor-parallel plan over M ranks beside the ring; the world size defaults to N (x M), "
                          "and a larger --world-size needs --sharding fsdp2 (FSDP2 over every rank of the data-"
                          "parallel and ring dims, torchtitan's dp_shard_cp); "
                          "torch balances the load where --seq divides into 2N chunks. Each place in the ring "
                          "traced")
    est.add_argument("--ep", type=int, default=None, metavar="N",
                     help="expert parallelism (causal-lm, a mixture-of-experts config): each layer's experts spread "
                          "over N ranks as transformers' DistributedConfig(fsdp_size=W, ep_size=N) lays them out, "
                          "with its FSDP2 over all W ranks (--world-size, default N); with --tp M (M divides N) the "
                          "dense layers are laid out by the model's own tensor-parallel plan over M ranks and FSDP2 "
                          "shards them over W/M; tokens routed evenly over the experts (Run(routing=\"skewed\") in "
                          "Python for the worst case). Each place on the ep dim traced")
    est.add_argument("--cp-rotate", default="allgather", choices=("allgather", "alltoall"),
                     help="with --cp: how the ring passes keys and values (torch's set_rotate_method; default "
                          "allgather)")
    est.add_argument("--schedule", default="1F1B", metavar="NAME",
                     help="with --pp: torch's pipeline schedule: GPipe, 1F1B (default), Interleaved1F1B, LoopedBFS, "
                          "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV")
    est.add_argument("--microbatches", type=int, default=None, metavar="M",
                     help="with --pp: micro-batches per step (default: one per stage rank, N)")
    save = est.add_argument_group("checkpoint saves", "predict the run's checkpoint save too (a phase of its own, "
                                  "traced after the steps; the verdict takes the larger of training and saving)")
    save.add_argument("--checkpoint", choices=["full", "sharded"], default=None,
                      help="the run saves checkpoints: under FSDP or tensor parallelism, a full state dict (gathered "
                           "on rank 0, to its host memory by default) or a sharded one (each rank its own shards)")
    save.add_argument("--checkpoint-weights-only", action="store_true",
                      help="the optimizer's state is not saved (HF save_only_model, Lightning save_weights_only)")
    save.add_argument("--checkpoint-on-device", action="store_true",
                      help="a full state dict stays on the device (offload_to_cpu=False)")
    save.add_argument("--checkpoint-every-rank", action="store_true",
                      help="every rank keeps the full state dict (rank0_only=False)")
    est.add_argument("--loading", choices=["device", "host", "meta", "meta-rank0"], default=None,
                     help="predict the model's loading too (a phase of its own, per rank; the verdict takes the "
                          "largest phase): 'device', each rank holds the whole model on its device before the engine "
                          "shards it (from_pretrained with a device_map, model.to(device) before FSDP); 'host', FSDP "
                          "moves it from the host unit by unit (FSDP1 device_id, fully_shard of a CPU model); "
                          "'meta', built on meta and each rank materialises its own shards (torchtitan, Lightning's "
                          "ModelParallelStrategy, init_module(empty_init=True)); 'meta-rank0', those shards filled "
                          "from a full state dict rank 0 broadcasts one tensor at a time (set_model_state_dict with "
                          "broadcast_from_rank0, accelerate's cpu_ram_efficient_loading; under FSDP1 its "
                          "sync_module_states broadcast)")
    est.add_argument("--offload-optimizer", action="store_true", help="optimizer state on the CPU (ZeRO-Offload)")
    est.add_argument("--offload-params", action="store_true", help="parameter shards on the CPU (ZeRO-3 / FSDP)")
    est.add_argument("--gradient-as-bucket-view", action="store_true",
                     help="DDP's gradient_as_bucket_view=True: gradients are views into DDP's buckets (needs "
                          "--world-size above 1 and DDP, the default sharding there)")
    est.add_argument("--deepspeed-config", metavar="PATH",
                     help="read the ZeRO stage, offload settings and gradient reduction buffer sizes from a "
                          "DeepSpeed config (JSON)")
    est.add_argument("--json", metavar="PATH", help="also write the estimate, verdict and inputs as JSON")
    est.add_argument("--plot", metavar="PATH", help="also draw the predicted memory timeline as a PNG "
                                                   "(needs matplotlib)")
    est.add_argument("--no-suggest", dest="suggest", action="store_false",
                     help="when it does not fit, skip the ranked suggestions (each is a further trace)")

    chk = sub.add_parser("check", help="dry-run your training script: `preflight check [options] -- python train.py`",
                         description="Options given here win over the same settings written in the script; "
                                     "options left out leave the script's settings alone.")
    # None: a headroom written in the script stands unless --headroom is given.
    _add_plan_options(chk, headroom=None)
    chk.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                     help=f"stop the script (its whole process group) if it has not finished after SECONDS; exit "
                          f"status {EXIT_TIMEOUT}")
    chk.add_argument("--no-suggest", dest="suggest", action="store_false",
                     help="when it does not fit, exit without ranking changes that would (each is a further trace)")
    chk.add_argument("script", nargs=argparse.REMAINDER, help="the command after --")
    chk.epilog = (f"Exit status: {EXIT_FITS} fits (or no budget), {EXIT_DOES_NOT_FIT} does not fit, "
                  f"{EXIT_NO_VERDICT} no verdict, {EXIT_USAGE} no report or bad input, {EXIT_TIMEOUT} --timeout "
                  "reached; SIGINT/SIGTERM are passed on to the script's process group, and `check` then exits "
                  "128 + the signal's number (130, 143).")
    return parser


def _add_plan_options(p: argparse.ArgumentParser, headroom: float | None = DEFAULT_HEADROOM) -> None:
    p.add_argument("--gpu", help=f"plan for this GPU: {', '.join(known_gpus())}")
    p.add_argument("--budget", help="memory budget, e.g. 24GiB or 80GB (default: the GPU's memory)")
    p.add_argument("--headroom", type=float, default=headroom,
                   help=f"fraction of the budget kept free (default {DEFAULT_HEADROOM})")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks")
    p.add_argument("--sharding", choices=SHARDING_CHOICES, default=None,
                   help="how the ranks share the model: ddp; zero1, zero2, zero3 (DeepSpeed ZeRO: each allocation "
                        "rescaled to one rank's share); fsdp-full, fsdp-grad-op (FSDP1's FULL_SHARD, SHARD_GRAD_OP) "
                        "and fsdp2 (fully_shard): each rank's step traced through the engine, one figure per rank")
    p.add_argument("--full", dest="fast", action="store_false",
                   help="trace every block of a deep model (slower). By default a repeated stack of blocks is traced "
                        "from its first few and composed: the same bytes, in seconds whatever the depth")


def _budget(args: argparse.Namespace) -> int | None:
    try:
        check_headroom(DEFAULT_HEADROOM if args.headroom is None else args.headroom)
        return resolve_budget(args.budget, gpu=args.gpu)
    except ValueError as err:
        raise UsageError(str(err).replace("`budget`", "--budget").replace("`headroom`", "--headroom")) from None


# ---- preflight estimate ---------------------------------------------------------------------------------------

def _estimate(args: argparse.Namespace) -> int:
    budget = _budget(args)
    if args.batch < 1:
        raise UsageError(f"--batch should be at least 1, got {args.batch}.")
    if args.world_size < 1:
        raise UsageError(f"--world-size should be at least 1, got {args.world_size}.")
    if args.lora_r is not None and args.lora_r < 1:
        raise UsageError(f"--lora-r should be a positive LoRA rank (8 and 16 are common), got {args.lora_r}; "
                         "leave it out for full fine-tuning.")
    if args.cuda_context is not None and not args.gpu:
        raise UsageError("--cuda-context is added to the device total computed for a GPU: pass --gpu too (e.g. "
                         "--gpu H100-80GB --cuda-context 1343MiB).")
    if args.nccl_buffers is not None and not args.gpu:
        raise UsageError("--nccl-buffers is added to the device total computed for a GPU: pass --gpu too (e.g. "
                         "--gpu H100-80GB --world-size 8 --nccl-buffers 600MiB).")
    if args.quantize and not args.lora_r:
        raise UsageError(f"--quantize {args.quantize}: quantized base weights are frozen, so nothing would train; "
                         "add --lora-r 16 (LoRA adapters over them: QLoRA with nf4/fp4).")
    if args.double_quant and args.quantize not in ("nf4", "fp4"):
        raise UsageError("--double-quant quantizes 4-bit statistics: pass it with --quantize nf4 or fp4.")
    # Before the trace: a file that cannot be written would otherwise lose the verdict after minutes of work.
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        _check_writable(option, path)
    sharding, offload = _sharding(args)
    import preflight

    param_dtype, dtype_reason = _param_dtype(args)
    config = _config(args)
    warnings_ = (_config_dtype_warnings(args, config, param_dtype, dtype_reason)
                 + _one_rank_warnings(args, sharding, offload))
    generation = _generation(args, sharding, offload)
    with _progress("building the model on the meta device"):
        model, optimizer, batch = _build(args, config, param_dtype)
    for text in warnings_:
        print(f"preflight: warning: {text}", file=sys.stderr)
    run = _run(args, sharding, offload)
    if run.pipelined:
        _check_cut(model, run.parallel.pp)
    if generation is not None:
        run = run.replace(generation=generation)
        prompts = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
        with _progress(f"tracing generate on fake tensors (prefill and {args.max_new_tokens} decoding steps)"):
            est = preflight.estimate_generation(model, prompts, run)
    else:
        with _progress("tracing 2 training steps on fake tensors"):
            est = preflight.estimate(model, optimizer, batch, run)
    params = _parameter_summary(model)
    print(_assumptions_text(args, params, param_dtype, dtype_reason, sharding, offload))
    print(est)
    verdict = _verdict(est.run_required_bytes, budget, args.headroom, lower_bound=est.coverage.lower_bound,
                       phase=max([("training", est.required_bytes)] + [(p.name, p.required_bytes) for p in est.phases],
                                 key=lambda item: item[1])[0] if est.phases else None)
    print(verdict["text"])
    saving = est.phase("saving")
    if verdict["fits"] is False and saving is not None and saving.required_bytes == est.run_required_bytes and \
            saving.required_bytes > est.required_bytes:
        print("the checkpoint save is the peak: save a sharded state dict (--checkpoint sharded), or gather a full one "
              "to the host of rank 0 alone (leave out --checkpoint-on-device and --checkpoint-every-rank)")
    loading = est.phase("loading")
    if verdict["fits"] is False and loading is not None and loading.required_bytes == est.run_required_bytes and \
            loading.required_bytes > est.required_bytes:
        if run.loading is not None and run.loading.from_rank0:
            print("the model's loading is the peak: have each rank read its own shards from a distributed "
                  "checkpoint (torch.distributed.checkpoint) rather than rank 0's full state dict (--loading meta)")
        else:
            print("the model's loading is the peak: build it on the meta device so that each rank materialises only "
                  "its own shards (--loading meta)" + (", or load it on the host and let FSDP move it unit by unit "
                                                      "(--loading host)" if run.loading.placement == "device" else ""))
    suggestions: list[dict[str, Any]] = []
    if verdict["fits"] is False and args.suggest and generation is None:
        suggestions = _suggest(args, model, optimizer, batch, config, budget, run)
        print(_suggestions_text(suggestions))
    if args.json:
        out = {**est.to_dict(), **{k: v for k, v in verdict.items() if k != "text"},
               "parameters": params, "inputs": _inputs(args, param_dtype, sharding, offload), "run": run.to_dict(),
               "versions": _versions(), "suggestions": suggestions, "warnings": warnings_}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    if args.plot:
        from preflight.report._plot import plot_estimate

        try:
            plot_estimate(est, args.plot, budget_bytes=verdict["budget_bytes"], usable_bytes=verdict["usable_bytes"])
        except ImportError as err:
            raise UsageError(str(err)) from None
        print(f"plot: {args.plot}")
    if verdict["fits"] is None:
        return EXIT_NO_VERDICT if budget is not None else EXIT_FITS
    return EXIT_FITS if verdict["fits"] else EXIT_DOES_NOT_FIT


def _generation(args: argparse.Namespace, sharding: str | None, offload: dict[str, bool]) -> dict[str, Any] | None:
    """``model.generate``'s keyword arguments the generation flags say (None without --generate), or a UsageError
    naming what does not go with generation."""
    if not args.generate:
        given = [f for f, v in (("--max-new-tokens", args.max_new_tokens is not None),
                                ("--num-beams", args.num_beams != 1), ("--do-sample", args.do_sample)) if v]
        if given:
            raise UsageError(f"{', '.join(given)} plan(s) generation: add --generate (the training step is planned "
                             "without it).")
        return None
    if args.task not in ("causal-lm", "seq2seq-lm"):
        raise UsageError(f"--generate needs a model that generates: --task causal-lm or seq2seq-lm, not {args.task}.")
    if args.seq is None:
        raise UsageError("--generate needs --seq: the prompt length in tokens.")
    if args.max_new_tokens is None or args.max_new_tokens < 1:
        raise UsageError("--generate needs --max-new-tokens N (N >= 1): how many tokens each sequence generates.")
    if args.num_beams < 1:
        raise UsageError(f"--num-beams should be at least 1, got {args.num_beams}.")
    if (args.world_size > 1 or sharding or any(offload.values()) or args.deepspeed_config or args.accumulate != 1
            or getattr(args, "offload_activations", None)):
        raise UsageError("--generate plans one device's generation: leave out --world-size, --sharding, offloading, "
                         "--offload-activations, --deepspeed-config and --accumulate (they describe training).")
    # Every sequence runs to max_new_tokens in the trace (the worst case); the pad token only fills finished rows.
    return {"max_new_tokens": args.max_new_tokens, "num_beams": args.num_beams, "do_sample": args.do_sample}


def _param_dtype(args: argparse.Namespace) -> tuple[str, str]:
    """The parameter dtype to plan with, and why (said in the output)."""
    implied = _PRECISION_PARAM_DTYPE.get(args.precision or "")
    if args.param_dtype is not None:
        if implied is not None and args.param_dtype != implied:
            raise UsageError(f"--precision {args.precision} casts the parameters to {implied}, but --param-dtype is "
                             f"{args.param_dtype}: drop --param-dtype or pass --param-dtype {implied}.")
        return args.param_dtype, "--param-dtype"
    if implied is not None:
        return implied, f"--precision {args.precision} casts the parameters"
    if args.precision in ("bf16-mixed", "16-mixed"):
        return "float32", f"--precision {args.precision} keeps fp32 master weights"
    return "float32", "the default; pass --param-dtype for half-precision weights"


def _one_rank_warnings(args: argparse.Namespace, sharding: str | None, offload: dict[str, bool]) -> list[str]:
    """A warning when a sharding is planned over one rank without offloading (ZeRO-Offload on one GPU is a plan of
    its own): said, not silently planned as if it were the job's."""
    if sharding in (None, "ddp") or args.world_size > 1 or any(offload.values()):
        return []
    return [f"--sharding {sharding} with --world-size {args.world_size}: one rank holds every shard, so this plans "
            f"{sharding} over a single GPU. Pass --world-size N with the number of GPUs the job shards over."]


def _config_dtype_warnings(args: argparse.Namespace, config: Any, param_dtype: str, reason: str) -> list[str]:
    """A warning when the config names a dtype other than the one planned with (the config is not obeyed)."""
    # transformers >= 4.56 names it dtype (reading torch_dtype there logs a deprecation); older ones torch_dtype
    named = getattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", None)
    named = str(named).removeprefix("torch.") if named is not None else None
    if named is None or named == "auto" or named == param_dtype or args.param_dtype is not None:
        return []
    if args.precision in _PRECISION_PARAM_DTYPE:  # the precision casts whatever dtype the weights load in
        return []
    return [f"{args.hf_config} says dtype {named}, but the plan uses {param_dtype} parameters ({reason}). "
            f"If you load the weights in {named} (from_pretrained(..., dtype=torch.{named})), pass "
            f"--param-dtype {named}."]


def _parameter_summary(model: Any) -> dict[str, Any]:
    """Parameter counts (tied weights once) and the elements per dtype, for the table and the JSON."""
    unique = {id(p): p for p in model.parameters()}.values()
    dtypes: dict[str, int] = {}
    for p in unique:
        name = str(p.dtype).removeprefix("torch.")
        dtypes[name] = dtypes.get(name, 0) + p.numel()
    return {"count": sum(p.numel() for p in unique), "trainable": sum(p.numel() for p in unique if p.requires_grad),
            "dtypes": dtypes}


def _assumptions_text(args: argparse.Namespace, params: dict[str, Any], param_dtype: str, reason: str,
                      sharding: str | None, offload: dict[str, bool]) -> str:
    dtypes = ", ".join(f"{name} {n:,}" for name, n in params["dtypes"].items())
    shape = f"batch {args.batch}" + (f" x seq {args.seq}" if args.seq is not None else "")
    lora = f"LoRA r={args.lora_r} on {args.lora_targets}" if args.lora_r else "full fine-tuning"
    if args.quantize:
        lora += (f" over {args.quantize}{' double-quantized' if args.double_quant else ''} base weights "
                 "(bitsandbytes, prepared as peft's prepare_model_for_kbit_training)")
    tp, pp, cp, ep = (getattr(args, name, None) for name in ("tp", "pp", "cp", "ep"))
    degrees = [d for d in (tp if not ep else None, pp, cp, ep) if d]  # beside ep, tp's ranks are among ep's
    replicas = getattr(args, "replicate", 1) if ep else 1  # beside ep, HSDP's replicas hold ep's ranks each
    ranks = math.prod(degrees) * replicas if degrees and args.world_size == 1 else args.world_size
    plan = f"{ranks} rank(s)" + (f", tensor parallel degree {tp}" if tp else "") + \
        (f", expert parallel degree {ep} (transformers' layout, FSDP2 over every rank" +
         (f" / {tp} on the dense layers" if tp and tp > 1 else "") +
         (f" of each of {replicas} replicas" if replicas > 1 else "") + ", tokens routed evenly)" if ep else "") + \
        (f", context parallel degree {cp} ({args.cp_rotate}, each rank {args.seq // cp} tokens of each sequence)"
         if cp else "") + \
        (f", pipeline parallel degree {pp} ({args.schedule}, {_microbatches(args)} micro-batches of "
         f"{args.batch})" if pp else "") + \
        (f", {sharding}" if sharding else "") + \
        (f" gathering {args.fsdp_param_dtype} parameters (MixedPrecisionPolicy)"
         if getattr(args, "fsdp_param_dtype", None) else "") + \
        "".join(f", {k.replace('_', ' ')}" for k, v in offload.items() if v)
    if args.generate:
        mode = f"{args.num_beams} beams" if args.num_beams > 1 else "greedy"
        mode = ("sampling" + (f" with {args.num_beams} beams" if args.num_beams > 1 else "")) if args.do_sample \
            else mode
        return "\n".join([
            f"parameters: {params['count']:,}; dtypes: {dtypes}",
            f"assumed: parameters in {param_dtype} ({reason}); precision {args.precision or 'as the parameters'}"
            + (f"; {lora}" if args.lora_r else ""),
            f"assumed: generate, {args.batch} prompt(s) of {args.seq} tokens, {args.max_new_tokens} new tokens each, "
            f"{mode}, every sequence to its last token",
        ])
    return "\n".join([
        f"parameters: {params['count']:,} ({params['trainable']:,} trainable); dtypes: {dtypes}",
        f"assumed: parameters in {param_dtype} ({reason}); precision {args.precision or 'as the parameters'}; "
        f"optimizer {args.optimizer}; {lora}{'; checkpointing' if args.checkpointing else ''}"
        + (f"; activations offloaded to the host ({args.offload_activations})"
           if getattr(args, "offload_activations", None) else ""),
        f"assumed: {args.task}, {shape}, {plan}",
    ])


def _run(args: argparse.Namespace, sharding: str | None, offload: dict[str, bool]) -> Any:
    """The `preflight.Run` the flags describe (the same description the Python API takes)."""
    from preflight._estimate import check_plan
    from preflight._run import Loop, Run, Target
    from preflight.parallel import ParallelPlan, deepspeed_plan

    if args.accumulate < 1:
        raise UsageError(f"--accumulate should be at least 1, got {args.accumulate}.")
    parallel = None
    replicate = getattr(args, "replicate", 1)
    if replicate != 1 and (replicate < 2 or sharding != "fsdp2" or any(
            getattr(args, flag, None) is not None for flag in ("pp", "cp")) or any(offload.values())):
        raise UsageError(f"--replicate {replicate}: FSDP2's hybrid sharding replicates over at least 2 groups, with "
                         "--sharding fsdp2 (alone, with --tp or with --ep), without --pp, --cp or offloading.")
    param_dtype = getattr(args, "fsdp_param_dtype", None)
    if param_dtype is not None and (sharding != "fsdp2" and getattr(args, "ep", None) is None or any(
            getattr(args, flag, None) is not None for flag in ("pp", "cp"))):
        raise UsageError(f"--fsdp-param-dtype {param_dtype}: FSDP2's parameter dtype is planned with --sharding "
                         "fsdp2 (alone, with --tp, --replicate or --ep), without --pp or --cp.")
    hsdp = None
    if replicate > 1 or param_dtype is not None:
        import torch

        from preflight.parallel import FSDP2Plan

        hsdp = FSDP2Plan(replicate=replicate)
        if param_dtype is not None:
            hsdp = hsdp.gathering(getattr(torch, param_dtype))
    try:
        tp, pp = getattr(args, "tp", None), getattr(args, "pp", None)
        if pp is None and (getattr(args, "microbatches", None) is not None or
                           getattr(args, "schedule", "1F1B") != "1F1B"):
            raise UsageError("--schedule and --microbatches describe a pipeline: pass --pp N (its stage ranks) too.")
        cp, ep = getattr(args, "cp", None), getattr(args, "ep", None)
        if ep is not None:
            other = _given(args, offload, "--pp", "--cp", "--deepspeed-config", "--offload-optimizer",
                           "--offload-params", "--generate")
            if ep < 2 or args.task != "causal-lm" or other or sharding not in (None, "fsdp2"):
                raise UsageError(f"--ep {ep}: expert parallelism is planned for a causal-lm over at least 2 ranks, "
                                 "with transformers' FSDP2 (--sharding fsdp2 or none)" +
                                 (f"; not with {', '.join(other)}" if other else "") + ".")
            if tp is not None and (tp < 1 or ep % tp):
                raise UsageError(f"--tp {tp} beside --ep {ep}: transformers' tensor parallelism of the dense layers "
                                 "runs over a degree that divides --ep's (DistributedConfig(tp_size=..., "
                                 "ep_size=...)).")
            from preflight.parallel import EPPlan, TPPlan

            world = ep * replicate if args.world_size == 1 else args.world_size
            parallel = ParallelPlan(world, "fsdp2", ep=EPPlan(ep), tp=TPPlan(tp) if tp not in (None, 1) else None,
                                    fsdp=hsdp, source="the command line")
        if cp is None and getattr(args, "cp_rotate", "allgather") != "allgather":
            raise UsageError("--cp-rotate describes context parallelism: pass --cp N (the ranks of the ring) too.")
        if parallel is not None:
            pass  # expert parallelism, above
        elif pp is not None:  # with --tp and --cp inside it where given
            parallel = _pp_plan(args, sharding, offload)
        elif cp is not None:
            other = _given(args, offload, "--deepspeed-config", "--offload-optimizer", "--offload-params",
                           "--generate")
            if cp < 1 or args.task != "causal-lm" or other or (tp is not None and tp < 1):
                raise UsageError(f"--cp {cp}: context parallelism is planned for a causal-lm over at least 1 rank, "
                                 "alone or with --tp N and --sharding fsdp2" +
                                 (f"; not with {', '.join(other)}" if other else "") + ".")
            from preflight.parallel import CPPlan, TPPlan

            world = cp * (tp or 1) if args.world_size == 1 else args.world_size
            parallel = ParallelPlan(world, sharding, cp=CPPlan(cp, args.cp_rotate), tp=TPPlan(tp) if tp else None,
                                    source="the command line")
        elif tp is not None:
            if tp < 1 or args.deepspeed_config or any(offload.values()):
                raise UsageError(f"--tp {tp}: give a degree of at least 1, without --deepspeed-config or offloading "
                                 "(tensor parallelism is traced alone or with --sharding fsdp2).")
            from preflight.parallel import TPPlan

            world = tp if args.world_size == 1 else args.world_size
            parallel = ParallelPlan(world, sharding, tp=TPPlan(tp), fsdp=hsdp, source="the command line")
        elif args.deepspeed_config:
            parallel = deepspeed_plan(args.deepspeed_config, world_size=args.world_size, source="--deepspeed-config")
        elif args.world_size > 1 or sharding or any(offload.values()):
            parallel = ParallelPlan(args.world_size, check_plan(args.world_size, sharding, **offload),
                                    source="the command line", gradient_as_bucket_view=args.gradient_as_bucket_view,
                                    fsdp=hsdp, **offload)
        return Run(precision=args.precision, loop=Loop(accumulate=args.accumulate,
                                                       optimizer_impl=getattr(args, "optimizer_impl", None),
                                                       offload_activations=getattr(args, "offload_activations",
                                                                                   None)),
                   target=Target(device="cuda" if args.gpu else "cpu", gpu=args.gpu, budget=args.budget,
                                 allocator=args.allocator, cuda_context=args.cuda_context,
                                 nccl_buffers=getattr(args, "nccl_buffers", None)),
                   parallel=parallel, fast=args.fast, checkpoint=_checkpoint(args), loading=_loading(args))
    except (ValueError, TypeError) as err:
        raise UsageError(str(err).replace("pass sharding='fsdp2'", "pass --sharding fsdp2")) from None


def _given(args: argparse.Namespace, offload: dict[str, bool], *flags: str) -> list[str]:
    """Which of ``flags`` the command line gives (a parallel engine's refusals name them)."""
    given = {"--tp": getattr(args, "tp", None) is not None, "--pp": getattr(args, "pp", None) is not None,
             "--cp": getattr(args, "cp", None) is not None, "--deepspeed-config": bool(args.deepspeed_config),
             "--offload-optimizer": offload["offload_optimizer"], "--offload-params": offload["offload_params"],
             "--quantize": bool(getattr(args, "quantize", None)), "--generate": bool(getattr(args, "generate", False)),
             "--accumulate": args.accumulate != 1}
    return [flag for flag in flags if given[flag]]


def _loading(args: argparse.Namespace) -> Any:
    """The `preflight.Loading` ``--loading`` says (None without it)."""
    from preflight._loading import Loading

    placement = getattr(args, "loading", None)
    if placement is None:
        return None
    if getattr(args, "generate", False):
        raise UsageError("--loading describes a training run's loading; --generate plans generation alone.")
    return Loading("meta", from_rank0=True) if placement == "meta-rank0" else Loading(placement)


def _checkpoint(args: argparse.Namespace) -> Any:
    """The `preflight.Checkpoint` the ``--checkpoint`` flags say (None without ``--checkpoint``)."""
    from preflight._checkpoint import Checkpoint

    details = [flag for flag, given in (("--checkpoint-weights-only", getattr(args, "checkpoint_weights_only", False)),
                                        ("--checkpoint-on-device", getattr(args, "checkpoint_on_device", False)),
                                        ("--checkpoint-every-rank", getattr(args, "checkpoint_every_rank", False)))
               if given]
    kind = getattr(args, "checkpoint", None)
    if kind is None:
        if details:
            raise UsageError(f"{', '.join(details)} describe(s) a checkpoint save: add --checkpoint full (or "
                             "sharded).")
        return None
    if getattr(args, "generate", False):
        raise UsageError("--checkpoint describes a training run's saves; --generate plans generation alone.")
    return Checkpoint(optimizer=not args.checkpoint_weights_only, state_dict=kind,
                      offload_to_cpu=not args.checkpoint_on_device, rank0_only=not args.checkpoint_every_rank)


def _pp_plan(args: argparse.Namespace, sharding: str | None, offload: dict[str, bool]) -> Any:
    """The pipeline plan ``--pp`` says: transformers' own cut of the model, torch's schedule, the causal-LM loss;
    with ``--tp``, each stage laid out by the model's own tensor-parallel plan (torchtitan's PP x TP); with ``--cp``,
    the steps inside torch's ring."""
    from preflight.parallel import CPPlan, ParallelPlan, PPPlan, TPPlan, causal_lm_loss, split_transformers

    other = _given(args, offload, "--deepspeed-config", "--offload-optimizer", "--offload-params",
                   "--generate", "--accumulate")
    tp, cp = getattr(args, "tp", None), getattr(args, "cp", None)
    if args.pp < 2 or args.task != "causal-lm" or other or (tp is not None and tp < 1) or (cp is not None and cp < 1):
        raise UsageError(f"--pp {args.pp}: pipeline parallelism is planned for a causal-lm over at least 2 stage "
                         "ranks, alone or with --tp N, --cp N and --sharding fsdp2" +
                         (f"; not with {', '.join(other)}" if other else "") +
                         " (the schedule's micro-batches are its accumulation: --microbatches).")
    plan = PPPlan(args.pp, causal_lm_loss, schedule=args.schedule, microbatches=args.microbatches,
                  split=split_transformers)
    world = args.pp * (tp or 1) * (cp or 1) if args.world_size == 1 else args.world_size
    return ParallelPlan(world, sharding, pp=plan, tp=TPPlan(tp) if tp else None,
                        cp=CPPlan(cp, args.cp_rotate) if cp else None, source="the command line")


def _check_cut(model: Any, plan: Any) -> None:
    """Cut the meta model's first stage before any trace: a model transformers' cut does not fit is a usage error
    here, not a lower bound after the trace."""
    from preflight.parallel import fake_replica
    from preflight.parallel._rank import MetaTwins

    try:  # on a plain meta copy, as the trace cuts it: a deep copy of bitsandbytes' meta weights fails in bitsandbytes
        plan.stage_module(fake_replica(model, MetaTwins()), 0)
    except ValueError as err:
        raise UsageError(f"--pp {plan.stages}: {err}".replace("give the plan your own `split`",
                                                               "plan it in Python with your own split "
                                                               "(docs/pipeline-parallel.md)")) from None


def _microbatches(args: argparse.Namespace) -> int:
    """The pipeline's micro-batches per step: ``--microbatches``, or `PPPlan`'s default, one per stage rank (the
    step batch is built before the plan, so the default is said here too)."""
    return args.microbatches or args.pp


def _suggest(args: argparse.Namespace, model: Any, optimizer: Any, batch: Any, config: Any, budget: int | None,
             run: Any) -> list[dict[str, Any]]:
    """Ranked changes from `preflight.advise`, as the callbacks print them, each predicted under the flags' run (per
    rank under --world-size, --sharding, offload or --deepspeed-config), with the command that plans it where the
    flags can say it."""
    import dataclasses

    from preflight.advice import advise

    run = run.replace(target=dataclasses.replace(run.target, budget=budget))
    with _progress("ranking changes that would fit, alone and combined (--no-suggest skips this)"):
        found = advise(model, optimizer, batch, run, headroom=args.headroom,
                       make_batch=lambda b: _batch(args, config, batch_size=b))
    return [{**s.to_dict(), "command": _rerun_command(args, s.change)} for s in found]


def _rerun_command(args: argparse.Namespace, change: dict[str, Any]) -> list[str] | None:
    """``preflight estimate`` with ``args`` and the suggestion's ``change`` made, or None where a flag cannot say
    the change (a bitsandbytes optimizer the CLI does not build, a DeepSpeed config of its own)."""
    changed = argparse.Namespace(**vars(args))
    for key, value in change.items():
        if key in _CHANGE_FLAGS:
            setattr(changed, _CHANGE_FLAGS[key], value)
        elif key == "optimizer" and value in _OPTIMIZER_FLAGS and args.optimizer == "adamw":
            changed.optimizer = _OPTIMIZER_FLAGS[value]
        elif key == "zero_stage":
            changed.sharding = f"zero{value}"
        elif key not in _IMPLIED_CHANGES or _IMPLIED_CHANGES[key] not in change:
            return None
    if changed.deepspeed_config and any(k in change for k in ("sharding", "zero_stage", "offload_optimizer")):
        return None  # the stage and offload are the config's
    if changed.precision in _PRECISION_PARAM_DTYPE and "base_dtype" not in change:
        changed.param_dtype = None  # the precision casts the parameters
    return ["preflight", "estimate", *_flags(changed)]


def _flags(args: argparse.Namespace) -> list[str]:
    """The flags that say ``args`` (those that differ from the defaults), in the parser's order."""
    parser = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["estimate"]
    out: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", *_RERUN_SKIPS):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            out.append(flag)
        else:
            out += [flag, str(value)]
    return out


def _suggestions_text(suggestions: list[dict[str, Any]]) -> str:
    if not suggestions:
        return "what to change: preflight.advise found no change that lowers the peak"
    lines = ["what to change (ranked; predicted peak with the change):"]
    for i, s in enumerate(suggestions[:_TOP_SUGGESTIONS], 1):
        lines.append(f"  {i}. {'fits' if s['fits'] else 'still over'}: {s['description']}")
        if s.get("command"):
            lines.append(f"     rerun: {' '.join(s['command'])}")
    return "\n".join(lines)


def _inputs(args: argparse.Namespace, param_dtype: str, sharding: str | None,
            offload: dict[str, bool]) -> dict[str, Any]:
    return {"hf_config": os.path.abspath(args.hf_config), "task": args.task, "batch": args.batch, "seq": args.seq,
            "precision": args.precision, "param_dtype": param_dtype, "optimizer": args.optimizer,
            "lora": {"r": args.lora_r, "targets": args.lora_targets} if args.lora_r else None,
            "quantize": {"scheme": args.quantize, "double_quant": args.double_quant} if args.quantize else None,
            "checkpointing": args.checkpointing, "world_size": args.world_size, "sharding": sharding, **offload,
            "gradient_as_bucket_view": args.gradient_as_bucket_view, "tp": args.tp,
            "replicate": getattr(args, "replicate", 1), "fsdp_param_dtype": getattr(args, "fsdp_param_dtype", None),
            "pp": {"stages": args.pp, "schedule": args.schedule, "microbatches": _microbatches(args)}
            if args.pp else None,
            "deepspeed_config": args.deepspeed_config, "gpu": args.gpu, "budget": args.budget,
            "headroom": args.headroom, "fast": args.fast, "loading": getattr(args, "loading", None)}


def _versions() -> dict[str, str | None]:
    import platform
    from importlib import metadata

    import torch

    import preflight

    out: dict[str, str | None] = {"preflight": preflight.__version__, "python": platform.python_version(),
                                  "torch": torch.__version__}
    for dist in ("transformers", "peft", "bitsandbytes"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _sharding(args: argparse.Namespace) -> tuple[str | None, dict[str, bool]]:
    """The sharding and offload settings: the flags, or a DeepSpeed config's ZeRO section (a flag that says
    otherwise is a usage error)."""
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
        from preflight.parallel._deepspeed import deepspeed_settings

        try:
            sharding, offload = deepspeed_settings(ds, sharding, offload)
        except ValueError as err:
            raise UsageError(str(err).replace("`deepspeed_config`", "--deepspeed-config")) from None
    from preflight._estimate import check_plan

    try:
        planned = check_plan(args.world_size, sharding, **offload)
    except ValueError as err:
        text = str(err)  # in the options' own words
        for name in ("offload_params", "offload_optimizer", "world_size", "sharding"):
            flag = f"--{name.replace('_', '-')}"
            text = text.replace(f"set {name}=False", f"drop {flag}").replace(f"{name}=True", flag)
            text = text.replace(f"`{name}`", flag).replace(f"{name}=", f"{flag} ")
        raise UsageError(text) from None
    if getattr(args, "gradient_as_bucket_view", False) and planned != "ddp":
        raise UsageError(f"--gradient-as-bucket-view is DDP's option, but the plan is {planned or 'one device'} "
                         f"(--world-size {args.world_size}, --sharding {sharding}). Plan DDP (--world-size above 1, "
                         "--sharding ddp or none), or drop --gradient-as-bucket-view.")
    return sharding, offload


def _check_writable(option: str, path: str | None) -> None:
    """Raise a UsageError when ``path`` cannot be written (a missing folder, no permission, a folder itself)."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{option} {path!r} is a folder; give a file path, e.g. "
                         f"{os.path.join(path, 'estimate.json')!r}.")
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {path!r}: the folder {folder!r} does not exist. Create it first, or write "
                         "elsewhere.")
    existed = os.path.exists(path)
    try:  # the real test: permissions, read-only or special file systems (os.access says yes to root everywhere)
        with open(path, "a"):
            pass
    except OSError as err:
        raise UsageError(f"{option} {path!r} cannot be written: {err.strerror or err}. Choose another path.") from None
    if not existed:
        os.remove(path)  # written for real after the trace; nothing is left if the trace fails


def _verdict(required: int, budget: int | None, headroom: float, *, lower_bound: bool,
             phase: str | None = None) -> dict[str, Any]:
    """The verdict on ``required`` bytes (``phase``: the run's phase that needs them, when more than one was
    predicted)."""
    if budget is None:
        return {"fits": None, "budget_bytes": None, "usable_bytes": None,
                "text": "verdict: no budget (pass --gpu or --budget to get one)"}
    usable = usable_bytes(budget, headroom)
    fits: bool | None = required <= usable
    need = f"needs {format_bytes(required)}{' at least' if lower_bound else ''}{f' ({phase} peak)' if phase else ''} " \
           f"of {format_bytes(usable)} usable ({format_bytes(budget)} budget, {headroom:.0%} headroom)"
    if fits and lower_bound:  # a lower bound under the budget says nothing about the real peak
        fits = None
        text = f"verdict: NO VERDICT: the model could not be traced, and its lower bound {need}"
    else:
        text = f"verdict: {'FITS' if fits else 'DOES NOT FIT'}: {need}"
    return {"fits": fits, "budget_bytes": budget, "usable_bytes": usable, "text": text}


def _config(args: argparse.Namespace) -> Any:
    try:
        import transformers
    except ImportError as err:
        raise UsageError("`preflight estimate --hf-config` needs transformers: pip install transformers "
                         "(or, in your preflight clone, pip install -e '.[hf]')") from err
    config = _load_config(args.hf_config, transformers)
    _check_seq(args, config)
    return config


def _build(args: argparse.Namespace, config: Any, param_dtype: str) -> tuple[Any, Any, Any]:
    import torch
    import transformers

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
            # The dtype is ours to choose, not the config's: see _param_dtype.
            model = classes[args.task].from_config(config, dtype=getattr(torch, param_dtype))
    except Exception as err:  # noqa: BLE001 - whatever transformers raises building from the user's config is its error
        raise UsageError(f"cannot build a {args.task} model from {args.hf_config}: {_one_line(err)}") from None
    if args.quantize:
        model = _quantized(model, args)
    elif args.checkpointing:
        from preflight.advice._setup import enable_checkpointing

        enable_checkpointing(model)  # as advise switches it on: non-reentrant, under either name transformers has
    if args.lora_r:
        model = _lora(model, args)
    params: list = [p for p in model.parameters() if p.requires_grad]
    if getattr(args, "tp", None):
        # As transformers' Trainer groups them under tensor parallelism (one group per device mesh): torch's foreach
        # and fused steps refuse one list mixing the DTensors the plan lays out with the plain tensors it leaves.
        from preflight.parallel import TPPlan, laid_out_parameters

        try:
            laid = laid_out_parameters(model, TPPlan(args.tp))
        except ValueError:  # no plan of its own: the plan's refusal is said where the plan is traced
            laid = set()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [[p for n, p in named if n in laid], [p for n, p in named if n not in laid]]
        params = [{"params": g} for g in groups if g]
    optimizer = _optimizer(args.optimizer, params)
    return model, optimizer, _batch(args, config)


def _check_seq(args: argparse.Namespace, config: Any) -> None:
    if args.seq is None:
        return
    if args.seq < 1:
        raise UsageError(f"--seq should be at least 1, got {args.seq}.")
    for key in _MAX_POSITION_KEYS:
        limit = getattr(config, key, None)
        if isinstance(limit, int) and limit > 0 and args.seq > limit:
            raise UsageError(f"--seq {args.seq} is beyond the model's maximum positions: {key} = {limit} in "
                             f"{args.hf_config}. Pass --seq {limit} or less (or a config with a longer context).")


def _load_config(path: str, transformers: Any) -> Any:
    if not os.path.exists(path):
        raise UsageError(f"config not found: {path!r} (pass a local config.json or a folder holding one)")
    try:
        folder = os.path.isdir(path)
        if folder and not os.path.isfile(os.path.join(path, "config.json")):
            raise UsageError(f"{path!r} is a folder without a config.json; pass the config file itself.")
        with open(os.path.join(path, "config.json") if folder else path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or "model_type" not in data:
            raise UsageError(f"{path} has no `model_type`; transformers needs it to pick the model class")
        _check_model_type(path, data["model_type"], transformers)
        if folder:
            config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        else:
            config = transformers.AutoConfig.for_model(**data)
    except UsageError:
        raise
    except Exception as err:  # noqa: BLE001 - a config transformers refuses (a field's type, a failed validator)
        raise UsageError(f"cannot read the config {path!r}: {_one_line(err)}") from None
    _check_sizes(path, config)
    return config


def _one_line(err: BaseException) -> str:
    """``err`` as one line: its message's lines joined (huggingface_hub's validation errors name the field on the
    first line and say what is wrong on the next), with the exception's type where the message alone is a key."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    if isinstance(err, KeyError):
        import traceback

        frames = traceback.extract_tb(err.__traceback__)
        where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
        text = f"no entry {text}{where}: check the config's values for {text}"
    return text[:400]


def _check_model_type(path: str, model_type: Any, transformers: Any) -> None:
    """An unknown ``model_type``: the closest names transformers knows, not all of them."""
    import difflib

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    known = list(CONFIG_MAPPING_NAMES)
    if model_type in known:
        return
    close = difflib.get_close_matches(str(model_type), known, n=5, cutoff=0.5)
    hint = f"the closest it knows: {', '.join(close)}" if close else \
        f"it knows {len(known)} types, e.g. llama, gpt2, bert, t5, mistral"
    raise UsageError(f"{path}: model_type {model_type!r} is not a model type transformers "
                     f"{transformers.__version__} knows; {hint}.")


# Config sizes that must be positive (counts of layers may be 0, never negative).
_POSITIVE = re.compile(r"^(.*_size|.*_dim|d_model|d_ff|d_kv|n_embd|n_head|n_inner|n_positions|n_ctx|"
                       r"num_attention_heads|num_key_value_heads|num_heads|max_position_embeddings)$")
_COUNTS = re.compile(r"^(num_.*layers|n_layers?|num_layers|encoder_layers|decoder_layers)$")


def _check_sizes(path: str, config: Any) -> None:
    """A size or layer count in the config that no model can have (``n_layer=-1``, ``hidden_size=0``)."""
    for key, value in sorted(config.to_dict().items()):
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if (_POSITIVE.match(key) and value < 1) or (_COUNTS.match(key) and value < 0):
            least = 1 if _POSITIVE.match(key) else 0
            raise UsageError(f"{path}: {key} = {value}, but it should be at least {least}. Fix the config.")


def _quantized(model: Any, args: argparse.Namespace) -> Any:
    """The model as a QLoRA / LLM.int8 recipe loads it: quantized by transformers' bitsandbytes quantizer, then
    peft's ``prepare_model_for_kbit_training`` (the other weights in fp32, checkpointing as it enables it)."""
    import torch

    from preflight._quantize import bnb_config, quantize_on_meta
    from preflight._quiet import quiet_import_logs
    from preflight._steps import half_dtype

    compute = half_dtype(args.precision) or torch.float32
    try:
        with quiet_import_logs("bitsandbytes"):
            import bitsandbytes  # noqa: F401
            import peft
    except ImportError as err:
        raise UsageError(f"--quantize needs bitsandbytes and peft ({err}): pip install bitsandbytes peft") from err
    quantize_on_meta(model, bnb_config(args.quantize, compute_dtype=compute, double_quant=args.double_quant))
    return peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.checkpointing)


def _lora(model: Any, args: argparse.Namespace) -> Any:
    from preflight._quiet import quiet_import_logs

    try:
        with quiet_import_logs("bitsandbytes"):  # peft imports bitsandbytes where installed: not the user's import
            import peft
    except ImportError as err:
        raise UsageError("--lora-r needs peft: pip install peft (or, in your preflight clone, "
                         "pip install -e '.[hf]')") from err
    targets = args.lora_targets if args.lora_targets == "all-linear" else \
        [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    if targets != "all-linear":
        import torch

        names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear)})
        unknown = ", ".join(t for t in targets if t not in names)
        if unknown or not targets:
            raise UsageError(f"--lora-targets {args.lora_targets!r}: no linear layer named {unknown or 'so'} in "
                             f"this model. Its linear layers: {', '.join(names)} (or use all-linear).")
    return peft.get_peft_model(model, peft.LoraConfig(r=args.lora_r, target_modules=targets))


def _optimizer(name: str, params: list) -> Any:
    import torch

    if name in _BNB_OPTIMIZERS:
        from preflight._quiet import quiet_import_logs

        try:
            with quiet_import_logs("bitsandbytes"):  # its CPU build logs a missing optional kernel package
                import bitsandbytes as bnb
        except ImportError as err:
            raise UsageError(f"--optimizer {name} needs bitsandbytes: pip install bitsandbytes (or, in your "
                             "preflight clone, pip install -e '.[bnb]')") from err
        return getattr(bnb.optim, _BNB_OPTIMIZERS[name])(params, lr=1e-4)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2)
    return torch.optim.AdamW(params, lr=1e-4)


def _batch(args: argparse.Namespace, config: Any, batch_size: int | None = None) -> Any:
    import torch

    from preflight._device import planned

    # On the meta device: a planned batch takes no host memory, however large (`preflight._device.planned`).
    b = batch_size or args.batch
    if args.task == "image-cls":
        size = getattr(config, "image_size", 224)
        size = size if isinstance(size, int) else size[0]
        channels = getattr(config, "num_channels", 3)
        return {"pixel_values": planned((b, channels, size, size), torch.float32, 0.0),
                "labels": planned((b,), torch.long, 0)}
    if args.seq is None:
        raise UsageError(f"--seq is required for the {args.task} task")
    if getattr(args, "pp", None):  # the pipeline's step batch, (inputs, target), cut into micro-batches by torch
        ids = planned((b * _microbatches(args), args.seq), torch.long, 0)
        return (ids, ids)
    ids = planned((b, args.seq), torch.long, 0)
    if getattr(args, "cp", None):  # torch's ring attends causally without a mask; the labels are a tensor of their own
        return {"input_ids": ids, "labels": planned((b, args.seq), torch.long, 0)}
    batch = {"input_ids": ids, "attention_mask": planned((b, args.seq), torch.long, 1)}
    if args.task == "seq-cls":
        batch["labels"] = planned((b,), torch.long, 0)
    else:
        batch["labels"] = ids
    return batch


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
    if args.timeout is not None and not 0 < args.timeout < float("inf"):
        raise UsageError(f"--timeout should be a positive number of seconds, got {args.timeout}.")
    with tempfile.TemporaryDirectory(prefix="preflight-") as tmp:
        report_path = os.path.join(tmp, "report.json")
        env = dict(os.environ, PREFLIGHT_DRY_RUN="1", PREFLIGHT_REPORT=report_path)
        # --gpu plans for that GPU and its memory, replacing a budget= written in the script (--budget narrows it).
        budget = args.budget if args.budget is not None or args.gpu is None else _budget(args)
        for key, value in (("PREFLIGHT_GPU", args.gpu), ("PREFLIGHT_BUDGET", budget),
                           ("PREFLIGHT_WORLD_SIZE", args.world_size if args.world_size > 1 else None),
                           ("PREFLIGHT_SHARDING", args.sharding), ("PREFLIGHT_HEADROOM", args.headroom),
                           ("PREFLIGHT_FAST", None if args.fast else "0"),
                           ("PREFLIGHT_SUGGEST", None if args.suggest else "0")):
            if value is not None:  # a number of bytes says its unit: a bare number is refused as a size
                env[key] = f"{value}B" if key == "PREFLIGHT_BUDGET" and isinstance(value, int) else str(value)
        code = _run_child(command, env, args.timeout, report_path)
        if code in (EXIT_TIMEOUT, *_SIGNAL_EXITS):
            return code
        report = None
        if os.path.exists(report_path):
            with open(report_path) as f:
                try:
                    report = json.load(f)
                except json.JSONDecodeError:  # the script died while writing it
                    print(f"preflight: the report {report_path} is not complete JSON.", file=sys.stderr)
    return _decide(report, code)


def _run_child(command: list[str], env: dict[str, str], timeout: float | None, report_path: str) -> int:
    """Run the user's script in its own session (so its process group is its own: a launcher's workers too) and
    return its exit status; SIGINT, SIGTERM and SIGHUP sent to ``preflight check`` are passed on to that group.
    After a passed-on signal, or past ``timeout`` (then SIGTERM), the group gets `_GRACE_SECONDS` to exit before
    SIGKILL, and the status returned is 128 + the signal's number, or `EXIT_TIMEOUT`.

    The script's standard error is passed through as it comes until the report is written; what it prints after
    (a launcher's traceback for a rank's exit 3, when the exit status is the point) goes to a log file, named in one
    line, and only preflight's own lines of it are shown (`_ErrorPump`)."""
    reaper = _become_subreaper()
    ours = set(_orphans()) if reaper else set()  # children this process had before: not the script's
    try:
        child = subprocess.Popen(command, env=env, start_new_session=True, stderr=subprocess.PIPE)
    except FileNotFoundError:
        raise UsageError(f"command not found: {command[0]!r}") from None
    except PermissionError:
        raise UsageError(f"cannot run {command[0]!r}: permission denied (it is not executable). Make it "
                         f"executable (chmod +x {command[0]}) or run it through its interpreter, e.g. "
                         f"`preflight check -- python {command[0]}`.") from None
    except OSError as err:
        raise UsageError(f"cannot run {command[0]!r}: {err.strerror or err}. Run it through its interpreter, "
                         f"e.g. `preflight check -- python {command[0]}`.") from None
    pump = _ErrorPump(child, report_path)
    received: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        _signal_group(child.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        try:
            code = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"preflight check: the script did not finish within --timeout {timeout:g} s; stopping it "
                  f"(exit status {EXIT_TIMEOUT}).", file=sys.stderr, flush=True)
            _stop_group(child, signal.SIGTERM)
            return EXIT_TIMEOUT
        if received:
            _stop_group(child, received[0])
            return 128 + received[0]
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop_leftovers(child, reaper, ours)
        pump.finish()


class _ErrorPump:
    """Copy the script's standard error to ours as it comes (chunks, so progress bars' carriage returns pass at
    once) until ``report_path`` exists; after that, hold it back. `finish` shows preflight's own held-back lines and
    names the log file that has all the script's standard error, when anything was held back."""

    def __init__(self, child: subprocess.Popen, report_path: str) -> None:
        import threading

        self.child, self.report_path = child, report_path
        self.held: list[bytes] = []
        self.everything: list[bytes] = []
        self.thread = threading.Thread(target=self._pump, name="preflight-check-stderr", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        fd = self.child.stderr.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            self.everything.append(chunk)
            if self.held or os.path.exists(self.report_path):
                self.held.append(chunk)
            else:
                _write_stderr(chunk)

    def finish(self) -> None:
        self.thread.join(timeout=5)
        self.child.stderr.close()
        if not self.held:
            return
        text = b"".join(self.held).decode(errors="replace")
        ours = [line for line in text.splitlines() if line.startswith("preflight")]
        others = [line for line in text.splitlines() if line.strip() and not line.startswith("preflight")]
        for line in ours:
            print(line, file=sys.stderr)
        if others:
            fd, log = tempfile.mkstemp(prefix="preflight-check-", suffix=".log")
            with os.fdopen(fd, "wb") as f:
                f.write(b"".join(self.everything))
            # The last line that is not a traceback's indented frame: usually the error itself.
            last = next((line for line in reversed(others) if not line[:1].isspace()), others[-1])
            print(f"preflight check: the script printed {len(others)} more line(s) on stderr after the report was "
                  f"written (last: {last.strip()[:120]!r}); its whole stderr is in {log}", file=sys.stderr,
                  flush=True)


def _write_stderr(chunk: bytes) -> None:
    buffer = getattr(sys.stderr, "buffer", None)
    if buffer is not None:
        buffer.write(chunk)
        buffer.flush()
    else:
        sys.stderr.write(chunk.decode(errors="replace"))
        sys.stderr.flush()


def _become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``), so that a
    process the script daemonized (forked twice, in a session of its own, out of reach of the group's signals)
    comes back to ``preflight check`` when its parent exits, and can be stopped. False where that is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _stop_leftovers(child: subprocess.Popen, reaper: bool, ours: set[int]) -> None:
    """Stop whatever the script left running once it has exited: its process group, and with ``reaper`` every
    orphaned descendant (daemonized ones included), SIGTERM then, after `_GRACE_SECONDS`, SIGKILL; say so."""
    if child.poll() is None:
        return  # still running: the caller's signal handling has not finished with it
    _signal_group(child.pid, signal.SIGTERM)

    def left() -> list[int]:
        return [pid for pid in _orphans() if pid not in ours] if reaper else []

    orphans = left()
    for pid in orphans:
        _signal_pid(pid, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_SECONDS
    while left() and time.monotonic() < deadline:
        _reap(orphans)
        time.sleep(0.05)
    for pid in left():
        _signal_pid(pid, signal.SIGKILL)
    _signal_group(child.pid, signal.SIGKILL)
    time.sleep(0.05)
    _reap(orphans)
    if orphans:
        print(f"preflight check: stopped {len(orphans)} process(es) the script left running after it exited "
              f"(pid {', '.join(map(str, orphans[:5]))}).", file=sys.stderr, flush=True)


def _orphans() -> list[int]:
    """The processes whose parent is this one (orphans re-parented here by `_become_subreaper`), not reaped yet."""
    me, found = os.getpid(), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            found.append(int(entry))
    return found


def _reap(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def _signal_pid(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_group(child: subprocess.Popen, signum: int) -> None:
    """Send ``signum`` to the child's group, give it `_GRACE_SECONDS`, then SIGKILL whatever of the group is left."""
    _signal_group(child.pid, signum)
    try:
        child.wait(timeout=_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(child.pid, signal.SIGKILL)
    child.wait()


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass


def _decide(report: dict[str, Any] | None, child_status: int) -> int:
    """The exit status from the report the dry run wrote, never from the child's own status.

    A launcher (``accelerate launch``, ``torchrun``) turns a rank's exit 3 into its own failure status, and a script
    may catch ``SystemExit`` or fail after the report is written: the report is what the prediction said.
    """
    status = _status_text(child_status)
    if report is None:
        print(f"preflight: no preflight report was written: the script {status} without reaching a preflight "
              "check. Add the callback (preflight.integrations.lightning / .hf) or call preflight.check(...) "
              "before training; if it crashed, its own output above says why.", file=sys.stderr)
        return EXIT_USAGE
    if report.get("step_would_fail"):
        print(f"preflight: THE STEP WOULD FAIL (the script {status}): {report['step_would_fail']}", file=sys.stderr)
        return EXIT_STEP_FAILS
    fits = report.get("fits")
    peaks = report.get("rank_predicted_peak_bytes") or []
    failed = [rank for rank, peak in enumerate(peaks) if peak is None]
    if fits is False:
        word, code = "DOES NOT FIT", EXIT_DOES_NOT_FIT
    elif failed:
        word, code = f"NO VERDICT (the prediction failed on rank(s) {', '.join(map(str, failed))})", EXIT_NO_VERDICT
    elif fits is True:
        word, code = "FITS", EXIT_FITS
    elif report.get("budget_bytes") is not None:
        word, code = "NO VERDICT (the prediction is a lower bound under the budget)", EXIT_NO_VERDICT
    else:
        word, code = "NO BUDGET (pass --gpu or --budget)", EXIT_FITS
    print(f"preflight check: {word}: {_figure_text(report)}")
    # What a dry run exits with on its own for this verdict (1: a rank's prediction failed).
    expected = {EXIT_FITS: (EXIT_FITS,), EXIT_DOES_NOT_FIT: (EXIT_DOES_NOT_FIT,),
                EXIT_NO_VERDICT: (EXIT_NO_VERDICT, 1)}[code]
    if child_status not in expected:
        print(f"preflight: the script {status} after writing its report; the verdict above is the report's.",
              file=sys.stderr)
    return code


def _figure_text(report: dict[str, Any]) -> str:
    """The figure the verdict compared with the usable budget, named as the report's table names it."""
    peak = report.get("predicted_peak_bytes")
    total = report.get("predicted_device_total_bytes")
    eval_peak = report.get("eval_predicted_peak_bytes")
    eval_total = report.get("eval_predicted_device_total_bytes")
    required = report.get("predicted_required_bytes") or (total if total is not None else peak)
    if eval_total is not None and required == eval_total and eval_total > (total or 0):
        text = (f"evaluation device total {format_bytes(eval_total)} (evaluation peak {format_bytes(eval_peak)}; "
                f"training device total {format_bytes(total)})")
    elif eval_peak is not None and required == eval_peak and eval_peak > (total if total is not None else peak or 0):
        text = f"evaluation peak {format_bytes(eval_peak)} (training peak {format_bytes(peak)})"
    elif total is not None:
        text = (f"device total {format_bytes(total)} (reserved + CUDA context + workspaces; allocated peak "
                f"{format_bytes(peak)})")
    else:
        text = f"allocated peak {format_bytes(peak)}"
    usable, budget = report.get("usable_bytes"), report.get("budget_bytes")
    if budget is None:
        return text
    if usable is None:
        return f"{text} against a budget of {format_bytes(budget)}"
    return f"{text} against {format_bytes(usable)} usable ({format_bytes(budget)} budget, " \
           f"{report.get('headroom', 0):.0%} headroom)"


def _status_text(status: int) -> str:
    if status < 0:  # subprocess reports death by signal N as -N
        import signal

        try:
            return f"was killed by signal {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
