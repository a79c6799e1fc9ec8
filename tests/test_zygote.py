"""The zygotes (kata/harness/zygote.py, forked.py): every probe still gets processes of its
own, confined as a fresh one would be, with nothing of the harness in reach, and none outlives
what it serves."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time

import pytest

from kata import REPO_ROOT
from kata.harness import forked, sandbox, zygote
from tests.process_support import alive

ENV = dict(os.environ, PYTHONPATH=str(REPO_ROOT))


@pytest.fixture(scope="module")
def runners():
    started = zygote.Zygote("runner", ENV)
    assert started.usable(), started.failed
    yield started
    started.close()


def run_script(runners, tmp_path, source: str, binds=None, timeout=60) -> tuple[int, str, str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    child = forked.spawn(
        runners.name, [str(script)], cwd=str(tmp_path), env=dict(os.environ), binds=binds, path=[]
    )
    stdout, stderr = child.communicate(timeout=timeout)
    return child.returncode, stdout.decode(), stderr.decode()


def test_each_child_starts_from_the_zygote_not_from_its_siblings(runners, tmp_path):
    """A module-level counter (what a wrapper counting its calls would keep) starts afresh in
    every child: state never crosses from one probe's process to another's."""
    source = """
        import torch
        torch.calls = getattr(torch, "calls", 0) + 1
        print(torch.calls, "cuda initialised" if torch.cuda.is_initialized() else "no cuda yet")
    """
    for _ in range(3):
        returncode, stdout, stderr = run_script(runners, tmp_path, source)
        assert returncode == 0, stderr
        assert stdout.split() == ["1", "no", "cuda", "yet"]


def test_a_runner_child_has_nothing_of_the_harness(runners, tmp_path):
    source = f"""
        import sys
        assert not [name for name in sys.modules if name.split(".")[0] == "kata"], sys.modules
        assert {str(REPO_ROOT)!r} not in sys.path, sys.path
        try:
            import kata
        except ImportError:
            print("no harness")
    """
    returncode, stdout, stderr = run_script(runners, tmp_path, source)
    assert (returncode, stdout.strip()) == (0, "no harness"), stderr


def test_a_runner_child_is_confined_as_a_fresh_one(runners, tmp_path):
    confinement = sandbox.detect()
    if confinement.name != "user namespaces":
        pytest.skip(f"forked children are confined with user namespaces; here: {confinement.name}")
    writable = tmp_path / "judged"
    writable.mkdir()
    outside = REPO_ROOT / "kata-zygote-escape"
    source = f"""
        import os, socket
        open("written", "w").close()
        try:
            open({str(outside)!r}, "w").close()
            print("wrote outside")
        except OSError as error:
            print("blocked:", error.strerror)
        print("pid", os.getpid())
        try:
            socket.create_connection(("127.0.0.1", 22), timeout=2)
        except OSError:
            print("no network")
        caps = [l for l in open("/proc/self/status") if l.startswith("CapEff")]
        print(caps[0].split()[1])
    """
    binds = confinement.binds([writable])
    script = writable / "script.py"
    script.write_text(textwrap.dedent(source))
    child = forked.spawn(
        runners.name, [str(script)], cwd=str(writable), env=dict(os.environ), binds=binds, path=[]
    )
    stdout, stderr = child.communicate(timeout=60)
    lines = stdout.decode().splitlines()
    assert child.returncode == 0, stderr.decode()
    assert (writable / "written").exists() and not outside.exists()
    assert lines[0].startswith("blocked:"), lines
    assert lines[1] == "pid 2", lines  # a PID namespace of its own, as the launcher gives
    assert lines[2] == "no network", lines
    assert lines[3] == "0000000000000000", lines


def test_a_child_whose_client_goes_away_is_killed(runners, tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(300)\n")
    child = forked.spawn(
        runners.name, [str(script)], cwd=str(tmp_path), env=ENV, binds=None, path=[]
    )
    assert child.stdout.readline() == b"up\n"
    child.connection.close()  # as when the judge that asked for it dies
    deadline = time.monotonic() + 10
    while alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child.pid), "the runner outlived its judge"


def test_a_zygote_whose_review_goes_away_takes_its_children(tmp_path):
    started = zygote.Zygote("runner", ENV)
    assert started.usable(), started.failed
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(300)\n")
    child = forked.spawn(
        started.name, [str(script)], cwd=str(tmp_path), env=ENV, binds=None, path=[]
    )
    assert child.stdout.readline() == b"up\n"
    started.process.stdin.close()  # what the review's death does
    assert started.process.wait(timeout=10) == 0
    deadline = time.monotonic() + 10
    while alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child.pid), "a probe outlived its review's zygote"


def test_exit_codes_and_signals_come_back_as_popen_reports_them(runners, tmp_path):
    assert run_script(runners, tmp_path, "raise SystemExit(7)")[0] == 7
    assert run_script(runners, tmp_path, "import os\nos.abort()")[0] == -signal.SIGABRT
    returncode, _, stderr = run_script(runners, tmp_path, "raise ValueError('boom')")
    assert returncode == 1 and "ValueError: boom" in stderr


def test_someone_else_cannot_fork_from_it(runners):
    """Only this user's processes are served (abstract sockets have no file permissions)."""
    if os.getuid() != 0:
        pytest.skip("needs root to connect as another user")
    pid = os.fork()
    if pid == 0:
        try:
            os.setuid(65534)
            forked.spawn(runners.name, [sys.executable], cwd="/", env={}, binds=None, path=[])
            os._exit(1)
        except OSError:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0, "a process of another user was served"


