"""Build the fixed_attention operators once, into fixed/_build/, and load them.

A warm import loads a library named after a stamp (a hash of the sources, torch version, flavour,
flags and CUDA archs) straight away: no cpp_extension, no setuptools, no ninja. A cold import
builds it with torch.utils.cpp_extension.load (ninja) in a child process, for three reasons:
- the build is bounded: it says what it is doing, and gives up after FIXED_BUILD_TIMEOUT seconds
  (the child's whole process group, compilers included, is killed), never waiting silently;
- one importer builds at a time, under an flock() on fixed-build.lock, which the kernel drops
  when its holders die, so no leftover file can block a later import (the child inherits the
  lock: a build orphaned by its importer's death still holds it until it ends);
- an interrupted build resumes: ninja redoes only the steps that did not finish.
The stamped library only ever appears by an atomic rename, so nobody loads it half-written.
Only public cpp_extension behaviour is used: load() and the TORCH_CUDA_ARCH_LIST variable.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

_PACKAGE = Path(__file__).resolve().parent
_CSRC = _PACKAGE / "csrc"
_CPU_SOURCES = ("attention.cpp", "checks.cpp", "attention_cpu.cpp")
_CUDA_SOURCE = "attention_cuda.cu"
_LOCK_NAME = "fixed-build.lock"  # not "lock": cpp_extension takes that one itself
_DEFAULT_TIMEOUT_S = {"cpu": 600, "cuda": 1800}
_PROGRESS_EVERY_S = 30

_loaded: Path | None = None


def _flavour() -> str:
    # Cheapest test first: torch.cuda.is_available() may initialise the driver.
    if (_CSRC / _CUDA_SOURCE).exists() and torch.version.cuda and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _build_config(flavour: str) -> dict:
    sources = [_CSRC / name for name in _CPU_SOURCES]
    if flavour == "cuda":
        sources.append(_CSRC / _CUDA_SOURCE)
    cflags = ["-O3"]
    ldflags = []
    if torch.backends.openmp.is_available():  # at::parallel_for is OpenMP in such builds
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    return {
        # One name per flavour: the cpu and cuda builds never share objects or a library.
        "name": f"fixed_attention_{flavour}",
        "sources": [str(path) for path in sources],
        "extra_cflags": cflags,
        "extra_cuda_cflags": ["-O3"],
        "extra_ldflags": ldflags,
        "build_directory": str(_PACKAGE / "_build" / f"{flavour}-torch{torch.__version__}"),
        "with_cuda": flavour == "cuda",
        "is_python_module": False,
    }


def _cuda_arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST for the build: the user's, or the visible GPUs' (as cpp_extension
    picks them, the newest with +PTX), with compute capability 9.0 built as 9.0a. The one image
    for Hopper then has the wgmma forward and backward (csrc/kernels/*_sm90.cuh); a plain sm_90
    image beside it could be the one the driver picks."""
    requested = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(" ", ";")
    if requested and requested != "native":
        archs = [arch for arch in requested.split(";") if arch]
    else:
        newest = max(
            (int(name[3:-1]), int(name[-1])) for name in torch.cuda.get_arch_list() if "sm_" in name
        )
        capabilities = {
            min(torch.cuda.get_device_capability(index), newest)
            for index in range(torch.cuda.device_count())
        }
        archs = [f"{major}.{minor}" for major, minor in sorted(capabilities)]
        archs[-1] += "+PTX"
    return ";".join({"9.0": "9.0a", "9.0+PTX": "9.0a+PTX"}.get(arch, arch) for arch in archs)


def _stamp(config: dict) -> str:
    digest = hashlib.sha256()
    # The sources and the headers they may include (.cuh only for the CUDA build).
    headers = {".h", ".cuh"} if config["with_cuda"] else {".h"}
    paths = {Path(source) for source in config["sources"]}
    paths.update(path for path in _CSRC.rglob("*") if path.suffix in headers)
    for path in sorted(paths):
        name = path.relative_to(_CSRC).as_posix().encode()
        digest.update(name + b"\0" + path.read_bytes() + b"\0")
    flags = {key: value for key, value in config.items() if key != "sources"}
    archs = _cuda_arch_list() if config["with_cuda"] else ""
    digest.update(
        repr((torch.__version__, torch.version.cuda, sorted(flags.items()), archs)).encode()
    )
    return digest.hexdigest()[:16]


