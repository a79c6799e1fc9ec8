"""The kata's command line: `python -m kata --help` lists the subcommands."""

from __future__ import annotations

import argparse
import json
import sys

from kata import FLAWED_DIR, REPO_ROOT, KataError


def _review(args) -> int:
    from kata.review import format_table, resolve_implementation, run_review

    implementation = resolve_implementation(args.impl)
    review = run_review(implementation, timeout=args.timeout, seed=args.seed, only=args.only)
    print(json.dumps(review.to_json(), indent=2) if args.json else format_table(review))
    return 0


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

    implementation = resolve_implementation(args.impl)
    if implementation.kind == "fixed":
        builders.build_fixed()
        print("fixed/: extension built")
    else:
        library = builders.build_vendor_library(implementation.path)
        print(f"{library.relative_to(REPO_ROOT) if library.is_relative_to(REPO_ROOT) else library}")
    return 0


def _check_cuda(args) -> int:
    from kata.builders import PURE_CUDA_SOURCES, compile_check_cuda

    compile_check_cuda(PURE_CUDA_SOURCES, arch=args.arch)
    names = ", ".join(str(source.relative_to(REPO_ROOT)) for source in PURE_CUDA_SOURCES)
    print(f"nvcc -arch={args.arch} compiles {names}")
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
    import subprocess
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
    restore = ["git", "-C", str(REPO_ROOT), "checkout", "HEAD", "--", "flawed"]
    result = subprocess.run(restore, capture_output=True, text=True)
    if result.returncode != 0:
        raise KataError(f"git could not restore flawed/: {result.stderr.strip()}")
    manifest = json.loads(shipped.MANIFEST.read_text())
    for name in shipped.shipped_files().keys() - manifest.keys():
        (FLAWED_DIR / name).unlink()  # files the candidate added
    still = shipped.changed_files()
    if still:
        raise KataError("flawed/ still differs from the shipped files: " + ", ".join(still))
    print(f"flawed/ restored. Your copy: {backup.relative_to(REPO_ROOT)}/")
    return 0


def _bench(args) -> int:
    print("make bench: not yet. The benchmarks land with the performance work on fixed/.")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kata", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    review = commands.add_parser("review", help="scorecard of an implementation")
    review.add_argument(
        "--impl",
        default="flawed",
        help="flawed (default), fixed, or a directory: a copy of flawed/",
    )
    review.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    review.add_argument("--timeout", type=float, default=60.0, help="seconds per probe (60)")
    review.add_argument("--seed", type=int, help="replay the random inputs of an earlier review")
    review.add_argument("--only", nargs="+", metavar="ID", help="judge only these flaw ids")
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

    commands.add_parser("bench", help="benchmarks (not yet)").set_defaults(run=_bench)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KataError as error:
        print(f"kata: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
