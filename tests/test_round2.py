"""Round two: the shipped proposed fix (flawed/proposed_fix/) shows each of its five flaws, fixed/
passes every probe that judges them, and the round-two catalog is consistent."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from kata import FLAWED_DIR, REPO_ROOT
from kata.harness import probes, round2
from kata.harness.catalog import CATALOG
from kata.harness.judging import names_problem
from kata.harness.probes import PROBES
from kata.harness.remote import RemoteError
from kata.harness.review import Review, resolve_implementation, run_review
from kata.toolchain import shipped
from tests.conftest import NEED_MARKS, result_of, skip_unless_flawed_is_shipped


def round2_params():
    return [
        pytest.param(
            flaw,
            id=flaw.id,
            marks=[pytest.mark.flaw(flaw.id), *(NEED_MARKS[need] for need in flaw.needs)],
        )
        for flaw in round2.CATALOG
    ]


@pytest.fixture(scope="module")
def proposed_fix_review() -> Review:
    # Build the extension once before the probes start, so that no probe spends its time limit
    # waiting on the cold build.
    failure = round2.prepare()
    assert failure is None, f"flawed/proposed_fix/ must build as shipped: {failure}"
    return run_review(
        resolve_implementation(str(round2.ROUND2_DIR)),
        catalog=round2.CATALOG,
        round_number=2,
        prepare=round2.prepare,
    )


@pytest.fixture(scope="module")
def fixed_round2_review() -> Review:
    return run_review(resolve_implementation("fixed"), catalog=round2.CATALOG)


@pytest.mark.parametrize("flaw", round2_params())
def test_shipped_proposed_fix_fails(flaw, request):
    skip_unless_flawed_is_shipped()
    review = request.getfixturevalue("proposed_fix_review")
    result = result_of(review, flaw.id)
    if (
        result.status == "fixed"
        and flaw.probe_id == "dtype"
        and review.machine.probe_device == "cuda"
    ):
        pytest.skip(
            "on a GPU machine the dtype probe passes CUDA inputs only, and the proposed fix "
            "checks the dtype of CUDA inputs: the flaw shows with CPU inputs (a CPU-only machine)"
        )
    assert result.status == "present", (
        f"the {flaw.probe_id} probe did not catch {flaw.id} in the shipped proposed fix: "
        f"{result.evidence} (replay: python -m kata review --round 2 --only {flaw.id} "
        f"--seed {review.seed})"
    )
    assert result.evidence, "a present flaw must come with evidence"


@pytest.mark.parametrize("flaw", round2_params())
def test_fixed_passes_round2_probe(flaw, fixed_round2_review):
    result = result_of(fixed_round2_review, flaw.id)
    assert result.status == "fixed", (
        f"fixed/ fails the {flaw.probe_id} probe that judges {flaw.id}: {result.evidence} "
        f"(replay: python -m kata review --round 2 --impl fixed --only {flaw.id} "
        f"--seed {fixed_round2_review.seed})"
    )


def test_round2_ids_are_unique_and_new():
    ids = [flaw.id for flaw in round2.CATALOG]
    assert len(ids) == len(set(ids)) == 5
    assert not set(ids) & {flaw.id for flaw in CATALOG}


def test_round2_points_total_50():
    assert all(flaw.points == 10 for flaw in round2.CATALOG)
    assert sum(flaw.points for flaw in round2.CATALOG) == 50


def test_round2_probes_exist():
    for flaw in round2.CATALOG:
        assert flaw.probe, f"{flaw.id} names no probe"
        assert flaw.probe_id in PROBES, f"{flaw.id}: no probe {flaw.probe_id!r}"


def test_a_status_message_fixes_round_one_but_not_round_two():
    """On a GPU the proposed fix raises CUDA's name for status 1, "invalid argument": round one's
    fix for an ignored status, but round two's reviewer wants the length or the limit named (the
    rubric's r2-status-not-raised), so its probe takes only the words that name them."""
    gpu_message = RemoteError(
        {"type": "RuntimeError", "message": "fast_attention failed: invalid argument"}
    )
    assert names_problem(gpu_message, probes.LENGTH_WORDS)
    assert not names_problem(gpu_message, probes.LIMIT_WORDS)
    named = RemoteError({"type": "ValueError", "message": "seq_len must be at most 4096, got 4097"})
    assert names_problem(named, probes.LIMIT_WORDS)
    [status_flaw] = [f for f in round2.CATALOG if f.id == "r2-status-not-raised"]
    assert status_flaw.probe_id == "length-limit"
    assert PROBES["length-limit"] is probes.probe_length_limit


