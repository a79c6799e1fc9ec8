"""perf/ptxas_diff.py, registers and spills of the tensor-core kernels in two checkouts: ptxas's
-v report is read per kernel, differences, kernels in one checkout only and serialized wgmma are
named, and bad input gets one line; with --sass, cuobjdump's SASS is compared instruction for
instruction. On canned ptxas and cuobjdump output (nvcc 13.0's text): the real compile takes
minutes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.perf_support import load_perf_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "perf" / "ptxas_diff.py"
ptxas_diff = load_perf_script("ptxas_diff")

MASKED = "_ZN15fixed_attention7kernels5flash7sm90_ws28flash_forward_sm90_ws_kernelI13__nv_bfloat16NS2_4TileILi256ELi64ELi2ELb1ELi1ELi2EfLi256EEELi1EEEv14CUtensorMap_stS7_S7_S7_PT_PfNS0_16AttentionProblemEbNS2_9SplitTailE"  # noqa: E501
PLAIN = "_ZN15fixed_attention7kernels5flash7sm90_ws28flash_forward_sm90_ws_kernelI13__nv_bfloat16NS2_4TileILi64ELi128ELi3ELb0ELi0ELi3EfLi64EEELi0EEEv14CUtensorMap_stS7_S7_S7_PT_PfNS0_16AttentionProblemEbNS2_9SplitTailE"  # noqa: E501


def entry(name: str, registers: int, stores: int, loads: int) -> str:
    """One kernel as ptxas -v reports it."""
    return (
        f"ptxas info    : Compiling entry function '{name}' for 'sm_90a'\n"
        f"ptxas info    : Function properties for {name}\n"
        f"    32 bytes stack frame, {stores} bytes spill stores, {loads} bytes spill loads\n"
        f"ptxas info    : Used {registers} registers, used 16 barriers, 32 bytes cumulative "
        "stack size\n"
    )


SERIALIZED = (
    "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are "
    "serialized due to non wgmma instructions defining accumulator registers of a wgmma between "
    f"start and end of the pipeline stage in the function '{PLAIN}'\n"
)


def test_each_kernel_is_read_from_the_report():
    report = entry(MASKED, 168, 32, 60) + entry(PLAIN, 128, 0, 0)
    assert ptxas_diff.kernels(report) == {MASKED: (168, 32, 60), PLAIN: (128, 0, 0)}


def test_differences_are_named_and_counted(capsys):
    a = entry(MASKED, 168, 50, 116) + entry(PLAIN, 128, 0, 0)
    b = entry(MASKED, 168, 46, 84) + SERIALIZED + entry(PLAIN, 128, 0, 0) + entry("_Z1kv", 32, 0, 0)
    assert ptxas_diff.report([a, b]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(
        "flash_forward_sm90_ws_kernel" in line
        and line.endswith("registers 168 -> 168, spill stores 50 -> 46, loads 116 -> 84 bytes")
        for line in lines
    )
    assert any(line.startswith("only in B: ") and "32 registers" in line for line in lines)
    assert any(line.startswith("B: ptxas serialized every wgmma of ") for line in lines)
    assert lines[-1] == "2 kernels in A, 3 in B: 2 differ, 1 serialized"


def test_the_same_report_is_the_same(capsys):
    a = entry(MASKED, 168, 50, 116) + entry(PLAIN, 128, 0, 0)
    assert ptxas_diff.report([a, a]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "2 kernels in A, 2 in B: 0 differ, 0 serialized"
    ]


def test_bad_input_gets_one_line(tmp_path, monkeypatch):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(ROOT), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"ptxas_diff.py: {tmp_path}: not a checkout of this project "
        "(no fixed/csrc/kernels/flash_backward_sm90.cuh)"
    )
    monkeypatch.setattr(ptxas_diff.shutil, "which", lambda _: None)
    with pytest.raises(ptxas_diff.Failure, match=r"^nvcc is not on PATH"):
        ptxas_diff.compile_both([ROOT, ROOT], timeout=1)
    with pytest.raises(ptxas_diff.Failure, match="ptxas reported no sm_90a kernels"):
        ptxas_diff.report(["", entry(PLAIN, 128, 0, 0)])


def test_a_failed_compile_gets_one_line(tmp_path, monkeypatch):
    """nvcc's first error line, after the checkout, and the other compile stopped."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\necho 'kernel.cu(3): error: identifier \"x\" is undefined'\nexit 1\n"
    )
    nvcc.chmod(0o755)
    monkeypatch.setattr(ptxas_diff.shutil, "which", lambda _: str(nvcc))
    monkeypatch.setattr(ptxas_diff.builders, "_torch_nvcc_flags", lambda: [])
    with pytest.raises(ptxas_diff.Failure) as failure:
        ptxas_diff.compile_both([ROOT, ROOT], timeout=60)
    assert str(failure.value) == (
        f'{ROOT}: nvcc failed: kernel.cu(3): error: identifier "x" is undefined'
    )


