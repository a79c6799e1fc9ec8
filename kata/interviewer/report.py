"""What `make review` prints for the interviewer: a header, the scorecard, the score with its
level band from rubric.md, and what the candidate changed; as a terminal table or as Markdown.
`python -m kata review --explain ID` puts a flaw's code, live evidence and rubric section together.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from kata import REPO_ROOT
from kata.harness.catalog import Flaw
from kata.harness.review import Review
from kata.harness.rubric import RUBRIC, level_bands, rubric_section
from kata.toolchain import shipped

__all__ = ["RUBRIC", "level_bands", "rubric_section"]  # and the formatters below


def level_for(review: Review, bands) -> str | None:
    return review.level(bands)


# ------------------------------------------------------------------------ candidate changes


@dataclass
class FileChange:
    name: str
    added: int
    removed: int
    lines: list[tuple[int, int]]  # touched line ranges in the candidate's file (first, last)
    status: str = "edited"  # "edited", "added" or "removed"


@dataclass
class Changes:
    baseline: str  # what the files are compared with, e.g. "the shipped flawed/"
    files: list[FileChange] = field(default_factory=list)
    lint: list[str] = field(default_factory=list)  # ruff check findings in the changed files
    lint_note: str | None = None  # why there are no findings to show, when ruff did not run


def candidate_changes(review: Review) -> Changes | None:
    """What the reviewed copy changed against the shipped code; None for fixed/."""
    implementation = review.implementation
    if implementation.kind != "dir":
        return None
    if review.round == 2:
        subdir, skip, baseline = shipped.ROUND2_SUBDIR, None, "the shipped flawed/proposed_fix/"
    else:
        subdir, skip, baseline = None, shipped.ROUND2_SUBDIR, "the shipped flawed/"
    diffs = shipped.diff(implementation.path, subdir, skip)
    changes = Changes(baseline)
    for name, lines in diffs.items():
        changes.files.append(_file_change(name, lines, implementation.path))
    python_files = [
        change.name
        for change in changes.files
        if change.name.endswith(".py") and change.status != "removed"
    ]
    changes.lint, changes.lint_note = _ruff(implementation.path, python_files)
    return changes


def _file_change(name: str, diff_lines: list[str], directory: Path) -> FileChange:
    added = removed = 0
    touched: list[int] = []  # lines of the candidate's file that are new, or where lines went
    line = 0
    for text in diff_lines:
        if text.startswith(("+++", "---")):
            continue
        if hunk := re.match(r"^@@ -\d+(?:,\d+)? \+(\d+)", text):
            line = int(hunk.group(1))
        elif text.startswith("+"):
            added += 1
            touched.append(line)
            line += 1
        elif text.startswith("-"):
            removed += 1
            touched.append(max(line, 1))
        else:
            line += 1
    exists = (directory / name).exists()
    status = (
        "removed" if not exists else "added" if name not in _shipped_names(directory) else "edited"
    )
    return FileChange(name, added, removed, _as_ranges(sorted(set(touched))), status)


def _as_ranges(numbers: list[int]) -> list[tuple[int, int]]:
    ranges: list[tuple[int, int]] = []
    for n in numbers:
        if ranges and n == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], n)
        else:
            ranges.append((n, n))
    return ranges


def _shipped_names(directory: Path) -> set[str]:
    # The candidate's directory is a copy of flawed/ or of flawed/proposed_fix/.
    subdir = shipped.ROUND2_SUBDIR if (directory / "csrc").is_dir() else None
    return set(shipped.shipped(subdir))


def _ruff(directory: Path, files: list[str]) -> tuple[list[str], str | None]:
    if not files:
        return [], None
    ruff = shutil.which("ruff")
    if ruff is None:
        return [], "ruff is not installed: no lint findings"
    command = [ruff, "check", "--output-format=concise", "--no-cache", "--quiet"]
    config = REPO_ROOT / "pyproject.toml"
    if config.exists():
        command += ["--config", str(config)]
    try:
        result = subprocess.run(
            [*command, *files], cwd=directory, capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        return [], "ruff ran past 60 s: no lint findings"
    findings = [line for line in result.stdout.splitlines() if re.match(r"^\S+:\d+:\d+: ", line)]
    return findings, None


def _ranges(lines: list[tuple[int, int]]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}–{b}" for a, b in lines)


def _describe(change: FileChange) -> str:
    if change.status == "removed":
        return f"{change.name}: removed"
    where = f" (lines {_ranges(change.lines)})" if change.lines else ""
    return f"{change.name}: {change.status}, +{change.added} −{change.removed}{where}"


# -------------------------------------------------------------------------------- outputs


def _header(review: Review) -> list[tuple[str, str]]:
    implementation = review.implementation
    where = "" if implementation.kind == "fixed" else f" ({implementation.path})"
    date = review.date.strftime("%Y-%m-%d %H:%M %Z")
    rows = [
        ("implementation", f"{implementation.label}{where}, round {review.round}"),
        ("device", review.machine.device),
        ("date", f"{date}    seed: {review.seed}"),
        ("vendor kernel", review.kernel_line),
    ]
    if review.sandbox_note:
        rows.append(("sandbox", review.sandbox_note))
    if implementation.kind == "dir":
        rows.append(("hints used", _hints_line(review.hints_used)))
    return rows


def _hints_line(used: dict[str, int] | None) -> str:
    if used is None:
        return "no hint record found (.kata-hints.json)"
    if not used:
        return "none"
    return ", ".join(f"{flaw_id} (level {level})" for flaw_id, level in sorted(used.items()))


def _score_line(review: Review, bands) -> str:
    if cause := review.import_failure:
        # No flaw was judged: a score would measure the import, not the fixes.
        return (
            f"Not judged: attention_wrapper.py does not import ({cause}). Every probe needs it, "
            "so there is no score or level band until it imports."
        )
    judged = [r for r in review.reports if r.result.status != "skipped"]
    skipped = len(review.reports) - len(judged)
    percent = f" ({round(100 * review.earned / review.possible)}%)" if review.possible else ""
    line = f"Score: {review.earned} of {review.possible} points{percent}"
    if level := level_for(review, bands):
        line += f", level band: {level} (rubric.md, Level bands)"
    count = f"{len(judged)} flaw{'s' if len(judged) != 1 else ''} judged on this machine"
    return line + f". {count}" + (f"; {skipped} skipped, not counted." if skipped else ".")


def format_table(review: Review, changes: Changes | None, bands) -> str:
    width = max(80, min(shutil.get_terminal_size((120, 24)).columns, 160))
    header = [f"{label + ':':<15} {value}" for label, value in _header(review)]
    lines = ["Attention-wrapper kata: review", *header, ""]
    if review.import_failure:
        lines += [_score_line(review, bands), ""]
    id_width = max([13, *(len(r.flaw.id) for r in review.reports)])
    lines.append(f"{'ID':<{id_width}} {'STATUS':<8} {'POINTS':>6}  EVIDENCE")
    for report in review.reports:
        points = (
            "-" if report.result.status == "skipped" else f"{report.earned}/{report.flaw.points}"
        )
        head = f"{report.flaw.id:<{id_width}} {report.result.status:<8} {points:>6}  "
        room = max(20, width - len(head))
        lines.append(head + textwrap.shorten(report.result.evidence, room, placeholder=" …"))
    lines += ["", _score_line(review, bands)]
    if changes is not None:
        lines += ["", f"Changes compared with {changes.baseline}:"]
        lines += [f"  {_describe(c)}" for c in changes.files] or ["  none: as shipped"]
        if changes.files:
            lines.append(_lint_summary(changes))
            lines += [f"    {finding}" for finding in changes.lint]
    lines += [
        "",
        "Full evidence: --markdown FILE or --json. A flaw in depth: --explain ID. "
        "Points and follow-ups: rubric.md.",
    ]
    return "\n".join(lines)


def _lint_summary(changes: Changes) -> str:
    if changes.lint_note:
        return f"  {changes.lint_note}"
    count = len(changes.lint)
    return f"  ruff check: {count} finding{'s' if count != 1 else ''} in the changed files"


def format_markdown(review: Review, changes: Changes | None, bands) -> str:
    lines = ["# Attention-wrapper kata: review", ""]
    lines += [f"- **{label}:** {' '.join(value.split())}" for label, value in _header(review)]
    lines += ["", f"**{_score_line(review, bands)}**", ""]
    lines += ["| id | status | points | evidence |", "| --- | --- | ---: | --- |"]
    for report in review.reports:
        points = (
            "–" if report.result.status == "skipped" else f"{report.earned}/{report.flaw.points}"
        )
        evidence = report.result.evidence.replace("|", "\\|")
        lines.append(f"| `{report.flaw.id}` | {report.result.status} | {points} | {evidence} |")
    skipped = [r for r in review.reports if r.result.status == "skipped"]
    if skipped:
        lines += ["", "## Not judged on this machine: ask about these instead", ""]
        lines += [f"- `{r.flaw.id}` ({r.flaw.title}): {r.result.evidence}" for r in skipped]
    if changes is not None:
        lines += ["", f"## Changes compared with {changes.baseline}", ""]
        lines += [f"- {_describe(c)}" for c in changes.files] or ["- none: as shipped"]
        if changes.files:
            lines += ["", _lint_summary(changes).strip()]
            if changes.lint:
                lines += ["", "```", *changes.lint, "```"]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------- explain


def code_excerpt(flaw: Flaw, directory: Path, context: int = 1) -> list[str]:
    """The shipped code lines a flaw sits in, numbered, with `context` lines around each."""
    excerpt = []
    for name, needle in flaw.code:
        path = directory / name
        if not path.exists():
            continue
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, start=1):
            if needle in line:
                excerpt.append(f"{name}:")
                for n in range(max(1, number - context), min(len(lines), number + context) + 1):
                    mark = ">" if n == number else " "
                    excerpt.append(f"  {mark}{n:4d}  {lines[n - 1]}")
                break
    return excerpt


def format_explanation(review: Review) -> str:
    """One flaw in depth: where it sits in the code, the live evidence, the rubric's section."""
    [report] = review.reports
    flaw, result = report.flaw, report.result
    lines = [f"{flaw.id}: {flaw.title} ({flaw.points} points)", "", "Where it sits: " + flaw.where]
    excerpt = code_excerpt(flaw, review.implementation.path)
    if excerpt:
        lines += ["", *excerpt]
    lines += ["", f"Live evidence on {review.machine.device} ({review.implementation.label}):"]
    lines += textwrap.wrap(
        f"{result.status}: {result.evidence}", 100, initial_indent="  ", subsequent_indent="  "
    )
    section = rubric_section(flaw.id)
    lines += ["", section if section else "rubric.md has no section for this flaw here."]
    return "\n".join(lines)
