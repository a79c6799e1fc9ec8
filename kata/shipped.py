"""Checksums of the shipped flawed/: the demonstrations run only on the files as shipped."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kata import FLAWED_DIR

MANIFEST = Path(__file__).with_name("shipped_flawed.json")
# Build outputs and caches that live in flawed/ but are not part of what ships.
_NOT_SHIPPED_SUFFIXES = (".so", ".pyc", ".o")
_NOT_SHIPPED_NAMES = {".custom_attention.build", "__pycache__"}


def shipped_files(directory: Path = FLAWED_DIR) -> dict[str, str]:
    """relative path -> sha256 of every source file under `directory`."""
    digests = {}
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory)
        if not path.is_file() or _NOT_SHIPPED_NAMES.intersection(relative.parts):
            continue
        if path.suffix in _NOT_SHIPPED_SUFFIXES:
            continue
        digests[relative.as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def changed_files(directory: Path = FLAWED_DIR) -> list[str]:
    """Files added, removed or edited compared with the shipped flawed/ (empty: as shipped)."""
    expected = json.loads(MANIFEST.read_text())
    actual = shipped_files(directory)
    return sorted(
        name for name in expected.keys() | actual.keys() if expected.get(name) != actual.get(name)
    )


def update_manifest() -> None:
    MANIFEST.write_text(json.dumps(shipped_files(), indent=2, sort_keys=True) + "\n")
