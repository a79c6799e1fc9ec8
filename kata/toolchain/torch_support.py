"""The torch releases the kata supports: the one `torch>=OLDEST,<NEXT` in pyproject.toml.

OLDEST is the first release whose APIs fixed/ and the harness use all work (README, "The torch
it runs on"); below NEXT are the releases tried. Read without importing torch, so that
`make deps` and the tools can say in one line that a torch cannot be used, before any of it runs.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib

from kata import REPO_ROOT

_SPEC = re.compile(r"^torch\s*>=\s*([\d.]+)\s*,\s*<\s*([\d.]+)$")


def requirement() -> str:
    """pyproject.toml's torch requirement, as pip takes it: 'torch>=2.6,<2.16'."""
    with open(REPO_ROOT / "pyproject.toml", "rb") as file:
        dependencies = tomllib.load(file)["project"]["dependencies"]
    (torch,) = (spec for spec in dependencies if re.match(r"torch\b", spec))
    return torch.replace(" ", "")


def supported_range() -> tuple[tuple[int, ...], tuple[int, ...]]:
    match = _SPEC.match(requirement())
    if match is None:
        raise ValueError(f"pyproject.toml: expected torch>=OLDEST,<NEXT; got {requirement()!r}")
    return release(match[1]), release(match[2])


def oldest() -> str:
    """The oldest supported release, as pip names it: '2.6.0'."""
    return ".".join(map(str, supported_range()[0]))


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version: '2.15.0+cu132' and '2.11.0a0+gitabc' give (2, 15, 0)
    and (2, 11, 0); a pre-release counts as its release."""
    numbers = re.match(r"\d+(?:\.\d+)*", version)
    if numbers is None:
        raise ValueError(f"not a version: {version!r}")
    parts = tuple(int(part) for part in numbers[0].split("."))
    return parts + (0,) * (3 - len(parts))


def installed() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def problem(version: str) -> str | None:
    """One line when `version` is outside the supported range, else None. An older torch lacks
    APIs the kata needs; a newer one is untried (it may work: the line says so)."""
    oldest, upper = supported_range()
    spec = requirement().removeprefix("torch")
    if release(version) < oldest:
        return (
            f"torch {version} is older than the kata supports ({spec}, pyproject.toml): "
            f"install a torch in that range (pip install '{requirement()}')"
        )
    if release(version) >= upper:
        return (
            f"torch {version} is newer than the releases the kata is tested with ({spec}, "
            "pyproject.toml): its verdicts are unverified on it"
        )
    return None


def too_old(version: str) -> bool:
    return release(version) < supported_range()[0]
