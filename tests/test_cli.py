"""The command line meets bad input: one `kata: ` line on stderr naming the problem, a non-zero
exit, no traceback. Run as a user runs it: `python -m kata ...` in a child process, from this
repository or from a fresh handout (nothing of this repository on the path)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kata import FLAWED_DIR, REPO_ROOT, KataError
from kata.harness import catalog, hints
from kata.harness.catalog import CATALOG
from kata.interviewer.handout import build_handout
from kata.toolchain import builders
from tests.process_support import alive
from tests.terminal_support import sigint_at_default

ROUND_ONE_IDS = ", ".join(flaw.id for flaw in CATALOG)


def _env(**extra: str) -> dict[str, str]:
    """No PYTHONPATH into this repository (a handout must stand alone), no colour."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "FORCE_COLOR"}}
    return env | {"NO_COLOR": "1"} | extra


def kata(*args: str, cwd: Path = REPO_ROOT, **options) -> subprocess.CompletedProcess:
    options.setdefault("env", _env())
    options.setdefault("timeout", 180)
    command = [sys.executable, "-m", "kata", *args]
    return subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL, **options
    )


def one_line_error(result: subprocess.CompletedProcess, status: int = 2) -> str:
    """The one stderr line of a refused command, checked: the status, no traceback, no output."""
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{result.stderr}"
    assert lines[0].startswith("kata: "), lines[0]
    assert result.returncode == status, (result.returncode, result.stderr)
    assert result.stdout == "", result.stdout  # refused before any review ran
    return lines[0]


@pytest.fixture(scope="module")
def handout(tmp_path_factory) -> Path:
    return build_handout(tmp_path_factory.mktemp("cli") / "handout")


# ------------------------------------------------------------------------------------- review


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("0", "must be a positive number of seconds, got '0'"),
        ("-5", "must be a positive number of seconds, got '-5'"),
        ("nan", "must be a positive number of seconds, got 'nan'"),
        ("inf", "must be a positive number of seconds, got 'inf'"),
        ("soon", "not a number of seconds: 'soon'"),
    ],
)
def test_review_refuses_a_time_limit_that_is_not_positive(value, problem):
    line = one_line_error(kata("review", "--timeout", value, "--only", "shape"))
    assert line.startswith(f"kata: argument --timeout: {problem}"), line


@pytest.mark.parametrize(
    ("value", "problem"),
    [("-1", "must be from 0 to 2**63 - 1, got -1"), ("2" * 30, "must be from 0 to 2**63 - 1")],
)
def test_review_refuses_a_seed_torch_cannot_take(value, problem):
    line = one_line_error(kata("review", "--seed", value, "--only", "shape"))
    assert line.startswith(f"kata: argument --seed: {problem}"), line


@pytest.mark.parametrize(
    ("only", "named"),
    [
        (["nosuch"], "unknown flaw id 'nosuch' in round 1"),
        (["dtype,nosuch", "other"], "unknown flaw ids 'nosuch', 'other' in round 1"),
        ([","], "no flaw id given"),
    ],
)
def test_review_only_refuses_unknown_ids_and_lists_the_rounds_ids(only, named):
    line = one_line_error(kata("review", "--only", *only))
    assert line == f"kata: --only: {named}; known: {ROUND_ONE_IDS}"


def test_review_only_knows_the_ids_of_round_two():
    from kata.harness import round2

    line = one_line_error(kata("review", "--round", "2", "--only", "dtype"))
    known = ", ".join(flaw.id for flaw in round2.CATALOG)
    assert line == f"kata: --only: unknown flaw id 'dtype' in round 2; known: {known}"


@pytest.mark.parametrize("only", [["dtype,shape"], ["dtype", "shape"], ["dtype,", "shape"]])
def test_review_only_takes_ids_comma_joined_or_apart(only):
    result = kata("review", "--json", "--only", *only)
    assert result.returncode == 0, result.stderr
    assert [flaw["id"] for flaw in json.loads(result.stdout)["flaws"]] == ["dtype", "shape"]


def test_bad_arguments_are_one_line_not_a_usage_block():
    line = one_line_error(kata("review", "--round", "3"))
    assert line == (
        "kata: argument --round: invalid choice: 3 (choose from 1, 2) "
        "(see `python -m kata review --help`)"
    )
    one_line_error(kata("nosuchcommand"))
    one_line_error(kata("hint"))


@pytest.mark.parametrize("arch", ["bogus", "sm_9", "90", "sm_90b"])
def test_check_cuda_refuses_what_is_not_a_gpu_code(arch):
    """Before: a bad --arch compiled the sm_90a kernels for minutes, silently, then failed."""
    line = one_line_error(kata("check-cuda", "--arch", arch))
    assert line.startswith(f"kata: argument --arch: {arch!r} is not a GPU code as nvcc"), line


def test_markdown_target_is_checked_before_the_review(tmp_path):
    target = tmp_path / "missing" / "report.md"
    line = one_line_error(kata("review", "--only", "shape", "--markdown", str(target)))
    assert line == f"kata: --markdown {target}: its directory does not exist"
    line = one_line_error(kata("review", "--only", "shape", "--markdown", str(tmp_path)))
    assert line == f"kata: --markdown {tmp_path}: a directory, not a file"