def test_round2_entries_are_complete():
    """Title, where and three hints; the code lines `review --explain` shows are in the shipped
    files (the manifest's copy, so that a candidate's edits do not fail this test)."""
    files = shipped.shipped()
    prefix = round2.ROUND2_DIR.relative_to(FLAWED_DIR).as_posix()
    for flaw in round2.CATALOG:
        assert flaw.title and flaw.where, flaw.id
        assert len(flaw.hints) == 3 and all(flaw.hints), flaw.id
        assert flaw.code, f"{flaw.id} shows no code"
        for name, needle in flaw.code:
            text = files.get(f"{prefix}/{name}")
            assert text is not None, f"{flaw.id}: {name} is not shipped in {prefix}/"
            assert needle in text, f"{flaw.id}: {needle!r} not found in {name}"


def test_rubric_has_a_round_two_section_per_flaw_with_the_catalogs_points():
    rubric = (REPO_ROOT / "rubric.md").read_text()
    round_two = rubric.split("## Round two: review the proposed fix", 1)[1]
    sections = re.findall(
        r"^### `(r2-[a-z0-9-]+)`: (.+?)\n+\*\*Points: (\d+)\*\*", round_two, flags=re.MULTILINE
    )
    assert [(i, int(p)) for i, _, p in sections] == [(f.id, f.points) for f in round2.CATALOG]


def test_round_two_review_command_judges_the_proposed_fix():
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "kata",
            "review",
            "--round",
            "2",
            "--json",
            "--only",
            "r2-status-not-raised",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert report["implementation"] == "flawed/proposed_fix"
    [flaw] = report["flaws"]
    assert (flaw["id"], flaw["status"]) == ("r2-status-not-raised", "present"), flaw


# What cpp_extension does around a build: before torch 2.14 (torch.utils.file_baton) create
# `lock` exclusively or wait while it exists; from 2.14 flock() it. HANG stands for a build
# that never finishes.
BATON_WRAPPER = textwrap.dedent(
    """
    import fcntl, os, sys, time
    from pathlib import Path

    lock = Path(__file__).parent / "build" / "cpu" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    build_s = 3600 if os.environ.get("HANG") else 0
    if os.environ["EXISTENCE_LOCKS"] == "1":
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            while lock.exists():
                time.sleep(0.1)
        else:
            time.sleep(build_s)
            lock.unlink()
    else:
        with open(lock, "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            time.sleep(build_s)
    """
)


def test_a_build_lock_left_by_a_killed_build_does_not_stall_round_two(tmp_path, monkeypatch):
    """A build killed by SIGKILL (a time limit) leaves cpp_extension's lock file. Before torch
    2.14 every later import waits while it exists: a review stalled in prepare() for its whole
    time limit (600 s), and the probes after it. prepare() now removes such a lock older than
    its time limit, removes the lock of a build it killed itself, and names a younger lock it
    waited on. From 2.14 the lock is an flock() and a file left behind blocks nothing."""
    existence_locks = round2.locks_block_while_they_exist()
    monkeypatch.setenv("EXISTENCE_LOCKS", "1" if existence_locks else "0")
    (tmp_path / "attention_wrapper.py").write_text(BATON_WRAPPER)
    lock = tmp_path / "build" / "cpu" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    an_hour_ago = time.time() - 3600
    os.utime(lock, (an_hour_ago, an_hour_ago))
    assert round2.prepare(tmp_path, timeout=20) is None
    assert lock.exists() != existence_locks

    lock.touch()  # younger than the time limit: it may be a live build's
    failure = round2.prepare(tmp_path, timeout=3) if existence_locks else None
    if existence_locks:  # waited on, then named
        assert failure is not None and "timed out after 3 s" in failure and str(lock) in failure
        assert lock.exists()
        lock.unlink()
    else:
        assert round2.prepare(tmp_path, timeout=20) is None

    monkeypatch.setenv("HANG", "1")  # the build takes the lock and never finishes: killed
    failure = round2.prepare(tmp_path, timeout=3)
    assert failure == "the extension did not build: timed out after 3 s"
    assert lock.exists() != existence_locks  # a killed flock() holder blocks nothing
    monkeypatch.delenv("HANG")
    assert round2.prepare(tmp_path, timeout=20) is None
