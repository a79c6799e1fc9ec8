"""The toolchain's checks: nvcc's compile checks of every kernel header (and the serialized
wgmma they refuse), the shipped checksums of flawed/, the GPU tests' compute-sanitizer runner."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from kata import FLAWED_DIR, KataError
from kata.toolchain import builders, shipped


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_pure_cuda_sources_compile_with_nvcc():
    """The vendor kernel and fixed/'s kernel headers compile without a GPU or torch headers, under
    the flags torch's extension build gives nvcc (no implicit half/bfloat16 conversions): the
    roots for sm_90 and, with wgmma code, sm_90a; every other header alone."""
    builders.compile_check_cuda(builders.cuda_checks())  # skipped when these bytes passed before


def test_the_cuda_checks_compile_every_kernel_header():
    """Every header in the kernels' directory is checked, and every one is a root (compiled
    optimised) or reached from one by its includes: a new header cannot slip past the check."""
    checks = builders.cuda_checks()
    kernels = builders.KERNELS_DIR
    checked = {check.source for check in checks}
    assert checked == {*builders.CUDA_ROOTS, *builders.CUDA_HEADERS}
    assert {p for p in kernels.iterdir() if p.suffix == ".cuh"} <= checked
    reached, frontier = set(), [c.source for c in checks if c.optimised]
    while frontier:
        source = frontier.pop()
        for line in source.read_text().splitlines():
            if line.startswith('#include "'):
                included = source.parent / line.split('"')[1]
                if included not in reached:
                    reached.add(included)
                    frontier.append(included)
    assert set(builders.CUDA_HEADERS) <= reached
    assert {c.arch for c in checks if c.optimised} == {"sm_90", "sm_90a"}


def test_a_passed_cuda_check_reruns_only_when_an_input_changes(tmp_path, monkeypatch):
    """compile_check_cuda remembers what passed: the same nvcc, flags and bytes of the sources and
    their neighbours (what they may include) skip the compile; a changed header does not."""
    compiled = []
    monkeypatch.setattr(builders, "CUDA_CHECKS_DIR", tmp_path / "checks")
    monkeypatch.setattr(builders, "_require_tool", lambda *_: sys.executable)
    monkeypatch.setattr(
        builders, "_run_compiler", lambda command, _, **__: compiled.append(command)
    )
    monkeypatch.setattr(builders, "_torch_nvcc_flags", lambda: ["-DFLAG"])
    kernel, header = tmp_path / "kernel.cuh", tmp_path / "common.cuh"
    kernel.write_text('#include "common.cuh"\n')
    header.write_text("// v1\n")
    sm90, sm90a = [builders.CudaCheck(kernel, "sm_90")], [builders.CudaCheck(kernel, "sm_90a")]
    assert builders.compile_check_cuda(sm90) and len(compiled) == 1
    assert "-gencode=arch=compute_90,code=sm_90" in compiled[0]
    assert not builders.compile_check_cuda(sm90) and len(compiled) == 1
    assert builders.compile_check_cuda(sm90a) and len(compiled) == 2
    unoptimised = [builders.CudaCheck(kernel, "sm_90", optimised=False)]
    assert builders.compile_check_cuda(unoptimised) and "-O0" in compiled[2]
    header.write_text("// v2\n")
    assert builders.compile_check_cuda(sm90) and len(compiled) == 4


def fake_nvcc(tmp_path, codes: str):
    """An nvcc whose --list-gpu-code prints `codes`."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(f"#!/bin/sh\nprintf '{codes}'\n")
    nvcc.chmod(0o755)
    return str(nvcc)


def test_a_gpu_code_nvcc_lacks_fails_before_any_compile(tmp_path, monkeypatch):
    """A GPU code the installed nvcc does not list fails at once, naming those it does: before,
    the sm_90a compiles ran their minutes first. sm_90a counts as sm_90's."""
    compiled = []
    nvcc = fake_nvcc(tmp_path, "sm_80\\nsm_90\\n")
    monkeypatch.setattr(builders, "CUDA_CHECKS_DIR", tmp_path / "checks")
    monkeypatch.setattr(builders, "_require_tool", lambda *_: nvcc)
    monkeypatch.setattr(
        builders, "_run_compiler", lambda command, _, **__: compiled.append(command)
    )
    monkeypatch.setattr(builders, "_torch_nvcc_flags", lambda: [])
    kernel = tmp_path / "kernel.cuh"
    kernel.write_text("// the kernels\n")
    checks = [builders.CudaCheck(kernel, "sm_90a"), builders.CudaCheck(kernel, "sm_91")]
    with pytest.raises(KataError) as failure:
        builders.compile_check_cuda(checks)
    assert str(failure.value) == (
        "cannot compile-check CUDA sources: nvcc does not compile for sm_91; it does: sm_80, sm_90"
    )
    assert compiled == []
    assert builders.compile_check_cuda(checks[:1]) and len(compiled) == 1


