"""The kata harness: flaw catalog, probes, process isolation, builders, reference, review, hints."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
FLAWED_DIR = REPO_ROOT / "flawed"
FIXED_DIR = REPO_ROOT / "fixed"


class KataError(Exception):
    """A problem the user can act on; the CLI prints its message as one line and exits 2."""
