"""Build the fixed_attention operators once, into fixed/_build/, and load them.

The cold build goes through torch.utils.cpp_extension.load (ninja, its file lock for parallel
importers, its own rebuild detection). A warm import skips it: importing cpp_extension pulls in
setuptools and load() runs ninja, which together cost more than the budget of a warm import.
Instead, after every successful load() the library is copied to a file named after a stamp
(a hash of the sources, torch version, flavour and flags); when that file exists it is loaded
directly. It only ever appears by an atomic rename, so no importer can load it half-written.
"""

from __future__ import annotations

import copy
import hashlib
import os
import shlex
import shutil
import sys
from pathlib import Path

import torch

_PACKAGE = Path(__file__).resolve().parent
_CSRC = _PACKAGE / "csrc"
_CPU_SOURCES = ("attention.cpp", "checks.cpp", "attention_cpu.cpp")
_CUDA_SOURCE = "attention_cuda.cu"

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
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "") if config["with_cuda"] else ""
    policy = _ARCH_POLICY if config["with_cuda"] else ""
    digest.update(
        repr((torch.__version__, torch.version.cuda, sorted(flags.items()), arch, policy)).encode()
    )
    return digest.hexdigest()[:16]


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


# The policy _cuda_arch_flags applies, in the stamp: a change to it is a new build.
_ARCH_POLICY = "sm_90 code as sm_90a"


def _cuda_arch_flags(cpp_extension) -> list[str]:
    """torch's -gencode flags (TORCH_CUDA_ARCH_LIST, or the visible GPUs), with sm_90 code built
    as sm_90a: the one image for compute capability 9.0 then has the wgmma forward and backward
    (csrc/kernels/flash_forward_sm90.cuh, flash_backward_sm90.cuh). Its PTX stays compute_90,
    for JIT on later GPUs. Any -gencode in extra_cuda_cflags makes load() add none of its own,
    so these are all of them."""
    torch_flags = getattr(cpp_extension, "_get_cuda_arch_flags", None)
    if torch_flags is None:  # a private helper: without it, torch's own flags, no sm_90a
        print(
            "fixed: this torch does not say its arch flags; building without sm_90a "
            "(correct, but Hopper runs the mma.sync forward and backward)",
            file=sys.stderr,
        )
        return []
    sm90 = "-gencode=arch=compute_90,code=sm_90"
    return [
        "-gencode=arch=compute_90a,code=sm_90a" if flag == sm90 else flag for flag in torch_flags()
    ]


def load_library() -> Path:
    """Load the operators into torch.ops.fixed_attention (once per process); return the path."""
    global _loaded
    if _loaded is not None:
        return _loaded
    flavour = _flavour()
    config = _build_config(flavour)
    build_dir = Path(config["build_directory"])
    stamped = build_dir / f"{config['name']}-{_stamp(config)}.so"
    if stamped.exists():
        torch.ops.load_library(str(stamped))
        _loaded = stamped
        return stamped

    _check_toolchain(flavour)
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    print(f"fixed: building the {flavour} operator into {build_dir} (once)", file=sys.stderr)
    # A copy: load() appends to the flag lists it is given, which would change the stamp.
    # It takes cpp_extension's build lock, builds if needed and loads the library.
    build_config = copy.deepcopy(config)
    if flavour == "cuda":
        build_config["extra_cuda_cflags"] += _cuda_arch_flags(cpp_extension)
    built = Path(cpp_extension.load(**build_config))
    _publish(built, stamped, config)
    _loaded = built
    return built


def _publish(built: Path, stamped: Path, config: dict) -> None:
    """Copy the built library to its stamped name, for the fast path of later imports.

    Under cpp_extension's own build lock, so that no concurrent ninja run rewrites it while it is
    copied, and only if the sources still hash to the stamp (not edited since the build).
    """
    from torch.utils.file_baton import FileBaton

    baton = FileBaton(str(stamped.parent / "lock"))
    while not baton.try_acquire():
        baton.wait()
    try:
        if stamped.name != f"{config['name']}-{_stamp(config)}.so":
            return
        partial = stamped.with_name(f".{stamped.name}.{os.getpid()}.partial")
        shutil.copyfile(built, partial)
        os.replace(partial, stamped)  # atomic: the fast path sees all of it or nothing
        for old in stamped.parent.glob(f"{config['name']}-*.so"):
            if old != stamped:
                old.unlink(missing_ok=True)
    finally:
        baton.release()
