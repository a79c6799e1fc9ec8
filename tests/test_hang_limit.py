"""No test waits silently: pyproject.toml's faulthandler_timeout ends a run whose test hangs (a
kernel that never returns, a child that never exits), with the stacks, and names the test. Its
limit sits past the CUDA build's own bound, which a first test may wait for, and inside CI's
90 minutes."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CI_BUDGET_S = 90 * 60
# kata/toolchain/builders.py waits for fixed/'s build this much past the build's own bound.
BUILD_WAIT_MARGIN_S = 120

HANGING_TEST = """
import time


def test_sleeps_past_the_limit():
    time.sleep(60)
"""


def ini_options() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]


def cuda_build_bound_s() -> float:
    """fixed/_build.py's _DEFAULT_TIMEOUT_S["cuda"], read from its syntax tree (importing fixed
    would load torch and the operator)."""
    tree = ast.parse((REPO / "fixed" / "_build.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "_DEFAULT_TIMEOUT_S"
            for target in node.targets
        ):
            return float(ast.literal_eval(node.value)["cuda"])
    raise AssertionError("fixed/_build.py has no _DEFAULT_TIMEOUT_S")


def test_the_limit_sits_between_the_build_bound_and_the_ci_budget():
    options = ini_options()
    limit = float(options["faulthandler_timeout"])
    assert cuda_build_bound_s() + BUILD_WAIT_MARGIN_S < limit < CI_BUDGET_S
    assert options["faulthandler_exit_on_timeout"] is True


@pytest.mark.parametrize("workers", [None, "1"], ids=["one-process", "xdist"])
def test_a_hung_test_ends_the_run_and_is_named(tmp_path, workers):
    if int(pytest.__version__.split(".")[0]) < 9:
        pytest.fail(
            f"pytest {pytest.__version__} has no faulthandler_exit_on_timeout (pytest 9 or later; "
            "pyproject.toml asks for it): a hung test would wait; pip install -U pytest"
        )
    (tmp_path / "test_hangs.py").write_text(HANGING_TEST)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path)]
    command += ["-o", "faulthandler_timeout=1", str(tmp_path / "test_hangs.py")]
    if workers:
        command += ["-n", workers]
    ended = subprocess.run(command, capture_output=True, text=True, timeout=50, check=False)
    output = ended.stdout + ended.stderr
    assert ended.returncode != 0, output
    assert "Timeout (0:00:01)!" in output, output
    assert "test_sleeps_past_the_limit" in output, output
