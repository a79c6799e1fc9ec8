"""Builds the vendor library of a flawed/ directory, the planted library of the library-path
probe, and the fixed/ extension; each build says in one line what is missing when it cannot run.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from kata import FIXED_DIR, REPO_ROOT, KataError

LIBRARY_NAME = "custom_attention.so"
STAMP_NAME = ".custom_attention.build"
CPU_SOURCE = "vendor/custom_attention_cpu.cpp"
CUDA_SOURCE = "vendor/custom_attention.cu"
BUILD_DIR = REPO_ROOT / "build"


def machine_flavour() -> str:
    """'cuda' when torch sees a usable CUDA device, else 'cpu': the vendor build to use."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _require_tool(tool: str, purpose: str, remedy: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise KataError(f"cannot {purpose}: {tool} not found on PATH ({remedy})")
    return path


COMPILER_TIMEOUT_S = 600  # the slowest compile here, nvcc on the vendor kernel, takes seconds


def _run_compiler(
    command: list[str],
    purpose: str,
    started: Callable[[subprocess.Popen], None] | None = None,
) -> str:
    """Run a compiler; its output (stdout, then stderr) where it succeeds. With `started`
    (compile_check_cuda's), the compiler runs in a process group of its own and is handed over
    as it starts, so that _end_group can end it with what it started (nvcc's cicc and ptxas)."""
    name = Path(command[0]).name
    own_group = started is not None
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0 if own_group else None,
    ) as process:
        if started is not None:
            started(process)
        try:
            stdout, stderr = process.communicate(timeout=COMPILER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            if own_group:
                _end_group(process)
            else:
                process.kill()
            process.communicate()
            raise KataError(f"cannot {purpose}: {name} ran past {COMPILER_TIMEOUT_S} s") from None
    if process.returncode != 0:
        output = (stderr or stdout).strip()
        raise KataError(f"cannot {purpose}: {name} failed:\n{output}")
    return (stdout or "") + (stderr or "")


def _end_group(process: subprocess.Popen) -> None:
    """Kill a compiler that runs in a group of its own, with every process in that group (a
    killed nvcc alone would leave its children writing to the pipes it is read through)."""
    if process.poll() is None:  # one that has ended waited for its children
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def _write_text_atomically(path: Path, text: str) -> None:
    """Readers see the old text or the new, never a half-written file: reviews that run side by
    side (pytest -n, two terminals) build the shared libraries at the same moment."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, delete=False) as file:
        file.write(text)
    os.replace(file.name, path)


def _sources_digest(directory: Path, sources: list[str]) -> str:
    digest = hashlib.sha256()
    for name in sources:
        path = directory / name
        digest.update(name.encode())
        digest.update(path.read_bytes() if path.exists() else b"<missing>")
    return digest.hexdigest()


def _vendor_sources(directory: Path, flavour: str) -> list[str]:
    main = CUDA_SOURCE if flavour == "cuda" else CPU_SOURCE
    headers = sorted(str(p.relative_to(directory)) for p in (directory / "vendor").glob("*.h"))
    return [main, *headers]


def vendor_library_is_current(directory: Path, flavour: str) -> bool:
    library, stamp = directory / LIBRARY_NAME, directory / STAMP_NAME
    if not library.exists() or not stamp.exists():
        return False
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    expected = _sources_digest(directory, _vendor_sources(directory, flavour))
    return recorded == {"flavour": flavour, "sources": expected}


def build_vendor_library(directory: Path, flavour: str | None = None, force=False) -> Path:
    """Build <directory>/custom_attention.so for this machine unless it is already current."""
    directory = Path(directory).resolve()
    flavour = flavour or machine_flavour()
    library = directory / LIBRARY_NAME
    if not force and vendor_library_is_current(directory, flavour):
        return library
    with _one_build_at_a_time(directory):
        if not force and vendor_library_is_current(directory, flavour):
            return library  # another process built it while this one waited
        return _build_vendor_library(directory, flavour, library)


@contextlib.contextmanager
def _one_build_at_a_time(directory: Path):
    """Hold a lock of this directory's vendor build. Two builds at once each stay atomic, but one
    caller would return while the other's scratch directory still sits in `directory`, and a
    copy of it made then fails when that scratch goes (pytest -n on a fresh GPU machine: the
    fixture's copy of flawed/ failed so). The kernel drops the lock when its holder dies."""
    digest = hashlib.sha256(str(directory).encode()).hexdigest()[:16]
    path = BUILD_DIR / "locks" / f"vendor-{digest}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:  # another user's lock file: a read-only descriptor locks as well
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # nowhere to lock: the builds are still atomic one by one
            yield
            return
    try:
        # The holder's compile is bounded (COMPILER_TIMEOUT_S); a holder stopped outright is not.
        # A wait is said once it passes 2 s: g++'s build of the CPU kernel is shorter.
        started, said = time.monotonic(), False
        deadline = started + COMPILER_TIMEOUT_S + 60
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if not said and now > started + 2:
                    print(
                        f"kata: waiting for another build of {directory / LIBRARY_NAME}",
                        file=sys.stderr,
                        flush=True,
                    )
                    said = True
                if now > deadline:
                    raise KataError(
                        f"cannot build {directory / LIBRARY_NAME}: another build of it held its "
                        f"lock ({path}) for over {COMPILER_TIMEOUT_S + 60} s"
                    ) from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)


def _build_vendor_library(directory: Path, flavour: str, library: Path) -> Path:
    sources = _vendor_sources(directory, flavour)
    main_source = directory / sources[0]
    purpose = f"build {library}"
    if not main_source.exists():
        raise KataError(f"cannot {purpose}: {main_source} is missing")
    if flavour == "cuda":
        compiler = _require_tool("nvcc", purpose, "install the CUDA toolkit or put it on PATH")
        arch = _cuda_arch()
        flags = ["-O3", "-shared", "-Xcompiler", "-fPIC", f"-arch={arch}"]
    else:
        compiler = _require_tool("g++", purpose, "install a C++ compiler: apt-get install g++")
        flags = ["-O2", "-shared", "-fPIC"]
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        partial = Path(scratch) / LIBRARY_NAME
        _run_compiler([compiler, *flags, str(main_source), "-o", str(partial)], purpose)
        os.replace(partial, library)  # never leave a half-written library behind
    stamp = {"flavour": flavour, "sources": _sources_digest(directory, sources)}
    _write_text_atomically(directory / STAMP_NAME, json.dumps(stamp))
    return library


def _cuda_arch() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


REFERENCE_DIR = BUILD_DIR / "vendor-reference"


def build_reference_library(flavour: str | None = None) -> Path:
    """The shipped vendor library, built from shipped_flawed.json (never from a working copy
    a candidate may have edited): the kernel whose answers a wrapper must return."""
    from kata.toolchain import shipped

    flavour = flavour or machine_flavour()
    directory = REFERENCE_DIR / flavour
    for name, text in shipped.shipped().items():
        if name.startswith("vendor/"):
            path = directory / name
            if not path.exists() or path.read_text() != text:
                path.parent.mkdir(parents=True, exist_ok=True)
                _write_text_atomically(path, text)
    return build_vendor_library(directory, flavour)


PLANTED_SOURCE = r"""
// A library planted in the working directory by the library-path probe. Loading it leaves
// a marker file behind; calling it computes nothing and touches no buffer (they may live on a
// GPU), so a planted load can never pass as correct.
#include <stdio.h>

__attribute__((constructor)) static void mark_loaded(void) {
    FILE* marker = fopen("PLANTED_LIBRARY_WAS_LOADED", "w");
    if (marker) fclose(marker);
}

int launch_attention_kernel(const float* q, const float* k, const float* v, float* out,
                            int batch_size, int seq_len) {
    return 0;
}
"""
PLANTED_MARKER = "PLANTED_LIBRARY_WAS_LOADED"


def build_planted_library() -> Path:
    """The impostor custom_attention.so of the library-path probe (host code only)."""
    target = BUILD_DIR / "planted" / LIBRARY_NAME
    source = target.parent / "planted.c"
    if target.exists() and source.exists() and source.read_text() == PLANTED_SOURCE:
        return target
    purpose = "build the planted library of the library-path probe"
    compiler = _require_tool("gcc", purpose, "install a C compiler: apt-get install gcc")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Each build in a scratch directory of its own, as build_vendor_library does: reviews that
    # run side by side would otherwise compile into, and move away, one another's files.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        scratch_source, partial = Path(scratch) / source.name, Path(scratch) / LIBRARY_NAME
        scratch_source.write_text(PLANTED_SOURCE)
        command = [compiler, "-O1", "-shared", "-fPIC", str(scratch_source), "-o", str(partial)]
        _run_compiler(command, purpose)
        os.replace(partial, target)
        os.replace(scratch_source, source)
    return target


def build_fixed() -> None:
    """Build (or find already built) the fixed/ extension, in a child so a compiler crash or a
    missing tool becomes one clear error here. Its progress lines ("fixed: building ...") show
    as they come; fixed/_build.py bounds the build (FIXED_BUILD_TIMEOUT), and so does this wait."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    )
    try:  # fixed/_build.py's bound (1800 s at most by default) and a margin; it names a bad value
        bound = float(os.environ.get("FIXED_BUILD_TIMEOUT") or 1800) + 120
    except ValueError:
        bound = 1800 + 120
    child = subprocess.Popen(
        [sys.executable, "-c", "import fixed"],
        cwd=FIXED_DIR.parent,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    said: list[str] = []

    def relay() -> None:
        for line in child.stderr:
            said.append(line)
            if line.startswith("fixed: "):
                print(line, end="", file=sys.stderr, flush=True)

    relaying = threading.Thread(target=relay, daemon=True)
    relaying.start()
    try:
        child.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        child.kill()
        raise KataError(f"cannot build fixed/: importing it ran past {bound:.0f} s") from None
    finally:
        if child.poll() is None:  # Ctrl-C reached it too: fixed/_build.py ends its build
            child.kill()
        relaying.join(timeout=5)
    if child.returncode != 0:
        lines = [line.rstrip() for line in said if line.strip()]
        detail = "\n".join(lines[-15:])
        raise KataError(f"cannot build fixed/: importing it failed:\n{detail}")


# Pure CUDA sources (no torch headers): nvcc compiles them on a machine without a GPU. The roots
# (what no other source here includes) compile as the extension build compiles them, one image
# each: every kernel is in one of them. A kernel header's launchers instantiate every kernel they
# name, so compiling each header alone at full optimisation compiled the forward kernels three
# times per image; alone and unoptimised, each header still shows that it includes what it uses.
KERNELS_DIR = FIXED_DIR / "csrc" / "kernels"
CUDA_ROOTS = (
    REPO_ROOT / "flawed" / CUDA_SOURCE,
    KERNELS_DIR / "attention_backward_kernels.cuh",  # the generic kernels
    KERNELS_DIR / "flash_backward_sm90.cuh",  # every tensor-core kernel, forward and backward
    KERNELS_DIR / "mask_tiles.cuh",  # the map of a mask's tiles
)
# The image with wgmma code (sm_90a): the root that holds it.
SM90A_ROOTS = (KERNELS_DIR / "flash_backward_sm90.cuh",)
CUDA_HEADERS = tuple(
    KERNELS_DIR / name
    for name in (
        "attention_problem.cuh",
        "attention_kernels.cuh",
        "flash_common.cuh",
        "flash_forward_cta.cuh",
        "flash_forward_f32.cuh",
        "flash_forward.cuh",
        "flash_backward_rows.cuh",
        "flash_backward_f32_rows.cuh",
        "flash_backward_f32.cuh",
        "flash_backward_tiling.cuh",
        "flash_backward.cuh",
        "wgmma.cuh",
        "sm90_pipeline.cuh",
        "flash_forward_sm90_ws_tile.cuh",
        "flash_forward_sm90_ws_schedule.cuh",
        "flash_forward_sm90_ws_args.cuh",
        "flash_forward_sm90_ws_epilogue.cuh",
        "flash_forward_sm90_ws_producer.cuh",
        "flash_forward_sm90_ws_cta.cuh",
        "flash_forward_sm90_ws.cuh",
        "flash_forward_sm90.cuh",
        "flash_backward_sm90_producer.cuh",
        "flash_backward_sm90_epilogue.cuh",
        "flash_backward_sm90_cta.cuh",
        "flash_backward_sm90_wide.cuh",
    )
)
PURE_CUDA_SOURCES = (*CUDA_ROOTS, *CUDA_HEADERS)


@dataclass(frozen=True)
class CudaCheck:
    """One nvcc run: `source` compiled for `arch`, optimised as the extension build optimises or
    not at all (front end and ptxas still check everything; a third of the time)."""

    source: Path
    arch: str
    optimised: bool = True

    def flags(self) -> list[str]:
        number = self.arch.removeprefix("sm_")
        flags = [f"-gencode=arch=compute_{number},code=sm_{number}"]  # as the build: one image
        return flags if self.optimised else [*flags, "-Xcicc", "-O0", "-Xptxas", "-O0"]


def cuda_checks(arch: str = "sm_90") -> list[CudaCheck]:
    """The roots for `arch` and for sm_90a, optimised; every other header alone, unoptimised.
    The slowest first: they run side by side on every core."""
    return [
        *(CudaCheck(source, "sm_90a") for source in SM90A_ROOTS),
        *(CudaCheck(source, arch) for source in reversed(CUDA_ROOTS)),
        *(CudaCheck(source, arch, optimised=False) for source in reversed(CUDA_HEADERS)),
    ]


def _torch_nvcc_flags() -> list[str]:
    """The flags torch.utils.cpp_extension gives nvcc (no implicit half/bfloat16 conversions or
    operators): the check must reject what the real build would."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    return list(COMMON_NVCC_FLAGS)


def nvcc_command(nvcc: str, check: CudaCheck) -> list[str]:
    """nvcc's command for `check`, less its output (-o): also perf/ptxas_diff.py's."""
    return [nvcc, *check.flags(), *_torch_nvcc_flags(), "-x", "cu", "-c", str(check.source)]


CUDA_CHECKS_DIR = BUILD_DIR / "cuda-checks"  # one empty file per passed check, named by its inputs
# What a pass means, in its name too: a pass remembered under older rules is not this one.
_CHECK_RULES = "nvcc exits 0; ptxas serializes no wgmma"


def _unknown_gpu_code(nvcc: str, arches: set[str]) -> str | None:
    """Why nvcc cannot compile for one of `arches` (its --list-gpu-code lacks it; sm_90a is
    sm_90's), or None, also where this nvcc cannot list them."""
    try:
        listed = subprocess.run(
            [nvcc, "--list-gpu-code"], capture_output=True, text=True, timeout=60
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    for arch in sorted(arches):
        if listed and arch.rstrip("af") not in listed:
            return f"{Path(nvcc).name} does not compile for {arch}; it does: {', '.join(listed)}"
    return None


def compile_check_cuda(
    checks: list[CudaCheck],
    progress: Callable[[str], None] | None = None,
    every_s: float = 30.0,
) -> bool:
    """Run nvcc's checks side by side (no GPU needed, nothing runs). Skipped, returning False,
    when the same checks passed before: the same nvcc, flags and arches over the same bytes of
    the sources and of every file they may include (their directories'); True when run. The
    sm_90a kernels take minutes on two cores: `progress` hears how far they are every every_s."""
    purpose = "compile-check CUDA sources"
    nvcc = _require_tool("nvcc", purpose, "install the CUDA toolkit or put it on PATH")
    commands = [nvcc_command(nvcc, check) for check in checks]
    sources = sorted({check.source for check in checks})
    passed = CUDA_CHECKS_DIR / _check_digest(nvcc, commands, sources)
    if passed.exists():
        return False
    unknown = _unknown_gpu_code(nvcc, {check.arch for check in checks})
    if unknown:  # before minutes of the other compiles, which end in the same failure
        raise KataError(f"cannot {purpose}: {unknown}")
    # The first failure ends the rest: the compiles not begun never start, and those running
    # are killed, so a broken header is reported in seconds, not after minutes of sm_90a kernels.
    failed, running = threading.Event(), []

    def started(process: subprocess.Popen) -> None:
        running.append(process)
        if failed.is_set():  # it began as the first failure was found
            _end_group(process)

    def compile_one(n: int, command: list[str]) -> str | None:
        if failed.is_set():
            return None
        try:
            return _run_compiler([*command, "-o", f"{scratch}/{n}.o"], purpose, started=started)
        except BaseException:
            failed.set()  # here, before this worker takes the next compile
            raise

    with tempfile.TemporaryDirectory() as scratch, ThreadPoolExecutor(os.cpu_count()) as pool:
        compiles = [pool.submit(compile_one, n, command) for n, command in enumerate(commands)]
        started_at, pending = time.monotonic(), set(compiles)
        try:
            while pending:
                done, pending = wait(pending, timeout=every_s, return_when=FIRST_EXCEPTION)
                if first := next((c for c in done if c.exception() is not None), None):
                    raise first.exception()
                if pending and progress is not None:
                    finished = len(compiles) - len(pending)
                    progress(
                        f"still compiling ({time.monotonic() - started_at:.0f} s so far; "
                        f"{finished} of {len(compiles)} checks done)"
                    )
        except BaseException:  # that failure, or Ctrl-C (which the compilers' groups miss)
            failed.set()
            for process in running:
                _end_group(process)
            raise
        for check, compiled in zip(checks, compiles, strict=True):
            output = compiled.result()
            serialized = serialized_wgmma(output) if check.optimised else []
            if serialized:
                where = f"{check.source.name}, {check.arch}"
                raise KataError(f"cannot {purpose}: {serialized[0]} ({where})")
    CUDA_CHECKS_DIR.mkdir(parents=True, exist_ok=True)
    passed.touch()
    return True


# ptxas compiles a kernel whose wgmma it cannot pipeline by serializing every wgmma in it, and
# says so only in an advisory ("Potential Performance Loss: wgmma.mma_async instructions are
# serialized due to ...": C7511, C7514, C7515 and kin): the kernel stays correct at a fraction
# of its speed, which nothing else run without a GPU would notice (perf/NOTES.md, v45).
_SERIALIZED_WGMMA = re.compile(
    r"\((C\d+)\)[^\n]*wgmma\.mma_async instructions are serialized due to ([^\n]*?)"
    r" in (?:the )?function '([^']+)'"
)


def serialized_wgmma(output: str | None) -> list[str]:
    """Each kernel whose wgmma ptxas serialized, per its advisories in `output`, in a line."""
    lines = []
    for code, reason, kernel in _SERIALIZED_WGMMA.findall(output or ""):
        reason = " ".join(reason.split())  # ptxas's text has a double space in one advisory
        lines.append(f"ptxas serialized every wgmma of {kernel_name(kernel)} ({code}: {reason})")
    return lines


def kernel_name(mangled: str) -> str:
    """A kernel's name demangled, without its parameters or the project's namespaces, where
    c++filt is at hand; else as ptxas printed it."""
    filt = shutil.which("c++filt")
    if filt is None:
        return mangled
    try:
        name = subprocess.run([filt, mangled], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return mangled
    name, depth = name.strip().removeprefix("void "), 0
    for index, char in enumerate(name):
        depth += {"<": 1, ">": -1}.get(char, 0)
        if char == "(" and depth == 0:
            name = name[:index]
            break
    return name.replace("fixed_attention::kernels::", "") or mangled


def _check_digest(nvcc: str, commands: list[list[str]], sources) -> str:
    digest = hashlib.sha256()
    try:
        version = subprocess.run(
            [nvcc, "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = f"unknown {time.time()}"  # never matches: the check runs
    digest.update(repr((version, commands, _CHECK_RULES)).encode())
    included = sorted({path for source in sources for path in Path(source).parent.iterdir()})
    for path in included:
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:24]
