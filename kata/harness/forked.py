"""The client's side of zygote.py: a child forked from a running zygote, with the part of
subprocess.Popen's interface the harness uses. Imports nothing of the harness (remote.py, in
every judge, uses it; the zygote imports the judge)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading


def spawn(name: str, argv: list[str], cwd: str, env: dict, **extra) -> Forked:
    """A child of the zygote listening on `name`, with Popen's pipes (stdin, stdout, stderr)."""
    return Forked(name, {"argv": argv, "cwd": cwd, "env": env, **extra})


class Forked:
    """A zygote's child, with the part of subprocess.Popen's interface the harness uses: pid,
    returncode, stdin/stdout/stderr pipes, poll, wait, kill, communicate."""

    def __init__(self, name: str, request: dict):
        ends = [os.pipe() for _ in range(3)]  # (read, write) each
        theirs = [ends[0][0], ends[1][1], ends[2][1]]
        self.connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.connection.connect("\0" + name)
            socket.send_fds(self.connection, [json.dumps(request).encode()], theirs)
            reply = json.loads(self.connection.recv(4096) or b"{}")
        except (OSError, ValueError) as error:
            for fd in [*theirs, ends[0][1], ends[1][0], ends[2][0]]:
                os.close(fd)
            self.connection.close()
            raise OSError(f"the zygote did not fork: {error}") from None
        finally:
            for fd in theirs:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if "pid" not in reply:
            raise OSError("the zygote did not fork")
        self.pid = reply["pid"]
        self.returncode: int | None = None
        self.stdin = open(ends[0][1], "wb")  # noqa: SIM115 (closed by the caller, as Popen's)
        self.stdout = open(ends[1][0], "rb")  # noqa: SIM115
        self.stderr = open(ends[2][0], "rb")  # noqa: SIM115
        self._output: dict[str, bytearray] = {}
        self._readers: list[threading.Thread] = []

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        self.connection.settimeout(timeout)
        try:
            message = self.connection.recv(4096)
        except (TimeoutError, BlockingIOError):
            return None
        except OSError:
            message = b""
        status = json.loads(message)["status"] if message else None
        if status is None:  # the zygote died: its children with it
            self.returncode = -signal.SIGKILL
        elif os.WIFSIGNALED(status):
            self.returncode = -os.WTERMSIG(status)
        else:
            self.returncode = os.WEXITSTATUS(status)
        self.connection.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._status(0)

    def wait(self, timeout: float | None = None) -> int:
        if self._status(timeout) is None:
            raise subprocess.TimeoutExpired("zygote child", timeout)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[bytes, bytes]:
        """Popen.communicate for stdin closed and stdout, stderr piped; callable again after a
        TimeoutExpired, as Popen's is."""
        if not self._readers:
            with contextlib.suppress(OSError):
                self.stdin.close()
            for stream in ("stdout", "stderr"):
                self._output[stream] = bytearray()
                reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
                reader.start()
                self._readers.append(reader)
        for reader in self._readers:
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired("zygote child", timeout)
        self.wait(timeout)
        return bytes(self._output["stdout"]), bytes(self._output["stderr"])

    def _read(self, stream: str) -> None:
        source = getattr(self, stream)
        for chunk in iter(lambda: source.read1(65536), b""):
            self._output[stream] += chunk
        source.close()
