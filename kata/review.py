"""`python -m kata review`: run every probe the machine allows against one implementation and
report each flaw as present, fixed or skipped, with evidence and points."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kata import FIXED_DIR, FLAWED_DIR, KataError, builders
from kata.catalog import CATALOG, Flaw, Need
from kata.isolation import (
    DEFAULT_TIMEOUT_S,
    Implementation,
    ProbeResult,
    kill_all,
    run_isolated,
)

BIG_MEMORY_BYTES = 40 * 2**30


@dataclass(frozen=True)
class Machine:
    device: str  # what the review reports as the device
    probe_device: str  # where probe inputs live: "cuda" or "cpu"
    gpu_count: int
    free_gpu_bytes: int

    @classmethod
    def detect(cls) -> Machine:
        import torch

        if not torch.cuda.is_available():
            return cls("cpu", "cpu", 0, 0)
        count = torch.cuda.device_count()
        name = torch.cuda.get_device_name(0) + (f" x{count}" if count > 1 else "")
        return cls(name, "cuda", count, torch.cuda.mem_get_info(0)[0])

    def skip_reason(self, flaw: Flaw) -> str | None:
        if Need.CUDA in flaw.needs and self.gpu_count == 0:
            return "needs a CUDA GPU; torch sees none on this machine"
        if Need.TWO_GPUS in flaw.needs and self.gpu_count < 2:
            return f"needs two CUDA GPUs; this machine has {self.gpu_count}"
        if Need.BIG_MEMORY in flaw.needs and self.free_gpu_bytes < BIG_MEMORY_BYTES:
            free = self.free_gpu_bytes / 2**30
            return f"needs about 40 GB of free GPU memory; {free:.0f} GB free"
        return None


@dataclass
class FlawReport:
    flaw: Flaw
    result: ProbeResult

    @property
    def earned(self) -> int:
        return self.flaw.points if self.result.status == "fixed" else 0


@dataclass
class Review:
    implementation: Implementation
    machine: Machine
    seed: int
    reports: list[FlawReport]
    round: int = 1  # 1: the wrapper in flawed/; 2: the proposed fix in flawed/proposed_fix/

    @property
    def earned(self) -> int:
        return sum(report.earned for report in self.reports)

    @property
    def possible(self) -> int:
        return sum(r.flaw.points for r in self.reports if r.result.status != "skipped")

    def to_json(self) -> dict:
        return {
            "implementation": self.implementation.label,
            "device": self.machine.device,
            "flaws": [
                {
                    "id": r.flaw.id,
                    "title": r.flaw.title,
                    "status": r.result.status,
                    "evidence": r.result.evidence,
                    "points": r.flaw.points,
                }
                for r in self.reports
            ],
            "score": {"earned": self.earned, "possible": self.possible},
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
) -> Review:
    """Judge `implementation` on every flaw of `catalog` this machine can run. `prepare` builds
    what the implementation needs instead of the vendor library, returning None or why it failed
    (round two's proposed fix builds its own extension)."""
    machine = Machine.detect()
    seed = secrets.randbelow(2**31) if seed is None else seed
    flaws = [flaw for flaw in catalog if only is None or flaw.id in only]
    if prepare is not None:
        build_failure = prepare(implementation.path)
    else:
        build_failure = _prepare(implementation, machine)
    needs_planted = any(flaw.probe_id == "library-path" for flaw in flaws)
    planted = builders.build_planted_library() if needs_planted else None

    def judge(flaw: Flaw) -> FlawReport:
        reason = machine.skip_reason(flaw)
        if reason:
            return FlawReport(flaw, ProbeResult("skipped", reason))
        if build_failure:
            return FlawReport(flaw, ProbeResult("present", build_failure))
        # The wrapper loads its library relative to the working directory; library-path is the
        # deliberate exception and gets a fresh empty one.
        in_place = implementation.kind == "dir" and flaw.probe_id != "library-path"
        result = run_isolated(
            flaw.probe_id,
            implementation,
            seed=seed,
            device=machine.probe_device,
            timeout=timeout,
            planted_library=planted,
            workdir=implementation.path if in_place else None,
        )
        return FlawReport(flaw, result)

    pool = ThreadPoolExecutor(max_workers=jobs or min(8, max(2, os.cpu_count() or 2)))
    try:
        reports = list(pool.map(judge, flaws))
    except KeyboardInterrupt:  # no probe may outlive a stopped review
        pool.shutdown(wait=False, cancel_futures=True)
        kill_all()
        raise
    finally:
        pool.shutdown()
    return Review(implementation, machine, seed, reports, round_number)
