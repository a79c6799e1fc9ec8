"""`python -m kata hint ID`: each call shows the next hint level for that flaw and remembers it."""

from __future__ import annotations

import json
from pathlib import Path

from kata import REPO_ROOT
from kata.catalog import get

STATE_FILE = REPO_ROOT / ".kata-hints.json"


def _levels_reached(state_file: Path) -> dict[str, int]:
    try:
        return json.loads(state_file.read_text())
    except (OSError, ValueError):
        return {}


def next_hint(flaw_id: str, state_file: Path = STATE_FILE) -> str:
    flaw = get(flaw_id)
    reached = _levels_reached(state_file)
    level = min(reached.get(flaw.id, 0) + 1, len(flaw.hints))
    reached[flaw.id] = level
    state_file.write_text(json.dumps(reached, indent=2, sort_keys=True) + "\n")
    shown = [f"Hint {n} of {len(flaw.hints)} for {flaw.id} ({flaw.title}):" for n in [level]]
    shown.append("  " + flaw.hints[level - 1])
    if level < len(flaw.hints):
        shown.append(f"Run `python -m kata hint {flaw.id}` again for the next level.")
    else:
        shown.append(f"That was the last hint. Where to look: {flaw.where}")
    return "\n".join(shown)


def reset_hints(state_file: Path = STATE_FILE) -> None:
    state_file.unlink(missing_ok=True)
