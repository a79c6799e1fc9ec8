"""perf/ncu_mix.py, a kernel's SASS per opcode from ncu's source page: executions, stall samples
and one stall reason are summed per opcode (predicates and flush-to-zero set aside), two kernels
print side by side, the mbarrier try_wait sites are listed with their executions, and input it
cannot read gets one line. On canned CSV in ncu 2025's layout (the real report needs a GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.perf_support import load_perf_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "perf" / "ncu_mix.py"
ncu_mix = load_perf_script("ncu_mix")

HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)",'
    '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed","stall_wait"'
)


def source_page(kernel: str, lines: list[tuple[str, int, int, int]]) -> str:
    """ncu's source page as CSV: (SASS, samples, executions, wait samples) per instruction."""
    rows = [f'"Kernel Name","{kernel}"', HEADER]
    for i, (sass, samples, executed, wait) in enumerate(lines):
        rows.append(
            f'"0x{0x7F00 + 16 * i:x}","      {sass}","{samples}","0","{executed:,}","{wait}"'
        )
    return "\n".join(rows) + "\n"


FIXED = source_page(
    "void flash_forward_sm90_ws_kernel<__nv_bfloat16>(CUtensorMap_st, CUtensorMap_st)",
    [
        ("FFMA R24, R24, UR4, R12", 10, 900, 0),
        ("MUFU.EX2 R24, R24", 30, 900, 20),
        ("MUFU.EX2 R25, R25", 10, 900, 20),
        ("@!P0  BRA 0x7fe9ff7ae700", 50, 1200, 0),
        ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9+0x34040], R0", 0, 3000, 0),
        ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR18+0x34010], R6", 0, 100, 0),
    ],
)
CUDNN = source_page(
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop",
    [
        ("FMUL.FTZ R3, R3, R2", 5, 1000, 0),
        ("MUFU.EX2 R3, R3", 5, 1000, 2),
        ("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R4+URZ+0x58], R3", 0, 50, 0),
        ("@!P1  NANOSLEEP.SYNCS 0x989680", 0, 50, 0),
    ],
)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_opcodes_drop_predicates_and_flush_to_zero():
    assert ncu_mix.opcode("@!P0  BRA 0x7fe9ff7ae700") == "BRA"
    assert ncu_mix.opcode("@UP1 UMOV UR7, UR15") == "UMOV"
    assert ncu_mix.opcode("FMUL.FTZ R3, R3, R2") == "FMUL"
    assert ncu_mix.opcode("HGMMA.64x128x16.F32.BF16 R112, R204, gdesc[UR12].tnspB, R112") == (
        "HGMMA.64x128x16.F32.BF16"
    )


def test_each_opcode_sums_its_lines(tmp_path):
    _, body = ncu_mix.read(write(tmp_path, "fixed.csv", FIXED))
    totals = ncu_mix.mix(body, "wait")
    assert totals["executed"]["MUFU.EX2"] == 1800
    assert totals["samples"]["MUFU.EX2"] == 40
    assert totals["wait"]["MUFU.EX2"] == 40
    assert totals["executed"]["SYNCS.PHASECHK.TRANS64.TRYWAIT"] == 3100


def test_two_kernels_side_by_side_with_their_waits(tmp_path, capsys):
    a, b = write(tmp_path, "a.csv", FIXED), write(tmp_path, "b.csv", CUDNN)
    assert ncu_mix.main([str(a), str(b), "--waits", "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "A = void flash_forward_sm90_ws_kernel<__nv_bfloat16>"  # no parameter list
    assert out[2].startswith("A: 7,000 warp instructions executed, 100 stall samples, 40 of them")
    mufu = next(line for line in out if line.startswith("MUFU.EX2"))
    # A: 1800 of 7000 executed, 40 of 100 samples, 40 of 40 waits; B: 1000 of 2100, 5 of 10, 2 of 2
    assert mufu.split() == ["MUFU.EX2", "25.7%", "40.0%", "100.0%", "|", "47.6%", "50.0%", "100.0%"]
    assert any(line.startswith("FMUL ") for line in out)  # B's FMUL.FTZ, among its top 3
    assert "A: 2 try_wait sites, 3,100 executions, 0 NANOSLEEP executions" in out
    assert "B: 1 try_wait sites, 50 executions, 50 NANOSLEEP executions" in out
    spins = out.index("A: 2 try_wait sites, 3,100 executions, 0 NANOSLEEP executions") + 1
    assert out[spins].split()[0] == "3,000"  # the busiest site first


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60
    )


def test_bad_input_gets_one_line(tmp_path):
    missing = run(str(tmp_path / "none.csv"))
    not_ncu = run(str(write(tmp_path, "other.csv", "a,b\n1,2\n")))
    no_counters = run(str(write(tmp_path, "plain.csv", '"Address","Source"\n"0x1","NOP"\n')))
    three = run(*(str(write(tmp_path, f"{i}.csv", FIXED)) for i in range(3)))
    typo = run(str(write(tmp_path, "fixed.csv", FIXED)), "--reason", "wiat")
    for result, words in (
        (missing, "No such file"),
        (not_ncu, "not ncu's source page as CSV"),
        (no_counters, "collect the SourceCounters section"),
        (three, "3 files: give one or two"),
        (typo, "no column 'stall_wiat' (reasons: wait)"),
    ):
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ncu_mix: ") and words in lines[0], lines
        assert result.stdout == ""
