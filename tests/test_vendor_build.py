"""The vendor library's build when two processes need it at once (pytest -n, a review beside
`make watch`): the second waits for the first and finds its library, so that no caller returns
while a build's scratch directory still sits in the directory it copies."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from kata import FLAWED_DIR, REPO_ROOT, KataError
from kata.toolchain import builders

SLOW_COMPILE_S = 4


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not on PATH")
def test_a_build_in_progress_is_waited_for_not_run_beside(tmp_path, capfd):
    copy = tmp_path / "flawed"
    shutil.copytree(FLAWED_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for built in (builders.LIBRARY_NAME, builders.STAMP_NAME):
        (copy / built).unlink(missing_ok=True)
    slow = tmp_path / "slow-bin"  # a g++ that takes SLOW_COMPILE_S first: a build in progress
    slow.mkdir()
    (slow / "g++").write_text(
        f'#!/bin/sh\nsleep {SLOW_COMPILE_S}\nexec {shutil.which("g++")} "$@"\n'
    )
    (slow / "g++").chmod(0o755)
    first = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from kata.toolchain import builders\n"
            f"builders.build_vendor_library({str(copy)!r}, 'cpu')",
        ],
        cwd=REPO_ROOT,
        env=dict(os.environ, PATH=f"{slow}{os.pathsep}{os.environ['PATH']}"),
    )
    try:
        deadline = time.monotonic() + 60
        while not any(path.name.startswith("tmp") for path in copy.iterdir()):
            assert first.poll() is None, "the first build ended before its scratch was seen"
            assert time.monotonic() < deadline, "the first build made no scratch directory"
            time.sleep(0.02)
        builders.build_vendor_library(copy, "cpu")  # the fast g++: done first if run beside
        leftovers = sorted(path.name for path in copy.iterdir() if path.name.startswith("tmp"))
        assert not leftovers, f"returned while another build's scratch was there: {leftovers}"
        assert builders.vendor_library_is_current(copy, "cpu")
        assert "kata: waiting for another build of" in capfd.readouterr().err
    finally:
        assert first.wait(timeout=60) == 0


def test_a_lock_held_too_long_is_one_clear_error(tmp_path, monkeypatch, capfd):
    """A holder stopped outright (not compiling) never lets go: the wait ends in one line."""
    copy = tmp_path / "flawed"
    shutil.copytree(FLAWED_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / builders.LIBRARY_NAME).unlink(missing_ok=True)
    monkeypatch.setattr(builders, "COMPILER_TIMEOUT_S", -57.5)  # the wait's bound: 2.5 s
    held_by_another = builders._one_build_at_a_time(copy.resolve())  # the stopped holder
    expected = pytest.raises(KataError, match="another build of it held its lock")
    with held_by_another, expected as raised:
        builders.build_vendor_library(copy, "cpu")
    assert "\n" not in str(raised.value) and "2.5 s" in str(raised.value)
    assert "kata: waiting for another build of" in capfd.readouterr().err
