"""The harness itself: isolation, the review's output, builders, hints, catalog and rubric."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

from kata import FLAWED_DIR, REPO_ROOT, KataError
from kata.harness import review as review_module
from kata.harness.catalog import CATALOG, Need
from kata.harness.hints import next_hint
from kata.harness.probes import PROBES
from kata.harness.remote import MAX_ANSWER_BYTES, Remote, RunnerStopped
from kata.harness.review import resolve_implementation, run_review
from kata.harness.rubric import rubric_section
from kata.toolchain import builders, shipped
from tests.process_support import alive
from tests.terminal_support import sigint_at_default

FAST_PROBES = ["shape", "contiguity"]  # two cheap probes: enough to see a review complete


@pytest.fixture
def candidate(tmp_path, flawed_library):
    """A copy of the shipped flawed/ (vendor library included) whose wrapper a test rewrites."""
    copy = tmp_path / "candidate"
    shutil.copytree(FLAWED_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))

    def with_wrapper(source: str):
        (copy / "attention_wrapper.py").write_text(source)
        return resolve_implementation(str(copy))

    return with_wrapper


def statuses(review):
    return {r.flaw.id: (r.result.status, r.result.evidence) for r in review.reports}


# ------------------------------------------------------------------------------- isolation


def test_segfaulting_candidate_is_present_with_the_signal(candidate):
    impl = candidate("import ctypes\n\ndef fast_attention(q, k, v):\n    ctypes.string_at(0)\n")
    review = run_review(impl, only=FAST_PROBES)
    assert len(review.reports) == len(FAST_PROBES)
    for status, evidence in statuses(review).values():
        assert status == "present"
        assert "process died with SIGSEGV" in evidence


def test_an_answer_too_large_to_be_one_is_not_read(tmp_path):
    # The runner is the candidate's process: one that announces 1 GiB and streams it would, read
    # as announced, put 1 GiB into the judge's memory (any amount, given time).
    flood = (
        "import os, struct\n"
        "os.write(1, struct.pack('<Q', 2**30))\n"
        "zeros = bytes(2**20)\n"
        "for _ in range(2**10):\n"
        "    os.write(1, zeros)\n"
    )
    remote = Remote([sys.executable, "-c", flood], tmp_path, dict(os.environ))
    started = time.monotonic()
    with pytest.raises(RunnerStopped, match=r"1,073,741,824 bytes, over the 256 MiB"):
        remote.request({"op": "health"})
    assert time.monotonic() - started < 30
    assert remote.process.wait(timeout=10) == -signal.SIGKILL
    # rubric.md and the corpus quote the evidence: they name the limit the judge holds
    assert f"over the {MAX_ANSWER_BYTES >> 20} MiB" in (REPO_ROOT / "rubric.md").read_text()


def test_an_answer_is_raw_bytes_never_an_archive_to_inflate(tmp_path):
    # torch.load takes deflated archives: 64 KB sent would be 64 MiB in the judge (a thousandfold,
    # past any cap on what is sent). The judge reads a table and raw bytes, and nothing else.
    saved = io.BytesIO()
    torch.save({"result": torch.zeros(2**24)}, saved)
    archive, deflated = zipfile.ZipFile(saved), io.BytesIO()
    with zipfile.ZipFile(deflated, "w", compression=zipfile.ZIP_DEFLATED) as bomb:
        for name in archive.namelist():
            bomb.writestr(name, archive.read(name))
    frame = json.dumps({"result": {"type": "Tensor"}}).encode() + b"\n" + deflated.getvalue()
    assert len(frame) < 2**20
    (tmp_path / "frame").write_bytes(struct.pack("<Q", len(frame)) + frame)
    send = "import os, sys; os.write(1, open(sys.argv[1], 'rb').read()); sys.stdin.read()"
    remote = Remote([sys.executable, "-c", send, str(tmp_path / "frame")], tmp_path, {})
    with pytest.raises(RunnerStopped, match="sent garbage"):
        remote.request({"op": "health"})
    remote.close()


def test_a_crash_fails_its_own_case_and_the_next_runs_fresh(candidate):
    """A segfault on the sliced key's case, loud refusals of a strided query and value: the crash
    is that case's failure, the value's case still runs (in a fresh runner) and the rubric's
    credit follows, partial. The probe used to end at the crash: present."""
    source = (
        "import ctypes\n\nimport torch\n\n_lib = ctypes.CDLL('./custom_attention.so')\n\n\n"
        "def fast_attention(q, k, v):\n"
        "    if not k.is_contiguous():\n        ctypes.string_at(0)\n"
        "    for name, t in (('query', q), ('value', v)):\n"
        "        if not t.is_contiguous():\n"
        "            raise ValueError(f'{name} must be contiguous')\n"
        "    out = torch.empty_like(q)\n"
        "    pointers = [ctypes.c_void_p(t.data_ptr()) for t in (q, k, v, out)]\n"
        "    _lib.launch_attention_kernel(*pointers, q.shape[0], q.shape[1])\n"
        "    return out\n"
    )
    review = run_review(candidate(source), only=["contiguity"])
    [(status, evidence)] = statuses(review).values()
    assert status == "partial", evidence
    assert evidence.startswith("key unchecked (query and value handled in every case)"), evidence
    assert "sliced key: process died with SIGSEGV" in evidence, evidence


def test_hanging_candidate_is_present_with_the_time_limit(candidate):
    impl = candidate("def fast_attention(q, k, v):\n    while True:\n        pass\n")
    review = run_review(impl, only=FAST_PROBES, timeout=8)
    for status, evidence in statuses(review).values():
        assert status == "present"
        assert evidence.startswith("timed out after 8 s")


def test_ctrl_c_leaves_no_probe_running(candidate, tmp_path):
    """Probes run in sessions of their own, out of the terminal's reach: Ctrl-C must kill them."""
    pids = tmp_path / "pids"
    pids.mkdir()
    impl = candidate(
        f"import os, pathlib\n\npathlib.Path({str(pids)!r}, str(os.getpid())).touch()\n\n\n"
        "def fast_attention(q, k, v):\n    while True:\n        pass\n"
    )
    review = subprocess.Popen(
        [sys.executable, "-m", "kata", "review", "--impl", str(impl.path), "--only", *FAST_PROBES],
        cwd=REPO_ROOT,
        # the probes report their pids in a directory a sandbox would keep them from
        env=dict(os.environ, KATA_SANDBOX="off"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=sigint_at_default,
    )
    deadline = time.monotonic() + 60
    while len(list(pids.iterdir())) < len(FAST_PROBES) and time.monotonic() < deadline:
        time.sleep(0.2)
    started = [int(path.name) for path in pids.iterdir()]
    assert len(started) == len(FAST_PROBES), "the probes did not start"
    review.send_signal(signal.SIGINT)
    try:
        review.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        review.kill()
        for pid in started:
            os.kill(pid, signal.SIGKILL)
        pytest.fail("the review did not stop within 30 s of Ctrl-C: it waited for its probes")
    time.sleep(0.5)
    survivors = [pid for pid in started if alive(pid)]
    assert not survivors, f"probe processes outlived the stopped review: {survivors}"


@pytest.mark.parametrize("confinement", ["machine-sandbox", "sandbox-off"])
def test_a_killed_review_leaves_no_probe_running(candidate, confinement):
    """A review killed outright (SIGKILL; a closed terminal's SIGHUP likewise) runs no cleanup:
    its probes, hung in the candidate's code, must end with it, not spin on. Under the sandbox
    this machine has (none where none works) and with it off."""
    impl = candidate("def fast_attention(q, k, v):\n    while True:\n        pass\n")
    mark = f"{os.getpid()}-{time.monotonic_ns()}"  # in the environment of all the review starts
    env = dict(os.environ, KATA_TEST_MARK=mark)
    if confinement == "sandbox-off":
        env["KATA_SANDBOX"] = "off"
    review = subprocess.Popen(
        [sys.executable, "-m", "kata", "review", "--impl", str(impl.path), "--only", *FAST_PROBES],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            # Started fresh (kata_runner.py), or forked from the runner zygote (named so)
            runners = [p for p in _processes_marked(mark) if _is_runner(*p)]
            if len(runners) >= len(FAST_PROBES):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the probes' runners did not start")
        time.sleep(3)  # into the candidate's loop
        review.kill()
        review.wait()
        deadline = time.monotonic() + 15
        while _processes_marked(mark) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _processes_marked(mark)
        assert not left, f"probe processes outlived the killed review: {left}"
    finally:
        review.kill()
        for pid, _ in _processes_marked(mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _processes_marked(mark: str) -> list[tuple[int, str]]:
    """(pid, command line) of the live processes with KATA_TEST_MARK=mark in their environment."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environment = (entry / "environ").read_bytes().split(b"\0")
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"KATA_TEST_MARK={mark}".encode() in environment and alive(int(entry.name)):
            found.append((int(entry.name), command[:200]))
    return found


def _is_runner(pid: int, command: str) -> bool:
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/comm").read_text().strip() == "kata-runner":
            return True
    return "kata_runner.py" in command


def test_syntax_broken_candidate_is_present_with_the_error(candidate):
    impl = candidate("def fast_attention(q, k, v:\n    return q\n")
    review = run_review(impl, only=FAST_PROBES)
    for status, evidence in statuses(review).values():
        assert status == "present"
        assert "syntax error at attention_wrapper.py:1" in evidence
    assert review.import_failure.startswith("syntax error at attention_wrapper.py:1: ")


KERNEL_WRAPPER = (
    "import ctypes\n\nimport torch\n\n_lib = ctypes.CDLL('./custom_attention.so')\n\n\n"
    "def fast_attention(q, k, v):\n"
    "    if q.requires_grad:\n        ctypes.string_at(0)  # dies in the autograd probe only\n"
    "    out = torch.empty_like(q)\n"
    "    pointers = [ctypes.c_void_p(t.data_ptr()) for t in (q, k, v, out)]\n"
    "    _lib.launch_attention_kernel(*pointers, q.shape[0], q.shape[1])\n"
    "    return out\n"
)


def test_a_crash_is_placed_in_the_probes_case_after_checked_calls(candidate):
    """The checked calls before a probe's first call name cases of their own; a crash after
    them is the probe's case's, whatever number of them the seed drew (1 to 3)."""
    impl = candidate(KERNEL_WRAPPER)
    for seed in range(4):
        review = run_review(impl, only=["autograd"], seed=seed)
        [(status, evidence)] = statuses(review).values()
        assert status == "present", evidence
        assert evidence.endswith("during case 'loss = attention term + other terms; backward'"), (
            seed,
            evidence,
        )


def test_judges_take_one_cuda_queue_and_only_the_stream_probes_runner_gets_the_default(
    monkeypatch,
):
    """One hardware queue per context makes a GPU review's 40 contexts cheap to create; the
    stream probe's runner keeps the default 8, without which a kernel on the wrong stream
    would be serialised behind the right one and its race never seen. A user's own number
    stands everywhere."""
    from kata.harness import isolation

    queues = isolation.CONNECTIONS_ENV
    monkeypatch.delenv(queues, raising=False)
    assert isolation._judge_env()[queues] == "1"
    assert isolation._runner_unsets("stream") == [queues]
    assert [p for p in PROBES if isolation._runner_unsets(p)] == ["stream"]
    monkeypatch.setenv(queues, "4")
    assert isolation._judge_env()[queues] == "4"
    assert isolation._runner_unsets("stream") == []


def test_cases_judged_in_lanes_keep_their_verdicts_and_a_hang_its_case(candidate, monkeypatch):
    """Device's cases in three lanes (a runner each, at once, as on a GPU machine): a crash is
    still its own case's failure, and a hang in one lane is placed in its case, not in the case
    another lane reported after it (on the CPU, lane 1 takes cases 1 and 4, and lanes 2 and 3
    report cases 2 and 3 after case 1 hangs)."""
    monkeypatch.setenv("KATA_CASE_LANES", "3")
    review = run_review(resolve_implementation("flawed"), only=["device"])
    [(status, evidence)] = statuses(review).values()
    assert status == "present", evidence
    if torch.cuda.is_available():  # four cases with CPU tensors first, each a fault
        assert evidence.startswith("cpu inputs on a CUDA machine: CUDA failed"), evidence
        assert evidence.endswith("[8/8 cases]"), evidence
    else:
        assert evidence.startswith("meta inputs: process died with SIGSEGV"), evidence
        assert evidence.endswith("[4/4 cases]"), evidence
    hangs_on_meta = KERNEL_WRAPPER.replace(
        "    out = torch.empty_like(q)\n",
        "    if q.is_meta and k.is_meta and v.is_meta:\n        while True:\n            pass\n"
        "    if not q.device == k.device == v.device:\n"
        "        raise ValueError('query, key and value must be on one device')\n"
        "    out = torch.empty_like(q)\n",
    )
    review = run_review(candidate(hangs_on_meta), only=["device"], timeout=8)
    [(status, evidence)] = statuses(review).values()
    assert status == "present", evidence
    assert evidence.endswith("timed out after 8 s during case 'meta inputs'"), evidence


def test_refusing_everything_is_not_loud(candidate):
    """Loud counts only while valid calls still work: a wrapper that raises on every call, with
    a message naming every problem, must not pass the input probes."""
    impl = candidate(
        "def fast_attention(q, k, v):\n"
        "    raise ValueError('query, key and value must be float32, (batch, seq_len, 64) '\n"
        "                     'with seq_len <= 4096, contiguous, on one device')\n"
    )
    input_probes = ["dtype", "shape", "contiguity", "device", "error-code"]
    review = run_review(impl, only=input_probes)
    for flaw_id, (status, evidence) in statuses(review).items():
        assert status == "present", (flaw_id, evidence)
        # Every case was loud, but so was every valid call: the checked call after the first
        # case (or, with none drawn, the control) decides, and says why.
        assert re.match(r"a (checked|valid) .*float32.* call.* raised ValueError", evidence), (
            evidence
        )


def test_a_message_that_names_nothing_is_not_loud(candidate):
    """Loud means the message names the problem: the argument, the offending value or the
    expected one. A refusal that names none of them is not a fix."""
    impl = candidate(
        "import torch\n\n\ndef fast_attention(q, k, v):\n"
        "    if q.dtype != torch.float32 or k.dtype != q.dtype or v.dtype != q.dtype:\n"
        "        raise ValueError('bad input')\n"
        + (FLAWED_DIR / "attention_wrapper.py").read_text().split("def fast_attention", 1)[0]
    )
    review = run_review(impl, only=["dtype"])
    status, evidence = statuses(review)["dtype"]
    assert status == "present", evidence
    assert "does not name the problem: ValueError: bad input" in evidence, evidence


def test_a_clear_message_is_loud_whatever_its_words(candidate):
    """The fair side of the same rule: a message that names the argument and both shapes counts,
    with none of the words a keyword list would have looked for."""
    shipped_source = (FLAWED_DIR / "attention_wrapper.py").read_text()
    check = (
        "def fast_attention(query, key, value):\n"
        "    for name, t in (('query', query), ('key', key), ('value', value)):\n"
        "        if t.dim() != 3 or t.shape != query.shape or t.shape[-1] != 64:\n"
        "            raise ValueError(f'{name} must be (batch, seq, 64) like query, "
        "got {tuple(t.shape)}')\n"
    )
    impl = candidate(shipped_source.replace("def fast_attention(query, key, value):\n", check))
    review = run_review(impl, only=["shape"])
    status, evidence = statuses(review)["shape"]
    assert status == "fixed", evidence
    assert "ValueError: query must be (batch, seq, 64) like query, got (2, 64, 32)" in evidence


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_refusing_every_cuda_call_is_not_loud_about_sizes(candidate):
    """The same control on the GPU: raising about sizes on every call does not fix int32-sizes."""
    impl = candidate(
        "def fast_attention(q, k, v):\n"
        "    raise ValueError('int32 overflow: tensor size too large')\n"
    )
    review = run_review(impl, only=["int32-sizes"])
    status, evidence = statuses(review)["int32-sizes"]
    assert status == "present", evidence
    assert "a valid float32 (2, 64, 64) call on cuda raised ValueError" in evidence, evidence


def test_review_grades_a_candidates_edit(candidate):
    """A dtype check added to the shipped wrapper turns dtype to fixed, and only dtype."""
    shipped_source = (FLAWED_DIR / "attention_wrapper.py").read_text()
    check = (
        "def fast_attention(query, key, value):\n"
        "    for tensor in (query, key, value):\n"
        "        if tensor.dtype != torch.float32:\n"
        "            raise TypeError(f'fast_attention needs float32, got {tensor.dtype}')\n"
    )
    edited = shipped_source.replace("def fast_attention(query, key, value):\n", check)
    assert edited != shipped_source
    review = run_review(candidate(edited), only=["dtype", "contiguity"])
    result = statuses(review)
    assert result["dtype"][0] == "fixed", result["dtype"][1]
    assert "TypeError" in result["dtype"][1]
    assert result["contiguity"][0] == "present"


def test_broken_vendor_build_is_evidence_not_a_crash(candidate, tmp_path):
    impl = candidate((FLAWED_DIR / "attention_wrapper.py").read_text())
    (impl.path / builders.CPU_SOURCE).write_text("this is not C++\n")
    (impl.path / builders.CUDA_SOURCE).write_text("this is not CUDA\n")
    review = run_review(impl, only=FAST_PROBES)
    for status, evidence in statuses(review).values():
        assert status == "present"
        assert evidence.startswith("the vendor library did not build")


# ---------------------------------------------------------------------------- command line


def run_kata(*args, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "kata", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        **kwargs,
    )


def test_review_json_has_exactly_the_documented_shape():
    completed = run_kata("review", "--impl", "fixed", "--json", "--only", "contiguity")
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert set(report) == {
        "implementation",
        "device",
        "round",
        "seed",
        "date",
        "flaws",
        "score",
        "level_band",
        "import_failure",
        "vendor_kernel",
        "sandbox",
        "hints_used",
    }
    assert report["implementation"] == "fixed" and report["round"] == 1
    assert isinstance(report["device"], str) and report["device"]
    assert isinstance(report["seed"], int) and report["date"].startswith("20")
    [flaw] = report["flaws"]
    assert set(flaw) == {"id", "title", "status", "evidence", "points", "earned"}
    assert flaw["id"] == "contiguity" and flaw["status"] == "fixed" and flaw["earned"] == 8
    assert report["score"] == {"earned": 8, "possible": 8}
    assert report["level_band"] == "staff" and report["import_failure"] is None
    assert report["vendor_kernel"]["compared"] is False  # fixed/ is its own operator


def test_possible_points_count_only_flaws_that_ran(fixed_review):
    ran = [r for r in fixed_review.reports if r.result.status != "skipped"]
    assert fixed_review.possible == sum(r.flaw.points for r in ran)
    assert fixed_review.earned == fixed_review.possible


def test_review_of_a_directory_without_a_wrapper_is_one_clear_error(tmp_path):
    completed = run_kata("review", "--impl", str(tmp_path))
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines() == [
        f"kata: {tmp_path} is not a copy of flawed/: it has no attention_wrapper.py"
    ]


def test_missing_compiler_is_one_clear_line(candidate, tmp_path):
    impl = candidate((FLAWED_DIR / "attention_wrapper.py").read_text())
    (impl.path / builders.LIBRARY_NAME).unlink()  # so the build must run a compiler
    empty = tmp_path / "empty-path"
    empty.mkdir()
    completed = run_kata("build", "--impl", str(impl.path), env={"PATH": str(empty)})
    # Only a CPU machine builds with g++; a CUDA one needs nvcc. Either must be named.
    assert completed.returncode == 2
    [line] = completed.stderr.strip().splitlines()
    assert re.fullmatch(r"kata: cannot build .*: (g\+\+|nvcc) not found on PATH \(.*\)", line)


def test_hints_advance_one_level_per_call_and_stop_at_the_last(tmp_path):
    state = tmp_path / "hints.json"
    flaw = CATALOG[0]
    for level in (1, 2, 3, 3):
        text = next_hint(flaw.id, state)
        assert f"Hint {level} of {len(flaw.hints)}" in text
        assert flaw.hints[level - 1] in text
    assert json.loads(state.read_text()) == {flaw.id: 3}
    with pytest.raises(KataError, match="unknown flaw id 'nope'"):
        next_hint("nope", state)


def test_hint_command_names_unknown_ids():
    completed = run_kata("hint", "no-such-flaw")
    assert completed.returncode != 0
    assert "unknown flaw id" in completed.stderr


# -------------------------------------------------------------------------------- builders


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
    monkeypatch.setattr(builders, "_run_compiler", lambda command, _: compiled.append(command))
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
    monkeypatch.setattr(builders, "_run_compiler", lambda command, _: outputs[0])
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


def test_stale_vendor_library_is_rebuilt(candidate):
    impl = candidate((FLAWED_DIR / "attention_wrapper.py").read_text())
    assert (
        builders.vendor_library_is_current(impl.path, "cpu") or builders.machine_flavour() != "cpu"
    )
    source = impl.path / builders.CPU_SOURCE
    source.write_text(source.read_text() + "\n// edited\n")
    assert not builders.vendor_library_is_current(impl.path, "cpu")
    builders.build_vendor_library(impl.path, "cpu")
    assert builders.vendor_library_is_current(impl.path, "cpu")


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


# --------------------------------------------------------------------- catalog and rubric


def test_catalog_ids_are_unique_and_points_total_100():
    ids = [flaw.id for flaw in CATALOG]
    assert len(ids) == len(set(ids)) == 12
    assert sum(flaw.points for flaw in CATALOG) == 100


def test_every_flaw_has_three_hints_and_a_location():
    for flaw in CATALOG:
        assert len(flaw.hints) == 3 and all(flaw.hints), flaw.id
        assert flaw.where, flaw.id


def test_every_flaw_has_a_probe_and_every_probe_judges_a_flaw():
    catalogs = list(CATALOG)
    try:
        from kata.harness import round2
    except ModuleNotFoundError:  # a handout has no round two
        pass
    else:
        catalogs += round2.CATALOG
    assert {flaw.probe_id for flaw in catalogs} == PROBES.keys()


def test_rubric_has_one_section_per_flaw_with_the_catalogs_points():
    rubric = (REPO_ROOT / "rubric.md").read_text()
    sections = re.findall(
        r"^## `([a-z0-9-]+)`: (.+?)\n+\*\*Points: (\d+)\*\*", rubric, flags=re.MULTILINE
    )
    found = [(flaw_id, int(points)) for flaw_id, _, points in sections]
    assert found == [(flaw.id, flaw.points) for flaw in CATALOG]
    titles = {flaw_id: title for flaw_id, title, _ in sections}
    for flaw in CATALOG:
        assert titles[flaw.id] == flaw.title, flaw.id


def test_rubric_states_each_flaws_partial_credit_as_the_catalog_does():
    for flaw in CATALOG:
        section = rubric_section(flaw.id)
        stated = re.findall(r"\*\*Partial credit: (\d+) points\*\*", section)
        expected = [str(flaw.partial_points)] if flaw.partial_points else []
        assert stated == expected, f"{flaw.id}: rubric says {stated}, catalog {expected}"
        assert flaw.partial_points < flaw.points, flaw.id


def test_rubric_names_every_error_type_that_is_never_loud():
    from kata.harness.judging import UNRELATED_TYPES

    rules = (REPO_ROOT / "rubric.md").read_text().split("## How the review judges", 1)[1]
    for name in UNRELATED_TYPES:
        assert f"`{name}`" in rules.split("\n## ", 1)[0], name


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


def _hold_lock(path: Path) -> subprocess.Popen:
    """Another review's big-memory probe: a process holding the lock until it is killed."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time\n"
            "f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True)\n"
            "time.sleep(60)",
            str(path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "held\n"
    return holder


def test_big_memory_probes_take_turns(tmp_path, monkeypatch, capfd):
    """Two reviews on one GPU never run int32-sizes at once: the second waits for the lock (and
    says so), gives up after its patience, and checks the free memory once it holds it."""
    lock = tmp_path / "big.lock"
    monkeypatch.setattr(review_module, "BIG_MEMORY_LOCK", lock)
    free = {"bytes": 80 * 2**30}
    monkeypatch.setattr(review_module, "free_gpu_bytes", lambda: free["bytes"])
    holder = _hold_lock(lock)
    try:
        with review_module.big_memory_turn(patience=0.5) as cannot:
            assert cannot == "another review held the GPU's memory for over 0 s"
        assert "waits for another review's big-memory probe" in capfd.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    with review_module.big_memory_turn(patience=0.5) as cannot:  # a dead holder frees it
        assert cannot is None
    free["bytes"] = 30 * 2**30  # another program took the memory since the review began
    with review_module.big_memory_turn(patience=0.5) as cannot:
        assert cannot == "needs about 60 GB of free GPU memory; 30 GB free"
    readings = iter([30 * 2**30, 30 * 2**30, 70 * 2**30])  # another review's probes end
    monkeypatch.setattr(review_module, "free_gpu_bytes", lambda: next(readings))
    with review_module.big_memory_turn(patience=5) as cannot:
        assert cannot is None
    assert "waits for 60 GB of GPU memory to be free (30 GB now)" in capfd.readouterr().err


def test_big_memory_patience_counts_per_holder(tmp_path, monkeypatch):
    """A queue of reviews, each holding the lock for less than the patience, is waited out: the
    patience restarts when the lock changes hands (its holder's token changes). With one
    deadline for the whole wait, eight reviews at once on an H200 skipped int32-sizes."""
    lock = tmp_path / "big.lock"
    monkeypatch.setattr(review_module, "BIG_MEMORY_LOCK", lock)
    monkeypatch.setattr(review_module, "free_gpu_bytes", lambda: 80 * 2**30)
    holder = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    os.pwrite(holder, b"review 1", 0)  # what each holder writes: a token of its own
    outcome = {}

    def wait_for_turn():
        with review_module.big_memory_turn(patience=1.0) as cannot:
            outcome["cannot"] = cannot

    waiter = threading.Thread(target=wait_for_turn)
    waiter.start()
    try:
        time.sleep(0.7)
        os.pwrite(holder, b"review 2", 0)  # the lock passes to the next review in line
        time.sleep(0.7)  # 1.4 s in all, each holder 0.7 s
    finally:
        fcntl.flock(holder, fcntl.LOCK_UN)
        os.close(holder)
    waiter.join(timeout=10)
    assert outcome == {"cannot": None}


def test_big_memory_queue_has_an_end(tmp_path, monkeypatch):
    """A lock whose token keeps changing (a long queue, or anyone writing the file) is waited
    for QUEUE_PATIENCE holders' patience in all, then the probe is skipped, never hung."""
    lock = tmp_path / "big.lock"
    monkeypatch.setattr(review_module, "BIG_MEMORY_LOCK", lock)
    holder = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    stop = threading.Event()

    def rotate_tokens():
        for n in range(1000):
            if stop.wait(0.2):
                return
            os.pwrite(holder, f"review {n:03d}".encode(), 0)

    rotator = threading.Thread(target=rotate_tokens)
    rotator.start()
    try:
        started = time.monotonic()
        with review_module.big_memory_turn(patience=0.5) as cannot:
            waited = time.monotonic() - started
    finally:
        stop.set()
        rotator.join()
        os.close(holder)
    assert cannot == "other reviews held the GPU's memory for over 2 s in all"
    assert 2.0 <= waited < 5.0, waited


def test_only_a_gpu_too_small_skips_big_memory_before_the_turn():
    """Free memory at the review's start is not the verdict: other reviews' probes hold it for a
    moment. Only a GPU with too little memory in all skips int32-sizes before its turn."""
    flaw = next(flaw for flaw in CATALOG if Need.BIG_MEMORY in flaw.needs)
    busy_h100 = review_module.Machine("H100", "cuda", 1, 20 * 2**30, 79 * 2**30)
    assert busy_h100.skip_reason(flaw) is None
    small = review_module.Machine("L4", "cuda", 1, 22 * 2**30, 22 * 2**30)
    assert small.skip_reason(flaw) == "needs about 60 GB of GPU memory; this GPU has 22 GB"


GUARD_CHECK = """
import ctypes, importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("runner", sys.argv[1])
runner = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runner)
device = torch.device(sys.argv[2])
host = torch.randn(1000)
placed = runner.InputGuards().place(host, device)
assert torch.equal(placed.cpu(), host)
print("inside", placed.sum().item(), flush=True)
nbytes = host.numel() * 4 + 16384  # 16 KiB past its end, as a kernel would read it
if device.type == "cpu":
    print("past", len(ctypes.string_at(placed.data_ptr(), nbytes)), flush=True)
else:
    past = torch.as_tensor(runner._CudaArray(placed.data_ptr(), nbytes), device=device)
    print("past", past.sum().item(), flush=True)
"""


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
def test_a_read_past_a_guarded_input_faults(device):
    """runner.InputGuards: an input of a probe's case ends where its mapping ends, so a kernel
    that reads past it faults, where an allocator would hand it a neighbour's bytes."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            GUARD_CHECK,
            str(REPO_ROOT / "kata" / "harness" / "runner.py"),
            device,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "inside" in done.stdout and "past" not in done.stdout, done.stdout + done.stderr
    if device == "cpu":
        assert done.returncode == -signal.SIGSEGV, done.stderr
    else:
        assert "illegal memory access" in done.stderr or "illegal address" in done.stderr, (
            done.stderr
        )
