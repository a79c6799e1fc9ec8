"""The kata's command line: `python -m kata --help` lists the subcommands.

The interviewer's (kata/interviewer/) and the candidate's (kata/candidate/) register their own;
the ones both use, and the maintainer's, are here.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import warnings

from kata import REPO_ROOT, KataError


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one `kata: ` line (no usage block), as every error is."""

    def error(self, message: str):
        self.exit(2, f"kata: {message} (see `{self.prog} --help`)\n")


def _list(args) -> int:
    from kata.harness.catalog import CATALOG

    for flaw in CATALOG:
        needs = ", ".join(sorted(need.value for need in flaw.needs)) or "cpu"
        print(f"{flaw.id:<13} {flaw.points:>3}  {flaw.title}  [{needs}]")
    return 0


def _build(args) -> int:
    from kata.harness.review import resolve_implementation
    from kata.toolchain import builders

    implementation = resolve_implementation(args.impl)  # in a handout, fixed/ is absent
    if implementation.kind == "fixed":
        builders.build_fixed()
        print("fixed/: extension built")
    else:
        library = builders.build_vendor_library(implementation.path)
        print(f"{library.relative_to(REPO_ROOT) if library.is_relative_to(REPO_ROOT) else library}")
    return 0


def _gpu_code(text: str) -> str:
    if not re.fullmatch(r"sm_\d{2,3}[af]?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a GPU code as nvcc writes them (sm_90)")
    return text


def _check_cuda(args) -> int:
    from kata.toolchain.builders import compile_check_cuda, cuda_checks

    checks = cuda_checks(args.arch)
    ran = compile_check_cuda(checks, lambda line: print(f"kata: check-cuda: {line}", flush=True))
    for check in checks:
        how = "" if check.optimised else " (alone, unoptimised)"
        print(f"nvcc {check.arch}: {check.source.relative_to(REPO_ROOT)}{how}")
    print("compiled" if ran else "unchanged: passed before")
    return 0


def _checksum(args) -> int:
    from kata.toolchain import shipped

    if args.update:
        shipped.update_manifest()
        print(f"updated {shipped.MANIFEST.relative_to(REPO_ROOT)}")
        return 0
    changed = shipped.changed_files()
    print("flawed/ is as shipped" if not changed else "edited: " + ", ".join(changed))
    return 0


def _bench(argv: list[str]) -> int:
    """`make bench` is fixed/'s performance tool, in bench/ beside the kata; a handout has none.
    Asked by name, not by catching ImportError, which would hide a real one inside bench/."""
    if importlib.util.find_spec("bench.cli") is None:
        print("kata: the bench is not part of this copy of the kata", file=sys.stderr)
        return 2
    from bench.cli import main as bench_main

    return bench_main(argv)


# The commands that import torch (here or in the processes they start); the others (list, hint,
# reset, handout, checksum) run without it.
_NEEDS_TORCH = ("review", "check", "watch", "build", "check-cuda", "bench")


def main(argv=None) -> int:
    # torch without numpy warns at import, on stderr, between the tools' one-line errors.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    argv = sys.argv[1:] if argv is None else argv
    from kata.toolchain import torch_support

    version = torch_support.installed()
    if version and torch_support.too_old(version):  # a newer one gets make deps' warning only
        print(f"kata: {torch_support.problem(version)}", file=sys.stderr)
        return 2
    if version is None and argv[:1] and argv[0] in _NEEDS_TORCH:
        print(
            f"kata: this Python ({sys.executable}) has no torch; `make deps` installs it",
            file=sys.stderr,
        )
        return 2
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    parser = _Parser(prog="python -m kata", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    from kata.candidate import commands as candidate
    from kata.interviewer import commands as interviewer

    interviewer.register(commands)
    candidate.register(commands)

    commands.add_parser("list", help="the flaw catalog").set_defaults(run=_list)

    build = commands.add_parser("build", help="build the vendor library or the fixed/ extension")
    build.add_argument("--impl", default="flawed")
    build.set_defaults(run=_build)

    check = commands.add_parser("check-cuda", help="compile-check the CUDA sources with nvcc")
    check.add_argument(
        "--arch",
        default="sm_90",
        type=_gpu_code,
        help="the GPU code of the checks other than sm_90a's (sm_90)",
    )
    check.set_defaults(run=_check_cuda)

    checksum = commands.add_parser("checksum", help="is flawed/ as shipped?")
    checksum.add_argument("--update", action="store_true", help="record flawed/ as shipped")
    checksum.set_defaults(run=_checksum)

    # bench parses its own options (python -m kata bench --help): see _bench().
    commands.add_parser("bench", help="benchmarks: flawed vs fixed vs SDPA (make bench)")

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