def _stamped_library(config: dict) -> Path:
    return Path(config["build_directory"]) / f"{config['name']}-{_stamp(config)}.so"


def _check_toolchain(flavour: str) -> None:
    """Fail with one readable line instead of an error from deep inside cpp_extension."""
    compiler = shlex.split(os.environ.get("CXX", "c++"))[0]
    if shutil.which(compiler) is None:
        raise RuntimeError(
            f"C++ compiler '{compiler}' not found: building fixed/ needs one "
            "(apt-get install g++, or set CXX to your compiler)"
        )
    if shutil.which("ninja") is None:
        raise RuntimeError(
            "ninja not found: torch.utils.cpp_extension builds fixed/ with it (pip install ninja)"
        )
    if flavour == "cuda":
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None:
            raise RuntimeError(
                "nvcc not found: building fixed/ for CUDA needs the CUDA toolkit "
                "(install it, or set CUDA_HOME)"
            )


def _timeout_s(flavour: str) -> float:
    value = os.environ.get("FIXED_BUILD_TIMEOUT", "")
    try:
        return float(value) if value else _DEFAULT_TIMEOUT_S[flavour]
    except ValueError:
        raise ValueError(
            f"FIXED_BUILD_TIMEOUT must be a number of seconds; got {value!r}"
        ) from None


def _say(message: str) -> None:
    print(f"fixed: {message}", file=sys.stderr, flush=True)


def load_library() -> Path:
    """Load the operators into torch.ops.fixed_attention (once per process); return the path."""
    global _loaded
    if _loaded is None:
        flavour = _flavour()
        config = _build_config(flavour)
        stamped = _stamped_library(config)
        if not stamped.exists():
            _build(flavour, config, stamped)
        torch.ops.load_library(str(stamped))
        _loaded = stamped
    return _loaded


def _build(flavour: str, config: dict, stamped: Path) -> None:
    _check_toolchain(flavour)
    build_dir = stamped.parent
    build_dir.mkdir(parents=True, exist_ok=True)
    timeout = _timeout_s(flavour)
    deadline = time.monotonic() + timeout
    with open(build_dir / _LOCK_NAME, "a+") as lock:
        _acquire(lock, f"the {flavour} operator", deadline, timeout)
        if stamped.exists():  # built by the process we waited for
            return
        # The lock file names the build child while it runs (the child empties it when it ends):
        # a name left there is a build cut short, whose finished steps ninja keeps.
        lock.seek(0)
        unfinished = lock.read().strip()
        if unfinished:
            _say(
                f"resuming the build of the {flavour} operator that process {unfinished} left "
                f"unfinished, in {build_dir}"
            )
        else:
            _say(f"building the {flavour} operator in {build_dir} (once)")
        _run_build_child(flavour, stamped, lock, deadline, timeout)


def _acquire(lock, what: str, deadline: float, timeout: float) -> None:
    """flock() the build lock, saying whom we wait for; give up at the deadline."""
    started = time.monotonic()
    announced = started + 2  # a wait shorter than this is not worth a line
    while True:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        now = time.monotonic()
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        if now >= deadline:
            raise TimeoutError(
                f"fixed: gave up after {timeout:.0f} s waiting for process {holder}, which is "
                f"building {what} in {Path(lock.name).parent} (FIXED_BUILD_TIMEOUT sets the limit)"
            )
        if now >= announced:
            _say(
                f"waiting for process {holder}, which is building {what} "
                f"({now - started:.0f} s so far; gives up after {timeout:.0f} s)"
            )
            announced = now + _PROGRESS_EVERY_S
        time.sleep(0.2)


