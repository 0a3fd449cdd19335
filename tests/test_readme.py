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
# The two test tiers: the fast one before every commit, the slow one (multi-process, end-to-end trainers) in CI too.
# Each prints its 20 slowest tests, so that a CI log says where the time went.
FAST_TESTS = 'python -m pytest -q -n 2 --dist loadfile -m "not slow" --durations=20'
SLOW_TESTS = "python -m pytest -q -n 2 --dist loadfile -m slow --durations=20"
HOW_LONG = re.compile(r"takes\s+(about\s+)?\d+(\s+to\s+\d+)?\s+minutes\s+on\s+2\s+CPU\s+cores")  # across line breaks


def _setup_section() -> str:
    start = README.index("## Set up")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else len(README)]


def test_readme_installs_from_a_clone_with_the_extras():
    tomllib = pytest.importorskip("tomllib")
    setup = _setup_section()
    assert not FROM_PYPI.search(README.replace("(`pip install preflight-memory` finds nothing)", ""))
    for step in ("git clone", "cd preflight-memory", "python -m venv .venv", "source .venv/bin/activate",
                 'pip install -e ".[dev]"', "python examples/quickstart.py"):
        assert step in setup, step
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in extras:
        assert f'.[{name}]' in setup, name


def test_readme_gives_both_test_tiers_and_how_long_each_takes():
    setup = _setup_section()
    for command in (FAST_TESTS, SLOW_TESTS):
        assert command in setup, command
    # Each tier says how long it takes: "takes about N minutes on 2 CPU cores".
    assert len(HOW_LONG.findall(setup)) >= 2, "each test tier needs its time"


def test_ci_ends_with_the_readmes_two_test_commands():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-2:] == [FAST_TESTS, SLOW_TESTS]


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
