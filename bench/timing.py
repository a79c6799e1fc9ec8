"""How the bench times: one call, a batch of calls (CUDA events or perf_counter), and the Bench,
which checks every implementation against the reference, then times the rows of each section."""

from __future__ import annotations

import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch

from bench.alternate import Entry, SmClock, alternate, runs_for
from bench.arguments import run_arguments
from bench.backends import Implementations, _first_line, _refusal, backend_of, sdpa
from bench.cases import (
    FWD,
    FWD_BWD,
    MAX_INPUT_SETS,
    NO_GPU,
    NO_WARMUP_MS,
    ROTATION_FACTOR,
    TOLERANCE,
    Impl,
    Settings,
    attention_flops,
    new_row,
    reference,
    relative_error,
    set_ratios,
)


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
        self.clock = SmClock(settings.device)  # read after each alternating batch (llm)

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

    def measure(
        self, row, call, n_sets: int, check, slow_key=None, backend=None, timed=True
    ) -> Entry | None:
        """Check `call(0)` once, then time `call(i)` (i: the input set) into `row`.

        check(result) -> (relative error, tolerance), or None for no check. slow_key: rows that
        share it and come later (longer sequences) are skipped once one call is too slow.
        backend: the SDPA backend the call forces ("flash", "cudnn"), to say why it refused.
        timed=False: check and warm up only, and return the row's Entry for alternate() (None
        where the row is not to be timed)."""
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
            if first_ms >= NO_WARMUP_MS:  # one-time work (cuDNN's plans) or a slow row: a
                _, estimate = timed_call(lambda: call(1 % n_sets), s.cuda)  # second call says
                next_set = 2
            if estimate < NO_WARMUP_MS:  # else the calls so far were warm-up enough
                warmups = min(10, max(1, int(0.1 * s.budget_s * 1e3 / max(estimate, 1e-3))))
                indices = [(next_set + i) % n_sets for i in range(warmups)]
                times = time_each(call, indices, s.cuda)
                estimate, next_set = statistics.median(times), next_set + warmups
            if not timed:
                return Entry(row, call, n_sets, next_set, estimate)
            runs = runs_for(s, estimate)
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
        return None

    def alternate(self, entries: list[Entry]) -> None:
        """Time checked, warm rows together in alternating batches (bench/alternate.py)."""
        alternate(entries, self.s.alternate_rounds, self.s, self.clock, time_each)

    # -------------------------------------------------------------------------- sections

    def run(self, impls: Implementations) -> None:
        for section in self.s.sections:
            sections = {"overhead": self.overhead, "kata": self.kata, "llm": self.llm}
            sections["args"] = lambda impls: run_arguments(self, impls)
            sections[section](impls)
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
        set_ratios(r for r in self.rows if r["section"] == "llm")

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
            entries = []  # checked and warm: timed together, in alternating batches
            for impl, row in zip(chosen, rows, strict=True):
                if reason := self.cannot_run(impl):
                    row["status"] = reason
                    continue
                call = _llm_call(impl, sets, causal, backward)
                slow_key = (impl.key, dim, causal, pass_)
                check = check_backward if backward else check_forward
                entry = self.measure(row, call, len(sets), check, slow_key, impl.backend, False)
                if entry is not None:
                    entries.append(entry)
            self.alternate(entries)
            for row in rows:
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
