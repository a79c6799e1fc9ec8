"""`make bench`: flawed/ vs fixed/ vs torch's scaled_dot_product_attention, in one run.

Three sections (`--only` picks some):
  overhead  per-call host overhead at a tiny shape: flawed (the ctypes wrapper), fixed's
            fast_attention, its raw operator and SDPA; wall clock around many calls, µs per call.
  kata      the kata's shapes, float32 (B, S, 64): flawed, fixed, SDPA, and the cost of flawed's
            host round trip (`torch.empty_like(q, device="cpu").to(q.device)`) on its own.
  llm       LLM shapes, bfloat16 (B, H, S, D), forward and forward+backward: fixed and SDPA's
            default, flash and cuDNN backends, in TFLOP/s and as a ratio to the flash backend.
            Needs a CUDA GPU.

How it times. Every implementation is first checked once against float32 SDPA (the math backend,
an independent path) on fresh standard-normal inputs; a wrong result is reported as WRONG and
never timed. Then: warm-up calls, and timed runs until a row's time budget or its run cap is
spent (at least `min_runs`); the median is reported. On a GPU each run sits between two CUDA
events, and the runs rotate among input sets that together are several times the L2 cache, so
the cache does not flatter small shapes. On the CPU each run is timed with perf_counter. A row
whose single call takes longer than `--max-call` seconds is reported as skipped, and the whole
run stops timing new rows once `--time-limit` is spent; both say so in the row's status.

FLOPs as FlashAttention's benchmarks count them: forward 4·B·H·L·S·D, halved when causal; the
backward 2.5x the forward, so forward+backward 3.5x.

Output: a table on stdout, every row in a JSON file (`--json`, default bench.json), and a chart
of the LLM rows (`--png`, default beside the JSON) when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kata import FLAWED_DIR

SECTIONS = ("overhead", "kata", "llm")
FWD, FWD_BWD = "fwd", "fwd+bwd"

L2_FALLBACK_BYTES = 50 * 2**20  # when the device does not report its L2 cache
ROTATION_FACTOR = 4  # the input sets of a row total at least this many L2 caches...
MAX_INPUT_SETS = 64  # ...with at most this many sets
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
    kata_batch: int = 8
    kata_seqs: tuple[int, ...] = (512, 1024, 2048, 4096)
    llm_batch: int = 4
    llm_heads: int = 16
    llm_seqs: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    llm_dims: tuple[int, ...] = (64, 128)
    llm_causal: tuple[bool, ...] = (False, True)

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
        time_limit_s=60.0 if args.quick else 150.0,
        max_seq=args.max_seq,
        seed=args.seed,
        l2_bytes=l2,
    )
    if args.quick:
        settings.overhead_batches, settings.overhead_calls = 3, 50
        settings.llm_seqs = (1024, 4096)
    if cuda:
        settings.kata_seqs = (1024, 4096) if args.quick else settings.kata_seqs
    else:
        # The CPU builds are plain loops: small sequences only.
        settings.kata_batch = 2
        settings.kata_seqs = (128, 256) if args.quick else (128, 256, 512)
    for name in ("budget_s", "min_runs", "max_runs", "max_call_s", "time_limit_s"):
        value = getattr(args, name)
        if value is not None:
            setattr(settings, name, value)
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


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def load_flawed() -> tuple[Callable | None, str | None]:
    """flawed/attention_wrapper.fast_attention, loaded as the kata loads it: the vendor library
    built for this machine, imported with flawed/ as the working directory (the wrapper opens
    ./custom_attention.so). Returns (function, None) or (None, why not)."""
    from kata import builders

    try:
        builders.build_vendor_library(FLAWED_DIR)
    except Exception as error:
        return None, f"flawed/ vendor library not built: {_first_line(error)}"
    previous = os.getcwd()
    try:
        os.chdir(FLAWED_DIR)
        name = "kata_bench_flawed_wrapper"
        spec = importlib.util.spec_from_file_location(name, FLAWED_DIR / "attention_wrapper.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.fast_attention, None
    except Exception as error:
        return None, f"flawed/attention_wrapper.py did not load: {_first_line(error)}"
    finally:
        os.chdir(previous)


def load_fixed():
    """The fixed package (built on first import), or (None, why not)."""
    try:
        import fixed

        return fixed, None
    except Exception as error:
        return None, f"fixed/ did not build or load: {_first_line(error)}"


def sdpa(query, key, value, causal=False):
    # (B, S, E) inputs go in as (B, 1, S, E): SDPA's fused kernels take 4-D inputs only.
    if query.dim() == 3:
        out = F.scaled_dot_product_attention(
            query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), is_causal=causal
        )
        return out.squeeze(1)
    return F.scaled_dot_product_attention(query, key, value, is_causal=causal)


def sdpa_forced(backend):
    from torch.nn.attention import sdpa_kernel

    def call(query, key, value, causal=False):
        with sdpa_kernel([backend]):
            return sdpa(query, key, value, causal)

    return call


def host_round_trip(query, key, value, causal=False):
    return torch.empty_like(query, device="cpu").to(query.device)


class Implementations:
    """Loaded once per run: flawed, fixed (and its raw operator), SDPA and its backends."""

    def __init__(self, sections: Iterable[str]):
        from torch.nn.attention import SDPBackend

        sections = set(sections)
        flawed, flawed_missing = (None, None)
        if sections & {"overhead", "kata"}:
            flawed, flawed_missing = load_flawed()
        fixed, fixed_missing = load_fixed()

        def fixed_call(query, key, value, causal=False):
            return fixed.fast_attention(query, key, value, causal=causal)

        def raw_op(query, key, value, causal=False):
            scale = 1.0 / math.sqrt(query.shape[-1])
            out, _ = torch.ops.fixed_attention.attention_forward(query, key, value, scale, causal)
            return out

        self.flawed = Impl(
            "flawed",
            "flawed (ctypes)",
            lambda q, k, v, causal=False: flawed(q, k, v),
            flawed_missing,
            bare=lambda q, k, v: (flawed, (q, k, v)),
        )
        self.fixed = Impl(
            "fixed",
            "fixed",
            fixed_call,
            fixed_missing,
            bare=lambda q, k, v: (fixed.fast_attention, (q, k, v)),
        )
        self.raw_op = Impl(
            "fixed raw op",
            "torch.ops.fixed_attention.attention_forward",
            raw_op,
            fixed_missing,
            bare=lambda q, k, v: (
                torch.ops.fixed_attention.attention_forward,
                (q, k, v, 1.0 / math.sqrt(q.shape[-1]), False),
            ),
        )
        self.sdpa = Impl(
            "sdpa",
            "SDPA default",
            sdpa,
            # 4-D views made before the loop, as a model holds (B, H, S, E) tensors.
            bare=lambda q, k, v: (
                F.scaled_dot_product_attention,
                tuple(t.unsqueeze(1) if t.dim() == 3 else t for t in (q, k, v)),
            ),
        )
        self.flash = Impl(
            "sdpa flash",
            "SDPA flash",
            sdpa_forced(SDPBackend.FLASH_ATTENTION),
            backend="flash",
        )
        self.cudnn = Impl(
            "sdpa cudnn",
            "SDPA cuDNN",
            sdpa_forced(SDPBackend.CUDNN_ATTENTION),
            backend="cudnn",
        )
        self.round_trip = Impl("host round trip", "host round trip", host_round_trip, checked=False)


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
        "rel_error": None,
        "status": "ok",
    }


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def timed_call(fn: Callable[[], object], cuda: bool):
    """(result, milliseconds) of one call: CUDA events around it on a GPU, else perf_counter."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return result, start.elapsed_time(end)
    begin = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - begin) * 1e3


