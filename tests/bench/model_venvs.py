"""The model venvs the bench tests run their programs with: `.venv-moshi` (torch + kyutai's
moshi) and `.venv-nemotron` (torch + NeMo), each where it is installed (its stamp file), so
a plain `make test` in the main venv still runs them where they exist (a bench that only ran
under `make test-moshi` rotted unseen once: bench/native_restore.py after cdaa032)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENVS = {"moshi": (".venv-moshi", "moshi"), "nemotron": (".venv-nemotron", "nemo")}


def python_for(model: str) -> str:
    """This interpreter when it has the model's packages, else the model's venv's; the
    test is skipped when neither is there."""
    venv, package = VENVS[model]
    if importlib.util.find_spec(package) is not None:
        return sys.executable
    python = ROOT / venv / "bin" / "python"
    if (ROOT / venv / ".installed").exists() and python.exists():
        return str(python)
    pytest.skip(f"{venv} is not installed (make test-{model} builds it)")
