"""The candidate's commands: `python -m kata check` (make kata), `watch` (make watch),
`hint ID` and `reset` (make reset).

`check` runs the harness's review of flawed/ (every probe in its own process) and words the
result for the person fixing the code: one line per flaw as soon as its check ends, the first
failure in full with its hint and replay commands as soon as it is known, then progress. `watch`
re-runs `check` in a child process whenever a file under flawed/ is saved, starting with the
checks that failed last time. `hint` shows the next hint level for one flaw; `reset` restores the
shipped flawed/ and keeps a backup of the candidate's copy.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from kata import FLAWED_DIR, REPO_ROOT, KataError

WATCH_INTERVAL_S = 0.5


def register(commands) -> None:
    """Add this module's subcommands to the `python -m kata` parser."""
    hidden = argparse.SUPPRESS
    check = commands.add_parser("check", help="the candidate's checks (make kata)")
    # --impl: for tests and interviewers, e.g. `check --impl fixed` to see every check pass.
    check.add_argument("--impl", default="flawed", help=hidden)
    check.add_argument("--watching", action="store_true", help=hidden)  # started by `watch`
    # Also from `watch`: the flaws that failed last time, whose probes start first, and the file
    # to write this run's failing ids to.
    check.add_argument("--first", default="", help=hidden)
    check.add_argument("--failing-to", default=None, help=hidden)
    check.set_defaults(run=_check)

    watch = commands.add_parser("watch", help="re-run `check` whenever flawed/ is saved")
    watch.add_argument("--impl", default="flawed", help=hidden)
    watch.add_argument("--max-runs", type=int, default=0, help=hidden)  # for tests
    watch.add_argument("--interval", type=float, default=WATCH_INTERVAL_S, help=hidden)
    watch.set_defaults(run=_watch)

    hint = commands.add_parser("hint", help="the next hint for one flaw id")
    hint.add_argument("id")
    hint.set_defaults(run=_hint)

    reset = commands.add_parser("reset", help="restore the shipped flawed/, keeping a backup")
    reset.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    reset.set_defaults(run=_reset)


# ---------------------------------------------------------------------------------------------
# check


class _Style:
    """Colour and marks for one stream: colour only on a TTY and without NO_COLOR."""

    def __init__(self, stream):
        self.colour = stream.isatty() and not os.environ.get("NO_COLOR")
        try:
            "✓✗◐–─".encode(stream.encoding or "ascii")
            self.marks = {"fixed": "✓", "partial": "◐", "present": "✗", "skipped": "–"}
            self.rule = "─"
        except (LookupError, UnicodeEncodeError):
            self.marks = {"fixed": "+", "partial": "~", "present": "x", "skipped": "-"}
            self.rule = "-"

    def paint(self, text: str, *codes: str) -> str:
        if not self.colour or not codes:
            return text
        return f"\033[{';'.join(codes)}m{text}\033[0m"

    def status(self, text: str, status: str) -> str:
        colours = {"fixed": "32", "partial": "33", "present": "31", "skipped": "2"}
        return self.paint(text, colours[status])


def _shown_dir(path: Path) -> str:
    """A directory as the candidate would type it: relative to the working directory when
    inside it, with a trailing slash."""
    try:
        shown = path.relative_to(Path.cwd()).as_posix()
    except ValueError:
        shown = str(path)
    return shown.rstrip("/") + "/"


FAILING = ("present", "partial")  # a partial fix is still a failing check


def _width() -> int:
    return max(60, min(shutil.get_terminal_size((100, 24)).columns, 110))


def flaw_line(report, style: _Style, id_width: int) -> str:
    """One flaw's line: its mark, id and title, and why a skipped one skipped."""
    status = report.result.status
    mark = style.marks[status]
    line = f"{report.flaw.id:<{id_width}}  {report.flaw.title}"
    if status == "skipped":  # the whole line dimmed, with the short reason
        reason = report.result.evidence.split(";")[0]
        return style.status(f"  {mark} {line}  (skipped: {reason})", status)
    return f"  {style.status(mark, status)} {line}"  # only the mark in colour: calm to read


def _import_name(implementation) -> str:
    return "attention_wrapper.py" if implementation.kind == "dir" else "fixed/"


def _import_lines(implementation, cause: str, style: _Style) -> list[str]:
    return [
        style.paint(f"{_import_name(implementation)} does not import:", "1")
        + f" {cause.rstrip('.')}.",
        "Fix that first: every check needs it.",
    ]


def _failure_lines(report, seed: int, implementation, style: _Style, same: int = 1) -> list[str]:
    """The first failure in full: its evidence, then how to get a hint and replay it."""
    replay = f"python -m kata review --only {report.flaw.id} --seed {seed}"
    if implementation.label != "flawed":
        replay += f" --impl {implementation.label}"
    evidence = textwrap.wrap(report.result.evidence, _width() - 4) or ["(no evidence recorded)"]
    lines = [
        style.paint(f"First failure: {report.flaw.id}", "1") + f" - {report.flaw.title}",
        *("    " + line for line in evidence),
    ]
    if same > 1:  # a syntax error, say, or a vendor library that does not build
        lines.append(f"    ({same} failing checks say this: start here)")
    return [
        *lines,
        "",
        f"    Hint:    python -m kata hint {report.flaw.id}",
        f"    Replay:  {replay}",
    ]


