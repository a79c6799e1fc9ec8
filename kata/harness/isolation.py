"""Runs each probe in a process of its own with a time limit, so that a segfault, an abort, an
illegal memory access or a hang becomes evidence instead of taking the test session or the
review down. The probe's judge and its runner are forked from zygotes (zygote.py) that imported
torch once for the whole review, never after CUDA init; KATA_ZYGOTE=off (or a zygote that does
not start) spawns fresh interpreters instead, as does a sandbox that execs (bubblewrap). `watch`
keeps its zygotes across saves (lasting_zygotes) and names them to each check in KATA_ZYGOTES.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kata import REPO_ROOT
from kata.harness import endings, forked, keeper, lifeline, sandbox, zygote
from kata.harness.child import MARKER

DEFAULT_TIMEOUT_S = 60.0
RUNNER = Path(__file__).resolve().with_name("runner.py")  # the script a probe's runner runs

# Probe processes still running. They run in sessions of their own (so a time limit can kill all
# they started), which also keeps the terminal's Ctrl-C from reaching them: kill_all() does.
_running: set[subprocess.Popen] = set()
_running_lock = threading.Lock()
_stopped = False  # set by kill_all: no new probe process starts after it
_zygotes: dict[str, zygote.Zygote | zygote.Adopted] = {}  # "judge", "runner": on first use
_keeper_state: dict | None = None  # keeper.kept()'s answer, {} where none; None: not asked yet
CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"  # hardware queues per CUDA context: _judge_env
STREAMS_OVERLAP = ("stream",)  # probes whose runners keep CUDA's default queues
LASTING = "KATA_ZYGOTES"  # "judge=NAME,runner=NAME[,kept=FILE]": zygotes another process keeps
LASTING_KEYS = ("judge", "runner", "kept")


def _zygote(kind: str) -> zygote.Zygote | zygote.Adopted | None:
    """The review's zygote of this kind, started on first use, once it is ready; None where
    zygotes are off or this one could not start (each probe then starts fresh interpreters,
    slower but the same)."""
    with _running_lock:
        started = _start_zygote(kind)
    if isinstance(started, zygote.Adopted):  # a kept zygote in use: its keeper waits on
        keeper.touch((_keeper_state or {}).get("file") or _lasting().get("kept"))
    return started if started is not None and started.usable() else None


def start_zygotes() -> None:
    """Start both zygotes now, without waiting: they import torch while the review imports its
    own and builds what it needs (this module imports torch only when a probe runs)."""
    with _running_lock:
        for kind in ("judge", "runner"):
            _start_zygote(kind)


def _start_zygote(kind: str) -> zygote.Zygote | zygote.Adopted | None:
    """Under _running_lock: the zygote of this kind, started if it is not yet."""
    off = os.environ.get("KATA_ZYGOTE", "").strip().lower() in ("off", "0", "no", "false")
    if off or _stopped:
        return None
    if kind not in _zygotes:
        lasting = zygote.Adopted(kind, _lasting()[kind]) if kind in _lasting() else None
        if lasting and lasting.usable():
            _zygotes[kind] = lasting
        elif kept := _kept():  # still importing torch, maybe: _zygote waits
            _zygotes[kind] = zygote.Adopted(kind, kept[kind], keeper=kept["pid"])
        else:  # none kept for us, or it is gone: one of this review's own
            _zygotes[kind] = zygote.Zygote(kind, _probe_env())
    return _zygotes[kind]


def _kept() -> dict | None:
    """Under _running_lock: the zygotes a keeper holds across runs (keeper.py), asked for once."""
    global _keeper_state
    if _keeper_state is None:
        _keeper_state = keeper.kept(_probe_env()) or {}
    return _keeper_state or None


def kept_zygotes_started() -> bool:
    """Whether this run started a keeper (the candidate's commands say so once)."""
    return bool(_keeper_state and _keeper_state.get("started"))


def _lasting() -> dict[str, str]:
    """{"judge": name, "runner": name, "kept": the keeper's file, where a keeper holds them}."""
    entries = (entry.partition("=") for entry in os.environ.get(LASTING, "").split(","))
    return {key: value for key, _, value in entries if key in LASTING_KEYS and value}


def lasting_zygotes() -> dict[str, str]:
    """For checks run one after another in child processes (watch): both zygotes started here
    and kept, named in an environment entry for the children (none where zygotes are off). They
    hold torch and the harness, never a candidate's code: nothing crosses from one check to the
    next but the time they saved. close_zygotes() ends them."""
    start_zygotes()
    kept = {kind: started.name for kind, started in _zygotes.items() if started.usable()}
    if kept and _keeper_state:
        kept["kept"] = _keeper_state["file"]  # each check touches it: the keeper waits on
    return {LASTING: ",".join(f"{key}={value}" for key, value in kept.items())}


def close_zygotes() -> None:
    """End this process's zygotes (with any children they still have); the next use starts new,
    or asks the keeper again (watch, after kata/ changed: the digest tells the old ones apart)."""
    global _keeper_state
    with _running_lock:
        for started in _zygotes.values():
            started.close()
        _zygotes.clear()
        _keeper_state = None


def machine_facts(timeout: float = 60) -> dict | None:
    """child.machine_facts, from a child of the judge zygote (CUDA initialised there, never in
    a zygote); None where zygotes are off or it answered nothing (the caller looks itself)."""
    judges = _zygote("judge")
    if judges is None:
        return None
    with tempfile.TemporaryDirectory(prefix="kata-machine-") as scratch:
        argv = ["kata.harness.child", json.dumps({"probe": "machine"})]
        with _running_lock:
            if _stopped:
                return None
            try:
                process = forked.spawn(judges.name, argv, cwd=scratch, env=_judge_env())
            except OSError:
                return None
            _running.add(process)
        try:
            stdout, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            return None
        finally:
            with _running_lock:
                _running.discard(process)
    found = [message["machine"] for message in _messages(stdout) if "machine" in message]
    return found[0] if found else None


def _probe_env() -> dict:
    """The environment of the zygotes: the harness importable."""
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=python_path, PYTHONFAULTHANDLER="1")


