"""`make kata`: the candidate's checks. One test per flaw, red until it is fixed in flawed/.

Each probe runs against the current flawed/ in its own process, exactly as `make review` does.
"""

from __future__ import annotations

import pytest

from kata.catalog import CATALOG
from kata.review import resolve_implementation, run_review


@pytest.fixture(scope="module")
def review():
    return run_review(resolve_implementation("flawed"))


@pytest.mark.parametrize("flaw", CATALOG, ids=[flaw.id for flaw in CATALOG])
def test_flaw_is_fixed(flaw, review):
    result = next(r.result for r in review.reports if r.flaw.id == flaw.id)
    if result.status == "skipped":
        pytest.skip(f"{flaw.id}: {result.evidence}")
    if result.status != "fixed":
        pytest.fail(
            f"{flaw.id} ({flaw.title}) is still present.\n"
            f"  evidence: {result.evidence}\n"
            f"  hint:     python -m kata hint {flaw.id}\n"
            f"  replay:   python -m kata review --only {flaw.id} --seed {review.seed}",
            pytrace=False,
        )
