"""`make deps`: install the declared dependencies that are missing, and nothing else.

Reads pyproject.toml's one dependency list. Never replaces an installed torch (a CUDA build
stays a CUDA build); torch itself is installed only when absent, as $TORCH_SPEC (default torch).
Runs before torch exists, so it imports nothing heavy.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib

from kata import REPO_ROOT

# distribution name -> (module to import, or None, and a command to find on PATH, or None)
_PROBES = {
    "pytest-check": ("pytest_check", None),
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


def main() -> int:
    missing = [name for name in declared() if not is_installed(name)]
    if not missing:
        return 0
    specs = [os.environ.get("TORCH_SPEC", "torch") if n == "torch" else n for n in missing]
    print(f"make deps: installing {' '.join(specs)}", flush=True)
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *specs])
    if result.returncode != 0:
        print(
            "make deps: pip could not install them. Offline? Install these from wheels: "
            + " ".join(missing),
            file=sys.stderr,
        )
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
