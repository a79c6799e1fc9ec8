"""The candidate's loop, tested as a candidate meets it: in a fresh handout (`make handout`),
through its own Makefile, with nothing of this repository on the path.

One handout per module: its first check builds the vendor library there (g++), and each check
runs every probe in its own process, so the checks are the slow part; the tests share them.
"""

from __future__ import annotations

import argparse
import io
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
from kata.candidate import commands as candidate
from kata.harness import hints, isolation
from kata.harness.catalog import CATALOG
from kata.harness.isolation import Implementation, ProbeResult
from kata.harness.review import FlawReport, Machine, Review
from kata.interviewer.handout import build_handout
from kata.toolchain import shipped
from tests.terminal_support import sigint_at_default

WRAPPER = "flawed/attention_wrapper.py"
SHIPPED_WRAPPER = shipped.shipped()["attention_wrapper.py"]
# The fix a candidate would make first: float32 only, and a TypeError that names the dtype.
DTYPE_FIX = (
    "    if any(t.dtype != torch.float32 for t in (query, key, value)):\n"
    "        raise TypeError(f'fast_attention needs float32 inputs, got dtype {query.dtype}')\n"
)
MACHINE = Machine.detect()
# What runs here: the CPU-visible flaws on a machine without a GPU, more on a GPU machine.
RUN_HERE = [flaw for flaw in CATALOG if MACHINE.skip_reason(flaw) is None]
SKIPPED_HERE = [flaw for flaw in CATALOG if MACHINE.skip_reason(flaw) is not None]


def _env() -> dict[str, str]:
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
    options.update(env=_env(), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return subprocess.run(command, cwd=cwd, **options)


def kata(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "kata", *args], cwd)


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
    assert _words(printed) == _words(evidence)


