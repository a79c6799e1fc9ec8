"""perf/device_build.py answers bad input with one line: a wrong command, a torch without CUDA,
and `place` in a checkout whose library was never built (it must never load another's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "perf" / "device_build.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def the_one_line(result: subprocess.CompletedProcess) -> str:
    """The script's own error line (torch may warn on stderr before it), and nothing else."""
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("device_build:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("args", [(), ("bogus",), ("place", "extra"), ("build", "--help")])
def test_a_wrong_command_gets_the_usage(args):
    assert the_one_line(run(*args)).startswith("device_build: usage:")


def test_place_finds_no_library_of_other_sources_or_says_torch_has_no_cuda():
    line = the_one_line(run("place"))
    if torch.version.cuda is None:
        assert line == (
            f"device_build: torch {torch.__version__} has no CUDA: "
            "install the GPU machine's torch build"
        )
    else:  # no build of this checkout's sources for this torch was carried here
        assert "no library built for these sources and torch" in line
        assert str(Path("fixed", "_build", "portable")) in line
