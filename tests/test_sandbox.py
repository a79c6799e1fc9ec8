"""The sandbox (kata/harness/sandbox.py): real confined processes, one set of checks per strategy
this machine has (each skips, saying why, where its strategy does not work here)."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from kata.harness import endings, sandbox

WRITE_REFUSED = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT}  # ENOENT: under a new tmpfs


@pytest.fixture(params=[sandbox.BUBBLEWRAP, sandbox.NAMESPACES], ids=["bwrap", "unshare"])
def box(request) -> sandbox.Sandbox:
    if (reason := sandbox.trial(request.param)) is not None:
        pytest.skip(f"{request.param.name} does not work on this machine: {reason}")
    return request.param


def run(box, code: str, writable: list[Path], cwd: Path, *args: str, timeout: float = 120):
    """Run `code` in a confined Python; its returncode as subprocess would report it bare."""
    argv = box.wrap([sys.executable, "-c", textwrap.dedent(code), *args], writable=writable)
    completed = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    completed.returncode = box.returncode(completed.returncode)
    return completed


@pytest.fixture
def in_home():
    """A directory in the home directory, standing in for the interviewer's files."""
    directory = Path(tempfile.mkdtemp(prefix="kata-sandbox-test-", dir=Path.home()))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def test_writes_only_to_the_writable_directories(box, tmp_path, in_home):
    writable, outside = tmp_path / "writable", tmp_path / "outside"
    writable.mkdir()
    outside.mkdir()
    home_file = Path.home() / f"kata-sandbox-test-{os.getpid()}"
    targets = [writable / "ok", Path("relative"), outside / "no", in_home / "no", home_file]
    code = """
        import json, sys
        said = {}
        for path in sys.argv[1:]:
            try:
                with open(path, "w") as file:
                    file.write("written")
                said[path] = "written"
            except OSError as error:
                said[path] = error.errno
        print(json.dumps(said))
    """
    try:
        completed = run(box, code, [writable], writable, *map(str, targets))
        assert completed.returncode == 0, completed.stderr
        said = json.loads(completed.stdout)
        assert said[str(targets[0])] == said["relative"] == "written"
        assert (writable / "ok").read_text() == (writable / "relative").read_text() == "written"
        for path in targets[2:]:
            assert said[str(path)] in WRITE_REFUSED, f"{path}: {said[str(path)]}"
            assert not path.exists(), f"the confined process wrote {path}"
    finally:
        home_file.unlink(missing_ok=True)


def test_no_network(box, tmp_path):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    code = """
        import socket, sys
        for address in [("127.0.0.1", int(sys.argv[1])), ("example.com", 80)]:
            try:
                socket.create_connection(address, timeout=5).close()
                print("connected to", address)
            except OSError as error:
                print("refused:", address, error)
    """
    with server:
        completed = run(box, code, [tmp_path], tmp_path, str(server.getsockname()[1]))
        with pytest.raises(TimeoutError):
            server.accept()
    assert completed.returncode == 0, completed.stderr
    assert "connected" not in completed.stdout
    assert completed.stdout.count("refused:") == 2, completed.stdout


def test_exit_codes_and_signals_come_through(box, tmp_path):
    assert run(box, "pass", [tmp_path], tmp_path).returncode == 0
    assert run(box, "raise SystemExit(3)", [tmp_path], tmp_path).returncode == 3
    crashed = run(box, "import ctypes; ctypes.string_at(0)", [tmp_path], tmp_path)
    assert crashed.returncode == -signal.SIGSEGV, crashed.stderr
    aborted = run(box, "import os; os.abort()", [tmp_path], tmp_path)
    assert aborted.returncode == -signal.SIGABRT, aborted.stderr


def test_killing_the_process_group_kills_everything_inside(box, tmp_path):
    token = f"kata-sandbox-survivor-{os.getpid()}-{time.monotonic_ns()}"
    code = """
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", sys.argv[1]])
        print("started", flush=True)
        time.sleep(120)
    """
    argv = box.wrap([sys.executable, "-c", textwrap.dedent(code), token], writable=[tmp_path])
    process = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert process.stdout.readline() == b"started\n"
        assert _processes_with(token), "the grandchild should be running before the kill"
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        process.stdout.close()
    deadline = time.monotonic() + 10
    while _processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _processes_with(token), "a process of the killed group survived"