def _run_build_child(flavour: str, stamped: Path, lock, deadline: float, timeout: float) -> None:
    """cpp_extension.load in a child of its own process group: bounded, and killable whole."""
    log = stamped.parent / "build.log"
    with open(log, "w") as output:
        child = subprocess.Popen(
            [
                sys.executable,
                "-P",
                __file__,
                flavour,
                str(stamped),
                str(lock.fileno()),
                str(timeout),
            ],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            pass_fds=(lock.fileno(),),  # the lock stays held while the child lives
            start_new_session=True,  # Ctrl-C reaches us; we end the whole build
        )
        _record_builder(lock.fileno(), str(child.pid))
        try:
            started = time.monotonic()
            while True:
                wait = max(0.1, min(_PROGRESS_EVERY_S, deadline - time.monotonic()))
                try:
                    returncode = child.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    elapsed = time.monotonic() - started
                    if time.monotonic() >= deadline:
                        raise TimeoutError(
                            f"fixed: gave up building the {flavour} operator after {elapsed:.0f} s "
                            f"(FIXED_BUILD_TIMEOUT sets the limit; the compiler's output is in "
                            f"{log}); the next import resumes the build"
                        ) from None
                    _say(f"still building ({elapsed:.0f} s so far; gives up after {timeout:.0f} s)")
        finally:  # also when the child was killed alone: its ninja may still be running
            _end_build(child)
    if returncode < 0:  # killed from outside (the OOM killer, a kill of its group, ...)
        raise RuntimeError(
            f"fixed: the build of the {flavour} operator was killed by "
            f"{signal.Signals(-returncode).name}; the next import resumes it"
        )
    if returncode != 0 or not stamped.exists():
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-30:])
        raise RuntimeError(f"fixed: building the {flavour} operator failed:\n{tail}")


def _record_builder(lock_fd: int, pid: str) -> None:
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, pid.encode(), 0)


def _end_build(child: subprocess.Popen) -> None:
    """End whatever is left in the build child's process group (nothing, after a build that
    ran to its end). SIGTERM first: ninja passes it on to the compilers, which run in process
    groups of their own, and waits for them; SIGKILL what is left after 10 s."""
    if _signal_group(child.pid, signal.SIGTERM):
        give_up = time.monotonic() + 10
        while time.monotonic() < give_up:
            child.poll()  # reaped, so that an empty group is seen as empty
            if not _signal_group(child.pid, 0):
                break
            time.sleep(0.1)
        else:
            _signal_group(child.pid, signal.SIGKILL)
    child.wait()


def _signal_group(pgid: int, number: int) -> bool:
    """Send signal `number` to a process group; False when nothing is left in it."""
    try:
        os.killpg(pgid, number)
    except ProcessLookupError:
        return False
    return True


def _child_main(flavour: str, stamped: str, lock_fd: str, timeout: str) -> int:
    """The build child: cpp_extension.load, then publish the library under its stamp."""
    status = _build_and_publish(flavour, Path(stamped), timeout)
    _record_builder(int(lock_fd), "")  # ran to its end: nothing left to resume
    return status


def _build_and_publish(flavour: str, stamped: Path, timeout: str) -> int:
    # Orphaned by its importer, the build still ends within the bound, compilers included
    # (ninja passes the SIGTERM on to them).
    signal.signal(signal.SIGALRM, lambda *_: os.killpg(0, signal.SIGTERM))
    signal.alarm(max(1, int(float(timeout))))
    config = _build_config(flavour)
    if flavour == "cuda":
        os.environ["TORCH_CUDA_ARCH_LIST"] = _cuda_arch_list()
    # Before torch 2.14, cpp_extension's lock is a file whose existence blocks; a build killed
    # mid-way leaves it behind. We hold the build lock, so nobody else is using it.
    Path(config["build_directory"], "lock").unlink(missing_ok=True)
    from torch.utils import cpp_extension

    try:  # a copy: load() appends to the flag lists it is given, which would change the stamp
        built = Path(cpp_extension.load(**copy.deepcopy(config)))
    except Exception as error:  # the compiler's errors are in the message
        print(error, file=sys.stderr)
        return 1
    if _stamped_library(config) != stamped:
        print("fixed/csrc changed during the build: import fixed again", file=sys.stderr)
        return 1
    partial = Path(f"{stamped}.{os.getpid()}.partial")
    shutil.copyfile(built, partial)
    os.replace(partial, stamped)  # atomic: the fast path sees all of it or nothing
    for old in stamped.parent.glob(f"{config['name']}-*.so"):
        if old != stamped:
            old.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(*sys.argv[1:]))