def test_a_long_cuda_check_says_how_far_it_is(tmp_path, monkeypatch):
    """Nothing waits silently: the sm_90a compiles take minutes on two cores."""
    monkeypatch.setattr(builders, "CUDA_CHECKS_DIR", tmp_path / "checks")
    monkeypatch.setattr(builders, "_require_tool", lambda *_: fake_nvcc(tmp_path, "sm_90\\n"))
    monkeypatch.setattr(builders, "_run_compiler", lambda command, _, **__: time.sleep(0.5) or "")
    monkeypatch.setattr(builders, "_torch_nvcc_flags", lambda: [])
    kernel = tmp_path / "kernel.cuh"
    kernel.write_text("// the kernels\n")
    heard = []
    checks = [builders.CudaCheck(kernel, "sm_90"), builders.CudaCheck(kernel, "sm_90a")]
    assert builders.compile_check_cuda(checks, heard.append, every_s=0.1)
    assert heard and all(line.startswith("still compiling (") for line in heard), heard
    assert heard[0].endswith("of 2 checks done)"), heard


def test_the_first_failed_cuda_check_ends_the_others_at_once(tmp_path, monkeypatch):
    """A broken header is reported when its compile fails, not after minutes of the others: the
    compiles still running are killed with what they started (nvcc's cicc and ptxas, here a
    child that would sleep a minute) and those not begun never start."""
    monkeypatch.setattr(builders, "CUDA_CHECKS_DIR", tmp_path / "checks")
    monkeypatch.setattr(builders, "_torch_nvcc_flags", lambda: [])
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    nvcc, ran = tmp_path / "nvcc", tmp_path / "ran"
    nvcc.write_text(
        "#!/bin/sh\n"
        'case "$1" in --*) echo sm_90; exit 0;; esac\n'  # --list-gpu-code, --version
        f'for a; do case $a in *.cuh) echo "$a" >> {ran};; esac; done\n'
        'case "$*" in *broken.cuh*) echo "broken.cuh(1): error: expected a ;" >&2; exit 1;; esac\n'
        f"sleep 60 & echo $! >> {tmp_path / 'children'}; wait\n"
    )
    nvcc.chmod(0o755)
    monkeypatch.setattr(builders, "_require_tool", lambda *_: str(nvcc))
    slow, broken, never = (tmp_path / f"{name}.cuh" for name in ("slow", "broken", "never"))
    for source in (slow, broken, never):
        source.write_text("// a kernel\n")
    checks = [builders.CudaCheck(source, "sm_90") for source in (slow, broken, never)]
    began = time.monotonic()
    with pytest.raises(KataError, match=r"nvcc failed:\nbroken.cuh\(1\): error: expected a ;"):
        builders.compile_check_cuda(checks)
    assert time.monotonic() - began < 30
    assert "never.cuh" not in ran.read_text()
    [child] = (tmp_path / "children").read_text().split()
    deadline = time.monotonic() + 5
    while _runs(child) and time.monotonic() < deadline:
        time.sleep(0.05)  # the signal takes a moment
    assert not _runs(child), "the slow compile's child still runs"


