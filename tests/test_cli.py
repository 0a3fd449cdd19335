"""The `preflight` command: exit codes 0 (fits), 3 (does not fit), 2 (bad input); JSON; dry-run of a script."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
from pathlib import Path
import sys
import textwrap

import pytest

from preflight._cli import main

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
              "max_position_embeddings": 256}


@pytest.fixture()
def config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


def run_cli(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "preflight", *args], capture_output=True, text=True, **kwargs)


@pytest.mark.slow
def test_estimate_exit_codes_fit_and_overflow(config, tmp_path):
    out = tmp_path / "est.json"
    fits = run_cli("estimate", "--hf-config", config, "--batch", "2", "--seq", "64", "--budget", "1GiB",
                   "--json", str(out))
    assert fits.returncode == 0, fits.stderr
    assert "FITS" in fits.stdout and "parameters" in fits.stdout
    assert "tracing 2 training steps" in fits.stderr  # progress is reported while it works
    report = json.loads(out.read_text())
    assert report["fits"] is True and report["budget_bytes"] == 2**30
    assert report["peak_bytes"] == sum(report["breakdown"].values())

    too_small = run_cli("estimate", "--hf-config", config, "--batch", "2", "--seq", "64", "--budget", "1MiB",
                        "--no-suggest")  # the suggestions' own tests search them
    assert too_small.returncode == 3
    assert "DOES NOT FIT" in too_small.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpu", "H1000"], "Known GPUs|known"),
        (["--budget", "12 GB?"], "Cannot read"),
        (["--budget", "80"], r"--budget: '80' has no unit\. Did you mean 80GB or 80GiB\?"),
        (["--hf-config", "/no/such/config.json"], "config not found"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(config, capsys, args, message):
    base = ["estimate", "--hf-config", config, "--batch", "2", "--seq", "64"]
    if args[0] == "--hf-config":
        base[2] = args[1]
        args = []
    assert main(base + args) == 2
    err = capsys.readouterr().err
    assert pytest.importorskip("re").search(message, err), err


def test_unknown_option_exits_2():
    result = run_cli("estimate", "--hf-config", "x.json", "--batch", "2", "--frobnicate")
    assert result.returncode == 2
    assert "unrecognized arguments: --frobnicate" in result.stderr


def test_gpu_target_with_sharding_in_json(config, tmp_path, capsys):
    out = tmp_path / "est.json"
    code = main(["estimate", "--hf-config", config, "--batch", "2", "--seq", "64", "--gpu", "A100-80GB",
                 "--world-size", "8", "--sharding", "zero3", "--precision", "bf16-mixed", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["gpu"] == "A100-80GB" and report["world_size"] == 8 and report["sharding"] == "zero3"
    assert report["device_total_bytes"] > report["peak_reserved_bytes"] >= report["peak_bytes"]
    assert report["usable_bytes"] == int(report["budget_bytes"] * 0.9)


def test_a_planned_step_that_would_fail_exits_5_with_the_reason(monkeypatch, capsys):
    from preflight import StepWouldFailError
    from preflight import _cli

    def failing(args):
        raise StepWouldFailError("a foreach step over DTensors and plain tensors. Fix: foreach=False")

    monkeypatch.setattr(_cli, "_estimate", failing)
    assert main(["estimate", "--hf-config", "c.json", "--batch", "1"]) == 5
    assert "THE STEP WOULD FAIL: a foreach step over DTensors and plain tensors. Fix:" in capsys.readouterr().err


def test_check_without_a_command_is_a_usage_error(capsys):
    assert main(["check", "--gpu", "H100-80GB"]) == 2
    assert "after --" in capsys.readouterr().err


def test_check_reports_a_script_that_never_reaches_preflight(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("print('training without preflight')\n")
    assert main(["check", "--", sys.executable, str(script)]) == 2
    assert "without reaching a preflight check" in capsys.readouterr().err


def test_check_no_suggest_reaches_the_scripts_checks_through_the_environment():
    from preflight._dryrun import settings_from_env
    from preflight.verdict import Options
    from preflight.verdict._predict import _with_environment

    assert settings_from_env({}).suggest and not settings_from_env({"PREFLIGHT_SUGGEST": "0"}).suggest
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PREFLIGHT_SUGGEST", "0")
        assert _with_environment(Options(suggest=True))[0].suggest is False
    assert _with_environment(Options(suggest=True))[0].suggest is True


@pytest.mark.slow
def test_check_propagates_the_dry_run_verdict(tmp_path):
    # A script that finishes its dry run the way the callbacks do: report, then exit 0 or 3.
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os
        from preflight._dryrun import finish, settings_from_env
        s = settings_from_env()
        assert s.dry_run and s.gpu == "A100-80GB" and s.world_size == 4
        need = int(os.environ["NEED"])
        finish({"fits": need < 100, "predicted_peak_bytes": need, "budget_bytes": 100}, need < 100)
        raise SystemExit("training ran in a dry run")
    """))
    for need, code in ((10, 0), (1000, 3)):
        result = run_cli("check", "--gpu", "A100-80GB", "--world-size", "4", "--", sys.executable, str(script),
                         env={**__import__("os").environ, "NEED": str(need)})
        assert result.returncode == code, result.stderr
        assert ("DOES NOT FIT" in result.stdout) == (code == 3)


@pytest.mark.slow
@pytest.mark.parametrize("budget, code", [("4GiB", 0), ("100MiB", 3)])
def test_check_dry_runs_an_example_script(budget, code):
    # The example's own check honours the dry run: it predicts, reports and exits before training. Over budget,
    # --no-suggest exits at the verdict without ranking changes (tests/advice search them).
    example = str(__import__("pathlib").Path(__file__).parents[1] / "examples" / "accelerate_loop.py")
    result = run_cli("check", "--budget", budget, "--no-suggest", "--", sys.executable, example)
    assert result.returncode == code, result.stderr[-2000:]
    assert ("DOES NOT FIT" in result.stdout) == (code == 3)
    assert "measured" not in result.stdout  # it stopped before step one: nothing was trained or verified
    assert "predicting what to change" not in result.stderr and "suggestion" not in result.stdout


