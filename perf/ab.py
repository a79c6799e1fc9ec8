"""A/B of two checkouts (or more) on one GPU: perf/args_times.py run in each in turn, several
rounds, and per case the medians and each checkout's speed over A's (perf/NOTES.md's A/B runs,
v27 on). From the repository root of any checkout:

    python perf/ab.py A_DIR B_DIR [C_DIR ...] [--cases plain,causal] [--rounds 3] [--cold]

A is the baseline; up to six checkouts (A to F), each timed in every round, so that several
variants share one machine, its warm-up and its drift. Each checkout needs fixed/ built for this
GPU (`python -m kata build --impl fixed`, or `python perf/device_build.py place` first). Rounds
rotate which checkout runs first (A B, B A, A B, ...; with three A B C, B C A, C A B, ...): a
machine that drifts (clocks, heat) then favours none, as it favoured A in v34's first A/B of
the split tail, where B always ran second. Prints, per case, fixed's forward and
forward+backward medians over the rounds in each checkout and each one's speed over A's (above
1: faster than A). `--cold` passes args_times.py --cold: each call reads a fresh input set, as in
`make bench`, so that a change to what a kernel reads is timed with K and V from DRAM (one
reused set keeps them in L2). Bad input or a failed run: one line, exit status 2. Stopped mid-run
(SIGTERM, as `timeout` sends, or Ctrl-C): the table of the rounds every checkout finished, if
any, then one line, exit status 2."""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

SCRIPT = Path("perf") / "args_times.py"
LABELS = "ABCDEF"  # the checkouts, in the order given; A is the baseline
# One args_times.py row: name, (shape): fwd <ms> ms vs SDPA ... fwd+bwd <ms> vs ...
ROW = re.compile(r"^(\S+)\s+\(.*?\): fwd ([\d.]+) ms vs SDPA .*?fwd\+bwd ([\d.]+) vs ")


class Failure(Exception):
    """A problem to report in one line."""


class Stopped(Exception):
    """SIGTERM mid-run: subprocess.run kills the running args_times.py as this passes."""


def _stop(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def round_order(rounds: int, checkouts: int = 2) -> list[tuple[str, ...]]:
    """Each round's order: the checkouts rotated by the round's number (with two, A first in
    even rounds, B in odd ones), so that each runs first, second, ... equally often."""
    labels = LABELS[:checkouts]
    return [
        tuple(labels[(index + number) % checkouts] for index in range(checkouts))
        for number in range(rounds)
    ]


def parse(text: str) -> dict[str, tuple[float, float]]:
    """args_times.py's rows: case name -> (fixed's forward ms, fixed's forward+backward ms)."""
    rows = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            rows[match.group(1)] = (float(match.group(2)), float(match.group(3)))
    return rows


def run_in(directory: Path, script: Path | str, args: list[str], timeout: float) -> str:
    """`python script args` in `directory` (perf/ab_bits.py's runs too): its output, or Failure
    naming the script with the run's last line."""
    name = Path(script).name
    try:
        result = subprocess.run(
            [sys.executable, str(script), *args],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise Failure(f"{directory}: {name} ran past {timeout:.0f} s") from None
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        last = lines[-1] if lines else f"exit status {result.returncode}"
        raise Failure(f"{directory}: {name} failed: {last}")
    return result.stdout


def run_checkout(
    directory: Path, cases: str, timeout: float, cold: bool = False
) -> dict[str, tuple[float, float]]:
    """One args_times.py run in `directory` (with --cold: a fresh input set per call), its rows."""
    output = run_in(directory, SCRIPT, ["--cases", cases, *(["--cold"] if cold else [])], timeout)
    rows = parse(output)
    if not rows:
        raise Failure(f"{directory}: args_times.py printed no rows")
    return rows


def table(runs: dict[str, list[dict[str, tuple[float, float]]]]) -> list[str]:
    """Per case in A's order, the medians over the rounds and each other checkout's speed over
    A's: fwd A, fwd B, B/A, fwd C, C/A, ..., then the same for forward+backward."""
    others = [side for side in runs if side != "A"]

    def group(cells: dict[str, str], ratios: dict[str, str]) -> str:
        parts = [f"{cells['A']:>9s}"]
        for side in others:
            parts += [f"{cells[side]:>9s}", f"{ratios[side]:>5s}"]
        return " ".join(parts)

    heads = [
        group({side: f"{column} {side}" for side in runs}, {s: f"{s}/A" for s in others})
        for column in ("fwd", "f+b")
    ]
    lines = [f"{'case':18s} {heads[0]}   {heads[1]}"]
    for name in runs["A"][0]:
        if not all(name in rows for side in runs for rows in runs[side]):
            lines.append(f"{name:18s} (not in every run)")
            continue
        groups = []
        for column in (0, 1):
            medians = {
                side: statistics.median(rows[name][column] for rows in runs[side]) for side in runs
            }
            cells = {side: f"{ms:.4f}" for side, ms in medians.items()}
            ratios = {side: f"{medians['A'] / medians[side]:.2f}" for side in others}
            groups.append(group(cells, ratios))
        lines.append(f"{name:18s} {groups[0]}   {groups[1]}")
    return lines


def report(
    runs: dict[str, list[dict[str, tuple[float, float]]]],
    rounds: int,
    done: int,
    directories: dict[str, Path],
    cold: bool = False,
) -> None:
    """The table of the first `done` rounds of each checkout."""
    count = f"{done}" if done == rounds else f"{done} of {rounds}"
    named = ", ".join(f"{side} = {directory}" for side, directory in directories.items())
    inputs = "a fresh input set per call (--cold)" if cold else "one input set per case"
    print(f"{named}; medians of {count} rounds, ms (fixed's); {inputs}")
    print("\n".join(table({side: runs[side][:done] for side in runs})))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument(
        "checkouts",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="checkout A (the baseline), then B (the change), and up to four more",
    )
    parser.add_argument("--cases", default="plain", help="args_times.py's case groups")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every checkout (3)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="args_times.py --cold: inputs streamed from DRAM, as make bench rotates them",
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    directories = {LABELS[i]: path for i, path in enumerate(args.checkouts[: len(LABELS)])}
    runs: dict[str, list[dict[str, tuple[float, float]]]] = {side: [] for side in directories}
    try:
        if not 2 <= len(args.checkouts) <= len(LABELS):
            raise Failure(f"{len(args.checkouts)} checkouts: 2 to {len(LABELS)}")
        if args.rounds < 1:
            raise Failure(f"--rounds {args.rounds}: at least 1")
        for directory in args.checkouts:
            if not (directory / SCRIPT).is_file():
                raise Failure(f"{directory}: no {SCRIPT} (a checkout's root?)")
        for number, order in enumerate(round_order(args.rounds, len(runs)), start=1):
            for side in order:
                runs[side].append(
                    run_checkout(directories[side], args.cases, args.timeout, args.cold)
                )
            print(f"round {number} of {args.rounds} done ({' '.join(order)})", flush=True)
    except Failure as failure:
        print(f"ab: {failure}", file=sys.stderr)
        return 2
    except (Stopped, KeyboardInterrupt) as stop:
        done = min(len(rows) for rows in runs.values())
        if done:
            report(runs, args.rounds, done, directories, args.cold)
        why = stop.args[0] if isinstance(stop, Stopped) else "interrupted"
        print(f"ab: stopped ({why}) after {done} of {args.rounds} rounds", file=sys.stderr)
        return 2
    report(runs, args.rounds, args.rounds, directories, args.cold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