def _runs(pid: str) -> bool:
    """Whether process `pid` runs: neither gone nor a zombie (an orphan waits for init to reap
    it, and a container's init may never)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ptxas's advisories as it printed them (nvcc 13.0, sm_90a): one that it serialized the wgmma of
# the D = 64 forward (a branch of perf/NOTES.md v45), and an injected arrive, which is harmless.
SERIALIZED_WGMMA = (
    "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are "
    "serialized due to non wgmma instructions defining accumulator registers of a wgmma between "
    "start and end of the pipeline stage in the function '_ZN15fixed_attention7kernels5flash7sm90"
    "_ws28flash_forward_sm90_ws_kernelI13__nv_bfloat16NS2_4TileILi64ELi128ELi3ELb0ELi0ELi3EfLi64E"
    "EELi0EEEv14CUtensorMap_stS7_S7_S7_PT_PfNS0_16AttentionProblemEbNS2_9SplitTailE'\n"
)


INJECTED_ARRIVE = (
    "ptxas info    : (C7519) warpgroup.arrive is injected in around line 4181 by compiler to "
    "allow use of registers in GMMA in function '_Z6kernelv'\n"
)


def test_a_serialized_wgmma_fails_the_cuda_check(tmp_path, monkeypatch):
    """ptxas keeps a kernel whose wgmma it cannot pipeline correct but serialized, far slower,
    and says so only in an advisory: the check fails on it, in one line naming the kernel, the
    code and the reason, and remembers no pass. Other advisories pass."""
    outputs = []
    monkeypatch.setattr(builders, "CUDA_CHECKS_DIR", tmp_path / "checks")
    monkeypatch.setattr(builders, "_require_tool", lambda *_: sys.executable)
    monkeypatch.setattr(builders, "_run_compiler", lambda command, _, **__: outputs[0])
    monkeypatch.setattr(builders, "_torch_nvcc_flags", lambda: [])
    kernel = tmp_path / "kernel.cuh"
    kernel.write_text("// the kernels\n")
    checks = [builders.CudaCheck(kernel, "sm_90a")]
    outputs.append(INJECTED_ARRIVE + SERIALIZED_WGMMA)
    with pytest.raises(KataError) as failure:
        builders.compile_check_cuda(checks)
    message = str(failure.value)
    assert "\n" not in message
    assert message.startswith("cannot compile-check CUDA sources: ptxas serialized every wgmma of ")
    assert "flash_forward_sm90_ws_kernel" in message and "C7515: non wgmma instructions" in message
    assert message.endswith("(kernel.cuh, sm_90a)")
    assert not (tmp_path / "checks").exists()  # not remembered as passed
    outputs[0] = INJECTED_ARRIVE
    assert builders.compile_check_cuda(checks)
    assert not builders.compile_check_cuda(checks)  # passed, remembered


def test_a_serialized_kernel_is_named_as_written(monkeypatch):
    """The advisory's kernel demangled, without its parameters and the project's namespaces
    (c++filt); as ptxas printed it where c++filt is missing."""
    mangled = SERIALIZED_WGMMA.split("'")[1]
    if shutil.which("c++filt"):
        assert builders.kernel_name(mangled) == (
            "flash::sm90_ws::flash_forward_sm90_ws_kernel<__nv_bfloat16, flash::sm90_ws::Tile<64, "
            "128, 3, false, 0, 3, float, 64>, 0>"
        )
    monkeypatch.setattr(builders.shutil, "which", lambda _: None)
    assert builders.kernel_name(mangled) == mangled


def test_shipped_checksums_notice_an_edit(tmp_path):
    copy = tmp_path / "flawed"
    shutil.copytree(FLAWED_DIR, copy)
    before = shipped.changed_files(copy)
    (copy / "attention_wrapper.py").write_text("# edited\n")
    (copy / "notes.txt").write_text("added\n")
    assert shipped.changed_files(copy) == sorted({*before, "attention_wrapper.py", "notes.txt"})


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="only on CI's clean clone (CI=true)")
def test_flawed_is_as_shipped_on_a_clean_clone():
    assert shipped.changed_files() == [], (
        "kata/toolchain/shipped_flawed.json is stale: run kata checksum"
    )


def test_sanitizer_runner_passes_clean_output_and_fails_otherwise(tmp_path, monkeypatch):
    """The compute-sanitizer runner of the GPU tests, driven by a stand-in for the tool."""
    from tests.cuda_support import run_clean

    stand_in = tmp_path / "fake-sanitizer"
    stand_in.write_text(
        '#!/bin/sh\ntool="$1"; shift\n"$@"\necho "========= ERROR SUMMARY: $ERRORS errors"\n'
    )
    stand_in.chmod(0o755)
    script = "print('sanitizer script done')\n"
    clean = "ERROR SUMMARY: 0 errors"
    monkeypatch.setenv("ERRORS", "0")
    line = run_clean(str(stand_in), "memcheck", script, tmp_path, clean)
    assert line == "========= ERROR SUMMARY: 0 errors"
    monkeypatch.setenv("ERRORS", "3")
    with pytest.raises(AssertionError, match="memcheck found problems"):
        run_clean(str(stand_in), "memcheck", script, tmp_path, clean)
    with pytest.raises(AssertionError, match="did not finish"):
        run_clean(str(stand_in), "memcheck", "pass\n", tmp_path, clean)
