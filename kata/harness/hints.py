"""`python -m kata hint ID`: each call shows the next hint level for that flaw and remembers it.

The record (STATE_FILE, at the root of the candidate's copy) is what the interviewer's scorecard
reads back through hints_used().
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from kata import REPO_ROOT, KataError
from kata.harness.catalog import BY_ID, Flaw

STATE_FILE = REPO_ROOT / ".kata-hints.json"


def round_two_catalog() -> tuple[Flaw, ...]:
    """Round two's flaws where this copy has them: the interviewer's repository, not a handout."""
    if importlib.util.find_spec("kata.harness.round2") is None:
        return ()
    from kata.harness import round2

    return round2.CATALOG


def lookup(flaw_id: str) -> Flaw:
    """A flaw of round one, or of round two where this copy has it."""
    if flaw_id in BY_ID:
        return BY_ID[flaw_id]
    round_two = round_two_catalog()
    for flaw in round_two:
        if flaw.id == flaw_id:
            return flaw
    known = ", ".join(BY_ID)
    if round_two:
        known += "; round two: " + ", ".join(flaw.id for flaw in round_two)
    raise KataError(f"unknown flaw id {flaw_id!r}; known ids: {known}")


def _read_record(state_file: Path) -> dict[str, int] | None:
    """flaw id -> level, or None when the file is missing, unreadable or not such a record."""
    try:
        record = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    # A level is a whole number from 1 (bool is an int to isinstance, and no level).
    if not all(type(level) is int and level >= 1 for level in record.values()):
        return None
    return record


def hints_used(candidate_dir: Path) -> dict[str, int] | None:
    """The highest hint level reached per flaw id by the candidate whose copy of flawed/ is
    `candidate_dir`, or None when there is no record (or only a malformed one).

    `python -m kata hint` writes the record at the root of the candidate's copy, the parent of
    flawed/; a submitted copy may carry it inside. Both are read, and the higher level counts.
    """
    candidate_dir = Path(candidate_dir)
    records = [
        record
        for path in (candidate_dir / STATE_FILE.name, candidate_dir.parent / STATE_FILE.name)
        if (record := _read_record(path)) is not None
    ]
    if not records:
        return None
    used: dict[str, int] = {}
    for record in records:
        for flaw_id, level in record.items():
            used[flaw_id] = max(used.get(flaw_id, 0), level)
    return used


def next_hint(flaw_id: str, state_file: Path = STATE_FILE) -> str:
    flaw = lookup(flaw_id)
    reached = _read_record(state_file) or {}  # a malformed record starts over
    level = min(reached.get(flaw.id, 0) + 1, len(flaw.hints))
    reached[flaw.id] = level
    try:
        state_file.write_text(json.dumps(reached, indent=2, sort_keys=True) + "\n")
    except OSError as error:
        raise KataError(f"cannot record the hint in {state_file}: {error.strerror}") from None
    shown = [f"Hint {level} of {len(flaw.hints)} for {flaw.id} ({flaw.title}):"]
    shown.append("  " + flaw.hints[level - 1])
    if level < len(flaw.hints):
        shown.append(f"Run `python -m kata hint {flaw.id}` again for the next level.")
    else:
        shown.append(f"That was the last hint. Where to look: {flaw.where}")
    return "\n".join(shown)


def reset_hints(state_file: Path = STATE_FILE) -> None:
    state_file.unlink(missing_ok=True)
