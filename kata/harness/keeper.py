"""Zygotes kept between runs: `make kata`, `make review`, then `make kata` again (an interview's
loop) find torch imported already, instead of paying 3-4 s per run on an H100 to import it again.

A keeper is a detached process (a session of its own, no terminal, its output on /dev/null) that
starts both zygotes (zygote.py) and holds them, named in build/zygotes/kept-DIGEST.json. Every
probe that uses them touches that file, and the keeper ends them and itself once no run has for
its idle time, or when the file is gone (make clean) or names another keeper. The zygotes hold
torch and the harness, never a candidate's code (their children confine themselves first and
nothing comes back to the zygote): what crosses from one run to the next is the time saved, as
with watch's zygotes.

DIGEST covers the harness sources, the interpreter, torch and the environment: only a run like
the one that started a keeper adopts its zygotes. A run unlike it starts a keeper of its own
beside it, never in its place, so no run's probes are ended by another's (an old one idles out).
KATA_KEEP_ZYGOTES=N keeps them N idle seconds (0: none kept); unset, it is IDLE_S, and none are
kept under pytest or CI. KATA_ZYGOTE=off turns zygotes off altogether.
`python -m kata.harness.keeper --stop` ends every keeper of this copy of the kata.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from kata import REPO_ROOT
from kata.harness import zygote

KEEP_ENV = "KATA_KEEP_ZYGOTES"
IDLE_S = 600  # ten minutes: longer than a candidate spends reading one failure
STATE_DIR = REPO_ROOT / "build" / "zygotes"
# What the zygotes' imports and their children's CUDA read from the environment.
ENV_PREFIXES = ("CUDA", "TORCH", "PYTORCH", "KATA_", "LD_", "PYTHON", "NVIDIA", "OMP_", "MKL_")
KINDS = ("judge", "runner")
START_TIMEOUT_S = 30  # for a keeper to name its zygotes; past it the run starts its own


def started_note(env: Mapping[str, str] = os.environ) -> str:
    """Said once, by the run that started a keeper: nothing of the kata's runs unannounced."""
    minutes = max(1, round(idle_seconds(env) / 60))
    return (
        f"torch stays imported for the next run: two helper processes wait {minutes} idle "
        f"minutes for it ({KEEP_ENV}=0 turns this off; python -m kata.harness.keeper --stop "
        "ends them)"
    )


def idle_seconds(env: Mapping[str, str] = os.environ) -> int:
    """How long kept zygotes may wait for a run with this environment; 0 where none are kept."""
    if env.get("KATA_ZYGOTE", "").strip().lower() in ("off", "0", "no", "false"):
        return 0
    told = env.get(KEEP_ENV, "").strip()
    if told:  # asked for, even under pytest (the adversarial corpus through kept zygotes)
        return int(told) if told.isdigit() else 0
    if env.get("PYTEST_CURRENT_TEST") or env.get("CI"):
        return 0  # a test's or CI's run leaves nothing behind
    return IDLE_S


def digest(env: dict) -> str:
    """What a kept zygote must share with the run that adopts it."""
    parts = [os.path.realpath(sys.executable), sys.prefix, sys.version]  # python = python3
    for source in sorted((REPO_ROOT / "kata").rglob("*.py")):
        content = hashlib.sha256(source.read_bytes()).hexdigest()
        parts += [str(source.relative_to(REPO_ROOT)), content]
    torch_spec = importlib.util.find_spec("torch")  # found, not imported
    if torch_spec and torch_spec.origin:
        parts += [torch_spec.origin, str(os.stat(torch_spec.origin).st_mtime_ns)]
    parts += sorted(f"{k}={v}" for k, v in env.items() if k.startswith(ENV_PREFIXES))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def kept(env: dict, state_dir: Path = STATE_DIR) -> dict | None:
    """{"judge": name, "runner": name, "pid": keeper, "file": its file, "started": bool} of
    zygotes kept for runs like this one, a keeper started for them where none was; None where
    that fails (the caller starts zygotes of its own). The zygotes may still be importing torch:
    the caller waits for them (zygote.Adopted.usable)."""
    idle = idle_seconds(env)
    if not idle:
        return None
    try:
        want = digest(env)
        path = state_dir / f"kept-{want[:32]}.json"
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(state_dir / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two runs at once start one keeper
            state = _read(path)
            if state and state.get("digest") == want and _is_keeper(state.get("pid")):
                touch(path)
                return {**state, "file": str(path), "started": False}
            return _start(env, want, idle, path)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def touch(path: str | Path | None) -> None:
    """A run is using the kept zygotes: their keeper's idle time starts again."""
    if path:
        with contextlib.suppress(OSError):
            os.utime(path)


def stop(state_dir: Path = STATE_DIR) -> int:
    """End every keeper named in state_dir (and their zygotes); how many there were."""
    ended = 0
    for path in state_dir.glob("kept-*.json"):
        state = _read(path)
        with contextlib.suppress(OSError):
            path.unlink()
        pid = (state or {}).get("pid")
        if _is_keeper(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
                ended += 1
    return ended


def _read(path: Path) -> dict | None:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _is_keeper(pid) -> bool:
    """Whether `pid` is a keeper of this user (never signal a process the file merely names)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return False
    return owner == os.getuid() and b"kata.harness.keeper" in command


def _start(env: dict, want: str, idle: int, path: Path) -> dict | None:
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", "kata.harness.keeper", str(path), want, str(idle)],
        env=env,
        cwd="/",  # holds no directory of the run's
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # outlives the run; the terminal's Ctrl-C does not reach it
    )
    # "started" once its file names its zygotes: a matter of milliseconds, never waited on long
    ready, _, _ = select.select([process.stdout], [], [], START_TIMEOUT_S)
    line = process.stdout.readline() if ready else b""
    process.stdout.close()
    state = _read(path)
    if line != b"started\n" or not state or state.get("pid") != process.pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        return None
    return {**state, "file": str(path), "started": True}


def serve(path: Path, want: str, idle: int) -> None:
    """The keeper: start both zygotes, name them in `path`, hold them until idle."""
    started = {kind: zygote.Zygote(kind, dict(os.environ)) for kind in KINDS}
    state = {"pid": os.getpid(), "digest": want, **{k: z.name for k, z in started.items()}}

    def end(*_):
        for kept_zygote in started.values():
            kept_zygote.close()
        if (_read(path) or {}).get("pid") == os.getpid():
            with contextlib.suppress(OSError):
                path.unlink()
        os._exit(0)

    signal.signal(signal.SIGTERM, end)
    fresh = path.with_name(f"{path.name}.{os.getpid()}")
    fresh.write_text(json.dumps(state))
    fresh.replace(path)  # whole or not at all
    os.write(1, b"started\n")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the run stops reading
    if not all(kept_zygote.usable() for kept_zygote in started.values()):
        end()
    while True:
        time.sleep(min(5, idle))
        if (_read(path) or {}).get("pid") != os.getpid():
            end()  # stopped (the file gone), or it names another keeper
        if any(kept_zygote.process.poll() is not None for kept_zygote in started.values()):
            end()
        try:
            if time.time() - path.stat().st_mtime > idle:
                end()
        except OSError:
            end()


if __name__ == "__main__":
    if sys.argv[1:] == ["--stop"]:
        ended = stop()
        print(f"stopped {ended} keeper(s) of kept zygotes" if ended else "no kept zygotes")
    else:
        serve(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