def test_no_signal_reaches_a_process_outside(box, tmp_path):
    """A candidate that kills the judge, the review or every process of the user (kill -1)
    reaches none of them: it runs in a PID namespace of its own, where their pids do not exist.
    (Not tried here with kill -1: outside a namespace that would end the test session.)"""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    code = """
        import os, signal, sys
        print("own pid namespace:", os.readlink("/proc/self/ns/pid") != sys.argv[2])
        try:
            os.kill(int(sys.argv[1]), signal.SIGTERM)
            print("signalled")
        except ProcessLookupError:
            print("no such process")
    """
    try:
        host_namespace = os.readlink("/proc/self/ns/pid")
        completed = run(box, code, [tmp_path], tmp_path, str(victim.pid), host_namespace)
        assert completed.returncode == 0, completed.stderr
        assert completed.stdout.split("\n")[:2] == ["own pid namespace: True", "no such process"]
        assert victim.poll() is None, "the process outside was killed"
    finally:
        victim.kill()
        victim.wait()


def test_no_process_outlives_the_box(box, tmp_path):
    """A daemon the code leaves behind (a session of its own, so out of its process group) ends
    with the box: nothing a candidate starts keeps running on the interviewer's machine."""
    token = f"kata-sandbox-daemon-{os.getpid()}-{time.monotonic_ns()}"
    code = """
        import subprocess, sys
        subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)", sys.argv[1]],
            start_new_session=True,
        )
    """
    completed = run(box, code, [tmp_path], tmp_path, token)
    assert completed.returncode == 0, completed.stderr
    deadline = time.monotonic() + 10
    while _processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = _processes_with(token)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, "a process started inside outlived the box"


