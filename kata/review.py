"""`python -m kata review`: run every probe the machine allows against one implementation and
report each flaw as present, fixed or skipped, with evidence and points."""

from __future__ import annotations

import os
import secrets
import shutil
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kata import FIXED_DIR, FLAWED_DIR, KataError, builders
from kata.catalog import CATALOG, Flaw, Need
from kata.isolation import DEFAULT_TIMEOUT_S, Implementation, ProbeResult, run_isolated

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
) -> Review:
    machine = Machine.detect()
    seed = secrets.randbelow(2**31) if seed is None else seed
    flaws = [flaw for flaw in CATALOG if only is None or flaw.id in only]
    build_failure = _prepare(implementation, machine)
    planted = (
        builders.build_planted_library() if any(f.id == "library-path" for f in flaws) else None
    )

    def judge(flaw: Flaw) -> FlawReport:
        reason = machine.skip_reason(flaw)
        if reason:
            return FlawReport(flaw, ProbeResult("skipped", reason))
        if build_failure:
            return FlawReport(flaw, ProbeResult("present", build_failure))
        # The wrapper loads its library relative to the working directory; library-path is the
        # deliberate exception and gets a fresh empty one.
        in_place = implementation.kind == "dir" and flaw.id != "library-path"
        result = run_isolated(
            flaw.id,
            implementation,
            seed=seed,
            device=machine.probe_device,
            timeout=timeout,
            planted_library=planted,
            workdir=implementation.path if in_place else None,
        )
        return FlawReport(flaw, result)

    with ThreadPoolExecutor(max_workers=jobs or min(8, max(2, os.cpu_count() or 2))) as pool:
        reports = list(pool.map(judge, flaws))
    return Review(implementation, machine, seed, reports)


def format_table(review: Review) -> str:
    width = max(80, min(shutil.get_terminal_size((120, 24)).columns, 140))
    where = "" if review.implementation.kind == "fixed" else f" ({review.implementation.path})"
    lines = [
        f"Review of {review.implementation.label}{where}",
        f"device: {review.machine.device}    seed: {review.seed}",
        "",
        f"{'ID':<13} {'STATUS':<8} {'POINTS':>6}  EVIDENCE",
    ]
    indent = " " * 31
    for report in review.reports:
        points = f"{report.earned}/{report.flaw.points}"
        if report.result.status == "skipped":
            points = "-"
        head = f"{report.flaw.id:<13} {report.result.status:<8} {points:>6}  "
        evidence = textwrap.wrap(report.result.evidence, width - len(indent)) or [""]
        lines.append(head + evidence[0])
        lines.extend(indent + line for line in evidence[1:])
    judged = [r for r in review.reports if r.result.status != "skipped"]
    skipped = len(review.reports) - len(judged)
    lines += [
        "",
        f"Score: {review.earned} of {review.possible} points "
        f"({len(judged)} flaws judged on this machine"
        + (f"; {skipped} skipped and not counted)" if skipped else ")"),
        "Points and discussion: rubric.md.  Hints: python -m kata hint ID",
    ]
    return "\n".join(lines)
