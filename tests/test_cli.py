"""The `duplex` console script is installed and never pretends to serve."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import EXIT_NOT_AVAILABLE, main


def duplex_executable() -> str:
    beside_python = Path(sys.executable).with_name("duplex")
    return str(beside_python) if beside_python.exists() else (shutil.which("duplex") or "")


@pytest.mark.parametrize(
    "command", [["serve"], ["api"], ["worker", "--plugin", "echo"], ["sessions", "ls"]]
)
def test_unbuilt_subcommands_say_so_and_fail(command, capsys):
    assert main(command) == EXIT_NOT_AVAILABLE
    assert "not available yet" in capsys.readouterr().err


def test_console_script_is_installed():
    executable = duplex_executable()
    assert executable, "the duplex console script is not installed"
    result = subprocess.run([executable, "serve"], capture_output=True, text=True, timeout=60)
    assert result.returncode == EXIT_NOT_AVAILABLE
    assert "duplex serve: not available yet" in result.stderr
    assert subprocess.run([executable, "--help"], capture_output=True, timeout=60).returncode == 0
