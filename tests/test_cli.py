"""The command line, run the way a user runs it."""

from __future__ import annotations

import subprocess
import sys

import attnlab


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnlab.cli", *args], capture_output=True, text=True, timeout=300)


def test_list_shows_every_formulation_with_forms_and_precisions():
    result = run_cli("list")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:2] == ["#", "formulation"]
    body = [line.split()[1] for line in lines[2:]]
    assert body == attnlab.names()
    assert all("recurrent, parallel, chunkwise" in line and "float64, mpmath" in line for line in lines[2:])


def test_unknown_command_and_formulation_are_refused_with_usage():
    result = run_cli("frobnicate")
    assert result.returncode == 2 and "invalid choice" in result.stderr
    result = run_cli("bench", "--formulations", "gla,flash")
    assert result.returncode == 2 and "unknown formulation(s) flash" in result.stderr
