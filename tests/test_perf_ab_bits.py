"""perf/ab_bits.py, the check that two checkouts give fixed/ the same bits: the same checkout
matches itself, a changed result is named per case and tensor, dQ alone differing on CUDA is
not counted (its atomics), and bad input or a failed run gets one line. On the CPU, with this
checkout's fixed/ and with stand-in fixed/ packages."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.perf_support import load_perf_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "perf" / "ab_bits.py"
ab_bits = load_perf_script("ab_bits")


def stand_in(directory: Path, body: str) -> Path:
    """A checkout whose fixed/ is `body` (a fast_attention, or anything else)."""
    (directory / "fixed").mkdir(parents=True)
    (directory / "fixed" / "__init__.py").write_text(textwrap.dedent(body))
    return directory


SDPA = """
    import torch
    def fast_attention(q, k, v, **options):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **options)
        return out * {factor} if options.get("dropout_p") else out
"""


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )


def test_this_checkout_matches_itself():
    result = run(str(ROOT), str(ROOT), "--device", "cpu")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == f"0 of {len(ab_bits.cases('cpu'))} cases differ"
    assert sum(line.endswith(" same") for line in lines) == len(ab_bits.cases("cpu"))


def test_a_changed_result_is_named_by_case_and_tensor(tmp_path):
    a = stand_in(tmp_path / "a", SDPA.format(factor=1.0))
    b = stand_in(tmp_path / "b", SDPA.format(factor=1.5))  # dropout's cases only
    result = run(str(a), str(b), "--device", "cpu")
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    differ = [line for line in lines if "DIFFER" in line]
    assert [line.split()[:3] for line in differ] == [
        ["64", "100", "dropout"],
        ["64", "129", "dropout"],
    ]
    assert all(line.endswith("DIFFER: out, dq, dk, dv") for line in differ)
    assert lines[-1] == f"2 of {len(ab_bits.cases('cpu'))} cases differ"


def test_dq_alone_counts_on_the_cpu_but_not_on_cuda():
    a = {"64 100 plain": ["1:1", "2:2", "3:3", "4:4"]}
    b = {"64 100 plain": ["1:1", "9:9", "3:3", "4:4"]}
    lines, differing = ab_bits.compare(a, b, "cuda")
    assert differing == 0 and "same but dq" in lines[0]
    lines, differing = ab_bits.compare(a, b, "cpu")
    assert differing == 1 and lines[0].endswith("DIFFER: dq")


def test_bad_input_and_failed_runs_get_one_line(tmp_path):
    for args, expected in (
        ([str(ROOT)], "1 checkouts given: two, A and B"),
        ([str(ROOT), str(tmp_path)], "no fixed/__init__.py"),
    ):
        result = run(*args, "--device", "cpu")
        assert result.returncode == 2 and result.stdout == ""
        assert len(result.stderr.splitlines()) == 1 and expected in result.stderr
    broken = stand_in(tmp_path / "broken", "raise ImportError('fixed: no compiler found')\n")
    result = run(str(ROOT), str(broken), "--device", "cpu")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"ab_bits: {broken}: ab_bits.py failed: ImportError: fixed: no compiler found"
    ]
