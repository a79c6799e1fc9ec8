"""`python -m kata review`: run every probe the machine allows against one implementation and
report each flaw as present, fixed or skipped, with evidence and points."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import math
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from kata import FIXED_DIR, FLAWED_DIR, KataError
from kata.harness import hints, rubric, sandbox
from kata.harness.catalog import CATALOG, Flaw, Need
from kata.harness.isolation import (
    DEFAULT_TIMEOUT_S,
    Implementation,
    ProbeResult,
    kill_all,
    machine_facts,
    run_isolated,
    start_zygotes,
)
from kata.toolchain import builders

# The probes that take longest (torch.compile's tracing; on a GPU the stream probe's trials), by
# measurement: on two cores compile alone takes 1.4 s. On an H100 machine compile sets the
# review's length: importing torch._dynamo takes 5 s there and the first compile 4 s more, after
# torch's own 5 s (preloading the compiler in the runner zygote delayed every probe by those 5 s).
LONG_PROBES = ("compile", "stream")
BIG_MEMORY_BYTES = 60 * 2**30  # the int32-sizes inputs live in the judge and the runner
# Reviews side by side on one GPU (make test -n 4, two terminals) would each take 40 GB at once
# for int32-sizes and run out of memory (seen on an H100: 13 of 67 adversarial tests failed so):
# such probes take this machine-wide lock, and look at the free memory again once they hold it.
BIG_MEMORY_LOCK = Path(tempfile.gettempdir()) / "kata-big-memory.lock"
QUEUE_PATIENCE = 4  # big_memory_turn: how many holders' patience a queue of reviews gets


@dataclass(frozen=True)
class Machine:
    device: str  # what the review reports as the device
    probe_device: str  # where probe inputs live: "cuda" or "cpu"
    gpu_count: int
    free_gpu_bytes: int
    total_gpu_bytes: int

    @classmethod
    def detect(cls) -> Machine:
        """From the judge zygote where one runs (this process never imports torch), else here."""
        facts = machine_facts()
        if facts is None:
            from kata.harness.child import machine_facts as facts_here

            facts = facts_here()
        count = facts["gpu_count"]
        if not count:
            return cls("cpu", "cpu", 0, 0, 0)
        name = facts["name"] + (f" x{count}" if count > 1 else "")
        return cls(name, "cuda", count, facts["free_bytes"], facts["total_bytes"])

    def skip_reason(self, flaw: Flaw) -> str | None:
        if Need.CUDA in flaw.needs and self.gpu_count == 0:
            return "needs a CUDA GPU; torch sees none on this machine"
        if Need.TWO_GPUS in flaw.needs and self.gpu_count < 2:
            return f"needs two CUDA GPUs; this machine has {self.gpu_count}"
        # Only a GPU too small skips here. Memory that other reviews' probes hold for now is
        # waited for in big_memory_turn: skipped at the start, two reviews side by side on one
        # H100 (60 GB of its 79 free for a moment) skipped int32-sizes.
        if Need.BIG_MEMORY in flaw.needs and self.total_gpu_bytes < BIG_MEMORY_BYTES:
            has = self.total_gpu_bytes / 2**30
            return f"needs about 60 GB of GPU memory; this GPU has {has:.0f} GB"
        return None


def _too_little_memory(free_bytes: int) -> str:
    return f"needs about 60 GB of free GPU memory; {free_bytes / 2**30:.0f} GB free"


@contextlib.contextmanager
def big_memory_turn(patience: float):
    """Hold the machine-wide big-memory lock; yields None, or why this probe cannot run now
    (one review held the lock, or too little memory stayed free under it, for `patience`
    seconds). The kernel releases the lock when its holder dies, so a killed review never blocks
    the next."""
    with contextlib.ExitStack() as stack:
        try:
            fd = os.open(BIG_MEMORY_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:  # another user's lock file: a read-only descriptor locks as well
            fd = os.open(BIG_MEMORY_LOCK, os.O_RDONLY)
        stack.callback(os.close, fd)
        # Patience counts per holder: each holder writes a token of its own into the file, and a
        # new token restarts the wait. Eight reviews side by side (the adversarial tests at -n 8
        # on an H200) queued for over 150 s in all, though each held the lock for less. The
        # queue as a whole gets QUEUE_PATIENCE holders' worth, so that a file whose token keeps
        # changing (any process that can write the file) cannot hold a review forever.
        now = time.monotonic()
        deadline, give_up, said = now + patience, now + QUEUE_PATIENCE * patience, False
        holder = _lock_token(fd)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if (token := _lock_token(fd)) != holder:
                    deadline, holder = min(time.monotonic() + patience, give_up), token
                if time.monotonic() > deadline:
                    yield (
                        f"another review held the GPU's memory for over {patience:.0f} s"
                        if deadline < give_up
                        else "other reviews held the GPU's memory for over"
                        f" {QUEUE_PATIENCE * patience:.0f} s in all"
                    )
                    return
                if not said:
                    print(
                        "kata: int32-sizes waits for another review's big-memory probe to end",
                        file=sys.stderr,
                        flush=True,
                    )
                    said = True
                time.sleep(0.2)
        _write_lock_token(fd)
        # Other reviews' probes hold GPU memory for seconds at a time: wait for them, as above.
        deadline, said = time.monotonic() + patience, False
        while (free := free_gpu_bytes()) < BIG_MEMORY_BYTES:
            if time.monotonic() > deadline:
                yield _too_little_memory(free)
                return
            if not said:
                print(
                    "kata: int32-sizes waits for 60 GB of GPU memory to be free"
                    f" ({free / 2**30:.0f} GB now)",
                    file=sys.stderr,
                    flush=True,
                )
                said = True
            time.sleep(1)
        yield None


def _lock_token(fd: int) -> bytes:
    """The token the lock's holder wrote (empty where none did)."""
    try:
        return os.pread(fd, 64, 0)
    except OSError:
        return b""