def _judge_env() -> dict:
    """The environment of a probe's judge, and by default of its runners: one hardware queue
    per CUDA context (where the user set no number). A review creates 40 contexts at once on a
    GPU, and the driver creates them one at a time, each with its queues: 16 at once took 3.9 s
    with the default 8 queues and 1.5 s with one (H100). A probe that needs streams to overlap
    gets the default back in its runner (STREAMS_OVERLAP)."""
    env = _probe_env()
    env.setdefault(CONNECTIONS_ENV, "1")
    return env


def _runner_unsets(probe_id: str) -> list[str]:
    """What a probe's runner drops from its judge's environment: one hardware queue serialises
    the streams' work, which would hide the race the stream probe looks for."""
    queues_set_here = CONNECTIONS_ENV not in os.environ
    return [CONNECTIONS_ENV] if probe_id in STREAMS_OVERLAP and queues_set_here else []


def kill_all() -> None:
    """Kill every probe process still running, with all it started, and start no more."""
    global _stopped
    with _running_lock:
        _stopped = True
        for process in _running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        for started in _zygotes.values():  # each takes its remaining children with it
            started.close()
        _zygotes.clear()


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
    status: str  # "present", "partial", "fixed" or "skipped"
    evidence: str
    last_case: str | None = None
    # {"checked": n, "bypassed": [case, ...]}: the supported calls compared with the vendor
    # kernel; None where no kernel was compared (fixed/, round two, no verdict)
    kernel: dict | None = None
    import_failure: str | None = None  # why the implementation did not import, when it did not


