"""Registers and spills of every tensor-core kernel in two checkouts, without a GPU: the check
that a kernel change leaves ptxas's fit of the other kernels as it was (perf/NOTES.md v45).
nvcc compiles each checkout's sm_90a root, fixed/csrc/kernels/flash_backward_sm90.cuh (every
tensor-core kernel, forward and backward, as `python -m kata check-cuda` compiles it), with
ptxas's -v, both at once. From the repository root of any checkout:

    python perf/ptxas_diff.py A_DIR B_DIR [--sass [CUOBJDUMP]]

Prints each kernel whose registers or spill bytes differ (A -> B), each that only one checkout
has, and each whose wgmma ptxas serialized, then a count. With --sass, cuobjdump also reads both
objects' SASS: a kernel whose instructions differ is named with its instruction counts and the
opcodes whose counts moved most, and the count line says how many kernels kept the same SASS
(instruction for instruction: the check that a change left a kernel as it was; v46). cuobjdump
is found on PATH or beside nvcc unless given. About two minutes on two cores.
Exit status 0: the same; 1: some kernel differs or is serialized; 2: bad input or a failed
compile (one line)."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from ab import Failure  # perf/ab.py: a script's own directory is on sys.path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # this checkout's kata: the flags of its compile check
from kata.toolchain import builders  # noqa: E402

ROOT_HEADER = Path("fixed/csrc/kernels/flash_backward_sm90.cuh")
ENTRY = re.compile(r"Compiling entry function '([^']+)' for 'sm_90a'")
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Used (\d+) registers")
FUNCTION = re.compile(r"^\s+Function : (\S+)")  # cuobjdump -sass: a kernel's section
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")  # /*addr*/ instruction ;
PREDICATE = re.compile(r"^@!?U?P\w+\s+")


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


def sass_functions(text: str) -> dict[str, list[str]]:
    """cuobjdump -sass's kernels: mangled name -> its instructions, without addresses and
    encodings (so that two kernels compare instruction for instruction)."""
    found: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if match := FUNCTION.match(line):
            current = found.setdefault(match.group(1), [])
        elif current is not None and (match := INSTRUCTION.match(line)):
            current.append(match.group(1))
    return found


def opcode(instruction: str) -> str:
    """An instruction's opcode without its predicate and modifiers: FSEL, IMAD, HGMMA, ..."""
    return PREDICATE.sub("", instruction).split()[0].split(".")[0]


def sass_change(a: list[str], b: list[str], shown: int = 6) -> str:
    """Two versions of a kernel: instruction counts, and the opcodes whose counts moved most."""
    before, after = Counter(map(opcode, a)), Counter(map(opcode, b))
    moved = sorted(
        (name for name in before | after if before[name] != after[name]),
        key=lambda name: (-abs(after[name] - before[name]), name),
    )
    detail = ", ".join(f"{name} {before[name]} -> {after[name]}" for name in moved[:shown])
    return f"SASS {len(a)} -> {len(b)} instructions" + (f" ({detail})" if detail else "")


def find_cuobjdump(given: str) -> str:
    """cuobjdump: `given`, else the one on PATH, else the one beside nvcc."""
    if given:
        if not Path(given).is_file():
            raise Failure(f"{given}: no such cuobjdump")
        return given
    nvcc = shutil.which("nvcc")
    for candidate in (shutil.which("cuobjdump"), nvcc and str(Path(nvcc).with_name("cuobjdump"))):
        if candidate and Path(candidate).is_file():
            return candidate
    raise Failure("cuobjdump is not on PATH nor beside nvcc: give it, --sass PATH")


def disassemble(cuobjdump: str, objects: list[str], timeout: float) -> list[str]:
    """cuobjdump -sass of each object, or Failure in one line."""
    texts = []
    for obj in objects:
        try:
            run = subprocess.run(
                [cuobjdump, "-sass", obj], capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise Failure(f"cuobjdump ran past {timeout:.0f} s") from None
        if run.returncode != 0 or not sass_functions(run.stdout):
            lines = (run.stderr or run.stdout).strip().splitlines()
            raise Failure(f"cuobjdump read no SASS: {lines[0] if lines else run.returncode}")
        texts.append(run.stdout)
    return texts


def checkout(directory: str) -> Path:
    path = Path(directory).resolve()
    if not (path / ROOT_HEADER).is_file():
        raise Failure(f"{directory}: not a checkout of this project (no {ROOT_HEADER})")
    return path


def compile_both(
    checkouts: list[Path], timeout: float, cuobjdump: str | None = None
) -> tuple[list[str], list[str] | None]:
    """ptxas's report for each checkout's root, the compiles side by side; with `cuobjdump`,
    also each object's SASS (else None)."""
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
            outputs = [
                finished(path, run, timeout) for path, run in zip(checkouts, runs, strict=True)
            ]
            objects = [f"{scratch}/{n}.o" for n in range(len(checkouts))]
            return outputs, disassemble(cuobjdump, objects, timeout) if cuobjdump else None
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


def report(outputs: list[str], sass: list[str] | None = None) -> int:
    """The differences between the two reports (and SASS, where given), printed; the exit
    status."""
    a, b = (kernels(output) for output in outputs)
    if not a or not b:
        raise Failure("ptxas reported no sm_90a kernels (its -v output changed?)")
    code_a, code_b = (sass_functions(text) for text in sass) if sass else ({}, {})
    differ = same_code = 0
    for name in sorted(a.keys() | b.keys()):
        if name not in b or name not in a:
            only, resources = ("A", a[name]) if name in a else ("B", b[name])
            print(f"only in {only}: {builders.kernel_name(name)}: {describe(resources)}")
            differ += 1
            continue
        changes = []
        if a[name] != b[name]:
            (ra, sa, la), (rb, sb, lb) = a[name], b[name]
            changes.append(
                f"registers {ra} -> {rb}, spill stores {sa} -> {sb}, loads {la} -> {lb} bytes"
            )
        if sass:
            if code_a.get(name) == code_b.get(name):
                same_code += 1
            else:
                changes.append(sass_change(code_a.get(name, []), code_b.get(name, [])))
        if changes:
            print(f"{builders.kernel_name(name)}: " + "; ".join(changes))
            differ += 1
    serialized = 0
    for label, output in zip("AB", outputs, strict=True):
        for line in builders.serialized_wgmma(output):
            print(f"{label}: {line}")
            serialized += 1
    common = len(a.keys() & b.keys())
    summary = f"{len(a)} kernels in A, {len(b)} in B: {differ} differ, {serialized} serialized"
    print(summary + (f"; SASS the same in {same_code} of {common}" if sass else ""))
    return 1 if differ or serialized else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", metavar="A_DIR", help="checkout A (the baseline)")
    parser.add_argument("b", metavar="B_DIR", help="checkout B (the change)")
    parser.add_argument("--timeout", type=float, default=builders.COMPILER_TIMEOUT_S)
    parser.add_argument(
        "--sass",
        nargs="?",
        const="",
        metavar="CUOBJDUMP",
        help="also compare the kernels' SASS (cuobjdump: on PATH or beside nvcc if not given)",
    )
    args = parser.parse_args(argv)
    try:
        checkouts = [checkout(args.a), checkout(args.b)]
        cuobjdump = find_cuobjdump(args.sass) if args.sass is not None else None
        return report(*compile_both(checkouts, args.timeout, cuobjdump))
    except Failure as failure:
        print(f"ptxas_diff.py: {failure}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
