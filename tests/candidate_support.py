"""What tests/test_candidate_loop.py and tests/test_candidate_output.py share: what runs on this
machine, and the candidate's commands run as a candidate runs them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kata import REPO_ROOT
from kata.harness.catalog import CATALOG
from kata.harness.review import Machine

MACHINE = Machine.detect()
# What runs here: the CPU-visible flaws on a machine without a GPU, more on a GPU machine.
RUN_HERE = [flaw for flaw in CATALOG if MACHINE.skip_reason(flaw) is None]
SKIPPED_HERE = [flaw for flaw in CATALOG if MACHINE.skip_reason(flaw) is not None]


def candidate_env() -> dict[str, str]:
    """The candidate's environment: no PYTHONPATH into this repository, no outer make. Other
    PYTHONPATH entries stay: an offline GPU machine may hold its wheels there."""
    drop = {"PYTHONPATH", "MAKEFLAGS", "MAKELEVEL", "MFLAGS", "FORCE_COLOR"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    outside = [
        entry
        for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if entry and not Path(entry).resolve().is_relative_to(REPO_ROOT)
    ]
    if outside:
        env["PYTHONPATH"] = os.pathsep.join(outside)
    return env | {"NO_COLOR": "1", "PYTHONUTF8": "1"}  # the marks the tests look for are UTF-8


def run(command: list[str], cwd: Path, **options) -> subprocess.CompletedProcess:
    options.setdefault("timeout", 180)
    options.update(env=candidate_env(), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return subprocess.run(command, cwd=cwd, **options)


def kata(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "kata", *args], cwd)


def words(text: str) -> str:
    text = re.sub(r"\((?:[^()]|\([^()]*\))*\)", "", text)
    text = re.sub(r"\bSIG[A-Z]+\b", "SIG", text)
    return " ".join(re.sub(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?", "N", text).split())
