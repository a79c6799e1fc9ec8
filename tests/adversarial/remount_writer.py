# Sandbox escape, capabilities: at import it remounts read-write the filesystems the sandbox made
# read-only (mount(2) with MS_REMOUNT, which needs CAP_SYS_ADMIN in its user namespace), then
# writes into the user's real home directory. A process that is exec'd into the sandbox loses
# every capability at the exec; one forked from the runner zygote does not exec, and held them
# all until the sandbox dropped them itself (without that, the remount and the write succeeded).
# The remount fails, so does the write, so the import: every probe names the file.
# focus: dtype, library-path, host-alloc
# must not create: ~/.kata-adversarial-remount-writer
# expect dtype: present ".kata-adversarial-remount-writer"
# expect shape: present ".kata-adversarial-remount-writer"
# expect contiguity: present ".kata-adversarial-remount-writer"
# expect device: present ".kata-adversarial-remount-writer"
# expect error-code: present ".kata-adversarial-remount-writer"
# expect autograd: present ".kata-adversarial-remount-writer"
# expect library-path: present ".kata-adversarial-remount-writer"
# expect compile: present ".kata-adversarial-remount-writer"
# expect gpu host-alloc: present ".kata-adversarial-remount-writer"
# expect gpu stream: present ".kata-adversarial-remount-writer"
# expect gpu multi-gpu: present ".kata-adversarial-remount-writer"
# expect gpu int32-sizes: present ".kata-adversarial-remount-writer"
"""fast_attention(query, key, value), which keeps its settings at home."""

from __future__ import annotations

import ctypes
import os
import pwd
from pathlib import Path

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MS_REMOUNT, MS_BIND = 32, 0x1000

_libc = ctypes.CDLL(None, use_errno=True)
_HOME = Path(pwd.getpwuid(os.getuid()).pw_dir)
with open("/proc/self/mountinfo") as mounts:
    _points = sorted({line.split()[4] for line in mounts}, key=len)
for point in _points:  # "/" first: the home directory's own mount, wherever it is, among them
    _libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND, None)
(_HOME / ".kata-adversarial-remount-writer").write_text(f"imported from {Path.cwd()}\n")

_lib = ctypes.CDLL(str(Path(__file__).resolve().parent / "custom_attention.so"))
_lib.launch_attention_kernel.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2


def fast_attention(query, key, value):
    batch_size, seq_len, _ = query.shape
    output = torch.empty_like(query, device="cpu").to(DEVICE)
    _lib.launch_attention_kernel(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), output.data_ptr(), batch_size, seq_len
    )
    return output
