"""The README's set-up works for a newcomer (issue 10, item 8): preflight is installed from a clone, not PyPI."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
# `pip install preflight-memory[...]` (quoted or not): the package is not on PyPI, so the command fails.
FROM_PYPI = re.compile(r"pip install ['\"]?preflight-memory")
TEST_COMMAND = "python -m pytest -q -n 2 --dist loadfile"


def test_readme_installs_from_a_clone_with_the_extras():
    tomllib = pytest.importorskip("tomllib")
    setup = README[README.index("## Set up"):README.index("## Use")]
    assert not FROM_PYPI.search(README.replace("(`pip install preflight-memory` finds nothing)", ""))
    for step in ("git clone", "cd preflight", "python -m venv .venv", "source .venv/bin/activate",
                 'pip install -e ".[dev]"', TEST_COMMAND):
        assert step in setup, step
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in extras:
        assert f'.[{name}]' in setup, name
    assert re.search(r"takes (about )?\d+( to \d+)? minutes on 2 CPU cores", setup)  # how long the tests take


def test_ci_runs_exactly_the_readmes_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == TEST_COMMAND


def test_readme_accelerate_snippet_shows_step_verifier():
    snippet = README[README.index("# accelerate / custom loops"):]
    snippet = snippet[:snippet.index("```")]
    assert "StepVerifier(accelerator, model, optimizer, report" in snippet
    assert "with verifier.step(batch)" in snippet


def test_install_hints_in_the_package_work_without_pypi():
    for path in (ROOT / "preflight").rglob("*.py"):
        assert not FROM_PYPI.search(path.read_text()), path
    assert not FROM_PYPI.search((ROOT / "integrations" / "accelerate.py").read_text())


def test_cli_install_hint_names_the_package_and_the_extra(tmp_path, capsys, monkeypatch):
    import json

    from preflight._cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                  "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": 1000}))
    monkeypatch.setitem(sys.modules, "peft", None)
    assert main(["estimate", "--hf-config", str(config), "--batch", "1", "--seq", "8", "--lora-r", "4"]) == 2
    err = capsys.readouterr().err
    assert "pip install peft" in err and "pip install -e '.[hf]'" in err


def test_every_subpackage_is_shipped():
    """A non-editable install ships only the packages pyproject.toml lists: each folder of preflight/ with an
    __init__.py must be there (preflight.parallel was once left out, so `pip install .` lacked it)."""
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "preflight").rglob("__init__.py")}
    assert found and found <= listed, sorted(found - listed)
    assert "preflight.integrations" in listed
