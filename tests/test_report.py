"""The interviewer's report: header, scorecard, level band, the candidate's changes, Markdown and
--explain; and the interviewer's loop: a copy with three flaws fixed is graded exactly so."""

from __future__ import annotations

import difflib
import shutil
import subprocess
import sys

import pytest

from kata import FLAWED_DIR, REPO_ROOT
from kata.harness.catalog import CATALOG
from kata.harness.review import resolve_implementation, run_review
from kata.interviewer import report

SHIPPED_WRAPPER = (FLAWED_DIR / "attention_wrapper.py").read_text()

# Three fixes a candidate might make, each a plain edit of the shipped wrapper.
THREE_FIXES = {
    "library-path": (
        'ctypes.CDLL("./custom_attention.so")',
        'ctypes.CDLL(str(Path(__file__).resolve().parent / "custom_attention.so"))',
    ),
    "dtype": (
        "    batch_size, seq_len, _ = query.shape\n",
        "    for tensor in (query, key, value):\n"
        "        if tensor.dtype != torch.float32:\n"
        "            raise TypeError(f'fast_attention needs float32 tensors, got {tensor.dtype}')\n"
        "    batch_size, seq_len, _ = query.shape\n",
    ),
    "error-code": (
        "    _lib.launch_attention_kernel(\n",
        "    status = _lib.launch_attention_kernel(\n",
    ),
}
RAISE_ON_STATUS = (
    "    return output\n",
    "    if status != 0:\n"
    "        raise RuntimeError(f'kernel failed: status {status}, seq_len {seq_len}')\n"
    "    return output\n",
)


def three_flaws_fixed(source: str) -> str:
    for old, new in [*THREE_FIXES.values(), RAISE_ON_STATUS]:
        assert old in source, old
        source = source.replace(old, new, 1)
    return "from pathlib import Path\n" + source


@pytest.fixture(scope="module")
def candidate_dir(tmp_path_factory, flawed_library):
    """A submitted copy of flawed/ with three flaws fixed and one lint finding."""
    copy = tmp_path_factory.mktemp("submission") / "flawed"
    shutil.copytree(FLAWED_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    wrapper = three_flaws_fixed(SHIPPED_WRAPPER).replace(
        "import ctypes\n", "import ctypes\nimport os\n"
    )
    (copy / "attention_wrapper.py").write_text(wrapper)
    return copy


@pytest.fixture(scope="module")
def candidate_review(candidate_dir):
    cpu_flaws = [flaw.id for flaw in CATALOG if flaw.cpu_visible]
    return run_review(resolve_implementation(str(candidate_dir)), only=cpu_flaws)


def test_three_fixed_flaws_are_graded_fixed_and_only_those(candidate_review):
    fixed = {r.flaw.id for r in candidate_review.reports if r.result.status == "fixed"}
    assert fixed == set(THREE_FIXES), {
        r.flaw.id: r.result.evidence for r in candidate_review.reports
    }
    assert candidate_review.earned == sum(f.points for f in CATALOG if f.id in THREE_FIXES)


def test_changes_name_the_edited_lines_and_ruff_findings(candidate_review):
    changes = report.candidate_changes(candidate_review)
    [change] = changes.files
    assert (change.name, change.status) == ("attention_wrapper.py", "edited")
    assert change.added > 0 and change.lines
    if shutil.which("ruff") is None:
        pytest.skip("ruff is not installed")
    assert any("F401" in finding and "os" in finding for finding in changes.lint), changes.lint


def test_markdown_report_has_score_changes_and_full_evidence(candidate_review, tmp_path):
    bands = report.level_bands()
    text = report.format_markdown(
        candidate_review, report.candidate_changes(candidate_review), bands
    )
    assert text.startswith("# Attention-wrapper kata: review")
    for r in candidate_review.reports:
        assert f"| `{r.flaw.id}` | {r.result.status} |" in text
        assert r.result.evidence.replace("|", "\\|") in text  # in full, never shortened
    assert f"Score: {candidate_review.earned} of {candidate_review.possible} points" in text
    assert "## Changes compared with the shipped flawed/" in text
    assert "attention_wrapper.py: edited" in text


def test_markdown_says_why_skipped_flaws_were_not_judged(fixed_review):
    text = report.format_markdown(fixed_review, None, [])
    skipped = [r for r in fixed_review.reports if r.result.status == "skipped"]
    if not skipped:
        pytest.skip("every flaw ran on this machine")
    assert "## Not judged on this machine: ask about these instead" in text
    for r in skipped:
        assert f"- `{r.flaw.id}` ({r.flaw.title}): {r.result.evidence}" in text


def test_level_bands_cover_every_score_once():
    bands = report.level_bands()
    assert bands, "rubric.md has no level-band table"
    covered = [p for low, high, _ in bands for p in range(low, high + 1)]
    assert sorted(covered) == list(range(101))


def test_level_band_follows_the_percentage(fixed_review):
    bands = [(0, 49, "low"), (50, 100, "high")]
    assert report.level_for(fixed_review, bands) == "high"  # fixed/ earns every point
    assert report.level_for(fixed_review, []) is None


def test_table_has_header_one_line_per_flaw_and_score(candidate_review):
    text = report.format_table(candidate_review, report.candidate_changes(candidate_review), [])
    lines = text.splitlines()
    assert lines[1].startswith("implementation: ") and "round 1" in lines[1]
    assert lines[2].startswith("device: ") and lines[3].startswith("date: ")
    for r in candidate_review.reports:
        [row] = [line for line in lines if line.startswith(r.flaw.id + " ")]
        assert r.result.status in row
    score = f"Score: {candidate_review.earned} of {candidate_review.possible} points"
    assert any(line.startswith(score) for line in lines)


def test_explain_shows_code_evidence_and_rubric():
    completed = subprocess.run(
        [sys.executable, "-m", "kata", "review", "--explain", "library-path"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 0, completed.stderr
    out = completed.stdout
    assert ">" in out and 'ctypes.CDLL("./custom_attention.so")' in out  # the flawed line
    assert "Live evidence on" in out and "present: " in out
    assert "## `library-path`: dlopen by a relative path (CWE-427)" in out
    assert "**Points: 6**" in out


def test_explain_names_unknown_ids():
    completed = subprocess.run(
        [sys.executable, "-m", "kata", "review", "--explain", "nope"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 2
    assert "unknown flaw id 'nope' in round 1" in completed.stderr


def test_touched_lines_are_the_edited_ones_not_the_diff_context(tmp_path):
    old = [f"line {n}" for n in range(1, 21)]
    new = [*old[:4], "inserted a", "inserted b", *old[4:9], "line 10 edited", *old[10:]]
    (tmp_path / "wrapper.py").write_text("\n".join(new))
    diff = list(difflib.unified_diff(old, new, lineterm=""))
    change = report._file_change("wrapper.py", diff, tmp_path)
    assert (change.added, change.removed) == (3, 1)
    assert change.lines == [(5, 6), (12, 12)]  # 5-6 inserted; old line 10 is new line 12
