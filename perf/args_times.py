"""Forward and forward+backward times of fixed and SDPA's default for the args rows a kernel change
moves (bf16 unless a case says float32, H = 16; CUDA events, 3 warm-up calls, the median of 20
batches, fixed's and SDPA's in alternating rounds), printed one row per case with SDPA's time over
fixed's. A batch is CALLS_PER_BATCH calls timed behind one untimed call, the time per call its
share: the GPU is busy when the first event fires and the host enqueues ahead of it, so a call's
host time (tens of microseconds, the glue's allocations among them) is hidden wherever it is shorter
than the GPU's, as in `make bench`'s batches. One call between two events, as before v35, counted
the host's time before the launch: the split tail's kernel gained 6% at plain-64 and this script
read 0.99x (perf/NOTES.md, v35).

The instrument of perf/NOTES.md's A/B runs (v27 on; perf/ab.py runs it in two checkouts,
alternating which goes first, so that both see the same machine). `make bench` stays the
record; this is the quick comparison. Needs a CUDA GPU and fixed/ built for it; from the
repository root:

    python perf/args_times.py [--cases masks,dropout,plain,causal]

`--cold` gives each call a fresh set of inputs (Q, K, V and the output's gradient; a mask is
shared), from sets that together fill four L2 caches, as `make bench` rotates them
(bench/timing.py): K and V then come from DRAM, not from the L2 that one reused set stays in. An
A/B of a change to what a kernel reads, or to its order of work, should run both ways (perf/ab.py
--cold): v43 of perf/NOTES.md has a forward that read 1.09x here and moved by nothing in the bench.

`--once CASE` runs one forward+backward of a case and nothing else, for a profiler (ncu) to
catch its kernels: `ncu --kernel-name regex:flash_backward python perf/args_times.py --once
dropout-64`."""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
HEADS = 16

# name: (batch, seq, head dim, mask kind, dropout_p[, dtype: bf16 if absent]), grouped as --cases
# takes them. Mask kinds:
# "float", "bool" (tensors), "causal" (is_causal=True), None; "ev-half": no mask, V (and the
# output) with half the head dim's columns (the bench's Ev = D / 2); "gqa", "gqa-causal": K and V
# with a quarter of the heads (the bench's GQA 16:4), without or with is_causal.
CASES = {
    "masks": {
        "float-64-2048": (4, 2048, 64, "float", 0.0),
        "float-64-8192": (1, 8192, 64, "float", 0.0),
        "float-128-2048": (4, 2048, 128, "float", 0.0),
        "float-128-8192": (1, 8192, 128, "float", 0.0),
        "bool-64-2048": (4, 2048, 64, "bool", 0.0),
        "bool-64-8192": (1, 8192, 64, "bool", 0.0),
    },
    "dropout": {
        "dropout-64": (4, 2048, 64, None, 0.1),
        "dropout-64-8192": (1, 8192, 64, None, 0.1),
        "dropout-128": (4, 2048, 128, None, 0.1),
        "dropout-128-8192": (1, 8192, 128, None, 0.1),
    },
    "plain": {
        "plain-64": (4, 2048, 64, None, 0.0),
        "plain-128": (4, 2048, 128, None, 0.0),
        "plain-64-8192": (1, 8192, 64, None, 0.0),
        "plain-128-8192": (1, 8192, 128, None, 0.0),
    },
    "values": {
        "ev-64": (4, 2048, 64, "ev-half", 0.0),
        "ev-128": (4, 2048, 128, "ev-half", 0.0),
        "ev-128-8192": (1, 8192, 128, "ev-half", 0.0),
    },
    "gqa": {
        "gqa-64": (4, 2048, 64, "gqa", 0.0),
        "gqa-128": (4, 2048, 128, "gqa", 0.0),
        "gqa-128-8192": (1, 8192, 128, "gqa", 0.0),
        "gqa-causal-128": (4, 2048, 128, "gqa-causal", 0.0),
    },
    "wide": {
        "wide-256": (4, 2048, 256, None, 0.0),
        "wide-256-8192": (1, 8192, 256, None, 0.0),
    },
    "causal": {
        "causal-64": (4, 2048, 64, "causal", 0.0),
        "causal-64-4096": (4, 4096, 64, "causal", 0.0),  # the bench's LLM shapes
        "causal-64-8192": (4, 8192, 64, "causal", 0.0),
        "causal-128": (4, 2048, 128, "causal", 0.0),
        "causal-128-8192": (1, 8192, 128, "causal", 0.0),
    },
    "llm": {  # issue 30's forward cells at B = 4 that the groups above leave out
        "llm-64-4096": (4, 4096, 64, None, 0.0),
        "llm-128-4096": (4, 4096, 128, None, 0.0),
        "llm-128-8192": (4, 8192, 128, None, 0.0),
        "llm-causal-128-4096": (4, 4096, 128, "causal", 0.0),
    },
    "float32": {  # head dim 128: about 20 s a case at S >= 2048
        "f32-128": (4, 2048, 128, None, 0.0, torch.float32),
        "f32-128-8192": (1, 8192, 128, None, 0.0, torch.float32),
        "f32-causal-128": (4, 2048, 128, "causal", 0.0, torch.float32),
        "f32-128-1024": (1, 1024, 128, None, 0.0, torch.float32),  # 128 row blocks of 128
        "f32-128-512": (1, 512, 128, None, 0.0, torch.float32),  # 64: half the SMs idle
    },
}
ALL_CASES = {name: case for group in CASES.values() for name, case in group.items()}


