"""The kata's command line: `python -m kata --help` lists the subcommands."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import warnings
from pathlib import Path

from kata import FLAWED_DIR, REPO_ROOT, KataError


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one `kata: ` line (no usage block), as every error is."""

    def error(self, message: str):
        self.exit(2, f"kata: {message} (see `{self.prog} --help`)\n")


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
    from kata import report
    from kata.review import Implementation, resolve_implementation, run_review

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
    return 0


def _round_two_prepare():
    from kata import round2

    return round2.prepare


def _round(number: int):
    """The catalog of a round and the directory its code ships in."""
    if number == 1:
        from kata.catalog import CATALOG

        return CATALOG, FLAWED_DIR
    # A handout leaves round2.py out. Asked by name, not by catching ImportError: that would
    # also hide a real import error inside round2.py.
    if importlib.util.find_spec("kata.round2") is None:
        raise KataError("round two is not part of this copy of the kata")
    from kata import round2

    return round2.CATALOG, round2.ROUND2_DIR


def _hint(args) -> int:
    from kata.hints import next_hint

    print(next_hint(args.id))
    return 0


def _list(args) -> int:
    from kata.catalog import CATALOG

    for flaw in CATALOG:
        needs = ", ".join(sorted(need.value for need in flaw.needs)) or "cpu"
        print(f"{flaw.id:<13} {flaw.points:>3}  {flaw.title}  [{needs}]")
    return 0


def _build(args) -> int:
    from kata import builders
    from kata.review import resolve_implementation

    implementation = resolve_implementation(args.impl)  # in a handout, fixed/ is absent
    if implementation.kind == "fixed":
        builders.build_fixed()
        print("fixed/: extension built")
    else:
        library = builders.build_vendor_library(implementation.path)
        print(f"{library.relative_to(REPO_ROOT) if library.is_relative_to(REPO_ROOT) else library}")
    return 0


def _check_cuda(args) -> int:
    from kata.builders import PURE_CUDA_SOURCES, SM90A_CUDA_SOURCES, compile_check_cuda

    for arch, sources in ((args.arch, PURE_CUDA_SOURCES), ("sm_90a", SM90A_CUDA_SOURCES)):
        compile_check_cuda(sources, arch=arch)
        names = ", ".join(str(source.relative_to(REPO_ROOT)) for source in sources)
        print(f"nvcc -arch={arch} compiles {names}")
    return 0


def _checksum(args) -> int:
    from kata import shipped

    if args.update:
        shipped.update_manifest()
        print(f"updated {shipped.MANIFEST.relative_to(REPO_ROOT)}")
        return 0
    changed = shipped.changed_files()
    print("flawed/ is as shipped" if not changed else "edited: " + ", ".join(changed))
    return 0


def _reset(args) -> int:
    import shutil
    import time

    from kata import shipped

    changed = shipped.changed_files()
    if not changed:
        print("flawed/ is as shipped: nothing to reset")
        return 0
    print("Edited since shipping: " + ", ".join(changed))
    if not args.yes:
        if not sys.stdin.isatty():
            raise KataError("reset needs confirmation: run `python -m kata reset --yes`")
        if input("Restore the shipped flawed/? A backup of your copy is kept. [y/N] ") != "y":
            print("Nothing changed.")
            return 1
    backup = REPO_ROOT / "flawed-backups" / time.strftime("%Y%m%d-%H%M%S")
    shutil.copytree(FLAWED_DIR, backup, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shipped.restore()
    still = shipped.changed_files()
    if still:
        raise KataError("flawed/ still differs from the shipped files: " + ", ".join(still))
    print(f"flawed/ restored. Your copy: {backup.relative_to(REPO_ROOT)}/")
    return 0


def main(argv=None) -> int:
    # torch without numpy warns at import, on stderr, between the tools' one-line errors.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from kata import bench

        return bench.main(argv[1:])
    parser = _Parser(prog="python -m kata", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

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

    hint = commands.add_parser("hint", help="the next hint for one flaw id")
    hint.add_argument("id")
    hint.set_defaults(run=_hint)

    commands.add_parser("list", help="the flaw catalog").set_defaults(run=_list)

    build = commands.add_parser("build", help="build the vendor library or the fixed/ extension")
    build.add_argument("--impl", default="flawed")
    build.set_defaults(run=_build)

    check = commands.add_parser("check-cuda", help="compile-check the CUDA sources with nvcc")
    check.add_argument("--arch", default="sm_90")
    check.set_defaults(run=_check_cuda)

    checksum = commands.add_parser("checksum", help="is flawed/ as shipped?")
    checksum.add_argument("--update", action="store_true", help="record flawed/ as shipped")
    checksum.set_defaults(run=_checksum)

    reset = commands.add_parser("reset", help="restore the shipped flawed/, keeping a backup")
    reset.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    reset.set_defaults(run=_reset)

    # bench parses its own options (python -m kata bench --help): see main() below.
    commands.add_parser("bench", help="benchmarks: flawed vs fixed vs SDPA (make bench)")

    from kata import candidate

    candidate.register(commands)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KataError as error:
        print(f"kata: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # review kills its probes on the way out (review.run_review)
        newline = "\n" if sys.stderr.isatty() else ""  # after the terminal's ^C
        print(f"{newline}kata: stopped (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
