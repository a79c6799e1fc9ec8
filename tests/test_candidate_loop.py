"""The candidate's loop, tested as a candidate meets it: in a fresh handout (`make handout`),
through its own Makefile, with nothing of this repository on the path.

One handout per module: its first check builds the vendor library there (g++), and each check
runs every probe in its own process, so the checks are the slow part; the tests share them.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kata import REPO_ROOT
from kata.harness import hints
from kata.harness.catalog import CATALOG
from kata.interviewer.handout import build_handout
from kata.toolchain import shipped
from tests.candidate_support import MACHINE, RUN_HERE, SKIPPED_HERE, candidate_env, kata, run, words
from tests.terminal_support import sigint_at_default

WRAPPER = "flawed/attention_wrapper.py"
SHIPPED_WRAPPER = shipped.shipped()["attention_wrapper.py"]
# The fix a candidate would make first: float32 only, and a TypeError that names the dtype.
DTYPE_FIX = (
    "    if any(t.dtype != torch.float32 for t in (query, key, value)):\n"
    "        raise TypeError(f'fast_attention needs float32 inputs, got dtype {query.dtype}')\n"
)


def with_dtype_fix(text: str) -> str:
    head, sep, body = text.partition("def fast_attention(query, key, value):\n")
    assert sep, "the shipped wrapper no longer defines fast_attention(query, key, value)"
    return head + sep + DTYPE_FIX + body


@pytest.fixture(scope="module")
def handout(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("candidate") / "kata"
    result = run(["make", "handout", f"DEST={dest}", f"PYTHON={sys.executable}"], REPO_ROOT)
    assert result.returncode == 0, result.stderr
    return dest


@pytest.fixture
def shipped_handout(handout: Path) -> Path:
    """The module's handout with the shipped wrapper back in place, whatever ran before."""
    (handout / WRAPPER).write_text(SHIPPED_WRAPPER)
    return handout


def test_round_two_handout_adds_the_proposed_fix(tmp_path):
    dest = build_handout(tmp_path / "round2", round_number=2)
    proposed = {n for n in shipped.shipped() if n.startswith(shipped.ROUND2_SUBDIR + "/")}
    assert proposed and all((dest / "flawed" / n).is_file() for n in proposed)
    assert not (dest / "kata" / "round2.py").exists()  # the answers stay with the interviewer


def test_handout_has_the_candidate_files_and_no_answers(tmp_path):
    dest = tmp_path / "handout"
    build_handout(dest)
    names = {path.relative_to(dest).as_posix() for path in dest.rglob("*") if path.is_file()}
    top = {".gitignore", "Makefile", "README.md", "flawed", "kata", "pyproject.toml"}
    assert {name.split("/")[0] for name in names} == top
    # flawed/ exactly as shipped (from the manifest, not the working copy), no build output.
    flawed = {
        n.removeprefix("flawed/"): (dest / n).read_text() for n in names if n.startswith("flawed/")
    }
    round_two = shipped.ROUND2_SUBDIR + "/"
    round_one = {n: text for n, text in shipped.shipped().items() if not n.startswith(round_two)}
    assert flawed == round_one  # the proposed fix of round two fixes round-one flaws: not here
    manifest = dest / shipped.MANIFEST.relative_to(REPO_ROOT)
    assert json.loads(manifest.read_text()) == round_one
    assert (dest / "README.md").read_text() == (REPO_ROOT / "CANDIDATE.md").read_text()
    for absent in (
        "fixed",
        "rubric.md",
        "tests",
        ".ci",
        "kata/harness/round2.py",
        "kata/interviewer/handout.mk",
    ):
        assert not (dest / absent).exists(), absent

    # What would give answers away, checked text by text over every file of the handout:
    # - outside kata/ (brief, Makefile, flawed/, pyproject.toml, .gitignore) not even a mention
    #   of fixed/, the rubric or a round-two id (r2-...);
    # - kata/ is the harness the candidate runs: it may name fixed/ and rubric.md (its
    #   interviewer commands, which fail cleanly here), but holds no round-two id;
    # - no file holds a line of rubric.md's prose, a line of fixed/'s sources, or an id, title,
    #   "where" or hint of the round-two catalog (kata/harness/round2.py).
    texts = {name: (dest / name).read_text() for name in names}
    for name, text in texts.items():
        assert not re.search(r"\br2-[a-z]", text), f"{name} names a round-two id"
        if not name.startswith("kata/"):
            for word in ("fixed/", "rubric"):
                assert word not in text.lower(), f"{name} mentions {word}"
    answers = _rubric_prose() | _fixed_source_lines() | _round_two_strings()
    assert answers, "nothing to look for: the answer files moved?"
    for name, text in texts.items():
        leaked = sorted(answer for answer in answers if answer in text)
        assert not leaked, f"{name} holds answers: {leaked[:3]}"

    # A second handout never overwrites one; a missing DEST says how to give one.
    result = kata("handout", str(dest), cwd=REPO_ROOT)
    assert result.returncode == 2
    assert result.stderr.strip() == f"kata: {dest} is not an empty directory; " + (
        "give make handout a new or empty one"
    )
    result = run(["make", "handout"], REPO_ROOT)
    assert "kata: where to? make handout DEST=path/to/dir" in result.stderr.splitlines()


