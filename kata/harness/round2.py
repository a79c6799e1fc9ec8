"""Round two: the candidate reviews flawed/proposed_fix/, a plausible rewrite of the wrapper as
a C++ extension, as a pull request. Five flaws, each judged by an existing probe.

Interviewer-only: the handout leaves this file out, so a candidate's copy holds no answers.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from kata import FLAWED_DIR, REPO_ROOT
from kata.harness.catalog import Flaw, _flaw
from kata.toolchain import torch_support

ROUND2_DIR = FLAWED_DIR / "proposed_fix"

WRAPPER = "attention_wrapper.py"
GLUE = "csrc/attention.cpp"
CPU_LAUNCHER = "csrc/attention_cpu.cpp"
CUDA_LAUNCHER = "csrc/attention_cuda.cu"

CATALOG: tuple[Flaw, ...] = (
    _flaw(
        "r2-cuda-only-dtype-check",
        "dtype checked only for CUDA inputs",
        10,
        probe="dtype",
        where="csrc/attention.cpp: attention_forward runs CHECK_INPUT (float32) only in its "
        "query.is_cuda() branch; make_params casts every data pointer to float* first",
        code=[(GLUE, "CHECK_INPUT(query);"), (GLUE, "params.q = static_cast<const float*>")],
        hints=(
            "Call it with float16 or float64 tensors on the CPU and compare with a float64 "
            "reference.",
            "Which inputs reach CHECK_FLOAT? make_params reinterprets every buffer as float "
            "on both devices, before any dtype is looked at.",
            "Check the dtype of all four tensors before the device branch (TORCH_CHECK_TYPE, "
            "naming the dtype), or take data_ptr<float>(), which checks it.",
        ),
    ),
    _flaw(
        "r2-status-not-raised",
        "A status code instead of an exception, and a broken error path",
        10,
        probe="length-limit",
        where="attention_wrapper.py: _FastAttention.forward formats a nonzero status with "
        "_error_string, which is defined only when CUDA is available",
        code=[(WRAPPER, "if status != 0:"), (WRAPPER, "def _error_string")],
        hints=(
            "What does it raise for a seq_len of 4097 on the CPU?",
            "The launcher returns a status for Python to turn into an error; the helper that "
            "formats it exists only on CUDA machines, and even there 'invalid argument' does "
            "not say that seq_len is over the limit.",
            "Raise in C++ where the problem is known: TORCH_CHECK_VALUE(seq_len <= 4096, ...) "
            "before the launch and C10_CUDA_KERNEL_LAUNCH_CHECK() after it; return the output, "
            "not a status.",
        ),
    ),
    _flaw(
        "r2-identity-backward",
        "backward passes grad_output through unchanged",
        10,
        probe="autograd",
        where="attention_wrapper.py: _FastAttention.backward returns grad_output three times",
        code=[(WRAPPER, "return grad_output, grad_output, grad_output")],
        hints=(
            "Backpropagate a loss through it and compare the gradients with those of a "
            "float64 reference.",
            "Returning grad_output is the gradient of the identity, not of "
            "softmax(QKᵀ·scale)·V; it only has the right shape because L == S here.",
            "Save what backward needs in forward (query, key, value, and the output or the "
            "log-sum-exp); with P = softmax(QKᵀ·scale): dV = Pᵀ·dO, dS = P∘(dO·Vᵀ − "
            "rowsum(dO∘O)), dQ = scale·dS·K, dK = scale·dSᵀ·Q.",
        ),
    ),
    _flaw(
        "r2-cpu-gpu-differ",
        "CPU and CUDA launchers compute different functions",
        10,
        probe="happy-path",
        where="csrc/attention_cpu.cpp: launch_attention_cpu multiplies by scale in the score "
        "and again inside std::exp; the CUDA kernel scales once",
        code=[
            (CPU_LAUNCHER, "std::exp((scores[j] - row_max) * scale)"),
            (CUDA_LAUNCHER, "expf(scores[j] - row_max)"),
        ],
        hints=(
            "Run plain float32 inputs on the CPU against the float64 reference (and, on a GPU, "
            "compare the CPU result with the CUDA one).",
            "Read the softmax of the two launchers side by side: how many times is 1/√d "
            "applied in each?",
            "Scale once (scores[j] = dot * scale, then std::exp(scores[j] - row_max)), and "
            "test every device the operator accepts against one reference.",
        ),
    ),
    _flaw(
        "r2-fixed-head-dim",
        "Head dim hard-coded to 64 in the launchers",
        10,
        probe="shape",
        where="csrc/attention_cpu.cpp, csrc/attention_cuda.cu: constexpr int64_t kHeadDim = 64 "
        "in both launchers; attention.cpp checks the rank and equal shapes, never size(2)",
        code=[
            (CPU_LAUNCHER, "constexpr int64_t kHeadDim = 64;"),
            (CUDA_LAUNCHER, "constexpr int64_t kHeadDim = 64;"),
        ],
        hints=(
            "Try a head dim of 32.",
            "AttentionParams carries batch and seq_len but no head dim: both launchers "
            "assume 64, so (B, L, 32) tensors are read and written with a row stride of 64, "
            "past their ends.",
            "Pass query.size(2) through AttentionParams and use it in both launchers (within "
            "what shared memory allows), or refuse any other head dim with an error naming it.",
        ),
    ),
)


def locks_block_while_they_exist() -> bool:
    """Whether cpp_extension's build lock (a file named `lock` in the build directory) blocks
    other builds for as long as the file exists: torch.utils.file_baton before torch 2.14, with
    no owner recorded, so that a build killed by SIGKILL (a time limit) leaves it and every
    later import waits on it forever. From 2.14 it is an flock(), which the kernel drops with
    its holder: a file left behind blocks nothing. tests/test_torch_support.py pins this on the
    installed torch."""
    version = torch_support.installed()
    return version is not None and torch_support.release(version) < (2, 14, 0)


def _build_locks(directory: Path) -> dict[Path, float]:
    """cpp_extension's build locks under `directory`/build, with their mtimes."""
    locks = {}
    build = directory / "build"
    for path in build.rglob("lock") if build.is_dir() else ():
        with contextlib.suppress(OSError):  # gone meanwhile: a live build finished
            locks[path] = path.stat().st_mtime
    return locks