def _words(text: str) -> str:
    text = re.sub(r"\((?:[^()]|\([^()]*\))*\)", "", text)
    text = re.sub(r"\bSIG[A-Z]+\b", "SIG", text)
    return " ".join(re.sub(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?", "N", text).split())


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
        env=_env(),
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


def test_check_exits_0_when_every_flaw_that_ran_is_fixed():
    result = kata("check", "--impl", "fixed", cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"\n{len(RUN_HERE)}/{len(RUN_HERE)} fixed on this machine" in result.stdout
    assert "Every check that runs here passes" in result.stdout
    assert "First failure" not in result.stdout


def _review(statuses: dict[str, str]) -> Review:
    reports = [
        FlawReport(flaw, ProbeResult(statuses.get(flaw.id, "fixed"), f"evidence of {flaw.id}"))
        for flaw in CATALOG
    ]
    return Review(Implementation("flawed", "dir", REPO_ROOT / "flawed"), MACHINE, 7, reports)


def test_exit_status_counts_only_the_flaws_that_ran():
    style = candidate._Style(io.StringIO())  # not a TTY: no colour
    text, status = candidate.format_check(_review({"stream": "skipped"}), style)
    assert status == 0 and f"\n{len(CATALOG) - 1}/{len(CATALOG) - 1} fixed" in text
    long_evidence = "; ".join(f"case {n}: wrong result, relative error 0.{n}" for n in range(40))
    review = _review({"stream": "skipped", "shape": "present"})
    next(r for r in review.reports if r.flaw.id == "shape").result.evidence = long_evidence
    text, status = candidate.format_check(review, style)
    assert status == 1 and "First failure: shape" in text
    assert _words(long_evidence) in _words(text)  # wrapped, never cut
    assert "\x1b[" not in text


def _not_importing(cause: str) -> Review:
    """A review in which every probe met a wrapper that does not import."""
    review = _review({f.id: "present" if f in RUN_HERE else "skipped" for f in CATALOG})
    for report in review.reports:
        if report.result.status == "present":
            report.result.evidence = f"importing attention_wrapper.py failed: {cause}"
            report.result.import_failure = cause
    if not isinstance(getattr(Review, "import_failure", None), property):
        review.import_failure = cause  # a plain attribute, not derived from the results
    return review


def test_a_wrapper_that_does_not_import_is_said_first_not_a_flaws_hint():
    cause = "syntax error at attention_wrapper.py:12: invalid syntax"
    text, status = candidate.format_check(_not_importing(cause), candidate._Style(io.StringIO()))
    assert status == 1
    assert f"\nattention_wrapper.py does not import: {cause}.\n" in text, text
    assert "Fix that first: every check needs it." in text
    assert "First failure" not in text and "python -m kata hint" not in text, text
    text, _ = candidate.format_check(
        _not_importing(cause), candidate._Style(io.StringIO()), watching=True
    )
    assert "save a file in" in text.splitlines()[-1]


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


def test_one_cause_behind_many_failures_is_pointed_out():
    broken = _review({flaw.id: "present" for flaw in CATALOG})
    for report in broken.reports:
        report.result.evidence = "importing the implementation failed: SyntaxError: invalid syntax"
    text, status = candidate.format_check(broken, candidate._Style(io.StringIO()))
    assert status == 1 and f"({len(CATALOG)} failing checks say this: start here)" in text


class _Pipe(io.StringIO):
    """stdout as a pipe takes it: what the reader has by now is what was flushed."""

    encoding = "utf-8"

    def __init__(self):
        super().__init__()
        self.flushed = ""

    def flush(self):
        super().flush()
        self.flushed = self.getvalue()


def _check_args(**options) -> argparse.Namespace:
    return argparse.Namespace(**{"impl": "flawed", "watching": False} | options)


def test_check_shows_the_first_failure_in_full_before_the_other_checks_end(monkeypatch, tmp_path):
    """A slow check must not hold back a failure already known: `check` prints each flaw's line
    as its report comes and the first failure to come in full at once, flushed (make watch and
    tests read a pipe); the end points at it instead of repeating it."""
    fixed, failing, *rest = RUN_HERE  # `failing` fails first; the catalog's first is fixed
    statuses = {flaw.id: "present" for flaw in RUN_HERE} | {fixed.id: "fixed"}
    statuses |= {flaw.id: "skipped" for flaw in SKIPPED_HERE}
    reports = {
        flaw.id: FlawReport(flaw, ProbeResult(statuses[flaw.id], f"evidence of {flaw.id}"))
        for flaw in CATALOG
    }
    out, seen_then, calls = _Pipe(), {}, {}

    def run_review(implementation, *, seed=None, on_report=None, first=None, **options):
        calls.update(seed=seed, first=first)
        for flaw in [*SKIPPED_HERE, fixed, failing, *rest]:  # completion order, not catalog's
            time.sleep(0.02)
            if on_report:
                on_report(reports[flaw.id])
            seen_then[flaw.id] = out.flushed
        return Review(implementation, MACHINE, seed or 7, [reports[f.id] for f in CATALOG])

    monkeypatch.setattr("kata.harness.review.run_review", run_review)
    monkeypatch.setattr(sys, "stdout", out)
    record = tmp_path / "failing"
    status = candidate._check(_check_args(first="stream,shape", failing_to=str(record)))
    text = out.getvalue()
    assert status == 1 and out.flushed == text

    # By the time the first failure's report is in, the reader has it in full, seed and all.
    replay = f"Replay:  python -m kata review --only {failing.id} --seed {calls['seed']}\n"
    then = seen_then[failing.id]
    assert f"First failure: {failing.id} - {failing.title}\n    evidence of {failing.id}\n" in then
    assert f"Hint:    python -m kata hint {failing.id}\n" in then and replay in then, then
    width = max(len(flaw.id) for flaw in CATALOG)
    assert f"  ✓ {fixed.id:<{width}}  {fixed.title}\n" in seen_then[fixed.id]
    for flaw in CATALOG:  # each line once, as it came, and not before
        line = rf"^  . {flaw.id} "
        assert len(re.findall(line, text, re.MULTILINE)) == 1, text
        assert re.search(line, seen_then[flaw.id], re.MULTILINE), flaw.id
    before = seen_then[fixed.id]
    assert not any(re.search(rf"^  . {f.id} ", before, re.M) for f in [failing, *rest])
    # The end: the progress, a pointer to the failure above, what to do next.
    end = text[len(seen_then[rest[-1].id if rest else failing.id]) :]
    skipped = f" ({len(SKIPPED_HERE)} skipped here)" if SKIPPED_HERE else ""
    assert end == (
        f"\n1/{len(RUN_HERE)} fixed on this machine{skipped}\n\n"
        f"First failure: {failing.id}, in full above.\n\n"
        f"Next: make {failing.id} pass, then run `make kata` again "
        "(`make watch` re-runs it on every save).\n"
    ), end
    assert text.count("Hint:") == 1 and text.count("Replay:") == 1, text
    # For `watch`: the order asked for went to the review, and the failing ids come back.
    assert calls["first"] == ["stream", "shape"]
    assert record.read_text().split() == [f.id for f in RUN_HERE if f is not fixed]


def test_watch_starts_with_the_checks_that_failed_last_time(monkeypatch, capsys):
    """Each save's check starts the probes of the flaws that failed in the check before it;
    a check that records nothing (it crashed, say) leaves the order as it was."""
    commands, recorded = [], [["shape", "stream"], ["stream"], None, [], []]

    def run(command, **options):
        commands.append(command)
        assert options["env"][isolation.LASTING] == "judge=J"
        ids = recorded[len(commands) - 1]
        if ids is not None and "--failing-to" in command:
            Path(command[command.index("--failing-to") + 1]).write_text("\n".join(ids))
        return subprocess.CompletedProcess(command, 2 if ids is None else 1)

    monkeypatch.setattr(candidate.subprocess, "run", run)
    monkeypatch.setattr(candidate, "_wait_for_save", lambda *args: ["attention_wrapper.py"])
    kept = []  # the zygotes watch keeps for all its checks: started once, named to each
    monkeypatch.setattr(
        isolation, "lasting_zygotes", lambda: kept.append(1) or {isolation.LASTING: "judge=J"}
    )
    args = argparse.Namespace(impl="flawed", max_runs=5, interval=0.01)
    assert candidate._watch(args) == 0
    assert kept == [1]

    def first(command):
        return command[command.index("--first") + 1] if "--first" in command else None

    assert [first(command) for command in commands] == [
        None,  # nothing failed yet
        "shape,stream",
        "stream",
        "stream",  # the third check recorded nothing: the order stays
        None,  # every check passed
    ], commands
    assert all(command[3:5] == ["check", "--watching"] for command in commands)
    assert capsys.readouterr().out.count("saved: attention_wrapper.py") == 4


def test_review_reports_each_flaw_as_it_ends_and_starts_the_ones_asked_first(monkeypatch):
    """run_review hands each report over as its probe ends (the skipped ones at once), starts
    the probes of `first` before the others, and keeps its reports in catalog order."""
    from kata.harness import review as review_module

    ids = [flaw.id for flaw in RUN_HERE if flaw.probe_id != "library-path"][:4]
    delays = dict(zip(ids, (0.6, 0.0, 0.2, 0.1), strict=True))
    started, delivered = [], []

    def run_isolated(probe_id, implementation, **options):
        started.append(probe_id)
        time.sleep(delays[probe_id])
        return ProbeResult("present", f"evidence of {probe_id}")

    monkeypatch.setattr(review_module, "run_isolated", run_isolated)
    only = ids + [flaw.id for flaw in SKIPPED_HERE]
    implementation = Implementation("flawed", "dir", REPO_ROOT / "flawed")
    review = review_module.run_review(
        implementation,
        only=only,
        jobs=1,  # one probe at a time: the order they start in is the order they end in
        prepare=lambda path: None,  # nothing to build
        on_report=lambda report: delivered.append(report.flaw.id),
        first=[ids[2], "no-such-id", ids[1]],
    )
    skipped = [flaw.id for flaw in CATALOG if flaw.id in only and flaw in SKIPPED_HERE]
    assert started == [ids[2], ids[1], ids[0], ids[3]]
    assert delivered == skipped + started
    assert [r.flaw.id for r in review.reports] == [f.id for f in CATALOG if f.id in only]

    # Two at a time: each is handed over as it ends, not in the order it started.
    delivered.clear()
    review_module.run_review(
        implementation,
        only=ids,
        jobs=2,
        prepare=lambda path: None,
        on_report=lambda report: delivered.append(report.flaw.id),
    )
    # Ends at 0.0, 0.2, 0.3 (ids[3] starts when ids[2] ends), 0.6: no two at the same moment (a
    # tie at 0.3 went either way on a loaded machine).
    assert delivered == [ids[1], ids[2], ids[3], ids[0]]
