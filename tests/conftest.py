"""Shared fixtures: one review of fixed/ and one of the shipped flawed/ per session (every probe
runs in its own process, so both reviews run once and the per-flaw tests read their results)."""

from __future__ import annotations

import os

import pytest

from kata import FLAWED_DIR
from kata.harness import keeper
from kata.harness.catalog import CATALOG, Need
from kata.harness.review import Review, resolve_implementation, run_review
from kata.toolchain import builders, shipped

# No keeper (kata/harness/keeper.py) outlives the tests: modules that look at the machine when
# collected, before PYTEST_CURRENT_TEST is set, and commands run with environments of their own
# would start one. KATA_KEEP_ZYGOTES=600 runs them through kept zygotes.
os.environ.setdefault(keeper.KEEP_ENV, "0")

NEED_MARKS = {
    Need.CUDA: pytest.mark.cuda,
    Need.TWO_GPUS: pytest.mark.multigpu,
    Need.BIG_MEMORY: pytest.mark.bigmem,
}


def flaw_params():
    """One pytest.param per catalog entry, id'd and marked by flaw id and by what it needs."""
    return [
        pytest.param(
            flaw,
            id=flaw.id,
            marks=[pytest.mark.flaw(flaw.id), *(NEED_MARKS[need] for need in flaw.needs)],
        )
        for flaw in CATALOG
    ]


def skip_unless_flawed_is_shipped() -> None:
    """The demonstrations prove each probe can fail on the shipped code only."""
    if changed := shipped.changed_files():
        pytest.skip(f"flawed/ has been edited; make reset to restore ({', '.join(changed)})")


def result_of(review: Review, flaw_id: str):
    result = next(r.result for r in review.reports if r.flaw.id == flaw_id)
    if result.status == "skipped":
        pytest.skip(f"{flaw_id}: {result.evidence}")
    return result


@pytest.fixture(scope="session")
def fixed_review() -> Review:
    return run_review(resolve_implementation("fixed"))


@pytest.fixture(scope="session")
def flawed_review() -> Review:
    return run_review(resolve_implementation("flawed"))


@pytest.fixture(scope="session")
def flawed_library():
    """The shipped flawed/ with its vendor library built for this machine."""
    return builders.build_vendor_library(FLAWED_DIR)
