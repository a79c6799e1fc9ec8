"""Registers and spills of every tensor-core kernel in two checkouts, without a GPU: the check
that a kernel change leaves ptxas's fit of the other kernels as it was (perf/NOTES.md v45).
nvcc compiles each checkout's sm_90a root, fixed/csrc/kernels/flash_backward_sm90.cuh (every
tensor-core kernel, forward and backward, as `python -m kata check-cuda` compiles it), with
ptxas's -v, both at once. From the repository root of any checkout:

    python perf/ptxas_diff.py A_DIR B_DIR

Prints each kernel whose registers or spill bytes differ (A -> B), each that only one checkout
has, and each whose wgmma ptxas serialized, then a count. About two minutes on two cores.
Exit status 0: the same; 1: some kernel differs or is serialized; 2: bad input or a failed
compile (one line)."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ab import Failure  # perf/ab.py: a script's own directory is on sys.path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # this checkout's kata: the flags of its compile check
from kata.toolchain import builders  # noqa: E402

ROOT_HEADER = Path("fixed/csrc/kernels/flash_backward_sm90.cuh")
ENTRY = re.compile(r"Compiling entry function '([^']+)' for 'sm_90a'")
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Used (\d+) registers")


def kernels(output: str) -> dict[str, tuple[int, int, int]]:
    """ptxas -v's kernels: mangled name -> (registers, spill store bytes, spill load bytes)."""
    found: dict[str, tuple[int, int, int]] = {}
    name, spills = None, (0, 0)
    for line in output.splitlines():
        if match := ENTRY.search(line):
            name, spills = match.group(1), (0, 0)
        elif name and (match := SPILLS.search(line)):
            spills = (int(match.group(1)), int(match.group(2)))
        elif name and (match := REGISTERS.search(line)):
            found[name] = (int(match.group(1)), *spills)
            name = None
    return found


def checkout(directory: str) -> Path:
    path = Path(directory).resolve()
    if not (path / ROOT_HEADER).is_file():
        raise Failure(f"{directory}: not a checkout of this project (no {ROOT_HEADER})")
    return path


def compile_both(checkouts: list[Path], timeout: float) -> list[str]:
    """ptxas's report for each checkout's root, the compiles side by side."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise Failure("nvcc is not on PATH: install the CUDA toolkit or put it on PATH")
    with tempfile.TemporaryDirectory() as scratch:
        runs = []
        try:
            for n, path in enumerate(checkouts):
                check = builders.CudaCheck(path / ROOT_HEADER, "sm_90a")
                command = [*builders.nvcc_command(nvcc, check), "-Xptxas", "-v"]
                runs.append(
                    subprocess.Popen(
                        [*command, "-o", f"{scratch}/{n}.o"],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                )
            return [finished(path, run, timeout) for path, run in zip(checkouts, runs, strict=True)]
        finally:
            for run in runs:  # the other compile, where one failed
                run.kill()
                run.wait()


def finished(path: Path, run: subprocess.Popen, timeout: float) -> str:
    """A compile's output once it ends, or Failure in one line."""
    try:
        output, _ = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Failure(f"{path}: nvcc ran past {timeout:.0f} s") from None
    if run.returncode != 0:
        lines = [line for line in output.splitlines() if "error" in line] or output.splitlines()
        first = lines[0].strip() if lines else f"exit status {run.returncode}"
        raise Failure(f"{path}: nvcc failed: {first}")
    return output


def describe(resources: tuple[int, int, int]) -> str:
    registers, stores, loads = resources
    return f"{registers} registers, spills {stores}/{loads} bytes (stores/loads)"


def report(outputs: list[str]) -> int:
    """The differences between the two reports, printed; the exit status."""
    a, b = (kernels(output) for output in outputs)
    if not a or not b:
        raise Failure("ptxas reported no sm_90a kernels (its -v output changed?)")
    differ = 0
    for name in sorted(a.keys() | b.keys()):
        if name not in b or name not in a:
            only, resources = ("A", a[name]) if name in a else ("B", b[name])
            print(f"only in {only}: {builders.kernel_name(name)}: {describe(resources)}")
        elif a[name] != b[name]:
            (ra, sa, la), (rb, sb, lb) = a[name], b[name]
            print(
                f"{builders.kernel_name(name)}: registers {ra} -> {rb}, spill stores "
                f"{sa} -> {sb}, loads {la} -> {lb} bytes"
            )
        else:
            continue
        differ += 1
    serialized = 0
    for label, output in zip("AB", outputs, strict=True):
        for line in builders.serialized_wgmma(output):
            print(f"{label}: {line}")
            serialized += 1
    print(f"{len(a)} kernels in A, {len(b)} in B: {differ} differ, {serialized} serialized")
    return 1 if differ or serialized else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", metavar="A_DIR", help="checkout A (the baseline)")
    parser.add_argument("b", metavar="B_DIR", help="checkout B (the change)")
    parser.add_argument("--timeout", type=float, default=builders.COMPILER_TIMEOUT_S)
    args = parser.parse_args(argv)
    try:
        return report(compile_both([checkout(args.a), checkout(args.b)], args.timeout))
    except Failure as failure:
        print(f"ptxas_diff.py: {failure}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