def test_ctrl_c_stops_review_with_one_line_and_no_probe_left(tmp_path):
    """SIGINT, as the terminal sends it, while every probe hangs: exit 130, one line."""
    builders.build_vendor_library(FLAWED_DIR)
    copy = tmp_path / "candidate"
    shutil.copytree(FLAWED_DIR, copy, ignore=shutil.ignore_patterns("__pycache__", "*backup*"))
    pids = tmp_path / "pids"
    pids.mkdir()
    (copy / "attention_wrapper.py").write_text(
        f"import os, pathlib\n\npathlib.Path({str(pids)!r}, str(os.getpid())).touch()\n\n\n"
        "def fast_attention(q, k, v):\n    while True:\n        pass\n"
    )
    only = ["shape", "contiguity"]
    review = subprocess.Popen(
        [sys.executable, "-m", "kata", "review", "--impl", str(copy), "--only", *only],
        cwd=REPO_ROOT,
        # the probes report their pids in a directory a sandbox would keep them from
        env=_env() | {"KATA_SANDBOX": "off"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_at_default,
    )
    deadline = time.monotonic() + 60
    while len(list(pids.iterdir())) < len(only) and time.monotonic() < deadline:
        time.sleep(0.2)
    started = [int(path.name) for path in pids.iterdir()]
    assert len(started) == len(only), "the probes did not start"
    review.send_signal(signal.SIGINT)
    try:
        stdout, stderr = review.communicate(timeout=30)
    finally:
        if review.poll() is None:
            review.kill()
    time.sleep(0.5)
    survivors = [pid for pid in started if alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"probe processes outlived the stopped review: {survivors}"
    assert "Traceback" not in stdout + stderr, stderr
    assert stderr.splitlines() == ["kata: stopped (Ctrl-C)"], stderr
    assert review.returncode == 130


def test_torch_without_numpy_keeps_errors_to_one_line(tmp_path):
    """torch warns "Failed to initialize NumPy" at import where numpy is missing. A stand-in
    numpy that cannot import gives that machine; it marks that torch did try it."""
    fake = tmp_path / "site" / "numpy"
    fake.mkdir(parents=True)
    mark = tmp_path / "numpy-was-tried"
    (fake / "__init__.py").write_text(
        f"import pathlib\npathlib.Path({str(mark)!r}).touch()\n"
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n"
    )
    copy = tmp_path / "candidate"
    copy.mkdir()
    shutil.copy(FLAWED_DIR / "attention_wrapper.py", copy)
    shutil.copytree(FLAWED_DIR / "vendor", copy / "vendor")
    empty = tmp_path / "empty-path"
    empty.mkdir()
    # `build` asks torch which build this machine needs, then finds no compiler on PATH.
    env = _env(PYTHONPATH=str(fake.parent), PATH=str(empty))
    result = kata("build", "--impl", str(copy), env=env)
    assert mark.exists(), "torch was not imported: pick a command that imports it"
    line = one_line_error(result)
    assert "not found on PATH" in line, line


# ----------------------------------------------------------------------------------- handout


def test_hint_of_an_unknown_id_in_a_handout_is_one_line(handout):
    line = one_line_error(kata("hint", "nosuchid", cwd=handout))
    assert line == f"kata: unknown flaw id 'nosuchid'; known ids: {ROUND_ONE_IDS}"
    assert not (handout / hints.STATE_FILE.name).exists()  # nothing recorded


def test_round_two_in_a_round_one_handout_is_one_line(handout):
    line = one_line_error(kata("review", "--round", "2", cwd=handout))
    assert line == "kata: round two is not part of this copy of the kata"


def test_catalog_knows_round_one_and_hints_ask_round_two(tmp_path):
    """catalog.py must not import round2.py (round2 imports it; a handout lacks it): the round
    that a hint belongs to is for the hint command to find."""
    from kata.harness import round2

    second = round2.CATALOG[0]
    with pytest.raises(KataError, match=f"unknown flaw id '{second.id}'"):
        catalog.get(second.id)
    state = tmp_path / "hints.json"
    assert second.hints[0] in hints.next_hint(second.id, state)
    with pytest.raises(KataError, match=f"round two: {second.id}"):
        hints.next_hint("nosuchid", state)


def test_shared_libraries_build_side_by_side(tmp_path, monkeypatch):
    """Reviews running at once (pytest -n, two terminals) build the planted library at the same
    moment; each build must survive the others (they once shared one partial file, and all but
    one failed with FileNotFoundError)."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(builders, "BUILD_DIR", tmp_path / "build")
    with ThreadPoolExecutor(max_workers=8) as pool:
        built = list(pool.map(lambda _: builders.build_planted_library(), range(8)))
    assert set(built) == {tmp_path / "build" / "planted" / builders.LIBRARY_NAME}
    assert built[0].stat().st_size > 0
    leftovers = sorted(p.name for p in built[0].parent.iterdir())
    assert leftovers == ["custom_attention.so", "planted.c"], leftovers
