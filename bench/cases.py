"""What the bench runs and records: its sections, sizes and tolerances, the FLOP count, a run's
Settings, an implementation (Impl), the rows of bench.json and their grouping, and the float32
SDPA reference every implementation is checked against."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SECTIONS = ("overhead", "kata", "llm", "args")
FWD, FWD_BWD = "fwd", "fwd+bwd"

L2_FALLBACK_BYTES = 50 * 2**20  # when the device does not report its L2 cache
ROTATION_FACTOR = 4  # the input sets of a row total at least this many L2 caches...
MAX_INPUT_SETS = 64  # ...with at most this many sets
# An alternating batch's settling ends where two chunks of its untimed calls have medians this
# close (bench/alternate.py's settle).
SETTLE_AGREEMENT = 0.01
# The float32 math reference runs in chunks of the flattened batch, scores of at most 512 MB each:
# at S = 16384 one (B, H) slice alone is 1 GB of scores, all 64 of them 68 GB.
REFERENCE_CHUNK_BYTES = 2**29
# ‖out − ref‖ / ‖ref‖ allowed against the float32 reference. float32 kernels land near 1e-6 (a
# TF32 path near 5e-4); bfloat16 storage rounds at 2⁻⁹. A wrong kernel is off by about 1.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
NO_WARMUP_MS = 250.0  # a checked call this slow was warm-up enough

NO_GPU = "need a CUDA GPU; torch sees none"


def attention_flops(batch, heads, len_q, len_kv, head_dim, *, causal=False, backward=False):
    """FLOPs of one attention call: forward 4·B·H·L·S·D (q·kᵀ and p·v, 2·L·S·D each per head),
    halved when causal; with the backward (2.5x the forward) 3.5x the forward."""
    flops = 4.0 * batch * heads * len_q * len_kv * head_dim
    if causal:
        flops /= 2
    if backward:
        flops *= 3.5
    return flops


# ------------------------------------------------------------------------------------ settings


@dataclass
class Settings:
    device: torch.device
    quick: bool
    sections: tuple[str, ...]
    budget_s: float  # time budget of one row's timed runs
    min_runs: int
    max_runs: int
    max_call_s: float  # a row whose single call takes longer is not timed
    time_limit_s: float  # no new row is timed once the run has taken this long
    max_seq: int | None
    seed: int
    l2_bytes: int
    overhead_shape: tuple[int, ...] = (1, 16, 64)
    overhead_batches: int = 7
    overhead_calls: int = 200
    # The llm and args sections time their implementations in this many alternating batches
    # each (bench/alternate.py; --rounds).
    alternate_rounds: int = 5
    # On a GPU each batch starts with its own calls, untimed, in chunks of about
    # alternate_settle_ms until two chunks agree, for at most about alternate_settle_max_ms
    # (bench/alternate.py's settle; equal: a fixed settle).
    alternate_settle_ms: float = 30.0
    alternate_settle_max_ms: float = 250.0
    kata_batch: int = 8
    kata_seqs: tuple[int, ...] = (512, 1024, 2048, 4096)
    llm_batch: int = 4
    llm_heads: int = 16
    llm_seqs: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    llm_dims: tuple[int, ...] = (64, 128)
    llm_causal: tuple[bool, ...] = (False, True)
    # The args section, SDPA's other arguments at (B, llm_heads, S, D): (S, B) pairs, shortest
    # first; B = 1 at S = 8192 for memory and time (bench/arguments.py).
    args_seqs: tuple[tuple[int, int], ...] = ((2048, 4), (8192, 1))
    args_dims: tuple[int, ...] = (64, 128)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def to_json(self) -> dict:
        return {
            "quick": self.quick,
            "sections": list(self.sections),
            "budget_s": self.budget_s,
            "min_runs": self.min_runs,
            "max_runs": self.max_runs,
            "max_call_s": self.max_call_s,
            "time_limit_s": self.time_limit_s,
            "max_seq": self.max_seq,
            "seed": self.seed,
            "l2_bytes": self.l2_bytes,
            "alternate_rounds": self.alternate_rounds,
            "alternate_settle_ms": self.alternate_settle_ms if self.cuda else 0.0,
            "alternate_settle_max_ms": self.alternate_settle_max_ms if self.cuda else 0.0,
            "rotation_bytes": ROTATION_FACTOR * self.l2_bytes,
            "overhead": {
                "shape": list(self.overhead_shape),
                "batches": self.overhead_batches,
                "calls_per_batch": self.overhead_calls,
            },
            "kata": {"batch": self.kata_batch, "seqs": list(self.kata_seqs)},
            "llm": {
                "batch": self.llm_batch,
                "heads": self.llm_heads,
                "seqs": list(self.llm_seqs),
                "dims": list(self.llm_dims),
                "causal": list(self.llm_causal),
            },
            "args": {
                "heads": self.llm_heads,
                "seqs": [seq for seq, _ in self.args_seqs],
                "batches": [batch for _, batch in self.args_seqs],
                "dims": list(self.args_dims),
            },
            "tolerance": {_dtype_name(k): v for k, v in TOLERANCE.items()},
        }


def make_settings(args, device: torch.device) -> Settings:
    cuda = device.type == "cuda"
    l2 = L2_FALLBACK_BYTES
    if cuda:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or l2
    settings = Settings(
        device=device,
        quick=args.quick,
        sections=tuple(args.only or SECTIONS),
        budget_s=0.25 if args.quick else 1.0,
        min_runs=3 if args.quick else 5,
        max_runs=10 if args.quick else 50,
        max_call_s=0.5 if args.quick else 1.0,
        time_limit_s=90.0 if args.quick else 600.0,
        max_seq=args.max_seq,
        seed=args.seed,
        l2_bytes=l2,
    )
    if args.quick:
        settings.overhead_batches, settings.overhead_calls = 3, 50
        settings.alternate_rounds = 3
        settings.alternate_settle_max_ms = settings.alternate_settle_ms  # one chunk: fixed
        settings.llm_seqs = (1024, 4096)
        settings.args_seqs, settings.args_dims = ((1024, 4),), (128,)
    if cuda:
        settings.kata_seqs = (1024, 4096) if args.quick else settings.kata_seqs
    else:
        # The CPU builds are plain loops: small sequences only.
        settings.kata_batch = 2
        settings.kata_seqs = (128, 256) if args.quick else (128, 256, 512)
    for name in (
        "budget_s",
        "min_runs",
        "max_runs",
        "max_call_s",
        "time_limit_s",
        "alternate_rounds",
        "alternate_settle_ms",
        "alternate_settle_max_ms",
    ):
        value = getattr(args, name)
        if value is not None:
            setattr(settings, name, value)
    # A --settle above the longest settle asked for (or the default one) is a fixed settle.
    if args.alternate_settle_max_ms is None:
        settings.alternate_settle_max_ms = max(
            settings.alternate_settle_max_ms, settings.alternate_settle_ms
        )
    settings.max_runs = max(settings.max_runs, settings.min_runs)
    return settings


# ------------------------------------------------------------------------------ what is timed


@dataclass
class Impl:
    key: str  # the row's "implementation" in bench.json
    label: str  # its column in the table
    call: Callable | None  # call(q, k, v, causal) -> output
    missing: str | None = None  # why it cannot run here: all its rows are skipped with this
    checked: bool = True  # computes attention (the host round trip does not)
    backend: str | None = None  # the SDPA backend it forces, as SDPA's warnings name it
    # For the host-overhead loop: bare(q, k, v) -> (function, args), the public entry point and
    # its arguments as a caller would pass them, with no wrapper of the bench's in between.
    bare: Callable | None = None


# ----------------------------------------------------------------------------------- the rows


def new_row(section, impl: Impl, shape, dtype, causal, pass_) -> dict:
    return {
        "section": section,
        "implementation": impl.key,
        "label": impl.label,
        "shape": list(shape),
        "dtype": _dtype_name(dtype),
        "causal": causal,
        "pass": pass_,
        "median_ms": None,
        "runs": 0,
        "tflops": None,
        "ratio_to_flash": None,
        "ratio_to_cudnn": None,
        "rel_error": None,
        "status": "ok",
    }


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def relative_error(result, reference) -> float:
    """‖result − reference‖ / ‖reference‖; inf when the result is not finite."""
    diff = torch.linalg.vector_norm(result.detach().float() - reference).item()
    norm = torch.linalg.vector_norm(reference).item()
    if not math.isfinite(diff):
        return math.inf
    return diff / norm if norm > 0 else diff


def reference(query, key, value, causal, grad_output=None):
    """float32 SDPA through the math backend, in chunks of the flattened batch: the output, and
    with grad_output the gradients (dq, dk, dv). The inputs are upcast, never re-drawn."""
    shapes = [t.shape for t in (query, key, value)]
    flat = [t.detach().float().reshape(-1, *t.shape[-2:]) for t in (query, key, value)]
    grad = None if grad_output is None else grad_output.detach().float().reshape(flat[0].shape)
    len_q, len_kv = flat[0].shape[-2], flat[1].shape[-2]
    chunk = max(1, REFERENCE_CHUNK_BYTES // max(1, len_q * len_kv * 4))
    outs, grads = [], ([], [], [])
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # float32 products, never TF32
    try:
        _reference_chunks(flat, grad, causal, chunk, outs, grads)
    finally:
        torch.set_float32_matmul_precision(precision)
    out = torch.cat(outs).reshape(shapes[0])
    if grad is None:
        return out, None
    return out, tuple(torch.cat(g).reshape(s) for g, s in zip(grads, shapes, strict=True))


def _reference_chunks(flat, grad, causal, chunk, outs, grads) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        for start in range(0, flat[0].shape[0], chunk):
            part = [t[start : start + chunk] for t in flat]
            if grad is None:
                with torch.no_grad():
                    outs.append(F.scaled_dot_product_attention(*part, is_causal=causal))
                continue
            part = [t.detach().requires_grad_(True) for t in part]
            with torch.enable_grad():
                out = F.scaled_dot_product_attention(*part, is_causal=causal)
                for into, g in zip(
                    grads,
                    torch.autograd.grad(out, part, grad[start : start + chunk]),
                    strict=True,
                ):
                    into.append(g)
            outs.append(out.detach())


# ratio_to_cudnn's bar is the faster of the cuDNN backend forced and SDPA's default, which on
# Hopper runs the same cuDNN kernel: on an H100 the forced row was the slower, unsteady one at
# S = 2048 (0.165-0.190 ms per batch against the default's 0.152-0.153, D = 64), a bar that
# flattered fixed (forcing enters a context manager on every call: the likely cause).
LLM_BARS = {"ratio_to_flash": ("sdpa flash",), "ratio_to_cudnn": ("sdpa cudnn", "sdpa")}


def set_ratios(rows: Iterable[dict], bars: dict[str, tuple[str, ...]] = LLM_BARS) -> None:
    """Each field of `bars` (ratio_to_flash, ratio_to_cudnn by default): the time of the fastest
    timed row among the implementations it names / the row's time (the row's TFLOP/s over that
    one's), per shape and pass; None where the first it names was not timed (no cuDNN: no cuDNN
    bar, whatever the default ran)."""
    for group in _groups(rows):
        for field, backends in bars.items():
            times = {r["implementation"]: r["median_ms"] for r in group if r["median_ms"]}
            if backends[0] not in times:
                continue
            bar = min(times[name] for name in backends if name in times)
            for row in group:
                if row["median_ms"]:
                    row[field] = bar / row["median_ms"]


def _groups(rows: Iterable[dict]) -> list[list[dict]]:
    """Rows of one shape, causality and pass, in order."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        key = (row["section"], row.get("case"), tuple(row["shape"]), row["causal"], row["pass"])
        groups.setdefault(key, []).append(row)
    return list(groups.values())