def _processes_with(token: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and token.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass  # ended meanwhile
    return found


def test_no_capabilities_disks_or_host_sockets_inside(box, tmp_path):
    code = """
        import ctypes, errno, os, stat
        status = open("/proc/self/status").read()
        assert "CapEff:\\t0000000000000000" in status, status
        with open("/dev/null", "w") as null:  # device nodes still open for writing
            null.write("x")
        assert os.urandom(4)
        devices = [n for n in os.listdir("/dev") if stat.S_ISBLK(os.lstat("/dev/" + n).st_mode)]
        assert not devices, f"block devices visible: {devices}"
        assert os.listdir("/run") == [], "the host's service sockets are visible"
        try:  # opened, never written: a kernel setting must be out of reach
            os.close(os.open("/proc/sys/kernel/hostname", os.O_WRONLY))
            raise AssertionError("/proc/sys is writable")
        except OSError as error:
            assert error.errno == errno.EROFS, error
        with open("/proc/self/comm", "w") as comm:  # its own entries stay writable (CUDA)
            comm.write("confined")
        libc = ctypes.CDLL(None, use_errno=True)
        # MS_REMOUNT | MS_BIND: making / writable again must be refused
        assert libc.mount(None, b"/", None, ctypes.c_ulong(32 | 4096), None) != 0
        assert libc.umount2(b"/tmp", 0) != 0, "the private /tmp could be unmounted"
        print("ok")
    """
    completed = run(box, code, [tmp_path], tmp_path)
    assert completed.returncode == 0 and completed.stdout == "ok\n", completed.stderr


def test_torch_and_torch_compile_work_inside(box, tmp_path):
    code = """
        import torch
        assert torch.ones(2).sum().item() == 2.0
        compiled = torch.compile(lambda x: (2 * x).sin().sum(), backend="aot_eager", fullgraph=True)
        x = torch.randn(8)
        torch.testing.assert_close(compiled(x), (2 * x).sin().sum())
        print("ok")
    """
    completed = run(box, code, [tmp_path], tmp_path, timeout=300)
    assert completed.returncode == 0 and completed.stdout.endswith("ok\n"), completed.stderr


def test_a_checkout_under_tmp_stays_readable(box, tmp_path):
    """The private /tmp hides the host's: a checkout (or Python) there is bound back, read-only."""
    under_tmp = Path(tempfile.mkdtemp(prefix="kata-sandbox-test-", dir="/tmp"))  # not TMPDIR
    try:
        _checkout_under_tmp(box, under_tmp)
    finally:
        shutil.rmtree(under_tmp, ignore_errors=True)


def _checkout_under_tmp(box, tmp_path: Path) -> None:
    checkout, work = tmp_path / "checkout", tmp_path / "work"
    (checkout / "kata" / "harness").mkdir(parents=True)
    work.mkdir()
    (checkout / "kata" / "__init__.py").write_text("")
    (checkout / "kata" / "harness" / "__init__.py").write_text("")
    shutil.copy(sandbox.LAUNCHER, checkout / "kata" / "harness" / "sandbox.py")
    inner = "import kata.harness.sandbox as s; open(s.__file__, 'a')"
    outer = f"""
        import subprocess, sys
        from kata.harness import sandbox
        argv = sandbox.{"BUBBLEWRAP" if box is sandbox.BUBBLEWRAP else "NAMESPACES"}.wrap(
            [sys.executable, "-c", {inner!r}], writable=[{str(work)!r}])
        sys.exit(subprocess.run(argv).returncode)
    """
    env = dict(os.environ, PYTHONPATH=str(checkout))
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(outer)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "OSError: [Errno 30] Read-only file system" in completed.stderr, completed.stderr


def test_round_two_build_runs_confined(tmp_path):
    box = sandbox.detect()
    if box.name == "none":
        pytest.skip(f"no sandbox on this machine: {box.note}")
    from kata.harness import round2

    # In this checkout, bound read-only inside wherever it lies (a file in HOME would be hidden
    # when HOME is under /tmp: "No such file or directory", not a refused write).
    home_file = Path(sandbox.LAUNCHER).parent / f"kata-sandbox-test-{os.getpid()}"
    wrapper = tmp_path / "attention_wrapper.py"
    wrapper.write_text(
        "import os\n"
        "open('built', 'w').close()  # its own directory: allowed\n"
        "assert os.environ['TORCH_EXTENSIONS_DIR'].startswith(os.getcwd())\n"
        f"open({str(home_file)!r}, 'w')\n"
    )
    try:
        failure = round2.prepare(tmp_path, timeout=60)
        assert failure is not None and "Read-only file system" in failure, failure
        assert (tmp_path / "built").exists() and not home_file.exists()
        wrapper.write_text("import ctypes\nctypes.string_at(0)\n")
        assert round2.prepare(tmp_path, timeout=60).endswith("process died with SIGSEGV")
    finally:
        home_file.unlink(missing_ok=True)


def test_detect_picks_a_working_strategy():
    detected = sandbox.detect()
    if detected.name == "none":
        pytest.skip(f"no sandbox on this machine: {detected.note}")
    assert sandbox.trial(detected) is None
    assert "\n" not in detected.note and detected.name in detected.note


def test_kata_sandbox_names_a_strategy(monkeypatch):
    monkeypatch.setenv("KATA_SANDBOX", "unshare")
    sandbox.detect.cache_clear()
    try:
        forced = sandbox.detect()
    finally:
        sandbox.detect.cache_clear()
    reason = sandbox.trial(sandbox.NAMESPACES)
    assert forced == (sandbox.NAMESPACES if reason is None else forced)
    assert reason is None or (forced.name == "none" and reason in forced.note)


def test_kata_sandbox_off_gives_none(monkeypatch):
    monkeypatch.setenv("KATA_SANDBOX", "off")
    sandbox.detect.cache_clear()
    try:
        off = sandbox.detect()
    finally:
        sandbox.detect.cache_clear()
    assert off.name == "none" and "KATA_SANDBOX=off" in off.note
    assert off.wrap(["python", "-c", "pass"], writable=[Path("/x")]) == ["python", "-c", "pass"]
    assert off.returncode(139) == 139


# The caps (sandbox.caps, TMP_CAP): each shown biting, and named by endings.death, which words a
# runner's end. Each bounds its own work, so that without a cap it fails instead of filling up.


def test_memory_cap_bites(box, tmp_path):
    cap = sandbox.memory_cap()
    code = """
        import ctypes, resource, sys
        cap = int(sys.argv[1])
        assert resource.getrlimit(resource.RLIMIT_DATA)[0] == cap, resource.getrlimit(2)
        bytearray(256 << 20)  # touched: legitimate work still fits
        malloc = ctypes.CDLL(None).malloc
        malloc.restype = ctypes.c_void_p
        assert malloc(ctypes.c_size_t(cap)) is None, "allocated past the cap"  # untouched
        bytearray(cap)  # MemoryError, before a page is touched
    """
    completed = run(box, code, [tmp_path], tmp_path, str(cap))
    assert completed.returncode == 1 and "MemoryError" in completed.stderr, completed.stderr
    said = endings.death(completed.returncode, completed.stderr.encode())
    assert f"memory cap ({cap / 2**30:.0f} GiB a process) was reached" in said, said


def test_tmp_cap_bites(box, tmp_path):
    code = """
        import errno, os, sys
        cap = int(sys.argv[1])
        for directory in ("/dev/shm", "/tmp"):
            info = os.statvfs(directory)
            assert info.f_blocks * info.f_frsize == cap, (directory, info)
            written = 0
            with open(f"{directory}/filler", "wb") as file:
                while written <= cap:  # bounded: without the cap this ends the test, no more
                    try:
                        written += file.write(bytes(1 << 20))
                        file.flush()
                    except OSError as error:
                        assert error.errno == errno.ENOSPC, error
                        break
            assert written <= cap, f"{directory}: wrote {written} bytes"
            if directory == "/tmp":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os.unlink(f"{directory}/filler")
    """
    completed = run(box, code, [tmp_path], tmp_path, str(sandbox.TMP_CAP))
    assert completed.returncode == 1 and "[Errno 28]" in completed.stderr, completed.stderr
    said = endings.death(completed.returncode, completed.stderr.encode())
    assert "the private /tmp's 1 GiB (or the disk's space) was reached" in said, said


def test_file_size_cap_bites(box, tmp_path):
    code = """
        import errno, resource, subprocess, sys
        cap = int(sys.argv[1])
        assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] == cap
        with open("sparse", "wb", buffering=0) as file:  # sparse: no disk space taken
            file.seek(cap - 1)
            file.write(b"x")  # up to the cap: allowed
            try:
                file.write(b"y")
                raise AssertionError("wrote past the cap")
            except OSError as error:  # Python ignores SIGXFSZ: EFBIG
                assert error.errno == errno.EFBIG, error
        # A program that does not ignore it dies of SIGXFSZ
        dd = ["dd", "if=/dev/zero", "of=sparse", "bs=1", "count=2", f"seek={cap - 1}"]
        sys.exit(-subprocess.run(dd, stderr=subprocess.DEVNULL).returncode)
    """
    completed = run(box, code, [tmp_path], tmp_path, str(sandbox.FILE_CAP))
    assert completed.returncode == signal.SIGXFSZ, completed.stderr
    said = endings.death(-signal.SIGXFSZ, b"")
    assert said == "process died with SIGXFSZ; the sandbox's file-size cap (2 GiB) was reached"


def test_process_cap_bites(box, tmp_path):
    if os.getuid() == 0:
        pytest.skip("RLIMIT_NPROC never binds root (the sandbox's note says so)")
    code = """
        import os, resource, signal, sys, time
        cap = resource.getrlimit(resource.RLIMIT_NPROC)[0]
        assert cap != resource.RLIM_INFINITY
        children = []
        try:
            while len(children) < int(sys.argv[1]):  # bounded without the cap too
                pid = os.fork()
                if pid == 0:
                    time.sleep(60)
                    os._exit(0)
                children.append(pid)
        finally:
            for pid in children:
                os.kill(pid, signal.SIGKILL)
        """
    bound = str(sandbox.caps()[resource.RLIMIT_NPROC] + 64)
    completed = run(box, code, [tmp_path], tmp_path, bound)
    assert completed.returncode == 1 and "BlockingIOError" in completed.stderr, completed.stderr
    said = endings.death(completed.returncode, completed.stderr.encode())
    assert "the sandbox's process cap was reached" in said, said


def test_death_names_no_cap_for_other_errors():
    said = endings.death(
        1, b"Traceback\nBlockingIOError: [Errno 11] Resource temporarily unavailable"
    )
    assert said.endswith("Resource temporarily unavailable"), said  # a socket's, not a fork's
    assert endings.death(-signal.SIGSEGV, b"") == "process died with SIGSEGV"


def test_note_names_the_caps():
    note = sandbox.NAMESPACES.note
    assert f"memory {sandbox.memory_cap() / 2**30:.0f} GiB a process" in note, note
    assert "/tmp and /dev/shm 1 GiB" in note and "files 2 GiB" in note, note
    assert ("processes not capped" if os.getuid() == 0 else "more processes") in note, note
