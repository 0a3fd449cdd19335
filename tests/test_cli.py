"""The `preflight` command: exit codes 0 (fits), 3 (does not fit), 2 (bad input); JSON; dry-run of a script."""

from __future__ import annotations

import json
import subprocess
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

    too_small = run_cli("estimate", "--hf-config", config, "--batch", "2", "--seq", "64", "--budget", "1MiB")
    assert too_small.returncode == 3
    assert "DOES NOT FIT" in too_small.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpu", "H1000"], "Known GPUs|known"),
        (["--budget", "12 GB?"], "Cannot read"),
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


def test_check_without_a_command_is_a_usage_error(capsys):
    assert main(["check", "--gpu", "H100-80GB"]) == 2
    assert "after --" in capsys.readouterr().err


def test_check_reports_a_script_that_never_reaches_preflight(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("print('training without preflight')\n")
    assert main(["check", "--", sys.executable, str(script)]) == 2
    assert "without reaching a preflight check" in capsys.readouterr().err


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


@pytest.mark.parametrize("budget, code", [("4GiB", 0), ("100MiB", 3)])
def test_check_dry_runs_an_example_script(budget, code):
    # The example's own check honours the dry run: it predicts, reports and exits before training.
    example = str(__import__("pathlib").Path(__file__).parents[1] / "examples" / "accelerate_loop.py")
    result = run_cli("check", "--budget", budget, "--", sys.executable, example)
    assert result.returncode == code, result.stderr[-2000:]
    assert ("DOES NOT FIT" in result.stdout) == (code == 3)
    assert "measured" not in result.stdout  # it stopped before step one: nothing was trained or verified


def test_options_for_lora_checkpointing_optimizer_and_task(config, tmp_path):
    base = ["estimate", "--hf-config", config, "--batch", "2", "--seq", "64"]
    full, lora, ckpt, sgd, cls = (tmp_path / f"{n}.json" for n in ("full", "lora", "ckpt", "sgd", "cls"))
    assert main(base + ["--json", str(full)]) == 0
    assert main(base + ["--lora-r", "4", "--lora-targets", "q_proj,v_proj", "--json", str(lora)]) == 0
    assert main(base + ["--checkpointing", "--json", str(ckpt)]) == 0
    assert main(base + ["--optimizer", "sgd", "--json", str(sgd)]) == 0
    assert main(base + ["--task", "seq-cls", "--json", str(cls)]) == 0
    full, lora, ckpt, sgd, cls = (json.loads(p.read_text()) for p in (full, lora, ckpt, sgd, cls))
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
    (["--precision", "bf16-true"], "bfloat16", 2, True),
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


def test_param_dtype_that_contradicts_a_true_precision_is_a_usage_error(config, capsys):
    code = main(["estimate", "--hf-config", config, "--batch", "2", "--seq", "32", "--precision", "bf16-true",
                 "--param-dtype", "float16"])
    assert code == 2
    assert "--param-dtype bfloat16" in capsys.readouterr().err


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
