"""The harness itself: isolation, the review's output and command line, the vendor library's
build, the guarded inputs. The catalog and rubric: test_catalog.py; the toolchain's checks:
test_toolchain_checks.py; the big-memory lock: test_big_memory.py."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from kata import FLAWED_DIR, REPO_ROOT
from kata.harness.probes import PROBES
from kata.harness.remote import MAX_ANSWER_BYTES, Remote, RunnerStopped
from kata.harness.review import resolve_implementation, run_review
from kata.toolchain import builders
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
    # On a GPU machine the lane that hangs first restarts its runner after CPU-tensor faults;
    # under load (pytest -n 7 on an H200) that took longer than 8 s, and the timeout then fell in
    # a restarted runner's checked call, before 'meta inputs' began.
    timeout = 30 if torch.cuda.is_available() else 8
    review = run_review(candidate(hangs_on_meta), only=["device"], timeout=timeout)
    [(status, evidence)] = statuses(review).values()
    assert status == "present", evidence
    assert evidence.endswith(f"timed out after {timeout} s during case 'meta inputs'"), evidence


def test_a_timeout_names_the_case_open_longest_and_a_death_the_last():
    """The messages of a GPU machine's device probe that ran out of time under load: lane 2
    hung in 'meta inputs' while lane 1, slow, started a fresh runner after its fault and
    reported that runner's checked call. The hang is lane 2's; a death is the last case's.
    Lane 0 (the probe's own) waits while lanes judge, and counts again once they are done."""
    from kata.harness.isolation import _open_case

    checked = "a checked (2, 64, 64) float32 call before the probe's own"
    messages = [
        {"case": "before the lanes", "lane": 0},
        {"case": "cpu inputs on a CUDA machine", "lane": 1},
        {"case": "cpu query, cuda others", "lane": 2},
        {"case": "cpu key, cuda others", "lane": 3},
        {"lane_done": 3},
        {"case": "meta inputs", "lane": 2},
        {"failure": "cpu inputs on a CUDA machine: CUDA failed after the call returned"},
        {"case": checked, "lane": 1},
    ]
    assert _open_case(messages, longest=True) == "meta inputs"
    assert _open_case(messages) == checked
    done = [*messages, {"lane_done": 1}, {"lane_done": 2}, {"case": "a valid call", "lane": 0}]
    assert _open_case(done, longest=True) == _open_case(done) == "a valid call"
    assert _open_case(messages[:1], longest=True) == "before the lanes"
    assert _open_case([], longest=True) is None


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


def test_hint_command_names_unknown_ids():
    completed = run_kata("hint", "no-such-flaw")
    assert completed.returncode != 0
    assert "unknown flaw id" in completed.stderr


# ------------------------------------------------------------------------- vendor library


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
