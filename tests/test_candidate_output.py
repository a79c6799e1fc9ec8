"""What `make kata` (python -m kata check) and `watch` print, from reviews made up here and from
the checks of this repository's fixed/: the exit status, an import failure said first, the first
failure in full before the other checks end, the order in which the checks start."""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import time
from pathlib import Path

from kata import REPO_ROOT
from kata.candidate import commands as candidate
from kata.harness import isolation
from kata.harness.catalog import CATALOG
from kata.harness.isolation import Implementation, ProbeResult
from kata.harness.review import FlawReport, Review
from tests.candidate_support import MACHINE, RUN_HERE, SKIPPED_HERE, kata, words


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
    assert words(long_evidence) in words(text)  # wrapped, never cut
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


def test_check_exits_0_when_every_flaw_that_ran_is_fixed():
    result = kata("check", "--impl", "fixed", cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"\n{len(RUN_HERE)}/{len(RUN_HERE)} fixed on this machine" in result.stdout
    assert "Every check that runs here passes" in result.stdout
    assert "First failure" not in result.stdout
