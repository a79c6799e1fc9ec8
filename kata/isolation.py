"""Runs each probe in its own freshly started Python process with a time limit, so that a
segfault, an abort, an illegal memory access or a hang becomes evidence instead of taking the
test session or the review down. Processes are spawned, never forked after CUDA init.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from kata import REPO_ROOT
from kata.child import MARKER

DEFAULT_TIMEOUT_S = 60.0

# Probe processes still running. They run in sessions of their own (so a time limit can kill all
# they started), which also keeps the terminal's Ctrl-C from reaching them: kill_all() does.
_running: set[subprocess.Popen] = set()
_running_lock = threading.Lock()
_stopped = False  # set by kill_all: no new probe process starts after it


def kill_all() -> None:
    """Kill every probe process still running, with all it started, and start no more."""
    global _stopped
    with _running_lock:
        _stopped = True
        for process in _running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


@dataclass(frozen=True)
class Implementation:
    """What to probe: the fixed/ package, or a directory holding an attention_wrapper.py."""

    label: str
    kind: str  # "fixed" or "dir"
    path: Path

    def to_json(self) -> dict:
        return {"kind": self.kind, "path": str(self.path)}


@dataclass
class ProbeResult:
    status: str  # "present", "fixed" or "skipped"
    evidence: str
    last_case: str | None = None


def run_isolated(
    probe_id: str,
    implementation: Implementation,
    *,
    seed: int,
    device: str,
    timeout: float = DEFAULT_TIMEOUT_S,
    planted_library: Path | None = None,
    workdir: Path | None = None,
) -> ProbeResult:
    """Run one probe in a child process and turn whatever happens into a ProbeResult."""
    spec = {
        "probe": probe_id,
        "implementation": implementation.to_json(),
        "seed": seed,
        "device": device,
        "planted_library": str(planted_library) if planted_library else None,
    }
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=python_path, PYTHONFAULTHANDLER="1")
    with tempfile.TemporaryDirectory(prefix=f"kata-{probe_id}-") as scratch:
        cwd = workdir or Path(scratch)
        with _running_lock:
            if _stopped:
                return ProbeResult("skipped", "the review was stopped")
            process = subprocess.Popen(
                [sys.executable, "-m", "kata.child", json.dumps(spec)],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: a timeout kills all it started
            )
            _running.add(process)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            timed_out = True
        finally:
            with _running_lock:
                _running.discard(process)
    messages = _messages(stdout)
    cases = [m["case"] for m in messages if "case" in m]
    last_case = cases[-1] if cases else None
    during = f" during case '{last_case}'" if last_case else ""
    verdicts = [m["verdict"] for m in messages if "verdict" in m]
    if verdicts and process.returncode == 0 and not timed_out:
        return ProbeResult(verdicts[-1]["status"], verdicts[-1]["evidence"], last_case)
    # No verdict: what was found before the end, then how it ended.
    found = [m["failure"] for m in messages if "failure" in m]
    stopped = [m["stopped"] for m in messages if "stopped" in m]
    if timed_out:
        end = f"timed out after {timeout:g} s{during}"
    elif stopped:
        end = stopped[-1] + during
    else:
        end = _death(process.returncode, stderr) + during
    return ProbeResult("present", "; ".join([*found, end]), last_case)


def _messages(stdout: bytes) -> list[dict]:
    messages = []
    for line in stdout.decode(errors="replace").splitlines():
        if line.startswith(MARKER):
            with contextlib.suppress(ValueError):
                messages.append(json.loads(line[len(MARKER) :]))
    return messages


def _death(returncode: int, stderr: bytes) -> str:
    """Say how the child ended without a verdict: a signal, or its last error line."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        lines = stderr.decode(errors="replace").splitlines()
        # What the C library said before faulthandler's report, e.g. "free(): invalid pointer".
        end = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python")), 0)
        said = [line.strip() for line in lines[:end] if line.strip()]
        return f"process died with {name}" + (f" ({said[-1][:160]})" if said else "")
    lines = [line.strip() for line in stderr.decode(errors="replace").splitlines() if line.strip()]
    interesting = [line for line in lines if not line.startswith(("File ", "Traceback", "^"))]
    last = interesting[-1] if interesting else "no output"
    return f"process exited with code {returncode}: {last[:240]}"
