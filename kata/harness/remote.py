"""The judge's side of runner.py: the implementation under test runs in that process, and
every answer it gives comes back here as plain data to be judged.

The judge never imports the implementation, so nothing the implementation does in its own
process (printing, patching modules, walking frames, stealing a key) reaches the verdict. What
it can still do is lie about what it observed; what it returns is checked against the float64
reference and, on supported inputs, against the vendor kernel run here.
"""

from __future__ import annotations

import io
import json
import math
import os
import signal
import struct
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from kata.harness import forked, lifeline
from kata.harness.endings import death

# The most an answer may take: 8 x the largest a probe asks for (the stream probe's output, a
# (32, 4096, 64) float32 tensor, 32 MiB). The runner is the candidate's: a length past this is
# an attack on the judge's memory (it would stream that much into it), not an answer.
MAX_ANSWER_BYTES = 256 * 2**20
MAX_STDERR_BYTES = 1_000_000  # what the judge keeps of the runner's stderr; the rest is drained


class ImplementationImportError(Exception):
    """Importing the implementation under test failed; the probe reports it as the evidence."""

    def __init__(self, cause: str):
        super().__init__(f"importing the implementation failed: {cause}")
        self.cause = cause


class RunnerStopped(Exception):
    """The implementation's process ended or broke down; the message says how."""


class RemoteError(Exception):
    """An exception the implementation raised, by its type's name and its message."""

    def __init__(self, raised: dict):
        super().__init__(raised["message"])
        self.type_name = raised["type"]
        self.mro = tuple(raised.get("mro", (raised["type"],)))


class NotATensor:
    """What the implementation returned, when it was not a tensor: named by its type."""

    def __init__(self, type_name: str):
        self.type_name = type_name


@dataclass
class Answer:
    result: object = None  # a tensor on the device the implementation reported, or NotATensor
    error: RemoteError | None = None
    cuda_failed: str | None = None  # CUDA failed after the call returned
    overwritten: tuple[int, ...] = ()  # the inputs (by position) the call wrote into
    header: dict | None = None  # the runner's whole reply (what an operation observed)


def pack(tensors: dict, name: str, tensor: torch.Tensor) -> dict:
    """A tensor for the runner: its whole storage and its view (sizes, strides, offset), so a
    transposed, sliced or expanded view arrives as one."""
    spec = {"device": str(tensor.device), "dtype": str(tensor.dtype).removeprefix("torch.")}
    spec |= {"size": list(tensor.shape), "stride": list(tensor.stride())}
    spec["offset"] = tensor.storage_offset()
    if tensor.device.type != "meta":
        storage = tensor.untyped_storage()
        count = storage.nbytes() // tensor.element_size()
        base = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        base.set_(storage, 0, (count,), (1,))
        tensors[name] = base.detach().to("cpu").clone()
    return spec


def pack_all(tensors: dict, prefix: str, inputs) -> list[dict]:
    """pack() of each tensor of `inputs`, named prefix0, prefix1, ... (runner.unpack_all)."""
    return [pack(tensors, f"{prefix}{i}", t) for i, t in enumerate(inputs)]


def materialize(spec: dict, tensors: dict, name: str = "result"):
    """The implementation's output, on the device it says it is on."""
    if spec.get("type") != "Tensor":
        return NotATensor(spec.get("type", "nothing"))
    device = spec["device"]
    if device.startswith("meta"):
        return torch.empty(spec["size"], dtype=getattr(torch, spec["dtype"][6:]), device="meta")
    tensor = tensors[name]
    return tensor.to(device) if device != "cpu" else tensor


def _tensors(table: list, data: bytearray) -> dict[str, torch.Tensor]:
    """The tensors of an answer, from the runner's table (name, dtype, sizes) and raw bytes. Views
    of `data`, no copy, nothing unpickled or inflated: an answer takes what it was sent."""
    tensors, offset = {}, 0
    for name, dtype_name, shape in table:
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype) or not all(
            type(size) is int and size >= 0 for size in shape
        ):
            raise ValueError(f"tensor {name!r} is not one: {dtype_name} {shape}")
        count = math.prod(shape)
        if offset + count * dtype.itemsize > len(data):
            raise ValueError(f"tensor {name!r} needs more bytes than were sent")
        flat = torch.frombuffer(data, dtype=dtype, count=count, offset=offset) if count else None
        tensors[str(name)] = torch.empty(shape, dtype=dtype) if flat is None else flat.view(shape)
        offset += count * dtype.itemsize
    if offset != len(data):
        raise ValueError(f"{len(data) - offset} bytes past the tensors the table lists")
    return tensors


