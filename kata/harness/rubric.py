"""What the tools read from rubric.md: the level bands and one flaw's section."""

from __future__ import annotations

import re
from pathlib import Path

from kata import REPO_ROOT

RUBRIC = REPO_ROOT / "rubric.md"  # interviewer-only: a handout has none


def level_bands(rubric: Path = RUBRIC) -> list[tuple[int, int, str]]:
    """(low %, high %, level) rows of rubric.md's level-band table; empty without a rubric."""
    try:
        text = rubric.read_text()
    except OSError:
        return []
    section = (
        text.split("## Level bands", 1)[-1].split("\n## ", 1)[0] if "## Level bands" in text else ""
    )
    rows = re.findall(r"^\|\s*(\d+)\s*[–-]\s*(\d+)\s*\|\s*([^|]+?)\s*\|\s*$", section, re.MULTILINE)
    return [(int(low), int(high), level) for low, high, level in rows]


def level_for(earned: int, possible: int, bands: list[tuple[int, int, str]]) -> str | None:
    if not bands or possible == 0:
        return None
    percent = round(100 * earned / possible)
    return next((level for low, high, level in bands if low <= percent <= high), None)


def rubric_section(flaw_id: str, rubric: Path = RUBRIC) -> str | None:
    """The rubric.md section of one flaw id, from its heading to the next heading of its level."""
    try:
        text = rubric.read_text()
    except OSError:
        return None
    match = re.search(rf"^(#+) `{re.escape(flaw_id)}`:.*?(?=^\1 |\Z)", text, re.M | re.S)
    return match.group(0).strip() if match else None