def format_summary(
    review, style: _Style, *, watching: bool = False, shown=None, shown_import: str | None = None
) -> tuple[str, int]:
    """What follows the flaws' lines: progress, then what to do next; and the exit status: 0
    when every flaw that ran is fixed, 1 otherwise. `shown`: the failure already printed in full
    as it came (CheckPrinter), `shown_import`: the import failure already printed; either is
    then only pointed at."""
    ran = [r for r in review.reports if r.result.status != "skipped"]
    fixed = [r for r in ran if r.result.status == "fixed"]
    skipped = len(review.reports) - len(ran)
    progress = f"{len(fixed)}/{len(ran)} fixed on this machine"
    lines = [style.paint(progress, "1") + (f" ({skipped} skipped here)" if skipped else "")]

    failures = [r for r in ran if r.result.status in FAILING]
    if not failures:
        lines += ["", style.paint(f"Every check that runs here passes ({len(ran)}).", "1", "32")]
        if skipped:
            lines.append("The skipped ones need hardware this machine lacks: they do not count.")
        lines.append("Well done. Tell your interviewer, and say what you would look at next.")
        return "\n".join(lines), 0

    implementation = review.implementation
    if cause := getattr(review, "import_failure", None):
        # One cause behind every red line: the first flaw's hint would send them the wrong way.
        if cause == shown_import:
            name = _import_name(implementation)
            lines += ["", f"{name} does not import (above): fix that first.", ""]
        else:
            lines += ["", *_import_lines(implementation, cause, style), ""]
        if watching:
            lines.append(
                f"Next: fix it; save a file in {_shown_dir(implementation.path)} to check again."
            )
        else:
            lines.append(
                "Next: fix it, then run `make kata` again (`make watch` re-runs it on every save)."
            )
        return "\n".join(lines), 1

    first = shown if shown in failures else failures[0]
    same = sum(r.result.evidence == first.result.evidence for r in failures)
    if first is shown:
        said = f" ({same} failing checks say the same: start there)" if same > 1 else ""
        lines += ["", f"First failure: {first.flaw.id}, in full above{said}.", ""]
    else:
        lines += ["", *_failure_lines(first, review.seed, implementation, style, same), ""]
    where = _shown_dir(implementation.path) if implementation.kind == "dir" else "it"
    if watching:
        lines.append(f"Next: make {first.flaw.id} pass; save a file in {where} to check again.")
    else:
        lines.append(
            f"Next: make {first.flaw.id} pass, then run `make kata` again "
            "(`make watch` re-runs it on every save)."
        )
    return "\n".join(lines), 1


def format_check(review, style: _Style, *, watching: bool = False) -> tuple[str, int]:
    """The candidate's view of a whole review at once, and the exit status: one line per flaw
    in catalog order, then the summary with the first failure in full."""
    id_width = max(len(report.flaw.id) for report in review.reports)
    lines = [flaw_line(report, style, id_width) for report in review.reports]
    summary, status = format_summary(review, style, watching=watching)
    return "\n".join([*lines, "", summary]), status


class CheckPrinter:
    """run_review's on_report for `check`: prints each flaw's line as its report comes, and the
    first failure in full right under its line, flushing each time (the output may be a pipe)."""

    def __init__(self, implementation, seed: int, style: _Style, stream, id_width: int):
        self.implementation, self.seed, self.style = implementation, seed, style
        self.stream, self.id_width = stream, id_width
        self.shown = None  # the failure printed in full
        self.shown_import: str | None = None  # or the import failure printed

    def __call__(self, report) -> None:
        lines = [flaw_line(report, self.style, self.id_width)]
        if report.result.status in FAILING and not (self.shown or self.shown_import):
            if cause := report.result.import_failure:
                self.shown_import = cause
                lines += ["", *_import_lines(self.implementation, cause, self.style), ""]
            else:
                self.shown = report
                failure = _failure_lines(report, self.seed, self.implementation, self.style)
                lines += ["", *failure, ""]
        print("\n".join(lines), file=self.stream, flush=True)