@pytest.mark.slow
def test_options_for_lora_checkpointing_optimizer_and_task(config, tmp_path):
    base = ["estimate", "--hf-config", config, "--batch", "2", "--seq", "64"]
    full, lora, ckpt, sgd, cls, off, gpu = (tmp_path / f"{n}.json"
                                            for n in ("full", "lora", "ckpt", "sgd", "cls", "off", "gpu"))
    assert main(base + ["--json", str(full)]) == 0
    assert main(base + ["--lora-r", "4", "--lora-targets", "q_proj,v_proj", "--json", str(lora)]) == 0
    assert main(base + ["--checkpointing", "--json", str(ckpt)]) == 0
    assert main(base + ["--optimizer", "sgd", "--json", str(sgd)]) == 0
    assert main(base + ["--task", "seq-cls", "--json", str(cls)]) == 0
    assert main(base + ["--gpu", "A100-80GB", "--json", str(gpu)]) == 0
    assert main(base + ["--gpu", "A100-80GB", "--offload-activations", "streams", "--json", str(off)]) == 0
    full, lora, ckpt, sgd, cls, off, gpu = (json.loads(p.read_text()) for p in (full, lora, ckpt, sgd, cls, off, gpu))
    assert off["breakdown"]["activations"] < gpu["breakdown"]["activations"]  # saved activations left the device
    assert off["run"]["loop"]["offload_activations"] == "streams" and gpu["run"]["loop"]["offload_activations"] is None
    assert lora["breakdown"]["optimizer_state"] < full["breakdown"]["optimizer_state"] / 10  # adapters only
    assert ckpt["peak_bytes"] < full["peak_bytes"]
    assert sgd["breakdown"]["optimizer_state"] < full["breakdown"]["optimizer_state"]  # momentum: 1 state, not 2
    assert cls["coverage"]["traced"] and cls["peak_bytes"] < full["peak_bytes"]  # no vocabulary-sized logits


def test_deepspeed_config_sets_stage_and_offload(config, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}))
    out = tmp_path / "est.json"
    assert main(["estimate", "--hf-config", config, "--batch", "2", "--seq", "64", "--gpu", "A100-80GB",
                 "--world-size", "4", "--deepspeed-config", str(ds), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["sharding"] == "zero3" and report["breakdown"]["optimizer_state"] == 0
    # Its gradient reduction buffer (DeepSpeed's default size, fp32) is the communication term; a flag that says
    # otherwise than the config is refused with exit code 2.
    assert report["breakdown"]["communication"] >= 500_000_000 * 4
    assert main(["estimate", "--hf-config", config, "--batch", "2", "--seq", "64", "--world-size", "4",
                 "--deepspeed-config", str(ds), "--sharding", "zero2"]) == 2


def test_a_lower_bound_under_the_budget_is_no_verdict(tmp_path, capsys, monkeypatch):
    # A forward that branches on a value computed from parameters: the trace stops, a lower bound remains.
    from transformers.models.llama import modeling_llama

    forward = modeling_llama.LlamaMLP.forward

    def branching_forward(self, x):
        out = forward(self, x)
        return out * 2 if out.sum() > 0 else out

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", branching_forward)
    path = tmp_path / "llama.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "vocab_size": 1000}))
    with pytest.warns(RuntimeWarning, match="lower bound"):
        code = main(["estimate", "--hf-config", str(path), "--batch", "2", "--seq", "32", "--budget", "1GiB"])
    assert code == 4
    assert "NO VERDICT" in capsys.readouterr().out


# ---- issue 10, item 4: the CLI says what it assumed -----------------------------------------------------------

@pytest.fixture()
def fp16_config(tmp_path):
    # Like Llama-2-7B's published config: it names float16, which says how the weights were saved, not how
    # mixed-precision training keeps them.
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, "torch_dtype": "float16"}))
    return str(path)


def _tiny_llama_parameters():
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**TINY_LLAMA))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("extra, dtype, itemsize, warns", [
    (["--precision", "bf16-mixed"], "float32", 4, True),  # mixed precision keeps fp32 master weights
    ([], "float32", 4, True),
    (["--precision", "bf16-mixed", "--param-dtype", "float16"], "float16", 2, False),
    (["--precision", "bf16-true"], "bfloat16", 2, False),  # it casts whatever the weights load in
])
def test_parameter_dtype_follows_the_precision_not_the_config(fp16_config, tmp_path, capsys, extra, dtype,
                                                              itemsize, warns):
    out = tmp_path / "est.json"
    assert main(["estimate", "--hf-config", fp16_config, "--batch", "2", "--seq", "32", "--json", str(out)]
                + extra) == 0
    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    n = _tiny_llama_parameters()
    assert report["parameters"] == {"count": n, "trainable": n, "dtypes": {dtype: n}}
    assert report["inputs"]["param_dtype"] == dtype
    assert report["breakdown"]["parameters"] == n * itemsize
    assert f"parameters: {n:,} ({n:,} trainable)" in captured.out
    assert f"parameters in {dtype}" in captured.out
    assert ("says dtype float16" in captured.err) == warns
    assert bool(report["warnings"]) == warns


def test_a_config_that_names_dtype_is_not_read_through_its_deprecated_torch_dtype():
    # transformers >= 4.56 logs "`torch_dtype` is deprecated! Use `dtype` instead!" on every read of torch_dtype:
    # a config with dtype (None: not named) is read through it alone; an older one through torch_dtype.
    from preflight._cli import _config_dtype_warnings

    class New:
        dtype = None

        @property
        def torch_dtype(self):
            raise AssertionError("torch_dtype read")

    class Old:
        torch_dtype = "float16"

    args = argparse.Namespace(param_dtype=None, precision=None, hf_config="c.json")
    assert _config_dtype_warnings(args, New(), "float32", "the default") == []
    assert "says dtype float16" in _config_dtype_warnings(args, Old(), "float32", "the default")[0]


