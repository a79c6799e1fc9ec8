"""The shipped flawed/, kept as text in kata/toolchain/shipped_flawed.json.

The demonstrations run only on the files as shipped; `make reset` restores them; the review
shows what a candidate changed against them. Text, not a git revision: a handout has no history.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from kata import FLAWED_DIR

MANIFEST = Path(__file__).with_name("shipped_flawed.json")
# Build outputs and caches that live in flawed/ but are not part of what ships.
_NOT_SHIPPED_SUFFIXES = (".so", ".pyc", ".o")
_NOT_SHIPPED_NAMES = {".custom_attention.build", "__pycache__", "build"}


def source_files(directory: Path = FLAWED_DIR) -> dict[str, str]:
    """relative path -> text of every source file under `directory`."""
    sources = {}
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory)
        if not path.is_file() or _NOT_SHIPPED_NAMES.intersection(relative.parts):
            continue
        if path.suffix in _NOT_SHIPPED_SUFFIXES:
            continue
        sources[relative.as_posix()] = path.read_text(errors="replace")
    return sources


ROUND2_SUBDIR = "proposed_fix"  # round two's code ships inside flawed/


def shipped(subdir: str | None = None) -> dict[str, str]:
    """The shipped files: all of flawed/, or those under `subdir` (paths relative to it)."""
    files = json.loads(MANIFEST.read_text())
    if subdir is None:
        return files
    prefix = subdir.rstrip("/") + "/"
    return {
        name.removeprefix(prefix): text for name, text in files.items() if name.startswith(prefix)
    }


def changed_files(directory: Path = FLAWED_DIR, subdir: str | None = None) -> list[str]:
    """Files added, removed or edited compared with the shipped flawed/ (empty: as shipped)."""
    expected, actual = shipped(subdir), source_files(directory)
    return sorted(
        name for name in expected.keys() | actual.keys() if expected.get(name) != actual.get(name)
    )


def diff(
    directory: Path, subdir: str | None = None, skip: str | None = None
) -> dict[str, list[str]]:
    """relative path -> unified diff lines against the shipped file, for each changed file
    (files under `skip`, relative to `directory`, are left out)."""
    expected, actual = shipped(subdir), source_files(directory)
    changed = changed_files(directory, subdir)
    if skip:
        changed = [name for name in changed if not name.startswith(skip.rstrip("/") + "/")]
    return {
        name: list(
            difflib.unified_diff(
                expected.get(name, "").splitlines(),
                actual.get(name, "").splitlines(),
                f"shipped/{name}",
                f"candidate/{name}",
                lineterm="",
            )
        )
        for name in changed
    }


def restore(directory: Path = FLAWED_DIR) -> None:
    """Write the shipped files back and remove source files the candidate added."""
    expected = shipped()
    for name in source_files(directory).keys() - expected.keys():
        (directory / name).unlink()
    for name, text in expected.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def update_manifest(directory: Path = FLAWED_DIR) -> None:
    """Record `directory` as shipped (maintainers, after a deliberate change to flawed/)."""
    MANIFEST.write_text(json.dumps(source_files(directory), indent=1, sort_keys=True) + "\n")