ROTATION_L2_CACHES = 4  # --cold: the input sets of a case fill at least this many L2 caches


def inputs(batch, seq, dim, mask_kind, dtype=torch.bfloat16, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    value_dim = dim // 2 if mask_kind == "ev-half" else dim
    kv_heads = HEADS // 4 if mask_kind in ("gqa", "gqa-causal") else HEADS
    q, k, v, grad = (
        torch.randn(batch, heads, seq, width, device="cuda", dtype=dtype, generator=generator)
        for heads, width in (
            (HEADS, dim),
            (kv_heads, dim),
            (kv_heads, value_dim),
            (HEADS, value_dim),
        )
    )
    mask = None
    if mask_kind == "float":  # the bench's: a bias per (query, key), shared by batch and heads
        mask = torch.randn(1, 1, seq, seq, device="cuda", dtype=dtype, generator=generator)
    elif mask_kind == "bool":  # the bench's: the causal mask as a tensor
        mask = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
    elif mask_kind in ("causal", "gqa-causal"):
        mask = "causal"  # calls() passes is_causal=True
    return [t.requires_grad_() for t in (q, k, v)], grad, mask


def input_sets_for(set_bytes: int, l2_bytes: int) -> int:
    """--cold: how many input sets of `set_bytes` fill ROTATION_L2_CACHES caches of `l2_bytes`
    (at least 2, so that no call reads the set of the call before it)."""
    return max(2, math.ceil(ROTATION_L2_CACHES * l2_bytes / max(1, set_bytes)))


def rotating(functions):
    """One function that calls each of `functions` in turn."""
    turn = itertools.cycle(functions)
    return lambda: next(turn)()


CALLS_PER_BATCH = 10


def batch_ms(fn):
    """fn's GPU time per call over one batch (the module's docstring)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()  # untimed: the GPU is busy when `start` is reached
    start.record()
    for _ in range(CALLS_PER_BATCH):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / CALLS_PER_BATCH


def alternating_medians_ms(functions, reps=20):
    """Each function's GPU time per call: the median of its `reps` batches, timed in rounds of one
    batch each, in an order reversed every other round. Timed one after the other, the first
    function's batches ran in what the case before left behind: after args_times' plain group the
    SM clock read 1635-1710 MHz against 1980 rested, and for about 100 ms fixed's (4, 16, 4096,
    64) forward kernel took 595-648 us and SDPA's 580-677, against 533 and 574 after
    (perf/NOTES.md, v59). In rounds, such a drift lands on both sides alike."""
    for fn in functions:
        for _ in range(3):
            fn()
    times = [[] for _ in functions]
    for round_ in range(reps):
        order = list(zip(functions, times, strict=True))
        for fn, batches in order if round_ % 2 == 0 else order[::-1]:
            batches.append(batch_ms(fn))
    return [statistics.median(batches) for batches in times]


def calls(attention, q, k, v, grad, mask, dropout_p):
    """The forward alone (no graph) and the forward+backward of one attention function."""

    causal = isinstance(mask, str)
    arguments = {"attn_mask": None if causal else mask, "dropout_p": dropout_p, "is_causal": causal}
    if k.shape[1] != q.shape[1]:
        arguments["enable_gqa"] = True

    def forward():
        with torch.no_grad():
            attention(q, k, v, **arguments)

    def forward_backward():
        attention(q, k, v, **arguments).backward(grad)

    return forward, forward_backward


def time_case(name, batch, seq, dim, mask_kind, dropout_p, dtype=torch.bfloat16, cold=False):
    import fixed  # after the GPU check: importing fixed builds its operator

    # Each case from an empty allocator cache, as make bench starts each LLM shape.
    gc.collect()
    torch.cuda.empty_cache()
    sets = [inputs(batch, seq, dim, mask_kind, dtype)]
    if cold:
        (q, k, v), grad, _ = sets[0]
        set_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, grad))
        properties = torch.cuda.get_device_properties(q.device)
        l2_bytes = getattr(properties, "L2_cache_size", 0) or 50 * 2**20  # an H100's, if unread
        count = input_sets_for(set_bytes, l2_bytes)
        shared_mask = mask_kind in ("float", "bool")  # made once: the other sets draw none
        kind = None if shared_mask else mask_kind
        sets += [inputs(batch, seq, dim, kind, dtype, seed) for seed in range(1, count)]
    mask = sets[0][2]
    forwards, forward_backwards = [], []
    for attention in (fixed.fast_attention, F.scaled_dot_product_attention):
        pairs = [calls(attention, *qkv, grad, mask, dropout_p) for qkv, grad, _ in sets]
        forwards.append(rotating([pair[0] for pair in pairs]))
        forward_backwards.append(rotating([pair[1] for pair in pairs]))
    fwd, sdpa_fwd = alternating_medians_ms(forwards)
    both, sdpa_both = alternating_medians_ms(forward_backwards)
    print(
        f"{name:18s} ({batch}, {HEADS}, {seq}, {dim}): fwd {fwd:.4f} ms vs SDPA {sdpa_fwd:.4f} "
        f"({sdpa_fwd / fwd:.2f}x)  fwd+bwd {both:.4f} vs {sdpa_both:.4f} ({sdpa_both / both:.2f}x)",
        flush=True,
    )


def run_once(name):
    import fixed

    batch, seq, dim, mask_kind, dropout_p, *dtype = ALL_CASES[name]
    (q, k, v), grad, mask = inputs(batch, seq, dim, mask_kind, *dtype)
    calls(fixed.fast_attention, q, k, v, grad, mask, dropout_p)[1]()
    torch.cuda.synchronize()
    print(f"{name}: one forward+backward done")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="masks,dropout,plain,causal", help=", ".join(CASES))
    parser.add_argument("--once", choices=sorted(ALL_CASES), help="one forward+backward of a case")
    parser.add_argument(
        "--cold", action="store_true", help="a fresh input set per call (make bench's rotation)"
    )
    args = parser.parse_args(argv)
    groups = [group for group in args.cases.split(",") if group]
    unknown = [group for group in groups if group not in CASES]
    if unknown:
        parser.error(f"unknown case group {unknown[0]!r}; choose from {', '.join(CASES)}")
    if not torch.cuda.is_available():
        print("args_times: needs a CUDA GPU; torch sees none", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    if args.once:
        run_once(args.once)
        return 0
    if args.cold:
        print(f"inputs: a fresh set per call, the sets filling {ROTATION_L2_CACHES} L2 caches")
    for group in groups:
        for name, case in CASES[group].items():
            time_case(name, *case, cold=args.cold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
