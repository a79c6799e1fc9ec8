"""The flaw catalog, its hints, its probes and the rubric agree."""

from __future__ import annotations

import json
import re

import pytest

from kata import REPO_ROOT, KataError
from kata.harness.catalog import CATALOG
from kata.harness.hints import next_hint
from kata.harness.probes import PROBES
from kata.harness.rubric import rubric_section


def test_hints_advance_one_level_per_call_and_stop_at_the_last(tmp_path):
    state = tmp_path / "hints.json"
    flaw = CATALOG[0]
    for level in (1, 2, 3, 3):
        text = next_hint(flaw.id, state)
        assert f"Hint {level} of {len(flaw.hints)}" in text
        assert flaw.hints[level - 1] in text
    assert json.loads(state.read_text()) == {flaw.id: 3}
    with pytest.raises(KataError, match="unknown flaw id 'nope'"):
        next_hint("nope", state)


def test_catalog_ids_are_unique_and_points_total_100():
    ids = [flaw.id for flaw in CATALOG]
    assert len(ids) == len(set(ids)) == 12
    assert sum(flaw.points for flaw in CATALOG) == 100


def test_every_flaw_has_three_hints_and_a_location():
    for flaw in CATALOG:
        assert len(flaw.hints) == 3 and all(flaw.hints), flaw.id
        assert flaw.where, flaw.id


def test_every_flaw_has_a_probe_and_every_probe_judges_a_flaw():
    catalogs = list(CATALOG)
    try:
        from kata.harness import round2
    except ModuleNotFoundError:  # a handout has no round two
        pass
    else:
        catalogs += round2.CATALOG
    assert {flaw.probe_id for flaw in catalogs} == PROBES.keys()


def test_rubric_has_one_section_per_flaw_with_the_catalogs_points():
    rubric = (REPO_ROOT / "rubric.md").read_text()
    sections = re.findall(
        r"^## `([a-z0-9-]+)`: (.+?)\n+\*\*Points: (\d+)\*\*", rubric, flags=re.MULTILINE
    )
    found = [(flaw_id, int(points)) for flaw_id, _, points in sections]
    assert found == [(flaw.id, flaw.points) for flaw in CATALOG]
    titles = {flaw_id: title for flaw_id, title, _ in sections}
    for flaw in CATALOG:
        assert titles[flaw.id] == flaw.title, flaw.id


def test_rubric_states_each_flaws_partial_credit_as_the_catalog_does():
    for flaw in CATALOG:
        section = rubric_section(flaw.id)
        stated = re.findall(r"\*\*Partial credit: (\d+) points\*\*", section)
        expected = [str(flaw.partial_points)] if flaw.partial_points else []
        assert stated == expected, f"{flaw.id}: rubric says {stated}, catalog {expected}"
        assert flaw.partial_points < flaw.points, flaw.id


def test_rubric_names_every_error_type_that_is_never_loud():
    from kata.harness.judging import UNRELATED_TYPES

    rules = (REPO_ROOT / "rubric.md").read_text().split("## How the review judges", 1)[1]
    for name in UNRELATED_TYPES:
        assert f"`{name}`" in rules.split("\n## ", 1)[0], name
