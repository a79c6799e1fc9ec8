"""A/B of two checkouts on one GPU: perf/args_times.py run in each in turn, several rounds, and
per case the medians and B's speed over A's (perf/NOTES.md's A/B runs, v27 on). From the
repository root of either checkout:

    python perf/ab.py A_DIR B_DIR [--cases plain,causal] [--rounds 3]

Each checkout needs fixed/ built for this GPU (`python -m kata build --impl fixed`, or
`python perf/device_build.py place` first). Rounds alternate which checkout runs first (A B,
B A, A B, ...): a machine that drifts (clocks, heat) then favours neither, as it favoured A in
v34's first A/B of the split tail, where B always ran second. Prints, per case, fixed's forward
and forward+backward medians over the rounds in each checkout and B's speed over A's (above 1:
B is faster). Bad input or a failed run: one line, exit status 2. Stopped mid-run (SIGTERM, as
`timeout` sends, or Ctrl-C): the table of the rounds both checkouts finished, if any, then one
line, exit status 2."""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

SCRIPT = Path("perf") / "args_times.py"
# One args_times.py row: name, (shape): fwd <ms> ms vs SDPA ... fwd+bwd <ms> vs ...
ROW = re.compile(r"^(\S+)\s+\(.*?\): fwd ([\d.]+) ms vs SDPA .*?fwd\+bwd ([\d.]+) vs ")


class Failure(Exception):
    """A problem to report in one line."""


class Stopped(Exception):
    """SIGTERM mid-run: subprocess.run kills the running args_times.py as this passes."""


def _stop(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def round_order(rounds: int) -> list[tuple[str, str]]:
    """Which checkout runs first in each round: A in even rounds (0, 2, ...), B in odd ones."""
    return [("A", "B") if number % 2 == 0 else ("B", "A") for number in range(rounds)]


def parse(text: str) -> dict[str, tuple[float, float]]:
    """args_times.py's rows: case name -> (fixed's forward ms, fixed's forward+backward ms)."""
    rows = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            rows[match.group(1)] = (float(match.group(2)), float(match.group(3)))
    return rows


def run_checkout(directory: Path, cases: str, timeout: float) -> dict[str, tuple[float, float]]:
    """One args_times.py run in `directory`, its rows."""
    try:
        result = subprocess.run(
            [sys.executable, str(SCRIPT), "--cases", cases],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise Failure(f"{directory}: args_times.py ran past {timeout:.0f} s") from None
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        last = lines[-1] if lines else f"exit status {result.returncode}"
        raise Failure(f"{directory}: args_times.py failed: {last}")
    rows = parse(result.stdout)
    if not rows:
        raise Failure(f"{directory}: args_times.py printed no rows")
    return rows


def table(runs: dict[str, list[dict[str, tuple[float, float]]]]) -> list[str]:
    """Per case in A's order, the medians over the rounds and B's speed over A's."""
    lines = [
        f"{'case':18s} {'fwd A':>9s} {'fwd B':>9s} {'B/A':>5s}   {'f+b A':>9s} {'f+b B':>9s} "
        f"{'B/A':>5s}"
    ]
    for name in runs["A"][0]:
        if not all(name in rows for side in "AB" for rows in runs[side]):
            lines.append(f"{name:18s} (not in every run)")
            continue
        medians = {
            side: [
                statistics.median(rows[name][column] for rows in runs[side]) for column in (0, 1)
            ]
            for side in "AB"
        }
        (fwd_a, both_a), (fwd_b, both_b) = medians["A"], medians["B"]
        lines.append(
            f"{name:18s} {fwd_a:9.4f} {fwd_b:9.4f} {fwd_a / fwd_b:5.2f}   "
            f"{both_a:9.4f} {both_b:9.4f} {both_a / both_b:5.2f}"
        )
    return lines


def report(
    runs: dict[str, list[dict[str, tuple[float, float]]]], rounds: int, done: int, a: Path, b: Path
) -> None:
    """The table of the first `done` rounds of each checkout."""
    count = f"{done}" if done == rounds else f"{done} of {rounds}"
    print(f"A = {a}, B = {b}; medians of {count} rounds, ms (fixed's)")
    print("\n".join(table({side: runs[side][:done] for side in "AB"})))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="checkout A (the baseline)")
    parser.add_argument("b", type=Path, help="checkout B (the change)")
    parser.add_argument("--cases", default="plain", help="args_times.py's case groups")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of A and B (default 3)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    runs: dict[str, list[dict[str, tuple[float, float]]]] = {"A": [], "B": []}
    try:
        if args.rounds < 1:
            raise Failure(f"--rounds {args.rounds}: at least 1")
        for directory in (args.a, args.b):
            if not (directory / SCRIPT).is_file():
                raise Failure(f"{directory}: no {SCRIPT} (a checkout's root?)")
        for number, order in enumerate(round_order(args.rounds), start=1):
            for side in order:
                directory = args.a if side == "A" else args.b
                runs[side].append(run_checkout(directory, args.cases, args.timeout))
            print(f"round {number} of {args.rounds} done ({' '.join(order)})", flush=True)
    except Failure as failure:
        print(f"ab: {failure}", file=sys.stderr)
        return 2
    except (Stopped, KeyboardInterrupt) as stop:
        done = min(len(runs["A"]), len(runs["B"]))
        if done:
            report(runs, args.rounds, done, args.a, args.b)
        why = stop.args[0] if isinstance(stop, Stopped) else "interrupted"
        print(f"ab: stopped ({why}) after {done} of {args.rounds} rounds", file=sys.stderr)
        return 2
    report(runs, args.rounds, args.rounds, args.a, args.b)
    return 0


if __name__ == "__main__":
    sys.exit(main())
