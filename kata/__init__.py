"""The kata: `python -m kata` (__main__.py). harness/ judges, interviewer/ and candidate/ hold
each reader's tools, toolchain/ installs and builds. The paths and the error every part shares
are here."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
FLAWED_DIR = REPO_ROOT / "flawed"
FIXED_DIR = REPO_ROOT / "fixed"


class KataError(Exception):
    """A problem the user can act on; the CLI prints its message as one line and exits 2."""
