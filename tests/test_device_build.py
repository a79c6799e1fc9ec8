"""perf/device_build.py answers bad input with one line: a wrong command, a torch without CUDA,
and `place` in a checkout whose library was never built (it must never load another's). Its
copies replace a library by a rename, never under a process that has it loaded."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.perf_support import load_perf_script

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, checkout: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(checkout / "perf" / "device_build.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=checkout,
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


def test_place_finds_no_library_of_other_sources_or_says_torch_has_no_cuda(tmp_path):
    # A copy of the script and of fixed/'s sources, without fixed/_build: on a GPU machine the
    # checkout's own portable/ may hold this checkout's library, which `place` would install.
    (tmp_path / "perf").mkdir()
    shutil.copy2(ROOT / "perf" / "device_build.py", tmp_path / "perf")
    (tmp_path / "fixed").mkdir()
    shutil.copy2(ROOT / "fixed" / "_build.py", tmp_path / "fixed")
    shutil.copytree(ROOT / "fixed" / "csrc", tmp_path / "fixed" / "csrc")
    line = the_one_line(run("place", checkout=tmp_path))
    if torch.version.cuda is None:
        assert line == (
            f"device_build: torch {torch.__version__} has no CUDA: "
            "install the GPU machine's torch build"
        )
    else:  # no build of this checkout's sources for this torch was carried here
        assert "no library built for these sources and torch" in line
        assert str(Path("fixed", "_build", "portable")) in line


def test_a_copy_never_changes_the_file_a_process_has_open(tmp_path):
    """`place` beside a test worker that had the old library loaded: copied over in place, the
    worker's mapped pages changed under it and it died of SIGSEGV (seen on an H200)."""
    copy_by_rename = load_perf_script("device_build").copy_by_rename
    source, target = tmp_path / "new.so", tmp_path / "lib.so"
    source.write_bytes(b"new library")
    target.write_bytes(b"old library")
    with target.open("rb") as loaded:
        copy_by_rename(source, target)
        assert loaded.read() == b"old library", "the open file was written over"
    assert target.read_bytes() == b"new library"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["lib.so", "new.so"]
