"""The vendor kernel must do the work: proved at run time, call by call.

The harness builds the vendor library from the SHIPPED sources (shipped_flawed.json, never
from a working copy a candidate may have edited) and loads it in the probe process by its absolute
path. On every probe input the vendor kernel supports (float32, dense, 3-D (B, S, 64), S ≤ 4096,
on the machine's device), the wrapper's output must be bit-identical to that kernel's own output
on the same data. The kernel is deterministic, so its answer is recognisable to the bit: a PyTorch
computation (SDPA, a hand-written softmax), a kernel result that was discarded, altered or cached
cannot match. Inputs the kernel does not support are left to the wrapper: falling back to PyTorch
for them is dispatch, not a bypass.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from pathlib import Path

import torch

HEAD_DIM = 64
MAX_SEQ_LEN = 4096
BYPASSED = "did not come from the vendor kernel"


class VendorKernel:
    """The shipped vendor kernel, callable on tensors, and the count of calls it judged."""

    def __init__(self, library: Path, device_type: str):
        self._library = ctypes.CDLL(str(library))
        self._library.launch_attention_kernel.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2
        self._library.launch_attention_kernel.restype = ctypes.c_int
        self.device_type = device_type  # "cuda" for the CUDA build, "cpu" for the CPU build
        self.checked = 0  # supported calls compared with the kernel
        self.bypassed: list[str] = []  # the cases whose answer was not the kernel's
        self._lock = threading.Lock()  # judging.judge_cases' lanes judge at the same time

    def supports(self, inputs) -> bool:
        """Whether the shipped kernel computes these inputs as they are."""
        query = inputs[0]
        return (
            all(isinstance(t, torch.Tensor) for t in inputs)
            and query.dim() == 3
            and query.device.type == self.device_type
            and 0 < query.shape[1] <= MAX_SEQ_LEN
            and query.shape[0] > 0
            and query.shape[2] == HEAD_DIM
            and query.numel() < 2**31
            and all(
                t.dtype == torch.float32
                and t.shape == query.shape
                and t.device == query.device
                and t.is_contiguous()
                for t in inputs
            )
        )

    def output(self, inputs) -> torch.Tensor:
        """The kernel's own answer for supported inputs (on their device)."""
        query, key, value = (t.detach() for t in inputs)
        output = torch.full_like(query, float("nan"))  # poisoned: a skipped write shows
        batch, length, _ = query.shape
        on_cuda = query.device.type == "cuda"
        guard = torch.cuda.device(query.device) if on_cuda else contextlib.nullcontext()
        with guard:
            if on_cuda:
                torch.cuda.synchronize()  # the kernel runs on the legacy default stream
            status = self._library.launch_attention_kernel(
                query.data_ptr(), key.data_ptr(), value.data_ptr(), output.data_ptr(), batch, length
            )
            if on_cuda:
                torch.cuda.synchronize()
        if status != 0:
            raise RuntimeError(f"the shipped vendor kernel returned {status} on supported inputs")
        return output

    def judge(self, name: str, result, inputs) -> str | None:
        """None when `result` is the kernel's answer (or the inputs are not the kernel's to
        answer), else the failure to report."""
        if not self.supports(inputs):
            return None
        with self._lock:
            self.checked += 1
            expected = self.output(inputs)
        same = (
            isinstance(result, torch.Tensor)
            and result.dtype == expected.dtype
            and result.shape == expected.shape
            and torch.equal(result.detach().to(expected.device), expected)
        )
        if same:
            return None
        with self._lock:
            self.bypassed.append(name)
        return (
            f"{name}: the answer {BYPASSED} (not bit-identical to the shipped kernel's output "
            "on the same inputs, which it supports)"
        )

    def summary(self) -> dict:
        return {"checked": self.checked, "bypassed": list(self.bypassed)}
