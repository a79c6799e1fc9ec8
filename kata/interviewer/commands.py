"""The interviewer's commands: `python -m kata review` (make review: the scorecard, its
Markdown, JSON and --explain) and `handout DEST` (make handout: the candidate's copy)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path

from kata import FLAWED_DIR, KataError


def register(commands) -> None:
    """Add the interviewer's subcommands to the `python -m kata` parser."""
    review = commands.add_parser("review", help="scorecard of an implementation")
    review.add_argument(
        "--impl",
        help="flawed (default), fixed, or a directory: a candidate's copy of flawed/ "
        "(of flawed/proposed_fix/ with --round 2)",
    )
    review.add_argument(
        "--round",
        type=int,
        choices=(1, 2),
        default=1,
        help="1: the wrapper (default); 2: review the proposed fix in flawed/proposed_fix/",
    )
    review.add_argument("--markdown", metavar="FILE", help="also write the report as Markdown")
    review.add_argument(
        "--explain", metavar="ID", help="one flaw in depth: its code, live evidence and rubric"
    )
    review.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    review.add_argument("--timeout", type=_seconds, default=60.0, help="seconds per probe (60)")
    review.add_argument("--seed", type=_seed, help="replay the random inputs of an earlier review")
    review.add_argument(
        "--only",
        nargs="+",
        metavar="ID",
        help="judge only these flaw ids (dtype shape, or dtype,shape)",
    )
    review.set_defaults(run=_review)

    handout = commands.add_parser("handout", help="write the candidate's copy into DEST")
    handout.add_argument("dest", nargs="?", help="a new or empty directory")
    handout.add_argument(
        "--round",
        type=int,
        choices=(1, 2),
        default=1,
        help="2 adds flawed/proposed_fix/, the code reviewed in round two",
    )
    handout.set_defaults(run=_handout)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:  # 0 would time every probe out: fixed/ at 0%
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


MAX_SEED = 2**63 - 1  # what torch's generators take; review prints seeds below 2**31


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be from 0 to 2**63 - 1, got {text}")
    return value


def _flaw_ids(values: list[str] | None, catalog, round_number: int) -> list[str] | None:
    """--only's ids, space- or comma-separated, each checked against the round's catalog."""
    if values is None:
        return None
    ids = list(dict.fromkeys(i.strip() for value in values for i in value.split(",") if i.strip()))
    known = [flaw.id for flaw in catalog]
    unknown = [i for i in ids if i not in known]
    if not ids:
        problem = "no flaw id given"
    elif unknown:
        plural = "s" if len(unknown) > 1 else ""
        problem = f"unknown flaw id{plural} {', '.join(map(repr, unknown))} in round {round_number}"
    else:
        return ids
    raise KataError(f"--only: {problem}; known: {', '.join(known)}")


def _review(args) -> int:
    from kata.harness import isolation, keeper
    from kata.harness.review import Implementation, resolve_implementation, run_review
    from kata.interviewer import report

    catalog, shipped_dir = _round(args.round)
    only = _flaw_ids(args.only, catalog, args.round)
    # Refused before the review, not after minutes of probes.
    if args.markdown and not Path(args.markdown).resolve().parent.is_dir():
        raise KataError(f"--markdown {args.markdown}: its directory does not exist")
    if args.markdown and Path(args.markdown).is_dir():
        raise KataError(f"--markdown {args.markdown}: a directory, not a file")
    if args.impl:
        implementation = resolve_implementation(args.impl)
    elif args.round == 2:
        implementation = Implementation("flawed/proposed_fix", "dir", shipped_dir)
    else:
        implementation = resolve_implementation("flawed")
    if args.explain:
        if not report.RUBRIC.exists():
            raise KataError("--explain is the interviewer's tool: this copy has no rubric.md")
        if args.explain not in {flaw.id for flaw in catalog}:
            known = ", ".join(flaw.id for flaw in catalog)
            raise KataError(
                f"unknown flaw id {args.explain!r} in round {args.round}; known: {known}"
            )
        only = [args.explain]
    review = run_review(
        implementation,
        timeout=args.timeout,
        seed=args.seed,
        only=only,
        catalog=catalog,
        round_number=args.round,
        prepare=_round_two_prepare() if args.round == 2 else None,
    )
    if args.explain:
        print(report.format_explanation(review))
        return 0
    changes, bands = report.candidate_changes(review), report.level_bands()
    if args.markdown:
        try:
            Path(args.markdown).write_text(report.format_markdown(review, changes, bands))
        except OSError as error:
            raise KataError(f"cannot write {args.markdown}: {error.strerror}") from None
    if args.json:
        print(json.dumps(review.to_json(), indent=2))
    else:
        print(report.format_table(review, changes, bands))
        if args.markdown:
            print(f"Markdown report written to {args.markdown}")
        if isolation.kept_zygotes_started():
            print(keeper.started_note())
    return 0


def _round_two_prepare():
    from kata.harness import round2

    return round2.prepare


def _round(number: int):
    """The catalog of a round and the directory its code ships in."""
    if number == 1:
        from kata.harness.catalog import CATALOG

        return CATALOG, FLAWED_DIR
    # A handout leaves round2.py out. Asked by name, not by catching ImportError: that would
    # also hide a real import error inside round2.py.
    if importlib.util.find_spec("kata.harness.round2") is None:
        raise KataError("round two is not part of this copy of the kata")
    from kata.harness import round2

    return round2.CATALOG, round2.ROUND2_DIR


def _handout(args) -> int:
    from kata.interviewer.handout import build_handout

    if not args.dest:
        raise KataError("where to? make handout DEST=path/to/dir")
    dest = build_handout(Path(args.dest), args.round)
    print(f"Candidate's copy written to {dest}")
    print(f"Before the interview: cd {dest} && make kata   (installs and builds what it needs)")
    return 0
