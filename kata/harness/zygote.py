"""Zygotes: processes that start Python and import torch once, then fork one child per probe, so
that no probe pays for them again (most of a probe's time went to two fresh interpreters, the
judge's and the runner's, each importing torch). Every probe still gets processes of its own.

Two kinds, each started once per review process (isolation.py) and ended with it:
- "judge": holds torch and the harness's judging modules; a child runs child.main(spec).
- "runner": holds torch alone; a child confines itself in the sandbox first (sandbox.confine:
  the same namespaces, mounts and dropped rights as the launcher gives a fresh process), drops
  every harness module and path, then runs runner.py as a script. Nothing of the candidate's
  runs before the confinement, and nothing of it reaches the zygote or another probe.
Neither zygote initialises CUDA (a process forked after that cannot use it): the children do.

Protocol: the zygote listens on an abstract Unix socket of a random name (per network namespace:
a sandboxed child cannot reach it) and serves only its own user (SO_PEERCRED). A request is one
JSON message with three descriptors (the child's stdin, stdout, stderr); the zygote forks and
answers {"pid": N}, then {"status": wait status} when the child ends (forked.py is the client's
side). A client that goes away takes its child with it (SIGKILL to the child's process group),
and the zygote, when the review that started it goes (its stdin closes), takes all of its
children.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

PR_SET_NAME, PR_SET_PDEATHSIG = 15, 1
MAX_REQUEST_BYTES = 1 << 20


# ---------------------------------------------------------------------------------------------
# the zygote


def serve(kind: str, name: str) -> None:
    """The zygote's main: preload, say "ready" on stdout, then fork children until stdin closes."""
    import torch  # noqa: F401 (the point: children find it imported)

    if kind == "judge":
        from kata.harness import child, judging, kernel_check, probes, reference  # noqa: F401
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + name)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(0, selectors.EVENT_READ, "parent")
    clients: dict[int, socket.socket | None] = {}  # child pid -> the connection that asked for it
    os.write(1, b"ready\n")
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.data == "parent":
                if not os.read(0, 4096):  # the review is gone: so are its probes
                    for pid in clients:
                        _kill_group(pid)
                    os._exit(0)
            elif key.data == "accept":
                connection, _ = listener.accept()
                pid = _fork_child(kind, connection, listener, selector)
                if pid is None:
                    connection.close()
                    continue
                clients[pid] = connection
                selector.register(connection, selectors.EVENT_READ, pid)
            else:  # the client closed its connection (or sent more): its child goes
                _kill_group(key.data)
                selector.unregister(key.fileobj)
                key.fileobj.close()
                clients[key.data] = None
        while clients:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = clients.pop(pid, None)
            if connection is not None:  # None: its client is gone
                selector.unregister(connection)
                with contextlib.suppress(OSError):
                    connection.send(json.dumps({"status": status}).encode())
                connection.close()


def _fork_child(kind: str, connection, listener, selector) -> int | None:
    uid = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
    if uid != os.getuid():
        return None
    try:
        message, fds, _, _ = socket.recv_fds(connection, MAX_REQUEST_BYTES, 3)
        request = json.loads(message)
    except (OSError, ValueError):
        return None
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return None
    pid = os.fork()
    if pid == 0:
        selector.close()
        _child(kind, request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    try:
        connection.send(json.dumps({"pid": pid}).encode())
    except OSError:
        _kill_group(pid)
    return pid


def _child(kind: str, request: dict, fds: list[int]) -> None:
    """The forked child: its own session, the client's descriptors as 0-2 and no other, the
    request's working directory and environment; then the judge or the (confined) runner."""
    status = 1
    try:
        os.setsid()  # its own process group: a time limit kills all it started
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)  # dies with the zygote
        libc.prctl(PR_SET_NAME, f"kata-{kind}".encode(), 0, 0, 0)
        for number, fd in enumerate(fds):
            os.dup2(fd, number)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the listener, other clients' connections
        # What a fresh interpreter would have: Python's own SIGINT handler, the rest default, a
        # random module of its own (a fork shares the zygote's state), no cached temp directory
        # (TMPDIR is the probe's).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for number in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(number, signal.SIG_DFL)
        import random
        import tempfile

        random.seed()
        tempfile.tempdir = None
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        if kind == "judge":
            import faulthandler

            faulthandler.enable()  # as PYTHONFAULTHANDLER=1 does for a fresh judge
            from kata.harness import child

            child.main(request["argv"][1])
        else:
            _run_runner(request)
        status = 0
    except SystemExit as end:
        status = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
    except KeyboardInterrupt:
        status = -signal.SIGINT  # as Python ends on one: killed by SIGINT, after the traceback
        import traceback

        traceback.print_exc()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        if status < 0:
            signal.signal(-status, signal.SIG_DFL)
            os.kill(os.getpid(), -status)
        os._exit(status if status >= 0 else 1)


