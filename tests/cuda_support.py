"""What the GPU test files share: the fixed/ package with its CUDA kernels, seeds that replay,
input helpers, and compute-sanitizer (its tools, find it, run a script under one of them)."""

from __future__ import annotations

import math
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kata import REPO_ROOT

# Every test of a GPU test file: marked cuda, skipped with the reason where there is no GPU.
NEEDS_CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (torch.cuda.is_available() is False)",
    ),
]


def fixed_with_cuda_kernels():
    """The fixed package, with its CUDA kernels built (nvcc, once) and registered."""
    import fixed

    assert torch._C._dispatch_has_kernel_for_dispatch_key(
        "fixed_attention::attention_forward", "CUDA"
    ), "fixed/ was built without attention_cuda.cu: no CUDA kernel is registered"
    return fixed


def seed_fixture(variable: str):
    """A `seed` fixture: a fresh seed for each test, or the one in `variable` to replay a failure.
    A test file binds it as `seed = seed_fixture(...)`; pytest finds it under that name."""

    @pytest.fixture
    def seed() -> int:
        return int(os.environ.get(variable, secrets.randbelow(2**31)))

    return seed


def replay_hint(variable: str, test_file: str):
    """replay(seed): the end of a failure message, saying how to rerun `test_file` on that seed."""

    def replay(seed: int) -> str:
        return f"seed {seed}; replay: {variable}={seed} python -m pytest {test_file}"

    return replay


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def poison_allocator(*shapes_and_dtypes):
    """NaN into blocks of the caching allocator that the next outputs of these sizes will reuse,
    so that an element a kernel forgets to write shows as NaN instead of a lucky zero."""
    blocks = [
        torch.full(shape, math.nan, dtype=dtype, device="cuda")
        for shape, dtype in shapes_and_dtypes
    ]
    del blocks


def lse_error(lse, reference) -> float:
    """Largest |lse − ref| / (1 + |ref|); inf where one is -inf and the other is not, or NaN."""
    got = lse.detach().to("cpu", torch.float64)
    both_neg_inf = (got == -math.inf) & (reference == -math.inf)
    diff = ((got - reference).abs() / (1 + reference.abs())).masked_fill(both_neg_inf, 0)
    diff = diff.nan_to_num(nan=math.inf)
    return diff.max().item() if diff.numel() else 0.0


def randn(shape, dtype, generator, device="cuda"):
    """Standard normal values (never zeros), drawn in float32 on the CPU, then cast and moved."""
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(device, dtype)


def make_inputs(lead, len_q, len_kv, head_dim, dtype, generator, device="cuda"):
    """q (*lead, L, E), k and v (*lead, S, E), drawn in that order."""
    return (
        randn((*lead, len_q, head_dim), dtype, generator, device),
        randn((*lead, len_kv, head_dim), dtype, generator, device),
        randn((*lead, len_kv, head_dim), dtype, generator, device),
    )


# (tool, the line of its output that says it found nothing): synccheck too, for the barriers
# around the tensor-core kernels' shared-memory buffers.
TENSOR_CORE_SANITIZER_TOOLS = [
    ("memcheck", "ERROR SUMMARY: 0 errors"),
    ("racecheck", "RACECHECK SUMMARY: 0 hazards displayed"),
    ("synccheck", "ERROR SUMMARY: 0 errors"),
]


def find_cuda_tool(name: str) -> str | None:
    """A CUDA toolkit program: on PATH, else in CUDA_HOME/bin; None when neither has it."""
    found = shutil.which(name)
    if found is None:
        from torch.utils.cpp_extension import CUDA_HOME

        candidate = os.path.join(CUDA_HOME or "/usr/local/cuda", "bin", name)
        found = candidate if os.access(candidate, os.X_OK) else None
    return found


def find_compute_sanitizer() -> str | None:
    return find_cuda_tool("compute-sanitizer")


def sanitize(tool: str, script: str, workdir: Path, clean: str) -> None:
    """run_clean under the compute-sanitizer found here, its summary line printed for the log;
    the test skips, saying so, where there is none."""
    sanitizer = find_compute_sanitizer()
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not on PATH (nor in CUDA_HOME/bin)")
    print(run_clean(sanitizer, tool, script, workdir, clean))


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
