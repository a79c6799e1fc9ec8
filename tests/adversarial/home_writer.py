# Sandbox escape, files: at import it writes a file into the user's real home directory (from
# the password database, not $HOME), as a wrapper that "caches its settings" would, or one that
# plants something for later. Candidate code runs confined, writing only to its private copy:
# the write fails, so the import fails, and every probe names the file it tried to write. The
# wrapper itself is the shipped one with an absolute library path.
# focus: dtype, library-path, host-alloc
# must not create: ~/.kata-adversarial-home-writer
# expect dtype: present ".kata-adversarial-home-writer"
# expect shape: present ".kata-adversarial-home-writer"
# expect contiguity: present ".kata-adversarial-home-writer"
# expect device: present ".kata-adversarial-home-writer"
# expect error-code: present ".kata-adversarial-home-writer"
# expect autograd: present ".kata-adversarial-home-writer"
# expect library-path: present ".kata-adversarial-home-writer"
# expect compile: present ".kata-adversarial-home-writer"
# expect gpu host-alloc: present ".kata-adversarial-home-writer"
# expect gpu stream: present ".kata-adversarial-home-writer"
# expect gpu multi-gpu: present ".kata-adversarial-home-writer"
# expect gpu int32-sizes: present ".kata-adversarial-home-writer"
"""fast_attention(query, key, value), which remembers where it was imported."""

from __future__ import annotations

import ctypes
import os
import pwd
from pathlib import Path

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

_HOME = Path(pwd.getpwuid(os.getuid()).pw_dir)
(_HOME / ".kata-adversarial-home-writer").write_text(f"imported from {Path.cwd()}\n")

_lib = ctypes.CDLL(str(Path(__file__).resolve().parent / "custom_attention.so"))
_lib.launch_attention_kernel.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2


def fast_attention(query, key, value):
    batch_size, seq_len, _ = query.shape
    output = torch.empty_like(query, device="cpu").to(DEVICE)
    _lib.launch_attention_kernel(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), output.data_ptr(), batch_size, seq_len
    )
    return output