def _check(args) -> int:
    import secrets

    from kata.harness import isolation, keeper
    from kata.harness.catalog import CATALOG
    from kata.harness.review import resolve_implementation, run_review

    implementation = resolve_implementation(args.impl)
    where = _shown_dir(implementation.path) if implementation.kind == "dir" else "fixed/"
    style = _Style(sys.stdout)
    header = f"Checking {where}: each check runs in its own process..."
    print(style.paint(header, "2") + "\n", flush=True)
    seed = secrets.randbelow(2**31)  # chosen here: the first failure's replay command needs it
    id_width = max(len(flaw.id) for flaw in CATALOG)
    printer = CheckPrinter(implementation, seed, style, sys.stdout, id_width)
    first = [flaw_id for flaw_id in (args.first or "").split(",") if flaw_id]
    try:
        review = run_review(implementation, seed=seed, on_report=printer, first=first or None)
    except KeyboardInterrupt:
        print("\nCheck interrupted.", flush=True)
        return 130
    summary, status = format_summary(
        review,
        style,
        watching=args.watching,
        shown=printer.shown,
        shown_import=printer.shown_import,
    )
    print("\n" + summary, flush=True)
    if isolation.kept_zygotes_started():
        print(style.paint(keeper.started_note(), "2"), flush=True)
    if args.failing_to:  # for `watch`: the next check starts with these
        failing = [r.flaw.id for r in review.reports if r.result.status in FAILING]
        Path(args.failing_to).write_text("".join(f"{flaw_id}\n" for flaw_id in failing))
    return status


# ---------------------------------------------------------------------------------------------
# watch

_IGNORED_DIRS = {"__pycache__", "build"}
_IGNORED_SUFFIXES = (".so", ".o", ".pyc", ".swp", ".swx", "~")


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """relative path -> (mtime_ns, size) of the files a save can change: no caches, build
    outputs, hidden files (editor swap files, the build stamp) or build directories."""
    files = {}
    for root, dirs, names in os.walk(directory):
        dirs[:] = [d for d in dirs if d not in _IGNORED_DIRS and not d.startswith(".")]
        for name in names:
            if name.startswith(".") or name.endswith(_IGNORED_SUFFIXES):
                continue
            path = Path(root, name)
            try:
                stat = path.stat()
            except OSError:
                continue  # removed between listing and stat: the next poll sees it
            files[path.relative_to(directory).as_posix()] = (stat.st_mtime_ns, stat.st_size)
    return files


def _wait_for_save(directory: Path, before: dict, interval: float) -> list[str]:
    """Poll until files differ from `before` and two polls agree (an editor's save can take
    several writes); return the names that changed. `before` is taken before the check ran, so
    a save during a run is seen at once."""
    current = before
    while True:
        time.sleep(interval)
        polled = snapshot(directory)
        if polled == current:
            changed = [
                n for n in sorted(before.keys() | polled.keys()) if before.get(n) != polled.get(n)
            ]
            if changed:
                return changed
        current = polled


def _watch(args) -> int:
    from kata.harness import isolation, keeper
    from kata.harness.review import resolve_implementation

    implementation = resolve_implementation(args.impl)
    if implementation.kind != "dir":
        raise KataError("watch follows a directory: flawed/ or a copy of it")
    directory = implementation.path
    style = _Style(sys.stdout)
    # Each check runs in a child: a crash, or an edit to kata/ itself, cannot wedge the watcher.
    command = [sys.executable, "-m", "kata", "check", "--watching"]
    if directory != FLAWED_DIR:
        command += ["--impl", str(directory)]
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=python_path)
    shown = _shown_dir(directory)
    runs, saved, failing = 0, [], []
    harness = None  # the judge's sources the kept zygotes imported
    try:
        with tempfile.TemporaryDirectory(prefix="kata-watch-") as scratch:
            # Each check writes its failing ids here; the next one starts their probes first.
            failing_file = Path(scratch, "failing")
            while True:
                if runs:
                    stamp = time.strftime("%H:%M:%S")
                    rule = style.rule * 3
                    banner = f"{rule} {stamp}  saved: {', '.join(saved)} {rule}"
                    print("\n" + style.paint(banner, "2"), flush=True)
                before = snapshot(directory)
                sources = snapshot(REPO_ROOT / "kata")
                if sources != harness:
                    # Torch imported once for every save, not once per check: the zygotes are
                    # kept here (started again when kata/ itself changed).
                    isolation.close_zygotes()
                    env.update(isolation.lasting_zygotes())
                    harness = sources
                    if isolation.kept_zygotes_started():
                        print(style.paint(keeper.started_note(), "2"), flush=True)
                failing_file.unlink(missing_ok=True)
                order = ["--first", ",".join(failing)] if failing else []
                this_run = [*command, *order, "--failing-to", str(failing_file)]
                status = subprocess.run(this_run, cwd=REPO_ROOT, env=env).returncode
                if status not in (0, 1):
                    print(f"(the check itself stopped with exit status {status}; see above)")
                with contextlib.suppress(OSError):  # none written: keep last time's order
                    failing = failing_file.read_text().split()
                runs += 1
                if args.max_runs and runs >= args.max_runs:
                    return 0
                print(style.paint(f"watching {shown} (Ctrl-C to stop)", "2"), flush=True)
                saved = _wait_for_save(directory, before, args.interval)
    except KeyboardInterrupt:
        print("\nstopped watching.")
        return 0
    finally:
        isolation.close_zygotes()


# ---------------------------------------------------------------------------------------------
# hint and reset


def _hint(args) -> int:
    from kata.harness.hints import next_hint

    print(next_hint(args.id))
    return 0


def _reset(args) -> int:
    from kata.toolchain import shipped

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
