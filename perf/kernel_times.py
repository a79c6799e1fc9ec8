"""Per-kernel CUDA time of fixed's and SDPA's forward+backward for a few of the bench's args
cases (torch.profiler; 3 warm-up steps, 5 profiled, times per step). Shows where a case's time
goes beside the attention kernels themselves: the glue's passes over a mask, the prologue and dQ
kernels, cuDNN's own. Needs a CUDA GPU and fixed/ built for it; run from the repository root:

    python perf/kernel_times.py

perf/NOTES.md (v25) quotes its output on an H100."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]

HEADS = 16
STEPS = 5


def step_of(attention, q, k, v, mask, dropout_p, grad):
    def step():
        attention(q, k, v, attn_mask=mask, dropout_p=dropout_p).backward(grad)

    return step


def report(name, batch, seq, dim, mask_kind=None, dropout_p=0.0):
    import fixed  # after the GPU check: importing fixed builds its operator

    torch.manual_seed(0)
    q, k, v, grad = (
        torch.randn(batch, HEADS, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = None
    if mask_kind == "float":  # the bench's: a bias per (query, key), shared by batch and heads
        mask = torch.randn(1, 1, seq, seq, device="cuda", dtype=torch.bfloat16)
    elif mask_kind == "bool":  # the bench's: the causal mask as a tensor
        mask = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
    for label, attention in (
        ("fixed", fixed.fast_attention),
        ("sdpa", F.scaled_dot_product_attention),
    ):
        step = step_of(attention, q, k, v, mask, dropout_p, grad)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                step()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.device_time_total for e in events) / STEPS / 1000
        print(f"== {name} {label}: {total:.3f} ms of kernels per forward+backward")
        for event in sorted(events, key=lambda e: -e.device_time_total)[:8]:
            ms = event.device_time_total / STEPS / 1000
            print(f"   {ms:8.3f} ms  x{event.count // STEPS:<3d} {event.key[:110]}")


def main() -> int:
    if not torch.cuda.is_available():
        print("kernel_times: needs a CUDA GPU; torch sees none", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    report("float mask D64 8192", 1, 8192, 64, mask_kind="float")
    report("bool mask D64 8192", 1, 8192, 64, mask_kind="bool")
    report("dropout D64 8192", 1, 8192, 64, dropout_p=0.1)
    report("plain D128 8192", 1, 8192, 128)
    report("head dim 256, 2048", 4, 2048, 256)
    return 0


if __name__ == "__main__":
    sys.exit(main())