def _rubric_prose() -> set[str]:
    lines = (REPO_ROOT / "rubric.md").read_text().splitlines()
    return {line.strip() for line in lines if len(line.strip()) > 50 and line[:1] not in "#|"}


def _fixed_source_lines() -> set[str]:
    """Lines of fixed/'s sources, but for those it shares with the shipped flawed/ (the vendor
    kernel's softmax loop, say): those are no answer."""
    sources = (p for p in (REPO_ROOT / "fixed").rglob("*") if p.suffix in {".py", ".cpp", ".h"})
    shared = {line.strip() for text in shipped.shipped().values() for line in text.splitlines()}
    return {
        line.strip()
        for path in sources
        if "_build" not in path.parts
        for line in path.read_text().splitlines()
        if len(line.strip()) > 40
    } - shared


def _round_two_strings() -> set[str]:
    """The round-two catalog's answers: ids, titles, where each flaw sits, hints."""
    from kata.harness import round2

    return {
        text for flaw in round2.CATALOG for text in (flaw.id, flaw.title, flaw.where, *flaw.hints)
    }


def test_handout_makefile_has_only_the_candidates_targets(handout):
    result = run(["make"], handout)
    assert result.returncode == 0, result.stderr
    targets = re.findall(r"^\s+make (\S+)", result.stdout, re.MULTILINE)
    assert targets == ["help", "deps", "build", "kata", "watch", "reset"]


def test_make_kata_on_the_shipped_handout(shipped_handout):
    result = run(["make", "kata", f"PYTHON={sys.executable}"], shipped_handout)
    out = result.stdout
    assert result.returncode != 0 and "Error 1" in result.stderr, out + result.stderr
    assert "Traceback" not in out + result.stderr
    for flaw in CATALOG:  # one line per flaw: mark, id, title, and why a skipped one skipped
        reason = MACHINE.skip_reason(flaw)
        mark, tail = ("–", f"(skipped: {reason.split(';')[0]})") if reason else ("✗", "")
        line = rf"^  {mark} {re.escape(flaw.id)} +{re.escape(flaw.title)}\s*{re.escape(tail)}$"
        assert re.search(line, out, re.MULTILINE), f"no line for {flaw.id}:\n{out}"
    skipped = f" ({len(SKIPPED_HERE)} skipped here)" if SKIPPED_HERE else ""
    assert f"\n0/{len(RUN_HERE)} fixed on this machine{skipped}\n" in out

    # The first failure to come is shown in full under its line, as it came; the end points
    # at it and says what to do next.
    first_id = re.search(r"^First failure: (\S+) - ", out, re.MULTILINE)[1]
    first = next(flaw for flaw in RUN_HERE if flaw.id == first_id)
    assert re.search(rf"^  ✗ {first.id} .*\n\nFirst failure: {first.id} - ", out, re.MULTILINE)
    assert out.count(f"Hint:    python -m kata hint {first.id}\n") == 1, out
    seed = re.search(rf"Replay:  python -m kata review --only {first.id} --seed (\d+)\n", out)
    assert seed, out
    assert out.index("Replay:") < out.index(" fixed on this machine"), out
    assert f"\nFirst failure: {first.id}, in full above.\n" in out, out
    assert out.rstrip().endswith(
        f"Next: make {first.id} pass, then run `make kata` again "
        "(`make watch` re-runs it on every save)."
    )

    # The replay command reproduces the evidence printed: the same cases, failing the same way.
    # Word for word but for parentheses, signal names and numbers, which vary from run to run:
    # a corrupted heap aborts (SIGABRT, with what the C library says) or faults (SIGSEGV, seen
    # in CI on torch 2.15), and a result read from memory nothing wrote has another error each
    # time (the first failure to come may be contiguity's: "relative error 1.1", then "0.99").
    replay = kata("review", "--only", first.id, "--seed", seed[1], "--json", cwd=shipped_handout)
    evidence = json.loads(replay.stdout)["flaws"][0]["evidence"]
    printed = out.split(f" - {first.title}\n", 1)[1].split("\n\n", 1)[0]
    assert words(printed) == words(evidence)


