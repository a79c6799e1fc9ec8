"""One check per flaw: fixed/ passes its probe, and the shipped flawed/ fails it (the
demonstration that the probe can fail at all)."""

from __future__ import annotations

import pytest

from tests.conftest import flaw_params, result_of, skip_unless_flawed_is_shipped


@pytest.mark.parametrize("flaw", flaw_params())
def test_fixed_passes(flaw, fixed_review):
    result = result_of(fixed_review, flaw.id)
    assert result.status == "fixed", (
        f"fixed/ shows flaw {flaw.id}: {result.evidence} "
        f"(replay: python -m kata review --impl fixed --only {flaw.id} --seed {fixed_review.seed})"
    )


@pytest.mark.parametrize("flaw", flaw_params())
def test_shipped_flawed_fails(flaw, request):
    skip_unless_flawed_is_shipped()
    review = request.getfixturevalue("flawed_review")
    result = result_of(review, flaw.id)
    assert result.status == "present", (
        f"the {flaw.id} probe did not catch the shipped flaw: {result.evidence} "
        f"(replay: python -m kata review --only {flaw.id} --seed {review.seed})"
    )
    assert result.evidence, "a present flaw must come with evidence"