class Remote:
    """One runner process for one probe, started on first use."""

    def __init__(self, command, cwd: Path, env: dict, signal_exits=False, fork_request=None):
        self.command, self.cwd, self.env = command, cwd, env
        # From the runner zygote ({"name", "argv", "binds", "path"}: zygote.py), else `command`
        self.fork_request = fork_request
        # bubblewrap reports its child's death by signal N as exit code 128 + N
        self.signal_exits = signal_exits
        self.process: subprocess.Popen | None = None
        self.stderr = bytearray()
        self.mark = 0  # where the current request's stderr begins

    def twin(self) -> Remote:
        """Another runner like this one (not started yet), for cases judged beside its own."""
        return Remote(self.command, self.cwd, self.env, self.signal_exits, self.fork_request)

    def _start(self) -> None:
        if self.fork_request is not None:
            request = dict(self.fork_request)
            name = request.pop("name")
            self.process = forked.spawn(name, cwd=str(self.cwd), env=self.env, **request)
        else:
            self._start_fresh()
        self.drainer = threading.Thread(target=self._drain, daemon=True)
        self.drainer.start()

    def _start_fresh(self) -> None:
        self.process = subprocess.Popen(
            self.command,
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=lifeline.die_with_this_thread(),  # dies with the judge
        )

    def _drain(self) -> None:
        for chunk in iter(lambda: self.process.stderr.read1(65536), b""):
            self.stderr += chunk[: max(0, MAX_STDERR_BYTES - len(self.stderr))]

    def request(self, header: dict, tensors: dict | None = None) -> tuple[dict, dict]:
        if self.process is None:
            self._start()
        self.mark = len(self.stderr)
        blob = io.BytesIO()
        if tensors:
            torch.save(tensors, blob)
        frame = json.dumps(header).encode() + b"\n" + blob.getvalue()
        try:
            self.process.stdin.write(struct.pack("<Q", len(frame)) + frame)
            self.process.stdin.flush()
            size = self.process.stdout.read(8)
            if len(size) < 8:
                raise EOFError
            (length,) = struct.unpack("<Q", size)
            if length > MAX_ANSWER_BYTES:
                self.process.kill()  # the sandbox, and all in it, with it
                raise RunnerStopped(
                    f"the implementation's process announced an answer of {length:,} bytes, over "
                    f"the {MAX_ANSWER_BYTES >> 20} MiB an answer may take: not read"
                )
            answer = self.process.stdout.read(length)
            if len(answer) < length:
                raise EOFError
        except (EOFError, BrokenPipeError):
            raise RunnerStopped(self._death()) from None
        try:
            head, table, body = answer.split(b"\n", 2)
            reply = json.loads(head)
            received = _tensors(json.loads(table), bytearray(body))
        except Exception as error:
            raise RunnerStopped(f"the implementation's process sent garbage: {error}") from None
        if "stopped" in reply:
            raise RunnerStopped(f"the probe could not go on: {reply['stopped']}")
        return reply, received

    def _death(self) -> str:
        self.process.stdin.close()
        try:  # its answer pipe closed: it is dying, or shut its pipe and goes on
            returncode = self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            returncode = self.process.wait()
        self._end_its_group()
        self.drainer.join(timeout=5)  # what it said last, a C library's abort message say
        if self.signal_exits and 128 < returncode < 128 + 65:
            returncode = 128 - returncode
        return death(returncode, bytes(self.stderr[self.mark :]))

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
        if self.process is not None:
            self._end_its_group()

    def _end_its_group(self) -> None:
        """A zygote's runner leads a session of its own: what it left running ends with it. A
        runner started here is in the judge's group, which its probe's end kills
        (isolation.run_isolated)."""
        if self.fork_request is not None:
            self.process.wait()
            lifeline.end_group(self.process.pid)
