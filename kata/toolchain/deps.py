"""`make deps`: install the declared dependencies that are missing, and nothing else.

Reads pyproject.toml's one dependency list. Never replaces an installed torch (a CUDA build
stays a CUDA build); torch itself is installed only when absent, as $TORCH_SPEC (default: the
supported range, torch_support.py). An installed torch outside that range gets one line: an older
one stops here, a newer one goes on, untried. Runs before torch exists, so it imports nothing
heavy.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib

from kata import REPO_ROOT
from kata.toolchain import torch_support

# distribution name -> (module to import, or None, and a command to find on PATH, or None)
_PROBES = {
    "pytest-check": ("pytest_check", None),
    "pytest-xdist": ("xdist", None),
    "ruff": (None, "ruff"),
    "ninja": (None, "ninja"),
}


def declared() -> list[str]:
    with open(REPO_ROOT / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]["dependencies"]


def is_installed(name: str) -> bool:
    module, command = _PROBES.get(name, (name.replace("-", "_"), None))
    if module and importlib.util.find_spec(module) is not None:
        return True
    return bool(command and shutil.which(command))


def _name(spec: str) -> str:
    return re.split(r"[<>=!~ ;\[]", spec, maxsplit=1)[0]


def main() -> int:
    missing = [spec for spec in declared() if not is_installed(_name(spec))]
    if not missing:
        return _check_torch()
    torch_spec = os.environ.get("TORCH_SPEC", torch_support.requirement())
    specs = [torch_spec if _name(spec) == "torch" else spec for spec in missing]
    print(f"make deps: installing {' '.join(specs)}", flush=True)
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *specs])
    if result.returncode != 0:
        print(
            "make deps: pip could not install them. Offline? Install these from wheels: "
            + " ".join(missing),
            file=sys.stderr,
        )
        return result.returncode
    return _check_torch()


def _check_torch() -> int:
    version = torch_support.installed()
    problem = version and torch_support.problem(version)
    if problem:
        print(f"make deps: {problem}", file=sys.stderr)
    return 1 if version and torch_support.too_old(version) else 0


if __name__ == "__main__":
    sys.exit(main())
