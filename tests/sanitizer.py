"""compute-sanitizer for the GPU tests: find it, run a script under one of its tools."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from kata import REPO_ROOT


def find_compute_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found is None:
        from torch.utils.cpp_extension import CUDA_HOME

        candidate = os.path.join(CUDA_HOME or "/usr/local/cuda", "bin", "compute-sanitizer")
        found = candidate if os.access(candidate, os.X_OK) else None
    return found


def run_clean(sanitizer: str, tool: str, script: str, workdir: Path, clean: str) -> str:
    """Run `script` (Python source that prints "sanitizer script done" at its end) under
    `sanitizer --tool=tool`; assert it finished and the output says `clean`. Returns the
    tool's summary line."""
    path = workdir / f"sanitize_{tool}.py"
    path.write_text(script)
    # Without the caching allocator every tensor is its own cudaMalloc, so memcheck sees an
    # access past a tensor's end instead of into a neighbour in the same cached block.
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    command = [sanitizer, f"--tool={tool}", sys.executable, str(path)]
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=workdir, timeout=600, check=False
    )
    output = result.stdout + result.stderr
    assert "sanitizer script done" in output, f"the script did not finish:\n{output[-4000:]}"
    assert clean in output, f"{tool} found problems:\n{output[-4000:]}"
    return next(line for line in output.splitlines() if "SUMMARY" in line)