def _write_lock_token(fd: int) -> None:
    """Tell the reviews waiting for the lock that it changed hands (a read-only file cannot)."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, os.urandom(16).hex().encode(), 0)
    except OSError:
        pass


def free_gpu_bytes() -> int:
    """The first GPU's free memory now, as Machine.detect finds it (torch stays out of here)."""
    return Machine.detect().free_gpu_bytes


@dataclass
class FlawReport:
    flaw: Flaw
    result: ProbeResult

    @property
    def earned(self) -> int:
        if self.result.status == "fixed":
            return self.flaw.points
        return self.flaw.partial_points if self.result.status == "partial" else 0


@dataclass
class Review:
    implementation: Implementation
    machine: Machine
    seed: int
    reports: list[FlawReport]
    round: int = 1  # 1: the wrapper in flawed/; 2: the proposed fix in flawed/proposed_fix/
    date: datetime.datetime = field(default_factory=lambda: datetime.datetime.now().astimezone())
    # Whether the answers on supported inputs were compared with the shipped vendor kernel's
    # (a candidate's wrapper in round one; not fixed/, not round two's own kernels).
    kernel_compared: bool = False
    sandbox_note: str = ""  # one line on how the candidate's code was confined, or that it wasn't
    hints_used: dict[str, int] | None = None  # flaw id -> highest hint level seen; None: no record

    @property
    def earned(self) -> int:
        return sum(report.earned for report in self.reports)

    @property
    def possible(self) -> int:
        return sum(r.flaw.points for r in self.reports if r.result.status != "skipped")

    def level(self, bands) -> str | None:
        return rubric.level_for(self.earned, self.possible, bands)

    @property
    def import_failure(self) -> str | None:
        """Why the wrapper did not import, when that is what every probe met (library-path's
        imports its own way and names the cause in its evidence): the one cause to fix before
        any flaw can be judged."""
        causes = Counter(r.result.import_failure for r in self.reports if r.result.import_failure)
        if not causes:
            return None
        [(cause, _)] = causes.most_common(1)
        judged = [r for r in self.reports if r.result.status != "skipped"]
        return cause if all(cause in r.result.evidence for r in judged) else None

    @property
    def bypassed(self) -> list[tuple[str, str]]:
        """(flaw id, case) of every supported call whose answer was not the vendor kernel's."""
        return [
            (r.flaw.id, case)
            for r in self.reports
            if r.result.kernel
            for case in r.result.kernel["bypassed"]
        ]

    @property
    def kernel_line(self) -> str:
        """What the scorecard's header says about the vendor kernel doing the work."""
        if not self.kernel_compared:
            what = (
                "fixed/ is its own operator"
                if self.implementation.kind == "fixed"
                else ("round two's proposed fix has kernels of its own")
            )
            return f"not compared ({what})"
        checked = sum(r.result.kernel["checked"] for r in self.reports if r.result.kernel)
        if bypassed := self.bypassed:
            flaws = sorted({flaw_id for flaw_id, _ in bypassed})
            return (
                f"BYPASSED in {len(bypassed)} of {checked} supported calls ({', '.join(flaws)}): "
                "their answers were not the shipped kernel's, and those flaws earn no points"
            )
        if checked == 0:
            return "no supported call was compared (no probe reached one)"
        return f"computed all {checked} supported calls (bit-identical to the shipped kernel)"

    def to_json(self, bands=None) -> dict:
        return {
            "implementation": self.implementation.label,
            "device": self.machine.device,
            "round": self.round,
            "seed": self.seed,
            "date": self.date.isoformat(timespec="seconds"),
            "flaws": [
                {
                    "id": r.flaw.id,
                    "title": r.flaw.title,
                    "status": r.result.status,
                    "evidence": r.result.evidence,
                    "points": r.flaw.points,
                    "earned": r.earned,
                }
                for r in self.reports
            ],
            "score": {"earned": self.earned, "possible": self.possible},
            "level_band": self.level(rubric.level_bands() if bands is None else bands),
            "import_failure": self.import_failure,
            "vendor_kernel": {
                "compared": self.kernel_compared,
                "summary": self.kernel_line,
                "bypassed": [{"id": i, "case": c} for i, c in self.bypassed],
            },
            "sandbox": self.sandbox_note,
            "hints_used": self.hints_used,
        }