def test_param_dtype_that_contradicts_a_true_precision_is_a_usage_error(config, capsys):
    code = main(["estimate", "--hf-config", config, "--batch", "2", "--seq", "32", "--precision", "bf16-true",
                 "--param-dtype", "float16"])
    assert code == 2
    assert "--param-dtype bfloat16" in capsys.readouterr().err


def test_fsdp2_world_size_prints_and_records_each_rank(config, tmp_path, capsys):
    out = tmp_path / "est.json"
    assert main(["estimate", "--hf-config", config, "--batch", "2", "--seq", "16", "--world-size", "2",
                 "--sharding", "fsdp2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "per rank (fsdp2, 2 ranks; rank 0 peaks):" in printed and "rank 1:" in printed
    report = json.loads(out.read_text())
    assert report["sharding"] == "fsdp2" and report["peak_rank"] == 0
    assert len(report["per_rank_peak_bytes"]) == 2 and report["peak_bytes"] == max(report["per_rank_peak_bytes"])
    assert report["breakdown"]["communication"] > 0


def test_replicate_plans_fsdp2_hybrid_sharding_per_rank(config, tmp_path, capsys):
    """--replicate R: FSDP2's HSDP (R groups of world/R ranks sharding the model); a rank holds a larger shard than
    under FSDP2 over every rank, the same as FSDP2 over world/R ranks."""
    figures = {}
    for name, flags in (("hsdp 2x2", ["--world-size", "4", "--replicate", "2"]), ("fsdp2 x4", ["--world-size", "4"]),
                        ("fsdp2 x2", ["--world-size", "2"])):
        out = tmp_path / f"{name}.json"
        assert main(["estimate", "--hf-config", config, "--batch", "2", "--seq", "16", "--sharding", "fsdp2",
                     *flags, "--json", str(out)]) == 0
        report = json.loads(out.read_text())
        figures[name] = report["per_rank_peak_bytes"]
        if name == "hsdp 2x2":
            assert report["inputs"]["replicate"] == 2 and len(figures[name]) == 4
    capsys.readouterr()
    assert figures["hsdp 2x2"][0] == figures["fsdp2 x2"][0] > figures["fsdp2 x4"][0]
    assert main(["estimate", "--hf-config", config, "--batch", "2", "--seq", "16", "--world-size", "4",
                 "--replicate", "2"]) == 2
    assert "--replicate 2: FSDP2's hybrid sharding" in capsys.readouterr().err


def test_fsdp_param_dtype_plans_fsdp2s_policy_and_is_suggested_under_autocast(config, tmp_path, capsys,
                                                                               monkeypatch):
    """--fsdp-param-dtype: FSDP2 casts the parameters it gathers (MixedPrecisionPolicy), freed at each reshard, where
    bf16-mixed alone leaves every gathered parameter's cast in autocast's cache through the forward; a run over
    budget by that is told the flag, and the command it prints exits 0."""
    from conftest import only_options

    only_options(monkeypatch, "FSDP2 parameter dtype")
    flags = ["--hf-config", config, "--batch", "2", "--seq", "16", "--world-size", "2", "--sharding", "fsdp2",
             "--precision", "bf16-mixed", "--headroom", "0"]
    figures = {}
    for name, extra in (("autocast", []), ("policy", ["--fsdp-param-dtype", "bfloat16"])):
        out = tmp_path / f"{name}.json"
        assert main(["estimate", *flags, *extra, "--json", str(out)]) == 0
        report = json.loads(out.read_text())
        figures[name] = report["required_bytes"]
    assert json.loads((tmp_path / "policy.json").read_text())["inputs"]["fsdp_param_dtype"] == "bfloat16"
    assert "gathering bfloat16 parameters (MixedPrecisionPolicy)" in capsys.readouterr().out
    assert figures["policy"] < figures["autocast"]
    budget = (figures["policy"] + figures["autocast"]) // 2
    assert main(["estimate", *flags, "--budget", f"{budget}B", "--json", str(tmp_path / "over.json")]) == 3
    first = json.loads((tmp_path / "over.json").read_text())["suggestions"][0]
    command = first["command"]
    assert first["fits"] and command[command.index("--fsdp-param-dtype") + 1] == "bfloat16"
    capsys.readouterr()
    assert main(first["command"][1:]) == 0
    assert main(["estimate", "--hf-config", config, "--batch", "2", "--seq", "16", "--fsdp-param-dtype",
                 "bfloat16"]) == 2
    assert "--fsdp-param-dtype bfloat16: FSDP2's parameter dtype is planned with --sharding fsdp2" in \
        capsys.readouterr().err


def test_json_records_the_inputs_and_versions(config, tmp_path):
    import torch

    import preflight

    out = tmp_path / "est.json"
    assert main(["estimate", "--hf-config", config, "--batch", "3", "--seq", "16", "--precision", "bf16-mixed",
                 "--optimizer", "sgd", "--lora-r", "4", "--world-size", "2", "--sharding", "zero2",
                 "--gpu", "A100-80GB", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    inputs = report["inputs"]
    assert inputs["hf_config"] == str(pytest.importorskip("pathlib").Path(config).resolve())
    assert (inputs["batch"], inputs["seq"], inputs["precision"], inputs["optimizer"]) == (3, 16, "bf16-mixed", "sgd")
    assert inputs["lora"] == {"r": 4, "targets": "all-linear"}
    assert (inputs["world_size"], inputs["sharding"], inputs["gpu"]) == (2, "zero2", "A100-80GB")
    assert report["versions"]["preflight"] == preflight.__version__
    assert report["versions"]["torch"] == torch.__version__
    assert 0 < report["parameters"]["trainable"] < report["parameters"]["count"]  # LoRA adapters only


def test_seq_beyond_the_models_positions_is_rejected(config, capsys):
    assert main(["estimate", "--hf-config", config, "--batch", "2", "--seq", "257"]) == 2
    err = capsys.readouterr().err
    assert "--seq 257" in err and "max_position_embeddings = 256" in err and "--seq 256 or less" in err


def test_version(capsys):
    import preflight

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"preflight {preflight.__version__}"


@pytest.mark.slow
def test_ranked_suggestions_when_it_does_not_fit_unless_no_suggest(config, tmp_path, capsys):
    out = tmp_path / "est.json"
    base = ["estimate", "--hf-config", config, "--batch", "2", "--seq", "32", "--budget", "4MiB"]
    assert main(base + ["--json", str(out)]) == 3
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert "what to change (ranked" in printed and report["suggestions"]
    assert report["suggestions"][0]["description"] in printed
    assert any(s["fits"] for s in report["suggestions"])

    assert main(base + ["--no-suggest", "--json", str(out)]) == 3
    assert "what to change" not in capsys.readouterr().out
    assert json.loads(out.read_text())["suggestions"] == []


def test_plot_writes_a_png(config, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    assert main(["estimate", "--hf-config", config, "--batch", "2", "--seq", "32", "--budget", "1GiB",
                 "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- issue 10, item 5: `preflight check` decides from the report, not from the child's exit status ----------

# A script that reports like a dry run, then does what the environment says: let the dry run's SystemExit end it
# ("exit"), catch SystemExit and finish normally ("catch"), or fail after the report ("fail").
REPORTER = textwrap.dedent("""
    import os, sys
    from preflight._dryrun import finish, settings_from_env

    need = int(os.environ.get("NEED", "10"))
    report = {"fits": need < 100, "predicted_peak_bytes": need, "predicted_required_bytes": need,
              "budget_bytes": 100, "usable_bytes": 90, "headroom": 0.1}
    if os.environ.get("TOTAL"):
        report["predicted_device_total_bytes"] = report["predicted_required_bytes"] = int(os.environ["TOTAL"])
    rank = int(os.environ.get("RANK", "0"))
    behaviour = os.environ.get("BEHAVIOUR", "exit")
    try:
        if rank == 0:
            finish(report, need < 100)
        # preflight's ranks meet after rank zero wrote the report (a barrier): here, wait for the file.
        path = settings_from_env().report_path
        for _ in range(600):
            try:
                if not path or __import__("json").load(open(path)):
                    break
            except (OSError, ValueError):
                __import__("time").sleep(0.1)
        raise SystemExit(0 if need < 100 else 3)
    except SystemExit:
        if behaviour == "exit":
            raise
        if behaviour == "fail":
            raise RuntimeError("the script failed after its report")
    print("training ran anyway")
""")


def _check_run(tmp_path, *command, cwd=None, **env):
    import os

    (tmp_path / "reporter.py").write_text(REPORTER)
    return run_cli("check", "--", *command, env={**os.environ, **env}, cwd=cwd or tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("behaviour, need, code", [
    ("catch", 1000, 3),  # caught SystemExit, exited 0: still DOES NOT FIT
    ("catch", 10, 0),
    ("fail", 10, 0),  # exited 1 after a report that fits
    ("fail", 1000, 3),
    ("exit", 1000, 3),
])
def test_check_decides_from_the_report(tmp_path, behaviour, need, code):
    result = _check_run(tmp_path, sys.executable, "reporter.py", BEHAVIOUR=behaviour, NEED=str(need))
    assert result.returncode == code, result.stdout + result.stderr
    assert ("DOES NOT FIT" in result.stdout) == (code == 3)
    if behaviour == "fail":
        assert "exited with status 1 after writing its report" in result.stderr


@pytest.mark.slow
def test_check_through_python_dash_m(tmp_path):
    result = _check_run(tmp_path, sys.executable, "-m", "reporter", NEED="1000", BEHAVIOUR="catch")
    assert result.returncode == 3, result.stderr
    assert "DOES NOT FIT" in result.stdout


def test_check_without_a_report_shows_the_childs_status(tmp_path, capsys):
    script = tmp_path / "crash.py"
    script.write_text("raise SystemExit(7)\n")
    assert main(["check", "--", sys.executable, str(script)]) == 2
    assert "no preflight report was written: the script exited with status 7" in capsys.readouterr().err


@pytest.mark.parametrize("total, named", [(None, "allocated peak 1000 B"), ("2000", "device total 1.95 KiB")])
def test_check_summary_names_the_figure_it_compared(tmp_path, total, named):
    env = {"NEED": "1000"} if total is None else {"NEED": "1000", "TOTAL": total}
    result = _check_run(tmp_path, sys.executable, "reporter.py", **env)
    assert result.returncode == 3
    assert f"DOES NOT FIT: {named}" in result.stdout and "against 90 B usable (100 B budget" in result.stdout


@pytest.mark.slow
def test_check_through_torchrun(tmp_path):
    # torchrun reports a rank's exit 3 as its own failure (exit 1); the verdict is still the report's.
    result = _check_run(tmp_path, sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", "reporter.py", NEED="1000")
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    assert "DOES NOT FIT" in result.stdout


@pytest.mark.slow
def test_check_through_accelerate_launch(tmp_path):
    pytest.importorskip("accelerate")
    result = _check_run(tmp_path, sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes",
                        "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                        "reporter.py", NEED="1000")
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    assert "DOES NOT FIT" in result.stdout


@pytest.mark.slow
def test_gpu_flag_replaces_a_budget_written_in_the_script(tmp_path):
    script = tmp_path / "budget.py"
    script.write_text(textwrap.dedent("""
        from preflight import Run, Target
        from preflight._budget import resolve_budget
        from preflight.verdict import Options
        from preflight.verdict._predict import _with_environment
        options, settings = _with_environment(Options(headroom=0.2))
        run = settings.run().over(Run(target=Target(budget="24GiB")))
        print("budget", resolve_budget(run.target.budget, gpu=run.target.gpu), "gpu", run.target.gpu,
              "headroom", options.headroom)
    """))
    import os

    result = run_cli("check", "--gpu", "H100-80GB", "--", sys.executable, str(script),
                     env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    from preflight._gpus import get_gpu

    assert f"budget {get_gpu('H100-80GB').memory_bytes} gpu H100-80GB headroom 0.2" in result.stdout


LIGHTNING_DDP = """import torch
from torch import nn
import lightning.pytorch as pl
from preflight.integrations.lightning import PreflightCallback


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    data = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[PreflightCallback(verify_steps=0)])
    trainer.fit(Tiny(), loader)
    print("trained")
"""


@pytest.mark.slow
def test_check_through_lightnings_multi_process_launch(tmp_path):
    # Lightning's "ddp" strategy on CPU re-runs the script once per extra rank (its subprocess launcher).
    pytest.importorskip("lightning")
    (tmp_path / "lit_ddp.py").write_text(LIGHTNING_DDP)
    result = run_cli("check", "--budget", "1KiB", "--", sys.executable, "lit_ddp.py", cwd=tmp_path)
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    assert "cpu x 2 ranks" in result.stdout and "trained" not in result.stdout
    table_peak = __import__("re").search(r"training peak\s+([\d.]+ \w+)", result.stdout).group(1)
    assert f"DOES NOT FIT: allocated peak {table_peak} against" in result.stdout  # the table's figure, named


@pytest.mark.parametrize("args, message", [
    (["--seq", "-1"], "--seq should be at least 1, got -1"),
    (["--seq", "0"], "--seq should be at least 1, got 0"),
    pytest.param(["--budget", "1" + "0" * 400], "--budget: '10000.*more than any memory", id="400-digits"),
    (["--budget", "0"], "--budget should be more than 0 bytes"),
    (["--budget", "nan"], "--budget: Cannot read 'nan'"),
    (["--sharding", "zero1", "--world-size", "2", "--offload-params"],
     "--offload-params needs full parameter sharding, got --sharding 'zero1'"),
    (["--lora-r", "-4"], "--lora-r should be a positive LoRA rank.*got -4"),
    (["--lora-r", "0"], "--lora-r should be a positive LoRA rank.*got 0"),
    (["--lora-r", "4", "--lora-targets", "q_proj,nope"], "no linear layer named nope.*Its linear layers: .*q_proj"),
    (["--quantize", "nf4"], "--quantize nf4: quantized base weights are frozen.*add --lora-r 16"),
    (["--quantize", "int8", "--lora-r", "4", "--double-quant"], "--double-quant .* with --quantize nf4 or fp4"),
    (["--cuda-context", "1343MiB"], "--cuda-context is added to the device total computed for a GPU: pass --gpu"),
    (["--gpu", "V100-32GB", "--cuda-context", "1343"], "cuda_context.*no unit"),
    (["--generate"], "--generate needs --max-new-tokens N"),
    (["--max-new-tokens", "8"], "--max-new-tokens plan.* generation: add --generate"),
    (["--generate", "--max-new-tokens", "8", "--task", "seq-cls"], "--generate needs a model that generates"),
    (["--generate", "--max-new-tokens", "8", "--world-size", "2"], "--generate plans one device's generation"),
    (["--generate", "--max-new-tokens", "8", "--offload-activations", "streams"],
     "--generate plans one device's generation"),
    (["--json", "/no/such/folder/out.json"], "--json '/no/such/folder/out.json': the folder '/no/such/folder' does"),
    (["--plot", "/proc/plot.png"], "--plot '/proc/plot.png' cannot be written"),
])
def test_every_bad_input_is_a_clear_error_before_any_trace(config, capsys, args, message):
    if "--lora-r" in args and args[args.index("--lora-r") + 1] == "4":
        pytest.importorskip("peft")
    assert main(["estimate", "--hf-config", config, "--batch", "2", "--seq", "64", *args]) == 2
    err = capsys.readouterr().err
    assert pytest.importorskip("re").search(message, err), err
    assert "Traceback" not in err and "tracing 2 training steps" not in err  # refused before the trace


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llamaa"}, "model_type 'llamaa' is not a model type transformers .* knows; the closest it knows: "
                               "llama, "),
    ({"num_hidden_layers": -1}, "num_hidden_layers = -1, but it should be at least 0"),
    ({"intermediate_size": 0}, "intermediate_size = 0, but it should be at least 1"),
])
def test_a_config_no_model_can_have_is_refused_with_the_closest_names(tmp_path, capsys, change, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, **change}))
    assert main(["estimate", "--hf-config", str(path), "--batch", "2", "--seq", "64"]) == 2
    err = capsys.readouterr().err
    assert pytest.importorskip("re").search(message, err), err
    assert len(err) < 400  # the closest names, not every model type transformers knows


def test_check_of_a_script_that_is_not_executable_exits_2(tmp_path, capsys):
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\necho hello\n")
    script.chmod(0o644)
    assert main(["check", "--", str(script)]) == 2
    err = capsys.readouterr().err
    assert "permission denied (it is not executable)" in err and f"chmod +x {script}" in err


@pytest.mark.slow
def test_a_deep_model_is_composed_by_default_and_full_traces_every_block(tmp_path):
    # 12 identical decoder layers: composed from 2-, 3- and 4-layer traces unless --full; the bytes agree.
    path = tmp_path / "deep.json"
    path.write_text(json.dumps({**TINY_LLAMA, "num_hidden_layers": 12}))
    reports = {}
    for flag in ([], ["--full"]):
        out = tmp_path / f"est{len(flag)}.json"
        assert main(["estimate", "--hf-config", str(path), "--batch", "2", "--seq", "32", "--gpu", "A100-80GB",
                     "--json", str(out), *flag]) == 0
        reports[bool(flag)] = json.loads(out.read_text())
    fast, full = reports[False], reports[True]
    assert (fast["inputs"]["fast"], full["inputs"]["fast"]) == (True, False)
    assert any(n.startswith("depth-independent trace: the 12 blocks") for n in fast["coverage"]["notes"])
    assert not any("depth-independent" in n or "fast=True" in n for n in full["coverage"]["notes"])
    for key in ("peak_bytes", "breakdown", "peak_reserved_bytes", "peak_phase"):
        assert fast[key] == full[key], key


def test_check_full_reaches_the_script_as_an_environment_variable(tmp_path):
    seen = tmp_path / "seen.txt"
    script = tmp_path / "train.py"
    script.write_text(f"import os\nopen({str(seen)!r}, 'a').write(repr(os.environ.get('PREFLIGHT_FAST')) + ' ')\n")
    for flag in (["--full"], []):
        main(["check", *flag, "--", sys.executable, str(script)])  # no report: the verdict is not the point here
    assert seen.read_text().split() == ["'0'", "None"]
    from preflight._dryrun import settings_from_env

    assert settings_from_env({"PREFLIGHT_FAST": "0"}).fast is False
    assert settings_from_env({}).fast is None


@pytest.mark.slow
def test_suggestions_under_a_sharded_plan_are_per_rank(config, tmp_path, capsys, monkeypatch):
    """--world-size/--sharding: each suggestion is predicted per rank under the same plan, the stronger sharding
    of FSDP included (SHARD_GRAD_OP -> FULL_SHARD). The two options asserted on are traced (test_options.py
    traces each under a plan)."""
    from conftest import only_options

    only_options(monkeypatch, "sharding", "bf16 precision")
    out = tmp_path / "est.json"
    plan = ["estimate", "--hf-config", config, "--batch", "4", "--seq", "32", "--world-size", "2",
            "--sharding", "fsdp-grad-op"]
    assert main([*plan, "--json", str(out)]) == 0
    # Over by the headroom alone: single changes fit, so no combination is searched (tests/advice/test_combine.py).
    budget = json.loads(out.read_text())["required_bytes"]
    capsys.readouterr()
    assert main([*plan, "--budget", f"{budget}B", "--json", str(out)]) == 3
    printed = capsys.readouterr().out
    assert "not available" not in printed
    report = json.loads(out.read_text())
    changes = {json.dumps(s["change"], sort_keys=True): s for s in report["suggestions"]}
    full = changes[json.dumps({"sharding": "fsdp-full", "world_size": 2}, sort_keys=True)]
    assert "FULL_SHARD" in full["description"] and "per GPU" in full["description"]
    assert full["predicted_peak_bytes"] < report["peak_bytes"]
    bf16 = changes[json.dumps({"precision": "bf16-true"}, sort_keys=True)]
    # The same plan in one process: the figure the suggestion gives is the per-rank bf16-true peak.
    assert main(["estimate", "--hf-config", config, "--batch", "4", "--seq", "32", "--world-size", "2",
                 "--sharding", "fsdp-grad-op", "--precision", "bf16-true", "--json", str(out)]) == 0
    assert bf16["predicted_peak_bytes"] == json.loads(out.read_text())["peak_bytes"]


@pytest.mark.slow
def test_gradient_as_bucket_view_plans_ddp_with_bucket_views(config, tmp_path, capsys):
    out = tmp_path / "est.json"
    peaks = {}
    for flags in ([], ["--gradient-as-bucket-view"]):
        assert main(["estimate", "--hf-config", config, "--batch", "1", "--seq", "8", "--world-size", "2",
                     *flags, "--json", str(out)]) == 0
        report = json.loads(out.read_text())
        peaks[bool(flags)] = report["peak_bytes"]
        assert report["inputs"]["gradient_as_bucket_view"] is bool(flags)
    assert peaks[True] < peaks[False]  # tiny batch: the peak holds every gradient, once instead of twice
    capsys.readouterr()
    assert main(["estimate", "--hf-config", config, "--batch", "1", "--seq", "8", "--world-size", "2",
                 "--sharding", "zero2", "--gradient-as-bucket-view"]) == 2
    assert "--gradient-as-bucket-view is DDP's option" in capsys.readouterr().err


@pytest.mark.slow
def test_a_sharding_over_one_rank_is_said(config, capsys, tmp_path):
    # Issue 24, item 10: `--sharding zero3` without `--world-size` planned ZeRO-3 over one GPU without a word.
    out = tmp_path / "est.json"
    base = ["estimate", "--hf-config", config, "--batch", "2", "--seq", "32", "--no-suggest", "--json", str(out)]
    assert main(base + ["--sharding", "zero3"]) == 0
    warning = "--sharding zero3 with --world-size 1: one rank holds every shard"
    assert warning in capsys.readouterr().err
    assert any(w.startswith(warning) for w in json.loads(out.read_text())["warnings"])
    assert main(base + ["--sharding", "zero3", "--world-size", "4"]) == 0
    assert main(base + ["--offload-optimizer"]) == 0  # ZeRO-Offload on one GPU: a plan of its own
    assert "one rank holds every shard" not in capsys.readouterr().err


@pytest.mark.slow
def test_a_planned_batch_takes_no_host_memory(config):
    """The planned batch is built on the meta device: 100 million sequences plan in the same host memory as 4
    (before, the OOM killer stopped it), and a batch too large for value shadows is a labelled lower bound."""

    def run(batch):
        # The child's own peak RSS, read after it exits (ru_maxrss of the largest waited-for child so far is
        # monotone, so each size runs in its own grandchild).
        code = ("import resource, subprocess, sys; subprocess.run([sys.executable, '-m', 'preflight', 'estimate', "
                f"'--hf-config', {str(config)!r}, '--batch', '{batch}', '--seq', '32', '--no-suggest'], "
                "capture_output=True); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        return int(done.stdout.strip()) * 1024

    small, huge = run(4), run(100_000_000)
    assert huge < small + 256 * 2**20  # the planned batch's int64 ids alone would be 25.6 GB
    done = run_cli("estimate", "--hf-config", str(config), "--batch", "100000000", "--seq", "32", "--no-suggest")
    assert done.returncode == 0 and "lower bound: " in done.stdout


@pytest.mark.parametrize("change, named", [
    ({"hidden_size": "big"}, "hidden_size"),  # a field of the wrong type
    pytest.param({"num_attention_heads": 5}, "not a multiple of the number of attention heads",  # inconsistent
                 marks=pytest.mark.slow),
    pytest.param({"rope_scaling": {"type": "bogus", "factor": 2.0}}, "'bogus'",  # a value the model cannot build
                 marks=pytest.mark.slow),
])
def test_a_config_transformers_refuses_is_one_line_and_exit_2(tmp_path, change, named):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, **change}))
    done = run_cli("estimate", "--hf-config", str(path), "--batch", "2", "--seq", "16", "--no-suggest")
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("preflight: error:")]
    assert len(errors) == 1 and named in errors[0] and "Traceback" not in done.stderr


def test_a_folder_named_preflight_in_the_working_directory_is_named_not_a_traceback(tmp_path):
    (tmp_path / "preflight").mkdir()  # a clone named preflight, run from the folder holding it
    done = subprocess.run([sys.executable, "-m", "preflight", "--help"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert str(tmp_path / "preflight") in done.stderr and "rename the clone" in done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="stopping daemonized descendants uses Linux's "
                    "PR_SET_CHILD_SUBREAPER")
def test_a_daemonized_grandchild_does_not_outlive_preflight_check(tmp_path):
    pid_file = tmp_path / "daemon.pid"
    script = tmp_path / "daemonizes.py"
    script.write_text(f"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(120)
    os._exit(0)
time.sleep(0.5)
""")
    done = run_cli("check", "--", sys.executable, str(script), timeout=120)
    assert done.returncode == 2  # no preflight report: the script never reached a check
    daemon = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(daemon, 0)
    assert "stopped 1 process(es)" in done.stderr


def test_ctrl_c_during_the_imports_is_one_line_and_exit_130(config):
    """(Ctrl-C inside a trace is tests/trace/test_interrupts.py's.)"""
    delay = 0.3  # the command is importing torch and transformers by then
    import signal
    import time

    child = subprocess.Popen([sys.executable, "-m", "preflight", "estimate", "--hf-config", config, "--batch", "2",
                              "--seq", "16"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    maps = pathlib.Path(f"/proc/{child.pid}/maps")
    deadline = time.monotonic() + 30
    while maps.exists() and "libtorch" not in maps.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)  # a loaded machine: wait until torch is being imported (the handler is set before that)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    if child.returncode == 0:
        pytest.skip("the run finished before the signal")
    # -2: CPython ended the process by SIGINT itself (preflight/__main__.py's `run` says when); a shell shows 130
    assert child.returncode in (130, -signal.SIGINT), (child.returncode, err[-3000:])
    assert "Traceback" not in err and "interrupted" in err, err[-3000:]


@pytest.fixture
def own_sigint_handler():
    """`preflight.__main__.run` installs its SIGINT handler; this process's own comes back afterwards."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_turned_into_another_error_by_a_library_is_still_exit_130(monkeypatch, capsys, own_sigint_handler):
    """A library that catches the KeyboardInterrupt while it imports and raises its own error from it (torch's
    operator lookup turns any failure into AttributeError) is still Ctrl-C: one line, exit 130, no traceback."""
    import preflight.__main__ as entry

    def importing():
        try:
            entry._interrupted(2, None)  # what the SIGINT handler does
        except KeyboardInterrupt as stopped:
            raise AttributeError("no such operator") from stopped

    monkeypatch.setattr(entry, "_run", importing)
    monkeypatch.setattr(entry._interrupted, "pressed", False)
    assert entry.run() == 130
    assert capsys.readouterr().err == "\npreflight: interrupted\n"


def test_an_error_without_ctrl_c_is_not_called_an_interruption(monkeypatch, own_sigint_handler):
    import preflight.__main__ as entry

    def broken():
        raise AttributeError("a real bug")

    monkeypatch.setattr(entry, "_run", broken)
    monkeypatch.setattr(entry._interrupted, "pressed", False)
    with pytest.raises(AttributeError, match="a real bug"):
        entry.run()


@pytest.mark.slow
def test_a_launchers_traceback_after_the_verdict_is_one_line_and_a_log(tmp_path):
    """A launcher turns the rank's exit 3 into a long traceback of its own; when the verdict is the point, preflight
    check shows one line and where the whole output went, and still the verdict's exit status."""
    launcher = tmp_path / "launcher.py"
    launcher.write_text(textwrap.dedent("""
        import subprocess, sys
        rc = subprocess.call([sys.executable] + sys.argv[1:])
        if rc:
            for _ in range(30):
                sys.stderr.write('  File "launcher.py", line 1, in <module>\\n')
            sys.stderr.write(f"ChildFailedError: rank 0 exited with {rc}\\n")
            sys.exit(1)
    """))
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch, preflight
        model = torch.nn.Linear(8, 1)
        preflight.check(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 8),
                        preflight.Run(target=preflight.Target(budget="100B")), step=lambda m, b: m(b).sum(),
                        suggest=False)
    """))
    done = run_cli("check", "--", sys.executable, str(launcher), str(script), timeout=300)
    assert done.returncode == 3, done.stderr[-2000:]
    assert 'File "launcher.py"' not in done.stderr
    line = next(x for x in done.stderr.splitlines() if "more line(s) on stderr after the report" in x)
    assert "ChildFailedError" in line
    log = line.rsplit(" is in ", 1)[1].strip()
    assert open(log).read().count('File "launcher.py"') == 30
    os.unlink(log)
    assert "exiting with status 3" in done.stderr  # preflight's own held-back line is shown


@pytest.mark.slow
def test_optimizer_impl_flag_plans_the_fused_step(config):
    peaks = {}
    for impl in (None, "fused"):
        args = ["estimate", "--hf-config", config, "--batch", "2", "--seq", "16", "--gpu", "H100-80GB", "--no-suggest"]
        args += ["--optimizer-impl", impl] if impl else []
        assert main([*args, "--json", str(Path(config).parent / f"{impl}.json")]) == 0
        peaks[impl] = json.loads((Path(config).parent / f"{impl}.json").read_text())["peak_bytes"]
    assert peaks["fused"] < peaks[None]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["nf4", "int8"])
def test_quantized_base_weights_are_planned_as_from_pretrained_loads_them(tmp_path, scheme):
    """`--quantize` builds on meta what a QLoRA / LLM.int8 recipe loads: from_pretrained with a BitsAndBytesConfig,
    peft's prepare_model_for_kbit_training, LoRA. The CLI's figure is the estimate of that loaded model."""
    import argparse
    import tempfile

    import torch

    pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    import preflight
    from preflight._cli import _batch
    from preflight._quantize import bnb_config

    path, out = tmp_path / "config.json", tmp_path / "out.json"
    path.write_text(json.dumps(TINY_LLAMA))
    flags = ["--quantize", scheme, "--lora-r", "4", "--precision", "bf16-mixed", "--checkpointing"]
    flags += ["--double-quant"] if scheme == "nf4" else []
    assert main(["estimate", "--hf-config", str(path), "--batch", "2", "--seq", "64", *flags, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["inputs"]["quantize"] == {"scheme": scheme, "double_quant": scheme == "nf4"}
    assert report["parameters"]["dtypes"].get("uint8" if scheme == "nf4" else "int8", 0) > 0

    config = transformers.AutoConfig.for_model(**TINY_LLAMA)
    with tempfile.TemporaryDirectory() as folder:
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=bnb_config(scheme, compute_dtype=torch.bfloat16, double_quant=scheme == "nf4"),
            device_map={"": "cpu"}, dtype=torch.float32)
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    batch = _batch(argparse.Namespace(task="causal-lm", batch=2, seq=64), config)
    loaded = preflight.estimate(model, optimizer, batch, preflight.Run(precision="bf16-mixed"))
    assert report["peak_bytes"] == loaded.peak_bytes and report["breakdown"] == loaded.breakdown


DDP_CHECK = textwrap.dedent("""
    import torch, torch.distributed as dist
    import preflight

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]))
    optimizer = torch.optim.AdamW(model.parameters())
    try:
        preflight.check(model, optimizer, torch.randn(8, 64), preflight.Run(target=preflight.Target(budget="64KiB")),
                        step=lambda m, b: m(b).sum(), suggest=False)
    finally:
        dist.destroy_process_group()
    print("training ran")
""")


@pytest.mark.slow
def test_check_of_a_ddp_job_through_torchrun_reports_before_any_rank_exits(tmp_path):
    # Every rank exits 3 together; torchrun stops the others as soon as one exits with a failure, so rank zero's
    # report must be written before any rank leaves (the ranks meet after it).
    (tmp_path / "job.py").write_text(DDP_CHECK)
    result = run_cli("check", "--", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                     "2", "job.py", cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PREFLIGHT_DRY_RUN"})
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    assert "DOES NOT FIT" in result.stdout and "training ran" not in result.stdout


def test_generate_plans_model_generate_as_the_real_run_measures_it(config, tmp_path, capsys):
    import torch
    import transformers

    from preflight._device import live_storages
    from preflight._measure import cpu_profiled_peak

    out = tmp_path / "gen.json"
    assert main(["estimate", "--hf-config", config, "--batch", "2", "--seq", "16", "--generate", "--max-new-tokens",
                 "8", "--num-beams", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert "assumed: generate, 2 prompt(s) of 16 tokens, 8 new tokens each, 2 beams" in printed.out
    assert "tracing generate on fake tensors (prefill and 8 decoding steps)" in printed.err
    report = json.loads(out.read_text())
    assert report["peak_phase"] == "generate" and report["run"]["generation"]["num_beams"] == 2
    # The same generation, run: prompts of token 0 as the CLI plans them, an end-of-sequence token the model cannot
    # pick, so that it runs the whole length as the plan assumes.
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY_LLAMA)).eval()
    ids = torch.zeros(2, 16, dtype=torch.long)
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    before = live_storages([list(model.parameters()), list(model.buffers()), prompts], torch.device("cpu"))
    with torch.no_grad():
        peak, _ = cpu_profiled_peak(lambda: model.generate(**prompts, max_new_tokens=8, num_beams=2,
                                                           eos_token_id=TINY_LLAMA["vocab_size"] + 5),
                                    resident=before)
    assert report["peak_bytes"] == sum(before.values()) + peak


@pytest.mark.slow
def test_bitsandbytes_optimizers_by_name(config, tmp_path):
    pytest.importorskip("bitsandbytes")
    state = {}
    for name in ("adamw", "lion", "lion8bit", "adamw8bit", "paged-adamw8bit"):
        out = tmp_path / f"{name}.json"
        gpu = ["--gpu", "H100-80GB"] if "adamw8bit" in name else []
        assert main(["estimate", "--hf-config", config, "--batch", "2", "--seq", "16", "--optimizer", name,
                     "--no-suggest", *gpu, "--json", str(out)]) == 0
        report = json.loads(out.read_text())
        state[name] = (report["breakdown"]["optimizer_state"], report.get("managed_bytes", 0))
    # One fp32 state per parameter against AdamW's two, which also keeps a 4-byte step per tensor (21 tensors here).
    assert state["adamw"][0] - 2 * state["lion"][0] == 4 * 21
    assert state["lion8bit"][0] < state["lion"][0]
    # On a GPU bitsandbytes pages the states of parameters of 1e5 elements or more into CUDA unified memory; this
    # model's largest has 64,000: nothing is paged, the state is in the allocator as without paging.
    assert state["paged-adamw8bit"] == (state["adamw8bit"][0], 0) and state["adamw8bit"][0] > 0