def run_isolated(
    probe_id: str,
    implementation: Implementation,
    *,
    seed: int,
    device: str,
    timeout: float = DEFAULT_TIMEOUT_S,
    planted_library: Path | None = None,
    workdir: Path | None = None,
    kernel_library: Path | None = None,
) -> ProbeResult:
    """Run one probe in a child process and turn whatever happens into a ProbeResult.
    `kernel_library`: the shipped vendor kernel, whose answers a wrapper must return."""
    env = _judge_env()
    with _scratch_directory(f"kata-{probe_id}-") as scratch:
        cwd = workdir or Path(scratch)
        spec = {
            "probe": probe_id,
            "seed": seed,
            "device": device,
            "planted_library": str(planted_library) if planted_library else None,
            "kernel_library": str(kernel_library) if kernel_library else None,
            "runner": _runner(implementation, Path(scratch), cwd),
        }
        spec["runner"]["unset"] = _runner_unsets(probe_id)
        judges = _zygote("judge")
        with _running_lock:
            if _stopped:
                return ProbeResult("skipped", "the review was stopped")
            if judges is not None:  # in a session of its own, dying with its zygote (and the
                # zygote with this review)
                argv = ["kata.harness.child", json.dumps(spec)]
                process = forked.spawn(judges.name, argv, cwd=scratch, env=env)
            else:
                # -P: the working directory (which the runner may write to) is not on the
                # judge's path
                process = subprocess.Popen(
                    [sys.executable, "-P", "-m", "kata.harness.child", json.dumps(spec)],
                    cwd=scratch,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,  # its own process group: a timeout kills all it
                    # started
                    preexec_fn=lifeline.die_with_this_thread(),  # and it dies with this review
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
            lifeline.end_group(process.pid)  # what its runners left running, before the cleanup
            with _running_lock:
                _running.discard(process)
    returncode = process.returncode
    messages = _messages(stdout)
    last_case = _open_case(messages, longest=timed_out)
    during = f" during case '{last_case}'" if last_case else ""
    verdicts = [m["verdict"] for m in messages if "verdict" in m]
    if len(verdicts) == 1 and returncode == 0 and not timed_out:
        [verdict] = verdicts
        return ProbeResult(
            verdict["status"],
            verdict["evidence"],
            last_case,
            verdict.get("kernel"),
            verdict.get("import_failure"),
        )
    # No verdict: what was found before the end, then how it ended.
    found = [m["failure"] for m in messages if "failure" in m]
    stopped = [m["stopped"] for m in messages if "stopped" in m]
    if timed_out:
        end = f"timed out after {timeout:g} s{during}"
    elif stopped:
        end = stopped[-1] + during
    else:
        end = endings.death(returncode, stderr) + during
    return ProbeResult("present", "; ".join([*found, end]), last_case)


@contextlib.contextmanager
def _scratch_directory(prefix: str):
    """A probe's scratch directory, removed afterwards even if something still writes into it: a
    process that left its group (os.setsid) outlives the probe's group. The removal is tried for
    up to 2 s; what is still there then stays in the temporary directory rather than ending the
    review with a traceback."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        for _ in range(20):
            try:
                shutil.rmtree(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _open_case(messages: list[dict], *, longest: bool = False) -> str | None:
    """Where a probe that died or ran out of time was: the case its judge reported last, among
    the lanes that had not finished (judging.judge_cases; lane 0 is the probe's own). With
    `longest` (a timeout), the case open the longest instead: with lanes, the one that hangs
    stays open while a slow lane goes on reporting, so the last one reported is the slow lane's
    (seen on a loaded GPU machine, a fresh runner's checked call named in place of the hang)."""
    open_cases: dict[int, str] = {}
    for message in messages:
        if "case" in message:
            lane = message.get("lane", 0)
            open_cases.pop(lane, None)  # reinserted: dicts keep the order of insertion
            open_cases[lane] = message["case"]
        elif "lane_done" in message:
            open_cases.pop(message["lane_done"], None)
    if longest:
        # Lane 0 waits while lanes judge: its case is theirs only when no lane is open.
        in_lanes = [case for lane, case in open_cases.items() if lane != 0]
        return next(iter(in_lanes), open_cases.get(0))
    return next(reversed(open_cases.values()), None)


def _runner(implementation: Implementation, scratch: Path, cwd: Path) -> dict:
    """How the probe's judge starts the process that runs the implementation: runner.py,
    copied into the scratch directory (always visible, even in a sandbox), with nothing of the
    harness on its path; for a candidate's code, in a sandbox. Forked from the runner zygote
    where one runs and the sandbox can confine a forked child (user namespaces, or none)."""
    script = scratch / "kata_runner.py"
    shutil.copyfile(RUNNER, script)
    command = [sys.executable, "-P", str(script), json.dumps(implementation.to_json())]
    outside = [
        entry
        for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if entry and not Path(entry).resolve().is_relative_to(REPO_ROOT)
    ]
    if implementation.kind == "fixed":
        outside.insert(0, str(REPO_ROOT))  # `import fixed`
    env = {"PYTHONPATH": os.pathsep.join(outside), "TMPDIR": str(scratch)}
    if implementation.kind == "dir":
        # round two's wrapper builds an extension: where kata.harness.round2.prepare built it
        env["TORCH_EXTENSIONS_DIR"] = str(implementation.path / "build" / "torch_extensions")
    signal_exits, binds = False, None
    fork_request = {"argv": command[2:], "path": outside}
    if implementation.kind == "dir":
        # A candidate's code is a stranger's: no network, writes only to what it is judged in.
        confinement = sandbox.detect()
        writable = [scratch, implementation.path]
        command = confinement.wrap(command, writable=writable)
        signal_exits = confinement.returncode(128 + signal.SIGSEGV) == -signal.SIGSEGV
        if confinement.name == "bubblewrap":
            fork_request = None  # bwrap confines only what it execs
        elif confinement.name == "user namespaces":
            binds = confinement.binds(writable)
    runner = {"command": command, "cwd": str(cwd), "env": env, "signal_exits": signal_exits}
    runners = _zygote("runner") if fork_request is not None else None
    if runners is not None:
        runner["zygote"] = {"name": runners.name, "binds": binds, **fork_request}
    return runner


def _messages(stdout: bytes) -> list[dict]:
    messages = []
    for line in stdout.decode(errors="replace").splitlines():
        if line.startswith(MARKER):
            with contextlib.suppress(ValueError):
                messages.append(json.loads(line[len(MARKER) :]))
    return messages