def prepare(directory: Path = ROUND2_DIR, timeout: float = 600.0) -> str | None:
    """Build the proposed fix's extension once, in a child process, before the probes run.

    Its first import builds it with ninja; without this, the parallel probes would all wait on
    that build inside their own time limits. Returns None, or why the build failed (evidence for
    every flaw, as a broken vendor build is in round one).

    Importing the wrapper runs the candidate's code: it runs in the sandbox (sandbox.py),
    which lets it write in `directory` only. A wrapper that builds in torch's default extension
    cache (~/.cache/torch_extensions) builds in `directory`/build/torch_extensions instead: the
    probes must get the same TORCH_EXTENSIONS_DIR to find it.
    """
    import signal

    from kata.harness import sandbox

    directory = Path(directory).resolve()
    # Where a lock file blocks while it exists, one older than this time limit is no live
    # build's (prepare kills its build by then, and a probe's import holds one for the second
    # its no-op ninja takes): stale, removed.
    started = time.time()
    existence_locks = locks_block_while_they_exist()
    for lock, mtime in _build_locks(directory).items() if existence_locks else ():
        if mtime < started - timeout:
            lock.unlink(missing_ok=True)
    wrapper = directory / "attention_wrapper.py"
    code = (
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('proposed_fix_warmup', {str(wrapper)!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
    )
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    extensions = directory / "build" / "torch_extensions"
    box = sandbox.detect()
    process = subprocess.Popen(
        box.wrap([sys.executable, "-c", code], writable=[directory]),
        cwd=directory,
        env=dict(os.environ, PYTHONPATH=python_path, TORCH_EXTENSIONS_DIR=str(extensions)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a time limit kills ninja and the compilers too
    )
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        # The killed build's own lock goes; an older one it may have waited on is named.
        older = []
        for lock, mtime in _build_locks(directory).items() if existence_locks else ():
            if mtime >= started:
                lock.unlink(missing_ok=True)
            else:
                older.append(lock)
        waited = (
            f", waiting on {older[0]}, a build lock from before this run: delete it if no "
            "build is running"
            if older
            else ""
        )
        return f"the extension did not build: timed out after {timeout:g} s{waited}"
    returncode = box.returncode(process.returncode)
    if returncode == 0:
        return None
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    # The compiler's first error says more than ninja's closing "build stopped" line.
    errors = [line for line in lines if " error: " in line]
    said = errors[0] if errors else lines[-1] if lines else "no output"
    if returncode < 0 and not errors:  # a crash: its last line is a traceback's
        try:
            said = f"process died with {signal.Signals(-returncode).name}"
        except ValueError:
            said = f"process died with signal {-returncode}"
    return f"the extension did not build: {said}"[:300]