def test_hints_go_up_a_level_each_time_and_stay_in_the_handout(handout):
    state = REPO_ROOT / ".kata-hints.json"
    ours = state.read_text() if state.exists() else None
    (handout / ".kata-hints.json").unlink(missing_ok=True)
    for level in (1, 2, 3):
        result = kata("hint", "dtype", cwd=handout)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"Hint {level} of 3 for dtype"), result.stdout
    assert json.loads((handout / ".kata-hints.json").read_text()) == {"dtype": 3}
    assert hints.hints_used(handout / "flawed") == {"dtype": 3}  # what the scorecard reads
    assert (state.read_text() if state.exists() else None) == ours


def test_handout_holds_no_hint_or_location_in_plain_text(handout):
    """Hints and where each flaw sits are answers: a grep of the handout finds none of them, nor
    a sentence or a telling word of one, while `python -m kata hint` still shows them."""
    answers = {text for flaw in CATALOG for text in (flaw.where, *flaw.hints)}
    pieces = {p.strip() for a in answers for p in re.split(r"[.;:?]\s", a) if len(p.strip()) > 25}
    words = {
        "getCurrentCUDAStream", "register_autograd", "autograd.Function", "TORCH_LIBRARY",
        "int64_t", "seq_len <= 4096", "uninitialised", "pageable", "ABI change", "fake (meta)",
    }  # fmt: skip
    assert all(any(word in answer for answer in answers) for word in words), "words moved?"
    texts = {
        path.relative_to(handout).as_posix(): path.read_text(errors="replace").lower()
        for path in handout.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".so"
    }
    for needle in sorted(answers | pieces | words):
        found = [name for name, text in texts.items() if needle.lower() in text]
        assert not found, f"{needle!r} is in plain text in {found}"

    (handout / ".kata-hints.json").unlink(missing_ok=True)
    result = kata("hint", "dtype", cwd=handout)
    assert result.returncode == 0, result.stderr
    assert f"\n  {CATALOG[0].hints[0]}\n" in result.stdout, result.stdout
    (handout / ".kata-hints.json").write_text(json.dumps({"dtype": 2}))
    result = kata("hint", "dtype", cwd=handout)
    assert CATALOG[0].hints[2] in result.stdout and CATALOG[0].where in result.stdout
    (handout / ".kata-hints.json").unlink()


def test_hints_used_reads_the_record_beside_or_inside_the_copy(tmp_path):
    copy = tmp_path / "flawed"
    copy.mkdir()
    assert hints.hints_used(copy) is None  # no record
    (tmp_path / ".kata-hints.json").write_text(json.dumps({"dtype": 2, "shape": 1}))
    assert hints.hints_used(copy) == {"dtype": 2, "shape": 1}
    # A submitted copy of flawed/ may carry its own: the higher level counts.
    (copy / ".kata-hints.json").write_text(json.dumps({"dtype": 3, "stream": 1}))
    assert hints.hints_used(copy) == {"dtype": 3, "shape": 1, "stream": 1}
    (tmp_path / ".kata-hints.json").unlink()
    assert hints.hints_used(copy) == {"dtype": 3, "stream": 1}


@pytest.mark.parametrize(
    "record", ["{not json", "[1, 2]", '{"dtype": "3"}', '{"dtype": 0}', '{"dtype": true}', ""]
)
def test_hints_used_ignores_a_malformed_record(tmp_path, record):
    (tmp_path / ".kata-hints.json").write_text(record)
    assert hints.hints_used(tmp_path / "flawed") is None
    # ... and the hint command starts it over instead of crashing on it.
    state = tmp_path / ".kata-hints.json"
    assert hints.next_hint("dtype", state).startswith("Hint 1 of 3 for dtype")
    assert hints.hints_used(tmp_path / "flawed") == {"dtype": 1}