def function(name: str, *instructions: str) -> str:
    """One kernel as cuobjdump -sass prints it (addresses and encodings that compare as noise)."""
    lines = [f"\t\tFunction : {name}", '\t.headerflags\t@"EF_CUDA_SM90"']
    for n, instruction in enumerate(instructions):
        encoding = f"0x{7 * n + 3:016x}"
        lines.append(
            f"        /*{16 * n:04x}*/                   {instruction} ;  /* {encoding} */"
        )
    return "\n".join(lines) + "\n"


def test_sass_is_read_per_kernel():
    text = function(PLAIN, "FSEL R2, R3, RZ, P0", "@!P1 BRA 0x40") + function(MASKED, "EXIT")
    assert ptxas_diff.sass_functions(text) == {
        PLAIN: ["FSEL R2, R3, RZ, P0", "@!P1 BRA 0x40"],
        MASKED: ["EXIT"],
    }
    assert [ptxas_diff.opcode(i) for i in ("@!UP2 IMAD.WIDE.U32 R4, R14, 0x3, RZ", "FSEL R1")] == [
        "IMAD",
        "FSEL",
    ]


def test_sass_differences_are_named_and_the_same_counted(capsys):
    report = entry(MASKED, 168, 50, 116) + entry(PLAIN, 128, 0, 0)
    kept = function(MASKED, "FFMA R1, R2, R3, R4", "EXIT")
    a = kept + function(PLAIN, "FSEL R1, R2, RZ, P0", "FSEL R3, R4, RZ, P1", "FMUL R5, R1, R3")
    b = kept + function(PLAIN, "FSEL R1, R2, RZ, P0", "FFMA R5, R1, R3, RZ")
    assert ptxas_diff.report([report, report], [a, b]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "flash_forward_sm90_ws_kernel" in lines[0]
    assert lines[0].endswith("SASS 3 -> 2 instructions (FFMA 0 -> 1, FMUL 1 -> 0, FSEL 2 -> 1)")
    assert lines[1] == "2 kernels in A, 2 in B: 1 differ, 0 serialized; SASS the same in 1 of 2"
    assert ptxas_diff.report([report, report], [a, a]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("SASS the same in 2 of 2")


def test_cuobjdump_is_found_or_named(tmp_path, monkeypatch):
    monkeypatch.setattr(ptxas_diff.shutil, "which", lambda _: None)
    with pytest.raises(ptxas_diff.Failure, match=r"^cuobjdump is not on PATH nor beside nvcc"):
        ptxas_diff.find_cuobjdump("")
    with pytest.raises(ptxas_diff.Failure, match=r"no such cuobjdump$"):
        ptxas_diff.find_cuobjdump(str(tmp_path / "cuobjdump"))
    nvcc = tmp_path / "nvcc"
    (tmp_path / "cuobjdump").write_text(
        "#!/bin/sh\necho 'cuobjdump fatal: not an ELF' >&2\nexit 1\n"
    )
    (tmp_path / "cuobjdump").chmod(0o755)
    monkeypatch.setattr(
        ptxas_diff.shutil, "which", lambda tool: str(nvcc) if tool == "nvcc" else None
    )
    found = ptxas_diff.find_cuobjdump("")
    assert found == str(tmp_path / "cuobjdump")
    with pytest.raises(ptxas_diff.Failure, match=r"^cuobjdump read no SASS: cuobjdump fatal"):
        ptxas_diff.disassemble(found, [str(nvcc)], timeout=30)
