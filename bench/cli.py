"""The bench's command line: its options, and main, which loads the implementations, runs the
sections, prints the table and writes bench.json and the chart."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from bench.backends import Implementations, _first_line, machine_facts
from bench.cases import SECTIONS, SETTLE_AGREEMENT, make_settings
from bench.table import format_table, write_chart
from bench.timing import Bench

# -------------------------------------------------------------------------------------- main


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (no usage block), as in the kata's commands."""

    def error(self, message: str):
        self.exit(2, f"bench: {message} (see `{self.prog} --help`)\n")


def _at_least(low: float, unit: str, whole: bool = False, above: bool = False):
    """An argparse type: a finite number of `unit` (a whole one where `whole`), `low` or more
    (more than `low` where `above`). Anything else is one line and exit 2 (_Parser.error), not a
    traceback at the end of the run (an inf or nan in bench.json) nor a silently empty row."""

    def parse(text: str) -> float:
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value > low if above else value >= low)):
            bound = f"more than {low:g}" if above else f"{low:g} or more"
            number = "whole number" if whole else "number"
            raise argparse.ArgumentTypeError(f"{text!r} is not a {number} of {unit}, {bound}")
        return value

    return parse


_milliseconds = _at_least(0, "milliseconds")


def _seed(text: str) -> int:
    """torch.Generator.manual_seed's range; past it the run ended in its ValueError."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not -(2**63) <= value < 2**64:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from -2**63 to 2**64 - 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m kata bench",
        description="Time flawed/, fixed/ and torch's SDPA side by side: host overhead, the "
        "kata's shapes and LLM shapes (GPU). Prints a table and writes JSON (and a chart).",
    )
    parser.add_argument("--quick", action="store_true", help="fewer shapes and runs")
    parser.add_argument(
        "--only", nargs="+", choices=SECTIONS, metavar="SECTION", help="overhead, kata, llm, args"
    )
    parser.add_argument(
        "--max-seq",
        type=_at_least(1, "keys", whole=True),
        metavar="N",
        help="skip sequence lengths above N (kata, llm, args)",
    )
    parser.add_argument(
        "--json", type=Path, default=Path("bench.json"), help="where the rows go (bench.json)"
    )
    parser.add_argument("--png", type=Path, help="the chart (default: bench.png beside the JSON)")
    parser.add_argument(
        "--table",
        type=Path,
        metavar="JSON",
        help="print the table of a run's JSON again, with this version's marks; times nothing",
    )
    parser.add_argument("--seed", type=_seed, default=0, help="seed of the random inputs (0)")
    parser.add_argument(
        "--budget",
        dest="budget_s",
        type=_at_least(0, "seconds"),
        metavar="S",
        help="seconds of timed runs per row (1; 0.25 with --quick)",
    )
    parser.add_argument(
        "--min-runs",
        type=_at_least(1, "runs", whole=True),
        metavar="N",
        help="timed runs per row at least (5; 3 with --quick)",
    )
    parser.add_argument(
        "--max-runs",
        type=_at_least(1, "runs", whole=True),
        metavar="N",
        help="timed runs per row at most (50; 10 with --quick)",
    )
    parser.add_argument(
        "--max-call",
        dest="max_call_s",
        type=_at_least(0, "seconds", above=True),
        metavar="S",
        help="rows whose single call takes longer are not timed (1 s; 0.5 s with --quick)",
    )
    parser.add_argument(
        "--rounds",
        dest="alternate_rounds",
        type=_at_least(1, "rounds", whole=True),
        metavar="N",
        help="alternating batches per llm and args row (5; 3 with --quick): more of them to read "
        "a ratio near 1.00x",
    )
    parser.add_argument(
        "--settle",
        dest="alternate_settle_ms",
        type=_milliseconds,
        metavar="MS",
        help="on a GPU, each alternating batch first runs its own calls untimed in chunks of "
        f"this long, until two chunks' medians agree within {SETTLE_AGREEMENT * 100:g}%% (30)",
    )
    parser.add_argument(
        "--settle-max",
        dest="alternate_settle_max_ms",
        type=_milliseconds,
        metavar="MS",
        help="at most this long of untimed calls per batch (250; with --quick, --settle's value: "
        "a fixed settle)",
    )
    parser.add_argument(
        "--time-limit",
        dest="time_limit_s",
        type=_at_least(0, "seconds"),  # 0: time nothing, every row says why
        metavar="S",
        help="time no new row after this many seconds (600; 90 with --quick)",
    )
    return parser


def json_destination_problem(path: Path) -> str | None:
    """Why the rows could not be written to `path`, found before any timing (a full GPU run takes
    minutes, and the JSON is written last), or None, having made its folder."""
    if path.is_dir():
        return f"--json {path} is a directory"
    blocker = next((p for p in (path.parent, *path.parent.parents) if p.is_file()), None)
    if blocker is not None:
        return f"--json {path}: {blocker} is a file, not a folder"
    if path.exists() and not os.access(path, os.W_OK):
        return f"--json {path} is not writable"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"--json {path}: cannot make its folder: {error.strerror or error}"
    if not os.access(path.parent, os.W_OK | os.X_OK):
        return f"--json {path}: its folder is not writable"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.table:
        print(table_of(args.table, parser))
        return 0
    problem = json_destination_problem(args.json)
    if problem:
        parser.error(problem)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    settings = make_settings(args, device)
    if settings.alternate_settle_max_ms < settings.alternate_settle_ms:
        parser.error(
            f"--settle-max {settings.alternate_settle_max_ms:g} is below --settle "
            f"{settings.alternate_settle_ms:g}: the longest settle is at least one chunk"
        )
    bench = Bench(settings)
    bench.log(f"bench: loading flawed/ and fixed/ on {device.type} (fixed/ builds on first use)")
    impls = Implementations(settings.sections)
    bench.started = time.perf_counter()  # the time limit counts from here, not from the build
    bench.run(impls)
    report = {
        "machine": machine_facts(device),
        "settings": settings.to_json(),
        "elapsed_s": round(bench.elapsed(), 1),
        "sdpa_kernels": bench.sdpa_kernels,
        "sm_clock": bench.clock.why_not or "NVML, after each alternating batch of the llm rows",
        "notes": bench.notes,
        "rows": bench.rows,
    }
    print(format_table(report))
    try:
        args.json.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    except OSError as error:  # changed during the run: the table above is all there is
        print(f"bench: could not write {args.json}: {error.strerror or error}", file=sys.stderr)
        return 1
    png = args.png or args.json.with_suffix(".png")
    try:
        png.parent.mkdir(parents=True, exist_ok=True)
        chart = write_chart(bench.rows, png)
    except Exception as error:  # the chart is optional: never lose the table or the JSON to it
        chart = f"no chart: {_first_line(error)}"
    print(f"\nrows: {args.json}; {chart}; took {bench.elapsed():.0f} s")
    return 0


def table_of(path: Path, parser: argparse.ArgumentParser) -> str:
    """The table of a bench.json written before; a file that is not one gets parser.error."""
    try:
        report = json.loads(path.read_text())
    except OSError as error:
        parser.error(f"--table: cannot read {path}: {error.strerror}")
    except ValueError:
        parser.error(f"--table: {path} is not JSON")
    try:
        return format_table(report)
    except (KeyError, TypeError, IndexError, AttributeError):
        parser.error(f"--table: {path} is not a bench.json (rows, machine and settings)")


if __name__ == "__main__":
    sys.exit(main())
