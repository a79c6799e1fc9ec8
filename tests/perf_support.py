"""The perf/ scripts as modules, for their tests: loaded from their files (perf/ is no package),
with perf/ on sys.path while they import, as it is when one runs as a script (their
`from ab import ...`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PERF = Path(__file__).resolve().parents[1] / "perf"


def load_perf_script(name: str) -> ModuleType:
    """perf/<name>.py as a module named perf_<name>."""
    spec = importlib.util.spec_from_file_location(f"perf_{name}", PERF / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(PERF))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(PERF))
    return module