def resolve_implementation(name: str) -> Implementation:
    """'flawed', 'fixed', or a directory holding a candidate's copy of flawed/."""
    if name == "fixed":
        if not FIXED_DIR.is_dir():
            raise KataError("this copy has no fixed/ (a candidate's handout leaves it out)")
        return Implementation("fixed", "fixed", FIXED_DIR)
    if name == "flawed":
        return Implementation("flawed", "dir", FLAWED_DIR)
    path = Path(name).expanduser().resolve()
    if not path.exists():
        raise KataError(f"{name} does not exist: give the directory of the candidate's copy")
    if not path.is_dir():
        raise KataError(f"{name} is not a directory: give the directory of the candidate's copy")
    if not (path / "attention_wrapper.py").is_file():
        raise KataError(f"{name} is not a copy of flawed/: it has no attention_wrapper.py")
    return Implementation(name, "dir", path)


def _prepare(implementation: Implementation, machine: Machine) -> str | None:
    """Build what the implementation needs; a candidate's broken build is evidence, not a crash."""
    if implementation.kind == "fixed":
        builders.build_fixed()
        return None
    if not (implementation.path / "vendor").is_dir():
        return None  # no vendor library to build: the implementation builds what it needs
    try:
        builders.build_vendor_library(implementation.path, machine.probe_device)
    except KataError as error:
        return f"the vendor library did not build: {str(error).splitlines()[0]}"
    return None


# The candidate's own workspace in this repository: judged in place (make kata, make review).
# Any other directory is a submission from elsewhere: judged on a private copy.
IN_PLACE_DIRS = (FLAWED_DIR, FLAWED_DIR / "proposed_fix")
# Build outputs a submission may carry: never trusted, rebuilt from its sources.
_NOT_COPIED = shutil.ignore_patterns(
    "*.so", "*.o", ".custom_attention.build", "__pycache__", "build"
)


def private_copy(implementation: Implementation, scratch: Path) -> Implementation:
    """The implementation the probes run: a submission is copied into `scratch` first, so that
    nothing the review builds or the candidate's code writes lands in the submitted directory."""
    if implementation.kind != "dir" or implementation.path in IN_PLACE_DIRS:
        return implementation
    copy = scratch / implementation.path.name
    try:
        shutil.copytree(implementation.path, copy, ignore=_NOT_COPIED, symlinks=True)
    except OSError as error:
        raise KataError(f"cannot copy {implementation.path} to judge it: {error}") from None
    return Implementation(implementation.label, "dir", copy)


