"""Build fixed/'s CUDA library on a machine without a GPU, for a GPU machine with the same torch.

A GPU machine lent by the hour then spends no time compiling: the extension's one CUDA
translation unit takes about five minutes of one nvcc process (perf/NOTES.md, v31). fixed/
loads a library named after a stamp of its sources, torch, flags, CUDA archs and build folder
(fixed/_build.py). `build` also keeps a copy named after the same stamp without the folder, in
fixed/_build/portable/; `place` puts the copy whose stamp matches its checkout where fixed/
loads it, so that a library of other sources is never loaded.

Here (torch the GPU machine's build, e.g. 2.11.0+cu130, with nvcc of the same CUDA major):

    python perf/device_build.py build

There, in a checkout of the same sources, with fixed/_build/portable/ carried over:

    python perf/device_build.py place

`where` prints the path this checkout loads. TORCH_CUDA_ARCH_LIST defaults to 9.0 (sm_90a).
The headers torch's CUDA headers include (cusparse.h, ...) come from the pip wheels beside
torch when the toolkit lacks them."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PORTABLE = ROOT / "fixed" / "_build" / "portable"


def fail(message: str) -> None:
    print(f"device_build: {message}", file=sys.stderr)
    raise SystemExit(2)


def fixed_build():
    """fixed/_build.py alone: importing fixed would build and load the CPU library."""
    spec = importlib.util.spec_from_file_location("fixed_build", ROOT / "fixed" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def copy_by_rename(source: Path, target: Path) -> None:
    """target becomes a copy of source through a rename. A process that has the old target
    loaded keeps its file: copying over it in place changes the pages under that process (a
    test worker died of SIGSEGV when `place` ran beside it)."""
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        shutil.copyfile(source, partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def add_wheel_headers() -> None:
    """pip's CUDA wheels (nvidia/cu*/include, lib) after the toolkit's own, where present."""
    import torch

    site = Path(torch.__file__).resolve().parents[1] / "nvidia"
    for wheel in sorted(site.glob("cu*")):
        for variable, folder in (("CPLUS_INCLUDE_PATH", "include"), ("LIBRARY_PATH", "lib")):
            if (wheel / folder).is_dir():
                parts = [os.environ.get(variable, ""), str(wheel / folder)]
                os.environ[variable] = os.pathsep.join(part for part in parts if part)


def main(argv: list[str]) -> None:
    if len(argv) != 1 or argv[0] not in ("build", "where", "place"):
        fail("usage: python perf/device_build.py build | where | place")
    import torch

    if torch.version.cuda is None:
        fail(f"torch {torch.__version__} has no CUDA: install the GPU machine's torch build")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    build = fixed_build()
    config = build._build_config("cuda")
    stamped = build._stamped_library(config)
    portable = PORTABLE / f"{config['name']}-{build._stamp({**config, 'build_directory': ''})}.so"
    if argv[0] == "build":
        if not stamped.exists():
            add_wheel_headers()
            build._build("cuda", config, stamped)
        PORTABLE.mkdir(parents=True, exist_ok=True)
        copy_by_rename(stamped, portable)
        print(portable)
        return
    if argv[0] == "place":
        if not portable.is_file():
            fail(
                f"no library built for these sources and torch {torch.__version__} in "
                f"{PORTABLE} (looked for {portable.name}): run build on a machine with them"
            )
        stamped.parent.mkdir(parents=True, exist_ok=True)
        copy_by_rename(portable, stamped)
    print(stamped)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (RuntimeError, TimeoutError) as error:  # fixed/_build.py's one-line errors
        fail(str(error).removeprefix("fixed: "))
