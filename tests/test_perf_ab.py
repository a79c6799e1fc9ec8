"""perf/ab.py, the A/B of two checkouts (or more): rounds rotate which runs first,
args_times.py's rows are read and their medians compared with A's, and bad input or a failed run
gets one line. On the CPU, with stand-ins for args_times.py that print fixed times."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.perf_support import load_perf_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "perf" / "ab.py"
ab = load_perf_script("ab")

# Two rows as args_times.py prints them.
ROWS = (
    "plain-64           (4, 16, 2048, 64): fwd 0.2000 ms vs SDPA 0.1767 (0.88x)"
    "  fwd+bwd 0.7000 vs 0.6984 (1.00x)\n"
    "plain-128          (4, 16, 2048, 128): fwd 0.3000 ms vs SDPA 0.2516 (0.84x)"
    "  fwd+bwd 1.2000 vs 1.1076 (0.92x)\n"
)


def stand_in(directory: Path, scale: float, fail: bool = False, hang_from: int = 0) -> Path:
    """A checkout whose perf/args_times.py prints ROWS with fixed's times times `scale`, and
    appends its arguments after --cases to calls.txt (or fails, saying why; or, from its
    hang_from-th call on, hangs)."""
    (directory / "perf").mkdir(parents=True)
    (directory / "perf" / "args_times.py").write_text(
        textwrap.dedent(
            f"""
            import os, re, sys, time
            from pathlib import Path
            log = Path(__file__).parents[1] / "calls.txt"
            with open(log, "a") as calls:
                calls.write(" ".join(sys.argv[2:]) + "\\n")
            if {hang_from} and len(log.read_text().splitlines()) >= {hang_from}:
                (log.parent / "hanging.pid").write_text(str(os.getpid()))
                time.sleep(60)
            if {fail!r}:
                sys.exit("args_times: needs a CUDA GPU; torch sees none")
            def scaled(match):
                return f"{{match.group(1)}} {{float(match.group(2)) * {scale}:.4f}}"
            for line in {ROWS!r}.splitlines():
                print(re.sub(r"(fwd\\+?b?w?d?) ([\\d.]+)(?= ms vs| vs)", scaled, line))
            """
        )
    )
    return directory


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


def test_rounds_alternate_which_checkout_runs_first():
    assert ab.round_order(3) == [("A", "B"), ("B", "A"), ("A", "B")]
    assert ab.round_order(4, 3) == [
        ("A", "B", "C"),
        ("B", "C", "A"),
        ("C", "A", "B"),
        ("A", "B", "C"),
    ]


def test_rows_are_read_and_other_lines_ignored():
    rows = ab.parse("some warning\n" + ROWS + "done\n")
    assert rows == {"plain-64": (0.2, 0.7), "plain-128": (0.3, 1.2)}


def test_medians_and_b_over_a(tmp_path):
    a = stand_in(tmp_path / "a", 1.0)
    b = stand_in(tmp_path / "b", 0.5)  # B takes half the time: twice as fast
    result = run(str(a), str(b), "--rounds", "2", "--cases", "plain,causal")
    assert result.returncode == 0, result.stderr
    assert "round 2 of 2 done (B A)" in result.stdout
    row = next(line for line in result.stdout.splitlines() if line.startswith("plain-64"))
    assert row.split() == ["plain-64", "0.2000", "0.1000", "2.00", "0.7000", "0.3500", "2.00"]
    assert (a / "calls.txt").read_text() == "plain,causal\nplain,causal\n"


def test_cold_reaches_every_run_and_the_report(tmp_path):
    """--cold: each args_times.py run gets --cold (a fresh input set per call), and the table's
    first line says which inputs it timed."""
    a = stand_in(tmp_path / "a", 1.0)
    b = stand_in(tmp_path / "b", 0.5)
    result = run(str(a), str(b), "--rounds", "2", "--cold")
    assert result.returncode == 0, result.stderr
    assert all((d / "calls.txt").read_text() == "plain --cold\n" * 2 for d in (a, b))
    assert "; a fresh input set per call (--cold)" in result.stdout, result.stdout
    plain = run(str(a), str(b), "--rounds", "1")
    assert "; one input set per case" in plain.stdout, plain.stdout


def test_cold_input_sets_fill_four_l2_caches():
    """args_times.py --cold: enough sets for four L2 caches, never fewer than two."""
    args_times = load_perf_script("args_times")
    l2 = 60 * 2**20
    assert args_times.input_sets_for(16 * 2**20, l2) == 15  # 240 MiB over 16 MiB sets
    assert args_times.input_sets_for(67 * 2**20, l2) == 4
    assert args_times.input_sets_for(268 * 2**20, l2) == 2  # larger than four caches: still 2
    calls = []
    turn = args_times.rotating([lambda: calls.append(0), lambda: calls.append(1)])
    for _ in range(5):
        turn()
    assert calls == [0, 1, 0, 1, 0]


def test_three_checkouts_each_against_a(tmp_path):
    """B and C in one run: each timed in every round, each one's speed over A's."""
    a = stand_in(tmp_path / "a", 1.0)
    b = stand_in(tmp_path / "b", 0.5)
    c = stand_in(tmp_path / "c", 2.0)  # C takes twice A's time
    result = run(str(a), str(b), str(c), "--rounds", "3")
    assert result.returncode == 0, result.stderr
    for line in ("round 2 of 3 done (B C A)", "round 3 of 3 done (C A B)"):
        assert line in result.stdout, result.stdout
    assert f"A = {a}, B = {b}, C = {c}; medians of 3 rounds" in result.stdout
    head = next(line for line in result.stdout.splitlines() if line.startswith("case"))
    assert head.split() == [
        "case", "fwd", "A", "fwd", "B", "B/A", "fwd", "C", "C/A",
        "f+b", "A", "f+b", "B", "B/A", "f+b", "C", "C/A",
    ]  # fmt: skip
    row = next(line for line in result.stdout.splitlines() if line.startswith("plain-128"))
    assert row.split() == [
        "plain-128", "0.3000", "0.1500", "2.00", "0.6000", "0.50",
        "1.2000", "0.6000", "2.00", "2.4000", "0.50",
    ]  # fmt: skip
    assert all((d / "calls.txt").read_text() == "plain\n" * 3 for d in (a, b, c))


def test_bad_input_and_a_failed_run_get_one_line(tmp_path):
    a = stand_in(tmp_path / "a", 1.0)
    failing = stand_in(tmp_path / "b", 1.0, fail=True)
    for args, expected in (
        ((str(a), str(tmp_path / "missing")), "no perf/args_times.py"),
        ((str(a),), "1 checkouts: 2 to 6"),
        ((str(a),) * 7, "7 checkouts: 2 to 6"),
        ((str(a), str(a), "--rounds", "0"), "--rounds 0: at least 1"),
        ((str(a), str(failing)), "args_times: needs a CUDA GPU"),
    ):
        result = run(*args)
        assert result.returncode == 2, result
        assert "Traceback" not in result.stderr, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ab: ") and expected in lines[0], lines


def test_a_stop_mid_run_prints_the_finished_rounds(tmp_path):
    """SIGTERM (what `timeout` sends) in round 2: round 1's table, then one line, status 2, and
    the hanging args_times.py killed with it."""
    a = stand_in(tmp_path / "a", 1.0)
    b = stand_in(tmp_path / "b", 0.5, hang_from=2)  # B's second call: round 2's first run
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(a), str(b), "--rounds", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline().startswith("round 1 of 3 done (A B)")
    deadline = time.monotonic() + 30
    while not (b / "hanging.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # B's hanging run has started
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 2, (out, err)
    assert "medians of 1 of 3 rounds" in out, out
    row = next(line for line in out.splitlines() if line.startswith("plain-64"))
    assert row.split() == ["plain-64", "0.2000", "0.1000", "2.00", "0.7000", "0.3500", "2.00"]
    assert err.strip().splitlines() == ["ab: stopped (SIGTERM) after 1 of 3 rounds"], err
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left sleeping
        os.kill(int((b / "hanging.pid").read_text()), 0)


def test_fixed_and_sdpa_batches_alternate(monkeypatch):
    """args_times.py times fixed's batches and SDPA's in rounds, the order reversed every other
    round, so that a drift of the GPU lands on both (perf/NOTES.md, v59); each gets its own
    median."""
    args_times = load_perf_script("args_times")
    timed = []
    monkeypatch.setattr(args_times, "batch_ms", lambda fn: fn())
    fixed_ms = iter([0.0] * 3 + [1.0, 9.0, 2.0, 3.0])  # three warm-up calls, then four batches

    def fixed():
        timed.append("fixed")
        return next(fixed_ms)

    def sdpa():
        timed.append("sdpa")
        return 5.0

    warm_up = ["fixed"] * 3 + ["sdpa"] * 3
    medians = args_times.alternating_medians_ms([fixed, sdpa], reps=4)
    assert timed == [*warm_up, "fixed", "sdpa", "sdpa", "fixed", "fixed", "sdpa", "sdpa", "fixed"]
    assert medians == [2.5, 5.0]
