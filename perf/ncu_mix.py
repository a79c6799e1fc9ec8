"""A kernel's SASS as ncu sampled it, per opcode: the share of executed instructions, of warp
stall samples and of one stall reason's samples; and its mbarrier waits, site by site. Given two
kernels (fixed's and cuDNN's, or two builds), side by side. The instrument of perf/NOTES.md v53,
where it showed fixed's MUFU.EX2 holding 41% of its `wait` stalls against cuDNN's 4%, and fixed's
producer retrying try_wait about 23,000 times per SM where cuDNN's sleeps (NANOSLEEP.SYNCS).

Each input is ncu's source page as CSV, from a report with source counters:

    ncu --kernel-name regex:NAME --launch-skip 2 --launch-count 1 --section SourceCounters \\
        --section WarpStateStats -o REPORT python ...
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > KERNEL.csv
    python perf/ncu_mix.py A.csv [B.csv] [--reason wait] [--top 20] [--waits]

Runs anywhere (no GPU). Exit status 0, or 2 with one line for input it cannot read."""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter
from pathlib import Path

EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"
PREDICATE = re.compile(r"^@!?U?P[T\d]+\s+")
TRY_WAIT = "SYNCS.PHASECHK.TRANS64.TRYWAIT"


class Failure(Exception):
    """A problem to report in one line."""


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0  # ncu writes "-" where a counter does not apply


def opcode(source: str) -> str:
    """The instruction's opcode with its modifiers, without a predicate ('@!P0 BRA 0x..' -> BRA)
    or flush-to-zero ('FMUL.FTZ' -> FMUL: cuDNN's arithmetic has it, fixed's has not)."""
    words = PREDICATE.sub("", source.strip()).split()
    return words[0].replace(".FTZ", "") if words else "?"


def read(path: Path) -> tuple[str, list[dict[str, str]]]:
    """The kernel's name and its instructions (one dict per SASS line, ncu's columns)."""
    try:
        rows = list(csv.reader(path.open(errors="replace")))
    except OSError as error:
        raise Failure(f"{path}: {error.strerror or error}") from None
    name = next((row[1] for row in rows if len(row) > 1 and row[0] == "Kernel Name"), "?")
    header_at = next((i for i, row in enumerate(rows) if row[:2] == ["Address", "Source"]), None)
    if header_at is None:
        raise Failure(f"{path}: no 'Address','Source' header: not ncu's source page as CSV")
    header = rows[header_at]
    missing = [column for column in (EXECUTED, SAMPLES) if column not in header]
    if missing:
        raise Failure(f"{path}: no column {missing[0]!r}: collect the SourceCounters section")
    width = len(header)
    body = [
        dict(zip(header, row, strict=True)) for row in rows[header_at + 1 :] if len(row) == width
    ]
    if not body:
        raise Failure(f"{path}: no instructions")
    return name, body


def mix(body: list[dict[str, str]], reason: str) -> dict[str, Counter]:
    """Per opcode: executed instructions, all stall samples, and `reason`'s samples."""
    column = f"stall_{reason}"
    totals = {"executed": Counter(), "samples": Counter(), reason: Counter()}
    for line in body:
        op = opcode(line["Source"])
        totals["executed"][op] += number(line[EXECUTED])
        totals["samples"][op] += number(line[SAMPLES])
        totals[reason][op] += number(line[column])
    return totals


def share(counter: Counter, key: str) -> str:
    whole = sum(counter.values())
    return f"{100 * counter[key] / whole:5.1f}%" if whole else "    -"


def short(name: str) -> str:
    """A kernel's name without its parameter list (ncu prints the whole signature)."""
    return re.sub(r"\(CUtensorMap_st.*$", "", name)[:110]


def report(kernels: list[tuple[str, list[dict[str, str]]]], reason: str, top: int) -> list[str]:
    mixes = [mix(body, reason) for _, body in kernels]
    lines = [f"{'AB'[i]} = {short(name)}" for i, (name, _) in enumerate(kernels)]
    for i, totals in enumerate(mixes):
        executed, samples = sum(totals["executed"].values()), sum(totals["samples"].values())
        waited = sum(totals[reason].values())
        lines.append(
            f"{'AB'[i]}: {executed:,.0f} warp instructions executed, {samples:,.0f} stall "
            f"samples, {waited:,.0f} of them '{reason}'"
        )
    chosen: list[str] = []
    for totals in mixes:
        for op, _ in totals["executed"].most_common(top):
            if op not in chosen:
                chosen.append(op)
    cell = f"{'executed':>9} {'samples':>8} {reason[:8]:>8}"
    lines.append(f"{'opcode':34s} " + " | ".join([cell] * len(mixes)))
    for op in chosen:
        cells = [
            f"{share(t['executed'], op):>9} {share(t['samples'], op):>8} {share(t[reason], op):>8}"
            for t in mixes
        ]
        lines.append(f"{op[:34]:34s} " + " | ".join(cells))
    return lines


def waits(kernels: list[tuple[str, list[dict[str, str]]]]) -> list[str]:
    """Each mbarrier try_wait site with its executions: a site run far more often than the
    loop around it retries (spins); NANOSLEEP.SYNCS after it marks a parked wait."""
    lines = []
    for i, (_, body) in enumerate(kernels):
        sites = [line for line in body if TRY_WAIT in line["Source"]]
        sleeps = sum(number(line[EXECUTED]) for line in body if "NANOSLEEP" in line["Source"])
        total = sum(number(line[EXECUTED]) for line in sites)
        lines.append(
            f"{'AB'[i]}: {len(sites)} try_wait sites, {total:,.0f} executions, "
            f"{sleeps:,.0f} NANOSLEEP executions"
        )
        for line in sorted(sites, key=lambda line: -number(line[EXECUTED]))[:8]:
            lines.append(
                f"  {number(line[EXECUTED]):>12,.0f}  {line['Address']}  {line['Source'].strip()}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", type=Path, help="ncu's source page as CSV (one or two)")
    parser.add_argument("--reason", default="wait", help="a stall reason's column (stall_REASON)")
    parser.add_argument("--top", type=int, default=20, help="opcodes per kernel, by executions")
    parser.add_argument("--waits", action="store_true", help="also the mbarrier try_wait sites")
    args = parser.parse_args(argv)
    try:
        if len(args.csv) > 2:
            raise Failure(f"{len(args.csv)} files: give one or two")
        if args.top < 1:
            raise Failure(f"--top {args.top}: at least 1")
        kernels = [read(path) for path in args.csv]
        for path, (_, body) in zip(args.csv, kernels, strict=True):
            if f"stall_{args.reason}" not in body[0]:
                reasons = ", ".join(k[6:] for k in body[0] if re.fullmatch(r"stall_\w+", k))
                raise Failure(
                    f"{path}: no column 'stall_{args.reason}' (reasons: {reasons or 'none'})"
                )
        lines = report(kernels, args.reason, args.top)
        if args.waits:
            lines += waits(kernels)
    except Failure as failure:
        print(f"ncu_mix: {failure}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