def run_review(
    implementation: Implementation,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    seed: int | None = None,
    only: list[str] | None = None,
    jobs: int | None = None,
    catalog: tuple[Flaw, ...] = CATALOG,
    round_number: int = 1,
    prepare: Callable[[Path], str | None] | None = None,
    on_report: Callable[[FlawReport], None] | None = None,
    first: list[str] | None = None,
) -> Review:
    """Judge `implementation` on every flaw of `catalog` this machine can run. `prepare` builds
    what the implementation needs instead of the vendor library, returning None or why it failed
    (round two's proposed fix builds its own extension).

    `on_report` is called with each FlawReport as soon as it is complete (skipped ones first,
    then each probe's as it finishes), one call at a time, from the thread that called
    run_review. `first`: flaw ids whose probes start before the others (in that order).
    The Review's reports stay in catalog order whatever the order of completion."""
    if not math.isfinite(timeout) or timeout <= 0:
        raise KataError(f"the time limit per probe must be a positive number, got {timeout:g} s")
    with tempfile.TemporaryDirectory(prefix="kata-review-") as scratch:
        judged = private_copy(implementation, Path(scratch))
        review = _run(
            judged, timeout, seed, only, jobs, catalog, round_number, prepare, on_report, first
        )
    review.implementation = implementation  # the report names what was submitted
    if implementation.kind == "dir":
        review.hints_used = hints.hints_used(implementation.path)
        review.sandbox_note = sandbox.detect().note
    return review


def _run(
    implementation, timeout, seed, only, jobs, catalog, round_number, prepare, on_report, first
) -> Review:
    start_zygotes()  # they import torch while the builds run; one then tells Machine.detect
    machine = Machine.detect()
    seed = secrets.randbelow(2**31) if seed is None else seed
    flaws = [flaw for flaw in catalog if only is None or flaw.id in only]
    if prepare is not None:
        build_failure = prepare(implementation.path)
    else:
        build_failure = _prepare(implementation, machine)
    needs_planted = any(flaw.probe_id == "library-path" for flaw in flaws)
    planted = builders.build_planted_library() if needs_planted else None
    # Round one's wrapper must return the shipped vendor kernel's answers on what it supports.
    compare_kernel = round_number == 1 and implementation.kind == "dir" and prepare is None
    kernel = builders.build_reference_library(machine.probe_device) if compare_kernel else None

    def settled(flaw: Flaw) -> FlawReport | None:
        """The report of a flaw that needs no probe: skipped here, or its build failed."""
        if reason := machine.skip_reason(flaw):
            return FlawReport(flaw, ProbeResult("skipped", reason))
        if build_failure:
            return FlawReport(flaw, ProbeResult("present", build_failure))
        return None

    def probe(flaw: Flaw) -> ProbeResult:
        # The wrapper loads its library relative to the working directory; library-path is the
        # deliberate exception and gets a fresh empty one.
        in_place = implementation.kind == "dir" and flaw.probe_id != "library-path"
        return run_isolated(
            flaw.probe_id,
            implementation,
            seed=seed,
            device=machine.probe_device,
            timeout=timeout,
            planted_library=planted,
            workdir=implementation.path if in_place else None,
            kernel_library=kernel,
        )

    def judge(flaw: Flaw) -> FlawReport:
        if Need.BIG_MEMORY not in flaw.needs:
            return FlawReport(flaw, probe(flaw))
        with big_memory_turn(patience=2 * timeout + 30) as cannot:
            result = ProbeResult("skipped", cannot) if cannot else probe(flaw)
        return FlawReport(flaw, result)

    # Calls come from this thread only (the loop below), so they never overlap.
    deliver = on_report or (lambda report: None)
    reports: list[FlawReport | None] = [None] * len(flaws)
    to_probe = []
    for index, flaw in enumerate(flaws):
        if report := settled(flaw):
            reports[index] = report
            deliver(report)
        else:
            to_probe.append(index)
    # The executor starts probes in the order they are submitted: the ones asked for first,
    # then the long ones (started last, they would end the review alone), then the catalog's.
    rank = {flaw_id: n for n, flaw_id in enumerate([*(first or []), *LONG_PROBES])}
    to_probe.sort(key=lambda index: rank.get(flaws[index].id, len(rank)))  # stable: catalog
    # One worker per probe where the cores allow: a worker waiting for a slot is pure delay.
    workers = jobs or max(1, min(len(to_probe), max(2, os.cpu_count() or 2)))
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        futures = {pool.submit(judge, flaws[index]): index for index in to_probe}
        for future in as_completed(futures):
            report = future.result()
            reports[futures[future]] = report
            deliver(report)
    except KeyboardInterrupt:  # no probe may outlive a stopped review
        pool.shutdown(wait=False, cancel_futures=True)
        kill_all()
        raise
    finally:  # on an error, start no more probes; let the running ones end
        pool.shutdown(cancel_futures=True)
    return Review(
        implementation, machine, seed, reports, round_number, kernel_compared=compare_kernel
    )