def test_watch_rechecks_on_save_and_counts_the_dtype_fix(shipped_handout):
    """make watch: the first check, then the candidate saves the dtype fix, then a second check
    that counts it; Ctrl-C (SIGINT to the terminal's process group) stops it cleanly."""
    watch = subprocess.Popen(
        ["make", "watch", f"PYTHON={sys.executable}"],
        cwd=shipped_handout,
        env=candidate_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal would give it
        preexec_fn=sigint_at_default,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in watch.stdout])
    reader.start()
    seen: list[str] = []

    def read_until(text: str, timeout: float = 120) -> None:
        """Read lines until a new one holds `text`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                pytest.fail(f"no {text!r} within {timeout} s:\n{''.join(seen)}")
            if text in seen[-1]:
                return

    try:
        read_until("watching flawed/ (Ctrl-C to stop)")
        first_run = "".join(seen)
        (shipped_handout / WRAPPER).write_text(with_dtype_fix(SHIPPED_WRAPPER))
        read_until("watching flawed/ (Ctrl-C to stop)")
        second_run = "".join(seen)[len(first_run) :]
        os.killpg(watch.pid, signal.SIGINT)
        watch.wait(timeout=30)
    finally:
        if watch.poll() is None:
            os.killpg(watch.pid, signal.SIGKILL)
    reader.join(timeout=10)
    rest = "".join(lines.get() for _ in range(lines.qsize()))
    assert f"0/{len(RUN_HERE)} fixed on this machine" in first_run
    assert "saved: attention_wrapper.py" in second_run, second_run
    assert re.search(r"^  ✓ dtype ", second_run, re.MULTILINE), second_run
    assert f"1/{len(RUN_HERE)} fixed on this machine" in second_run
    first_failure = re.search(r"^First failure: (\S+) - ", second_run, re.MULTILINE)
    assert first_failure and first_failure[1] in {f.id for f in RUN_HERE[1:]}, second_run
    assert "stopped watching." in rest and "Traceback" not in first_run + second_run + rest


def test_reset_restores_the_shipped_wrapper_and_keeps_a_backup(handout):
    edited = SHIPPED_WRAPPER + "\n# my edit\n"
    (handout / WRAPPER).write_text(edited)
    result = run(["make", "reset", f"PYTHON={sys.executable}"], handout)  # no terminal to ask
    assert "kata: reset needs confirmation: run `python -m kata reset --yes`" in result.stderr
    assert (handout / WRAPPER).read_text() == edited

    result = kata("reset", "--yes", cwd=handout)
    assert result.returncode == 0, result.stderr
    assert (handout / WRAPPER).read_text() == SHIPPED_WRAPPER
    backup = re.search(r"Your copy: (\S+)/", result.stdout)[1]
    assert (handout / backup / "attention_wrapper.py").read_text() == edited


def test_handout_has_no_fixed_to_review(handout):
    for command in (["review", "--impl", "fixed"], ["check", "--impl", "fixed"]):
        result = kata(*command, cwd=handout)
        assert result.returncode == 2
        assert (
            result.stderr == "kata: this copy has no fixed/ (a candidate's handout leaves it out)\n"
        )


def test_make_kata_says_when_the_wrapper_does_not_import(shipped_handout):
    broken = SHIPPED_WRAPPER.replace(
        "def fast_attention(query, key, value):", "def fast_attention(query, key, value"
    )
    assert broken != SHIPPED_WRAPPER
    (shipped_handout / WRAPPER).write_text(broken)
    line = 1 + SHIPPED_WRAPPER.split("\n").index("def fast_attention(query, key, value):")
    try:
        result = run(["make", "kata", f"PYTHON={sys.executable}"], shipped_handout)
    finally:
        (shipped_handout / WRAPPER).write_text(SHIPPED_WRAPPER)
    out = result.stdout
    assert result.returncode != 0 and "Traceback" not in out + result.stderr, out + result.stderr
    assert re.search(
        rf"^attention_wrapper.py does not import: syntax error at attention_wrapper.py:{line}: ",
        out,
        re.MULTILINE,
    ), out
    assert "Fix that first: every check needs it." in out
    assert "First failure" not in out, out
