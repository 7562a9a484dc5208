"""The supported platform: Python 3.12 and jax 0.12.x, and an install that leaves a user's jax be."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jaxlib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def setup_keywords() -> dict:
    """The literal keyword arguments and BASE list of setup.py, read without running it."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "BASE":
            found["install_requires"] = ast.literal_eval(node.value)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            for keyword in node.keywords:
                if keyword.arg == "python_requires":
                    found["python_requires"] = ast.literal_eval(keyword.value)
    return found


def test_this_interpreter_and_jax_are_in_the_supported_range():
    keywords = setup_keywords()
    jax_requirement = next(
        Requirement(r) for r in keywords["install_requires"] if Requirement(r).name == "jax"
    )
    assert jax_requirement.specifier.contains(jax.__version__)
    assert jax.__version__.startswith("0.12.") and jaxlib.__version__.startswith("0.12.")
    assert not jax_requirement.specifier.contains("0.10.2")  # 3.11's newest: not supported
    assert not jax_requirement.specifier.contains("0.13.0")  # the next minor is a decision
    assert keywords["python_requires"] == ">=3.12"
    assert sys.version_info >= (3, 12)


def test_find_python_names_a_3_12_interpreter_or_says_what_to_install(tmp_path):
    script = ROOT / "infra" / "find-python"
    found = subprocess.run([script], capture_output=True, text=True, check=False)
    if found.returncode == 0:
        version = subprocess.run(
            [found.stdout.strip(), "-c", "import sys; print(sys.version_info[:2])"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert version.stdout.strip() == "(3, 12)"
    # a PATH with no Python 3.12 and no pyenv: one line that says what to do, status 1
    bare = {"PATH": str(tmp_path), "HOME": str(tmp_path)}
    missing = subprocess.run(
        ["/bin/bash", script], capture_output=True, text=True, check=False, env=bare
    )
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.count("\n") == 1 and "Python 3.12" in missing.stderr


def test_installing_difforge_keeps_the_environments_jax():
    """What ``pip install -e .`` would do in this environment (jax 0.12.x already installed):
    install nothing of jax's, nor any other version of a package jax brings. (The build runs
    without isolation: setuptools is in the environment, torch brings it.)"""
    report = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-"]
        + ["--no-build-isolation", "-e", str(ROOT)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    would_install = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.stdout)["install"]
    }
    assert set(would_install) <= {"difforge"}, would_install