def time_each(fn: Callable[[int], object], indices: list[int], cuda: bool) -> list[float]:
    """Milliseconds of fn(i) for each i, launched back to back; one synchronisation at the end."""
    if not indices:
        return []
    if cuda:
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in indices
        ]
        for (start, end), index in zip(events, indices, strict=True):
            start.record()
            fn(index)
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for index in indices:
        begin = time.perf_counter()
        fn(index)
        times.append((time.perf_counter() - begin) * 1e3)
    return times


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


class Bench:
    def __init__(self, settings: Settings, log=None):
        self.s = settings
        self.rows: list[dict] = []
        self.sdpa_kernels: dict[str, dict] = {}
        self.notes: dict[str, str] = {}  # section -> why it did not run at all
        self.started = time.perf_counter()
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self.generator = torch.Generator(device=settings.device)
        self.generator.manual_seed(settings.seed)
        self.too_slow: dict[tuple, str] = {}  # (impl, family) -> why larger S are skipped

    # -------------------------------------------------------------------------- helpers

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def over_time(self) -> str | None:
        if self.elapsed() > self.s.time_limit_s:
            return f"skipped: the run's --time-limit of {self.s.time_limit_s:g} s was spent"
        return None

    def cannot_run(self, impl) -> str | None:
        """Why a row of `impl` is not run: the implementation is missing, or time is up."""
        return f"skipped: {impl.missing}" if impl.missing else self.over_time()

    def randn(self, shape, dtype, requires_grad=False):
        # Drawn in float32 and rounded: standard-normal values, never zeros.
        tensor = torch.randn(shape, generator=self.generator, device=self.s.device)
        return tensor.to(dtype).requires_grad_(requires_grad)

    def input_sets(self, shapes, dtype, requires_grad=False, cap=MAX_INPUT_SETS):
        """Enough fresh input sets that together they are ROTATION_FACTOR L2 caches."""
        nbytes = sum(math.prod(shape) for shape in shapes) * torch.empty((), dtype=dtype).itemsize
        count = min(cap, max(2, math.ceil(ROTATION_FACTOR * self.s.l2_bytes / max(1, nbytes))))
        return [
            tuple(self.randn(shape, dtype, requires_grad) for shape in shapes) for _ in range(count)
        ]

    def profile_sdpa(self, family: str, call: Callable[[], object]) -> None:
        """Which SDPA kernels really ran: one default call under torch.profiler."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.s.cuda:
            activities.append(ProfilerActivity.CUDA)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with profile(activities=activities) as prof:
                    call()
                    _sync(self.s.cuda)
            kernels, ops = set(), set()
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    kernels.add(event.name)
                elif "scaled_dot_product" in event.name or "attention" in event.name:
                    ops.add(event.name)
            self.sdpa_kernels[family] = {
                "backend": backend_of(kernels or ops),
                "kernels": sorted(kernels),
                "ops": sorted(ops),
            }
        except Exception as error:
            self.sdpa_kernels[family] = {"backend": f"unavailable: {_first_line(error)}"}

    def measure(self, row, call, n_sets: int, check, slow_key=None, backend=None) -> None:
        """Check `call(0)` once, then time `call(i)` (i: the input set) into `row`.

        check(result) -> (relative error, tolerance), or None for no check. slow_key: rows that
        share it and come later (longer sequences) are skipped once one call is too slow.
        backend: the SDPA backend the call forces ("flash", "cudnn"), to say why it refused."""
        s = self.s
        if slow_key in self.too_slow:
            row["status"] = self.too_slow[slow_key]
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result, first_ms = timed_call(lambda: call(0), s.cuda)
            except torch.OutOfMemoryError:
                row["status"] = "skipped: out of GPU memory"
                torch.cuda.empty_cache()
                return
            except Exception as error:
                row["status"] = f"unavailable: {_refusal(error, caught, backend)}"
                return
        if check is not None:
            error, tolerance = check(result)
            row["rel_error"] = error if math.isfinite(error) else None
            if not error <= tolerance:
                shown = "not finite" if not math.isfinite(error) else f"{error:.2e}"
                row["status"] = (
                    f"WRONG: relative error {shown} against float32 SDPA "
                    f"(tolerance {tolerance:.0e})"
                )
                return
        del result
        if first_ms > s.max_call_s * 1e3:
            # A first call can carry one-time work (cuDNN builds its plans, modules load
            # lazily): judge a second one before giving up on the row.
            _, first_ms = timed_call(lambda: call(1 % n_sets), s.cuda)
        if first_ms > s.max_call_s * 1e3:
            reason = (
                f"skipped: one call takes {first_ms / 1e3:.2f} s, over --max-call "
                f"{s.max_call_s:g} s"
            )
            row["status"] = reason
            row["single_call_ms"] = first_ms
            if slow_key is not None:
                self.too_slow[slow_key] = (
                    f"skipped: a shorter sequence already took {first_ms / 1e3:.2f} s per call "
                    f"(over --max-call {s.max_call_s:g} s)"
                )
            return
        try:
            estimate, next_set = first_ms, 1
            if first_ms < NO_WARMUP_MS:  # else the checked call was warm-up enough
                warmups = min(10, max(1, int(0.1 * s.budget_s * 1e3 / max(first_ms, 1e-3))))
                times = time_each(call, [(1 + i) % n_sets for i in range(warmups)], s.cuda)
                estimate, next_set = statistics.median(times), 1 + warmups
            runs = min(s.max_runs, max(s.min_runs, int(s.budget_s * 1e3 / max(estimate, 1e-3))))
            times = time_each(call, [(next_set + i) % n_sets for i in range(runs)], s.cuda)
        except torch.OutOfMemoryError:
            row["status"] = "skipped: out of GPU memory while timing"
            torch.cuda.empty_cache()
            return
        except Exception as error:  # it passed its check: a later call failing is a defect
            row["status"] = f"WRONG: a timed call failed: {_first_line(error)}"
            return
        row["median_ms"] = statistics.median(times)
        row["runs"] = runs

    # -------------------------------------------------------------------------- sections

    def run(self, impls: Implementations) -> None:
        for section in self.s.sections:
            {"overhead": self.overhead, "kata": self.kata, "llm": self.llm}[section](impls)
            if self.s.cuda:
                torch.cuda.empty_cache()

    def overhead(self, impls: Implementations) -> None:
        s, shape, dtype = self.s, self.s.overhead_shape, torch.float32
        self.log(f"bench: overhead {shape} float32")
        sets = self.input_sets([shape] * 3, dtype, cap=8)
        ref, _ = reference(*sets[0], False)
        tolerance = TOLERANCE[dtype]
        for impl in (impls.flawed, impls.fixed, impls.raw_op, impls.sdpa):
            row = new_row("overhead", impl, shape, dtype, False, FWD)
            row["calls_per_batch"] = s.overhead_calls
            self.rows.append(row)
            if reason := self.cannot_run(impl):
                row["status"] = reason
                continue

            try:
                result = impl.call(*sets[0], False)
                _sync(s.cuda)
                bare = [impl.bare(*inputs) for inputs in sets]
            except Exception as error:
                row["status"] = f"unavailable: {_first_line(error)}"
                continue
            error = relative_error(result, ref)
            row["rel_error"] = error if math.isfinite(error) else None
            if not error <= tolerance:
                row["status"] = f"WRONG: relative error {error:.2e} against float32 SDPA"
                continue
            per_call = []
            for batch in range(s.overhead_batches + 1):  # the first batch warms up
                _sync(s.cuda)
                begin = time.perf_counter()
                for i in range(s.overhead_calls):
                    function, args = bare[i % len(bare)]
                    function(*args)
                _sync(s.cuda)
                if batch:
                    per_call.append((time.perf_counter() - begin) * 1e3 / s.overhead_calls)
            row["median_ms"] = statistics.median(per_call)
            row["us_per_call"] = row["median_ms"] * 1e3
            row["runs"] = s.overhead_batches
        self.profile_sdpa("overhead float32", lambda: sdpa(*sets[0], False))

    def kata(self, impls: Implementations) -> None:
        s, dtype, batch, dim = self.s, torch.float32, self.s.kata_batch, 64
        profiled = False
        for seq in s.kata_seqs:
            shape = (batch, seq, dim)
            chosen = (impls.flawed, impls.fixed, impls.sdpa, impls.round_trip)
            rows = [new_row("kata", impl, shape, dtype, False, FWD) for impl in chosen]
            self.rows.extend(rows)
            if s.max_seq is not None and seq > s.max_seq:
                for row in rows:
                    row["status"] = f"skipped: S={seq} over --max-seq {s.max_seq}"
                continue
            self.log(f"bench: kata {shape} float32")
            try:
                sets = self.input_sets([shape] * 3, dtype)
                ref, _ = reference(*sets[0], False)
            except Exception as error:  # out of memory, or a CUDA context an earlier row broke
                for row in rows:
                    row["status"] = f"skipped: no inputs or reference: {_first_line(error)}"
                continue
            flops = attention_flops(batch, 1, seq, seq, dim)

            def check(result, ref=ref):
                return relative_error(result, ref), TOLERANCE[dtype]

            for impl, row in zip(chosen, rows, strict=True):
                if reason := self.cannot_run(impl):
                    row["status"] = reason
                    continue

                def call(i, impl=impl, sets=sets):
                    return impl.call(*sets[i % len(sets)], False)

                self.measure(row, call, len(sets), check if impl.checked else None, None)
                if row["median_ms"] and impl.checked:
                    row["tflops"] = flops / (row["median_ms"] * 1e-3) / 1e12
            if not profiled:
                self.profile_sdpa("kata float32", lambda sets=sets: sdpa(*sets[0], False))
                profiled = True
            del sets, ref
            if s.cuda:
                torch.cuda.empty_cache()

    def llm(self, impls: Implementations) -> None:
        s, dtype = self.s, torch.bfloat16
        chosen = (impls.fixed, impls.sdpa, impls.flash, impls.cudnn)
        no_gpu = None if s.cuda else f"skipped: {NO_GPU}"
        if no_gpu:
            self.notes["llm"] = f"LLM shapes: {NO_GPU}"
        profiled: set[str] = set()
        for seq in s.llm_seqs:  # shortest first: a time limit cuts the longest shapes
            for dim in s.llm_dims:
                for causal in s.llm_causal:
                    shape = (s.llm_batch, s.llm_heads, seq, dim)
                    groups = {
                        pass_: [
                            new_row("llm", impl, shape, dtype, causal, pass_) for impl in chosen
                        ]
                        for pass_ in (FWD, FWD_BWD)
                    }
                    all_rows = [row for rows in groups.values() for row in rows]
                    self.rows.extend(all_rows)
                    reason = no_gpu
                    if reason is None and s.max_seq is not None and seq > s.max_seq:
                        reason = f"skipped: S={seq} over --max-seq {s.max_seq}"
                    reason = reason or self.over_time()
                    if reason:
                        for row in all_rows:
                            row["status"] = reason
                        continue
                    self.llm_shape(impls, chosen, groups, shape, causal, profiled)
                    torch.cuda.empty_cache()
        set_ratios_to_flash(r for r in self.rows if r["section"] == "llm")

    def llm_shape(self, impls, chosen, groups, shape, causal, profiled: set[str]) -> None:
        dtype = torch.bfloat16
        batch, heads, seq, dim = shape
        self.log(f"bench: llm {shape} bfloat16 causal={causal}")
        try:
            sets = self.input_sets([shape] * 4, dtype, requires_grad=True)
            q0, k0, v0, g0 = sets[0]
            ref_out, ref_grads = reference(q0, k0, v0, causal, grad_output=g0)
        except Exception as error:  # out of memory, or a CUDA context an earlier row broke
            for rows in groups.values():
                for row in rows:
                    row["status"] = f"skipped: no inputs or reference: {_first_line(error)}"
            if self.s.cuda:
                torch.cuda.empty_cache()
            return
        tolerance = TOLERANCE[dtype]

        def check_forward(out):
            return relative_error(out, ref_out), tolerance

        def check_backward(result):
            out, grads = result
            errors = [relative_error(out, ref_out)]
            errors += [relative_error(g, r) for g, r in zip(grads, ref_grads, strict=True)]
            return max(errors), tolerance

        for pass_, rows in groups.items():
            backward = pass_ == FWD_BWD
            flops = attention_flops(batch, heads, seq, seq, dim, causal=causal, backward=backward)
            for impl, row in zip(chosen, rows, strict=True):
                if reason := self.cannot_run(impl):
                    row["status"] = reason
                    continue
                call = _llm_call(impl, sets, causal, backward)
                slow_key = (impl.key, dim, causal, pass_)
                check = check_backward if backward else check_forward
                self.measure(row, call, len(sets), check, slow_key, impl.backend)
                if row["median_ms"]:
                    row["tflops"] = flops / (row["median_ms"] * 1e-3) / 1e12
            family = f"llm bfloat16 D={dim} {'causal' if causal else 'non-causal'} {pass_}"
            if family not in profiled:
                profiled.add(family)
                default_call = _llm_call(impls.sdpa, sets, causal, backward)
                self.profile_sdpa(family, lambda call=default_call: call(0))


def _llm_call(impl: Impl, sets, causal: bool, backward: bool):
    if not backward:

        def forward(i):
            q, k, v, _ = sets[i % len(sets)]
            with torch.no_grad():
                return impl.call(q, k, v, causal)

        return forward

    def forward_backward(i):
        q, k, v, grad = sets[i % len(sets)]
        with torch.enable_grad():
            out = impl.call(q, k, v, causal)
            return out, torch.autograd.grad(out, (q, k, v), grad)

    return forward_backward


def _refusal(error: BaseException, caught, backend: str | None) -> str:
    """Why a call was refused. SDPA's "No available kernel" says why only in the warnings before
    it: a header per backend ("cuDNN attention kernel not used because:"), then its reasons."""
    reasons: dict[str, list[str]] = {}
    current = None
    for warning in caught:
        text = re.sub(r"\s*\(Triggered internally at .*", "", str(warning.message), flags=re.S)
        text = " ".join(text.split())
        if text.endswith("not used because:"):
            current = text.removesuffix(" not used because:").lower()
            reasons.setdefault(current, [])
        elif current is not None and text:
            reasons[current].append(text)
    mine = [
        reason
        for header, texts in reasons.items()
        if backend is not None and backend in header
        for reason in texts
    ]
    if mine:
        return "; ".join(dict.fromkeys(mine))
    return _first_line(error)


def backend_of(names: Iterable[str]) -> str:
    """The SDPA backend that a set of kernel (or operator) names shows."""
    text = " ".join(names).lower()
    for backend, words in (
        ("cudnn", ("cudnn",)),
        ("flash", ("flash",)),
        ("efficient", ("fmha", "efficient", "cutlass")),
        ("math", ("softmax", "_scaled_dot_product_attention_math")),
    ):
        if any(word in text for word in words):
            return backend
    return "unknown"


def set_ratios_to_flash(rows: Iterable[dict]) -> None:
    """ratio_to_flash = flash's time / the row's time (TFLOP/s over flash's), per shape and pass."""
    for group in _groups(rows):
        flash = next((r for r in group if r["implementation"] == "sdpa flash"), None)
        if flash is None or not flash["median_ms"]:
            continue
        for row in group:
            if row["median_ms"]:
                row["ratio_to_flash"] = flash["median_ms"] / row["median_ms"]


def _groups(rows: Iterable[dict]) -> list[list[dict]]:
    """Rows of one shape, causality and pass, in order."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        key = (row["section"], tuple(row["shape"]), row["causal"], row["pass"])
        groups.setdefault(key, []).append(row)
    return list(groups.values())


# ------------------------------------------------------------------------------ machine facts


def machine_facts(device: torch.device) -> dict:
    facts = {
        "device_type": device.type,
        "device": "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        count = torch.cuda.device_count()
        facts.update(
            device=props.name + (f" x{count}" if count > 1 else ""),
            gpu_count=count,
            compute_capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            memory_bytes=props.total_memory,
            l2_cache_bytes=getattr(props, "L2_cache_size", None),
            cudnn=torch.backends.cudnn.version(),
            driver=_driver_version(),
        )
    return facts


def _driver_version() -> str | None:
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return None
    try:
        result = subprocess.run(
            [nvidia_smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = result.stdout.strip().splitlines()
    return lines[0].strip() if result.returncode == 0 and lines else None


# ------------------------------------------------------------------------------------ output


def _fmt_ms(ms: float) -> str:
    if ms < 1:
        return f"{ms:.4f}"
    return f"{ms:.3f}" if ms < 100 else f"{ms:.1f}"


def _fmt_tflops(tflops: float) -> str:
    if tflops >= 100:
        return f"{tflops:.0f}"
    return f"{tflops:.1f}" if tflops >= 10 else f"{tflops:.2f}" if tflops >= 1 else f"{tflops:.3f}"


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


class Footnotes:
    """A table's cells that are not a number: a word and a number, the reason listed below."""

    def __init__(self):
        self.reasons: dict[str, int] = {}

    def mark(self, status: str) -> str:
        number = self.reasons.setdefault(status, len(self.reasons) + 1)
        return f"{status.split(':')[0]} [{number}]"

    def lines(self) -> list[str]:
        return [_short(f"  [{n}] {status}", 118) for status, n in self.reasons.items()]


_SECTION_TITLES = {"overhead": "host overhead", "kata": "kata shapes", "llm": "LLM shapes"}
_SECTION_HEADINGS = {"overhead": "Host overhead", "kata": "Kata shapes", "llm": "LLM shapes"}


def _shown(rows: list[dict]) -> list[list[dict]]:
    """The groups a table shows: all but those skipped whole for one reason (--max-seq, the time
    limit, no GPU), which the list of skipped rows gives instead."""
    shown = []
    for group in _groups(rows):
        statuses = {row["status"] for row in group}
        if not (len(statuses) == 1 and next(iter(statuses)).startswith("skipped")):
            shown.append(group)
    return shown


def format_table(report: dict) -> str:
    facts, rows, settings = report["machine"], report["rows"], report["settings"]
    header = f"make bench on {facts['device']}: torch {facts['torch']}"
    if facts["cuda"]:
        header += f", CUDA {facts['cuda']}, driver {facts.get('driver') or 'unknown'}"
    header += f", Python {facts['python']}, {facts['date']}"
    lines = [header + (" (--quick)" if settings["quick"] else "")]
    for section, table in (
        ("overhead", _overhead_table),
        ("kata", _kata_table),
        ("llm", _llm_tables),
    ):
        section_rows = [r for r in rows if r["section"] == section]
        if not section_rows:
            continue
        if _shown(section_rows):
            lines += ["", *table(section_rows, report)]
        else:
            reasons = sorted({r["status"] for r in section_rows})
            lines += ["", f"{_SECTION_HEADINGS[section]}: {'; '.join(reasons)}"]
    skipped: dict[str, list[dict]] = {}
    for row in rows:
        if row["status"].startswith("skipped"):
            skipped.setdefault(row["status"].removeprefix("skipped: "), []).append(row)
    if skipped:
        lines += ["", "Skipped rows:"]
        for reason, group in skipped.items():
            sections = ", ".join(sorted({_SECTION_TITLES[r["section"]] for r in group}))
            lines.append(_short(f"  {len(group):3d} {sections}: {reason}", 118))
    return "\n".join(lines)


_OVERHEAD_NAMES = {
    "flawed": "flawed: attention_wrapper.fast_attention (ctypes)",
    "fixed": "fixed.fast_attention",
    "fixed raw op": "torch.ops.fixed_attention.attention_forward",
    "sdpa": "torch.nn.functional.scaled_dot_product_attention",
}


def _overhead_table(rows, report) -> list[str]:
    facts, overhead = report["machine"], report["settings"]["overhead"]
    lines = [
        f"Per-call host overhead: {tuple(overhead['shape'])} float32 on {facts['device']}; wall "
        f"clock, median of {overhead['batches']} batches of {overhead['calls_per_batch']} calls",
        f"  {'what is called':<50}{'µs/call':>9}  status",
    ]
    for row in rows:
        value = f"{row['us_per_call']:.1f}" if row["median_ms"] else "-"
        name = _OVERHEAD_NAMES.get(row["implementation"], row["label"])
        lines.append(f"  {name:<50}{value:>9}  {_short(row['status'], 55)}")
    return lines + _sdpa_ran(report, "overhead float32")


def _sdpa_ran(report, family) -> list[str]:
    """One line: the backend SDPA's default call used for a shape family, and its first kernel."""
    entry = report["sdpa_kernels"].get(family)
    if not entry:
        return []
    names = entry.get("kernels") or entry.get("ops") or []
    first = f" ({_short(names[0], 70)})" if names else ""
    return [f"  SDPA default ran: {entry['backend']}{first}"]


def _kata_table(rows, report) -> list[str]:
    notes = Footnotes()
    order = ["flawed", "fixed", "sdpa", "host round trip"]
    labels = {r["implementation"]: r["label"] for r in rows}
    lines = [
        f"Kata shapes: float32 (B, S, 64), B={rows[0]['shape'][0]}, forward, on "
        f"{report['machine']['device']}: ms per call (TFLOP/s), median of the runs",
        f"  {'S':>6}  " + "".join(f"{labels[key]:<21}" for key in order) + "fixed vs flawed",
    ]
    for group in _shown(rows):
        by_impl = {r["implementation"]: r for r in group}
        cells = []
        for key in order:
            row = by_impl[key]
            if row["median_ms"]:
                tflops = f" ({_fmt_tflops(row['tflops'])})" if row["tflops"] else ""
                cells.append(f"{_fmt_ms(row['median_ms']) + ' ms' + tflops:<21}")
            else:
                cells.append(f"{notes.mark(row['status']):<21}")
        flawed, fixed = by_impl["flawed"]["median_ms"], by_impl["fixed"]["median_ms"]
        speedup = f"{flawed / fixed:.2f}×" if flawed and fixed else "-"
        lines.append(f"  {group[0]['shape'][1]:>6}  " + "".join(cells) + speedup)
    return lines + notes.lines() + _sdpa_ran(report, "kata float32")


def _llm_tables(rows, report) -> list[str]:
    order = ["fixed", "sdpa", "sdpa flash", "sdpa cudnn"]
    labels = {r["implementation"]: r["label"] for r in rows}
    batch, heads = rows[0]["shape"][:2]
    lines = []
    for pass_ in (FWD, FWD_BWD):
        notes = Footnotes()
        title = "forward" if pass_ == FWD else "forward+backward"
        lines += [
            f"LLM shapes: bfloat16 (B={batch}, H={heads}, S, D), {title}: TFLOP/s (ratio to "
            "SDPA flash), and flash's ms per call",
            f"  {'D':>4} {'causal':<7}{'S':>6}  "
            + "".join(f"{labels[key]:<18}" for key in order)
            + f"{'flash ms':>10}",
        ]
        groups = _shown([r for r in rows if r["pass"] == pass_])
        groups.sort(key=lambda g: (g[0]["shape"][3], g[0]["causal"], g[0]["shape"][2]))
        for i, group in enumerate(groups):
            family = (group[0]["shape"][3], group[0]["causal"])
            if i and family != (groups[i - 1][0]["shape"][3], groups[i - 1][0]["causal"]):
                lines.append("")
            by_impl = {r["implementation"]: r for r in group}
            cells = []
            for key in order:
                row = by_impl[key]
                if row["median_ms"]:
                    ratio = row["ratio_to_flash"]
                    text = _fmt_tflops(row["tflops"]) + (f" ({ratio:.2f}×)" if ratio else "")
                    cells.append(f"{text:<18}")
                else:
                    cells.append(f"{notes.mark(row['status']):<18}")
            flash_ms = by_impl["sdpa flash"]["median_ms"]
            _, _, seq, dim = group[0]["shape"]
            causal = "yes" if group[0]["causal"] else "no"
            lines.append(
                f"  {dim:>4} {causal:<7}{seq:>6}  "
                + "".join(cells)
                + f"{_fmt_ms(flash_ms) if flash_ms else '-':>10}"
            )
        lines += [*notes.lines(), ""]
    families = {k: v for k, v in report["sdpa_kernels"].items() if k.startswith("llm")}
    if families:
        lines.append("SDPA default ran (torch.profiler, one call per family; all names in JSON):")
        for family, entry in families.items():
            names = entry.get("kernels") or entry.get("ops") or []
            shown = _short(", ".join(names), 60)
            lines.append(f"  {family:<38} {_short(entry['backend'], 12):<12} {shown}")
    return lines


def write_chart(rows: list[dict], path: Path) -> str:
    """TFLOP/s of the LLM rows against S, one panel per pass, head dim and causality."""
    timed = [r for r in rows if r["section"] == "llm" and r["tflops"]]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no chart"
    if not timed:
        return "no chart: no LLM rows were timed"
    panels = sorted({(r["pass"], r["shape"][3], r["causal"]) for r in timed})
    passes = sorted({p for p, _, _ in panels})
    columns = sorted({(d, c) for _, d, c in panels})
    figure, axes = plt.subplots(
        len(passes), len(columns), figsize=(4 * len(columns), 3.5 * len(passes)), squeeze=False
    )
    for i, pass_ in enumerate(passes):
        for j, (dim, causal) in enumerate(columns):
            ax = axes[i][j]
            for color, impl in enumerate(dict.fromkeys(r["implementation"] for r in timed)):
                points = sorted(
                    (r["shape"][2], r["tflops"])
                    for r in timed
                    if r["implementation"] == impl
                    and r["pass"] == pass_
                    and r["shape"][3] == dim
                    and r["causal"] == causal
                )
                if points:
                    label = next(r["label"] for r in timed if r["implementation"] == impl)
                    ax.plot(*zip(*points, strict=True), marker="o", label=label, color=f"C{color}")
            seqs = sorted({r["shape"][2] for r in timed})
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqs, [str(seq) for seq in seqs], fontsize=7)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{pass_}, D={dim}, {'causal' if causal else 'non-causal'}", fontsize=9)
            ax.set_xlabel("S")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    batch, heads = timed[0]["shape"][:2]
    figure.suptitle(f"Attention TFLOP/s, bfloat16 (B={batch}, H={heads}, S, D)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"chart: {path}"


# -------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kata bench",
        description="Time flawed/, fixed/ and torch's SDPA side by side: host overhead, the "
        "kata's shapes and LLM shapes (GPU). Prints a table and writes JSON (and a chart).",
    )
    parser.add_argument("--quick", action="store_true", help="fewer shapes and runs")
    parser.add_argument(
        "--only", nargs="+", choices=SECTIONS, metavar="SECTION", help="overhead, kata, llm"
    )
    parser.add_argument(
        "--max-seq", type=int, metavar="N", help="skip sequence lengths above N (kata and LLM)"
    )
    parser.add_argument(
        "--json", type=Path, default=Path("bench.json"), help="where the rows go (bench.json)"
    )
    parser.add_argument("--png", type=Path, help="the chart (default: bench.png beside the JSON)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (0)")
    parser.add_argument(
        "--budget",
        dest="budget_s",
        type=float,
        metavar="S",
        help="seconds of timed runs per row (1; 0.25 with --quick)",
    )
    parser.add_argument(
        "--min-runs", type=int, metavar="N", help="timed runs per row at least (5; 3 with --quick)"
    )
    parser.add_argument(
        "--max-runs", type=int, metavar="N", help="timed runs per row at most (50; 10 with --quick)"
    )
    parser.add_argument(
        "--max-call",
        dest="max_call_s",
        type=float,
        metavar="S",
        help="rows whose single call takes longer are not timed (1 s; 0.5 s with --quick)",
    )
    parser.add_argument(
        "--time-limit",
        dest="time_limit_s",
        type=float,
        metavar="S",
        help="time no new row after this many seconds (150; 60 with --quick)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    settings = make_settings(args, device)
    bench = Bench(settings)
    bench.log(f"bench: loading flawed/ and fixed/ on {device.type} (fixed/ builds on first use)")
    impls = Implementations(settings.sections)
    bench.started = time.perf_counter()  # the time limit counts from here, not from the build
    bench.run(impls)
    report = {
        "machine": machine_facts(device),
        "settings": settings.to_json(),
        "elapsed_s": round(bench.elapsed(), 1),
        "sdpa_kernels": bench.sdpa_kernels,
        "notes": bench.notes,
        "rows": bench.rows,
    }
    print(format_table(report))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    png = args.png or args.json.with_suffix(".png")
    try:
        png.parent.mkdir(parents=True, exist_ok=True)
        chart = write_chart(bench.rows, png)
    except Exception as error:  # the chart is optional: never lose the table or the JSON to it
        chart = f"no chart: {_first_line(error)}"
    print(f"\nrows: {args.json}; {chart}; took {bench.elapsed():.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