def test_an_uncaught_keyboard_interrupt_ends_the_child_as_python_ends(runners, tmp_path):
    """A fresh interpreter dies by SIGINT after an uncaught KeyboardInterrupt; so does a child
    (tests/adversarial/exits_instead_of_raising.py states the evidence it gives)."""
    returncode, _, stderr = run_script(runners, tmp_path, "raise KeyboardInterrupt")
    assert returncode == -signal.SIGINT and "KeyboardInterrupt" in stderr


REVIEW_WITHOUT_TORCH = """
import sys
from kata.harness.review import resolve_implementation, run_review
review = run_review(resolve_implementation("flawed"), only=["shape"])
print(review.machine.probe_device, review.reports[0].result.status)
print("torch imported here" if "torch" in sys.modules else "no torch here")
"""


def test_the_review_process_never_imports_torch():
    """The zygotes import torch, and a child of the judge zygote tells the review what GPUs the
    machine has: on two cores a third import, the review's own, delayed every probe (the first
    one's answer came at 2.6 s instead of 2.1 s)."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    env.pop("KATA_ZYGOTE", None)
    done = subprocess.run(
        [sys.executable, "-c", REVIEW_WITHOUT_TORCH],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    answer, where = done.stdout.splitlines()[-2:]
    assert answer == ("cuda present" if torch_sees_a_gpu() else "cpu present"), done.stdout
    assert where == "no torch here", done.stdout


def torch_sees_a_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


KEPT_ZYGOTES_REVIEW = """
import sys
from kata.harness import isolation
from kata.harness.review import resolve_implementation, run_review
review = run_review(resolve_implementation("flawed"), only=["shape"])
print(review.reports[0].result.status)
print(" ".join(sorted(type(kept).__name__ for kept in isolation._zygotes.values())))
"""


def test_a_review_forks_its_probes_from_the_zygotes_it_is_given():
    """`watch` keeps its zygotes across saves and names them to each check (KATA_ZYGOTES): the
    check's probes fork from those, and it starts none of its own (on two cores that saved
    about a second a save, torch's import)."""
    import subprocess

    from kata.harness import isolation

    kept = [zygote.Zygote(kind, ENV) for kind in ("judge", "runner")]
    try:
        assert all(started.usable() for started in kept)
        env = dict(ENV, **{isolation.LASTING: ",".join(f"{z.kind}={z.name}" for z in kept)})
        env.pop("KATA_ZYGOTE", None)
        done = subprocess.run(
            [sys.executable, "-c", KEPT_ZYGOTES_REVIEW],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-2:] == ["present", "Adopted Adopted"], done.stdout
        assert all(started.usable() for started in kept)  # the review did not end them
    finally:
        for started in kept:
            started.close()


def test_a_kept_zygote_that_is_gone_is_replaced_by_a_review_of_its_own(monkeypatch):
    from kata.harness import isolation

    gone = zygote.Zygote("judge", ENV)
    assert gone.usable()
    gone.close()
    gone.process.wait(timeout=30)
    monkeypatch.setattr(isolation, "_zygotes", {})
    monkeypatch.setenv(isolation.LASTING, f"judge={gone.name}")
    try:
        own = isolation._zygote("judge")
        assert isinstance(own, zygote.Zygote) and own.name != gone.name
    finally:
        isolation.close_zygotes()