def _run_runner(request: dict) -> None:
    import runpy

    if request["binds"] is not None:
        from kata.harness import sandbox

        sandbox.confine([tuple(bind) for bind in request["binds"]])
        os.chdir(request["cwd"])  # the bind mount now at that path (confine did it too)
    # As a fresh `python -P kata_runner.py` would have it: no harness module, no harness path.
    repository = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for module in [name for name in sys.modules if name == "kata" or name.startswith("kata.")]:
        del sys.modules[module]
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry) != repository]
    sys.path[0:0] = request["path"]
    runpy.run_path(request["argv"][0], run_name="__main__")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# the review's side


class Zygote:
    """A started zygote of one kind: `spawn` forks a child of it."""

    def __init__(self, kind: str, env: dict):
        self.kind, self.name = kind, f"kata-{kind}-{os.getpid()}-{secrets.token_hex(16)}"
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-m", "kata.harness.zygote", kind, self.name],
            env=env,
            stdin=subprocess.PIPE,  # closes when this process ends, however it ends
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # torch's import-time warnings; a failed start shows
            # as one, and the probes then start fresh interpreters
            start_new_session=True,  # the terminal's Ctrl-C reaches the review, which ends us
        )
        self.ready = threading.Event()
        self.failed: str | None = None
        threading.Thread(target=self._wait_ready, daemon=True).start()

    def _wait_ready(self) -> None:
        line = self.process.stdout.readline()
        if line != b"ready\n":
            self.failed = f"the {self.kind} zygote did not start (exit code {self.process.wait()})"
        self.ready.set()

    def usable(self, timeout: float = 60) -> bool:
        return self.ready.wait(timeout) and self.failed is None and self.process.poll() is None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)


class Adopted:
    """A zygote that another process started and keeps (watch across its checks, a keeper
    across runs: keeper.py): used like a Zygote of this review's own, but never ended from here."""

    def __init__(self, kind: str, name: str, keeper: int | None = None):
        self.kind, self.name, self.keeper = kind, name, keeper

    def usable(self, timeout: float = 60) -> bool:
        """Whether it listens, as this user (it ends with the process that keeps it). A kept
        zygote may still be importing torch: that is waited for while its keeper lives."""
        deadline = time.monotonic() + (timeout if self.keeper else 0)
        while not self._listens():
            if time.monotonic() >= deadline or not _alive(self.keeper):
                return False
            time.sleep(0.02)
        return True

    def _listens(self) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
            try:
                probe.connect("\0" + self.name)
                peer = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            except OSError:
                return False
        return struct.unpack("3i", peer)[1] == os.getuid()  # never another user's socket

    def close(self) -> None:
        """Its keeper ends it: nothing to do here."""


def _alive(pid: int | None) -> bool:
    """Whether the keeper runs: a zombie (the run that started it has not reaped it) does not."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


if __name__ == "__main__":
    serve(*sys.argv[1:3])
