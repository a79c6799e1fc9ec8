"""The `args` section: what SDPA's other arguments cost fixed/ against SDPA, bfloat16, H = 16,
D = 64 and 128, forward and forward+backward, at S = 2048 with B = 4 and S = 8192 with B = 1
(there a call is 4x the work of S = 2048's; B = 4 would make it 16x and the float32 reference's
score tensors 17 GB each). Each case changes one thing from the plain row: a bool mask (the
causal mask as a tensor: half its blocks hidden, which the Hopper kernels skip), an additive
(1, 1, L, S) float mask (nothing hidden), grouped-query heads 16:4, head dims 80 and 256 (E = Ev,
each its one D), Ev = D/2, dropout, float32 inputs (the only case not in bfloat16). Every row runs
fixed/'s tensor-core kernels: head dim 80 and Ev != E at 64 or 128, whichever holds them (as
they are in Hopper's forward, padded elsewhere; perf/NOTES.md), 256 as it is; float32 in 3xTF32.

Each (case, S, D, pass) has three rows: fixed, SDPA's default (what a caller gets) and "SDPA
best" (what SDPA can do with those arguments): the fastest of its default and of its flash,
efficient and cuDNN backends, each forced by sdpa_kernel, that takes the call (math when none
does). The default is a candidate because a forced backend can be the slower of the two: on an
H100 the forced cuDNN row ran 0.15-0.42 ms per batch where the default, the same kernel, held
0.16 (forcing enters a context manager on every call, the likely cause; not measured alone).
Refusals are no error: the best row's `backends` gives each backend tried, its time or why not,
and `backend` the winner ("default" where SDPA's own choice was the fastest). ratio_to_sdpa
and ratio_to_best: the default's and the best's time over the row's.

Every S = 2048 row runs before any S = 8192 one, and a pass of a case is timed whole or not at
all, so a time limit cuts the longest rows and leaves each with its time or the reason. Rows are
checked against the float32 math reference with the same arguments, except dropout, whose keep
mask differs from every SDPA backend's by design: those rows say so and are timed unchecked."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench.backends import _first_line
from bench.cases import (
    FWD,
    FWD_BWD,
    NO_GPU,
    TOLERANCE,
    attention_flops,
    new_row,
    relative_error,
    set_ratios,
)

BEST = "sdpa best"  # the implementation of the best rows
UNCHECKED = "ok (unchecked: dropout's mask differs from SDPA's by design)"
# A backend's fields that its best row takes.
_COPIED = (
    "median_ms",
    "runs",
    "tflops",
    "rel_error",
    "status",
    "batch_medians_ms",
    "batch_sm_clock_mhz",
    "batch_clock_limits",
    "sm_clock_mhz",
)


@dataclass(frozen=True)
class Case:
    name: str
    heads_kv: int | None = None  # under GQA (enable_gqa=True)
    head_dim: int | None = None  # E = Ev at this one size; None: each D of the section
    half_v: bool = False  # Ev = D/2
    mask: str | None = None  # "bool": the causal mask as a bool tensor; "float": (1, 1, L, S)
    dropout_p: float = 0.0
    dtype: torch.dtype = torch.bfloat16

    def dims(self, section_dims: tuple[int, ...]) -> tuple[int, ...]:
        return (self.head_dim,) if self.head_dim else section_dims

    def head_dim_v(self, dim: int) -> int:
        return dim // 2 if self.half_v else dim


CASES = (
    Case("plain"),
    Case("bool mask", mask="bool"),
    Case("float mask", mask="float"),
    Case("GQA 16:4", heads_kv=4),
    Case("head dim 80", head_dim=80),
    Case("head dim 256", head_dim=256),
    Case("Ev D/2", half_v=True),
    Case("dropout 0.1", dropout_p=0.1),
    Case("float32", dtype=torch.float32),
)


def grid(settings) -> list[tuple[Case, tuple[int, int, int, int]]]:
    """(case, (B, H, S, D)) in the order they run: every case at the shortest S first."""
    return [
        (case, (batch, settings.llm_heads, seq, dim))
        for seq, batch in settings.args_seqs
        for case in CASES
        for dim in case.dims(settings.args_dims)
    ]


def new_rows(impls, case: Case, shape) -> dict[str, dict[str, dict]]:
    """The rows of one case and shape: {pass: {implementation: row}}, fixed, SDPA's default and
    SDPA's best."""
    groups = {}
    for pass_ in (FWD, FWD_BWD):
        rows = {}
        for impl in (impls.fixed, impls.sdpa):
            rows[impl.key] = new_row("args", impl, shape, case.dtype, False, pass_)
        best = new_row("args", impls.sdpa, shape, case.dtype, False, pass_)
        best.update(implementation=BEST, label="SDPA best", backend=None, backends={})
        rows[BEST] = best
        for row in rows.values():
            row.update(
                case=case.name,
                head_dim_v=case.head_dim_v(shape[3]),
                ratio_to_sdpa=None,
                ratio_to_best=None,
            )
        groups[pass_] = rows
    return groups


def run_arguments(bench, impls) -> None:
    s = bench.s
    no_gpu = None if s.cuda else f"skipped: {NO_GPU}"
    section_rows = []
    for case, shape in grid(s):
        groups = new_rows(impls, case, shape)
        rows = [row for group in groups.values() for row in group.values()]
        section_rows += rows
        bench.rows.extend(rows)
        seq = shape[2]
        reason = no_gpu
        if reason is None and s.max_seq is not None and seq > s.max_seq:
            reason = f"skipped: S={seq} over --max-seq {s.max_seq}"
        if reason := reason or bench.over_time():
            for row in rows:
                row["status"] = reason
            continue
        run_case(bench, impls, case, shape, groups)
        if s.cuda:  # the case's inputs and reference went with run_case's frame
            torch.cuda.empty_cache()
    set_ratios(section_rows, {"ratio_to_sdpa": ("sdpa",), "ratio_to_best": (BEST,)})


def run_case(bench, impls, case: Case, shape, groups) -> None:
    """Check and time one case at one shape: fixed, SDPA's default and its backends, each pass
    whole or, once the time limit is spent, not at all."""
    batch, heads, seq, dim = shape
    dim_v, heads_kv = case.head_dim_v(dim), case.heads_kv or heads
    dtype_name = str(case.dtype).removeprefix("torch.")
    bench.log(f"bench: args {case.name} {shape} Ev={dim_v} {dtype_name}")
    try:
        shapes = [
            shape,
            (batch, heads_kv, seq, dim),
            (batch, heads_kv, seq, dim_v),
            (batch, heads, seq, dim_v),
        ]
        sets = bench.input_sets(shapes, case.dtype, requires_grad=True)
        kwargs = {
            "attn_mask": _mask(case, seq, seq, bench),
            "dropout_p": case.dropout_p,
            "enable_gqa": case.heads_kv is not None,
        }
        check_fwd, check_bwd = (
            (None, None) if case.dropout_p else _checks(sets[0], kwargs, case.dtype)
        )
    except Exception as error:  # out of memory, or a CUDA context an earlier row broke
        for rows in groups.values():
            for row in rows.values():
                row["status"] = f"skipped: no inputs or reference: {_first_line(error)}"
        return
    for pass_, rows in groups.items():
        if reason := bench.over_time():
            for row in rows.values():
                row["status"] = reason
            continue
        backward = pass_ == FWD_BWD
        flops = attention_flops(batch, heads, seq, seq, dim, backward=backward)
        if dim_v != dim:  # q·kᵀ at E, p·v at Ev
            flops *= (dim + dim_v) / (2 * dim)
        timer = _Timer(bench, sets, kwargs, backward, check_bwd if backward else check_fwd, flops)
        entries, timed_rows = [], []
        for impl in (impls.fixed, impls.sdpa):
            if impl.missing:
                rows[impl.key]["status"] = f"skipped: {impl.missing}"
            else:
                entries += timer.prepare(rows[impl.key], impl)
                timed_rows.append(rows[impl.key])
        tried = _prepare_best(rows[BEST], impls, timer, entries)
        bench.alternate(entries)  # every row of the pass in turn, as the llm section's
        for row in [*timed_rows, *tried.values()]:
            timer.finish(row)
        _choose_best(rows[BEST], tried, rows["sdpa"])


@dataclass
class _Timer:
    """Checks and warms up one pass of one case at one shape, whichever implementation calls it;
    finish() completes a row once it has been timed."""

    bench: object
    sets: list[tuple[torch.Tensor, ...]]
    kwargs: dict
    backward: bool
    check: Callable | None
    flops: float

    def prepare(self, row: dict, impl) -> list:
        """The row's Entry for the alternating batches, or none if it is not to be timed."""
        call = _call(impl, self.sets, self.kwargs, self.backward)
        entry = self.bench.measure(
            row, call, len(self.sets), self.check, backend=impl.backend, timed=False
        )
        return [] if entry is None else [entry]

    def finish(self, row: dict) -> None:
        if self.kwargs["dropout_p"] and row["status"] == "ok":
            row["status"] = UNCHECKED
        if row["median_ms"]:
            row["tflops"] = self.flops / (row["median_ms"] * 1e-3) / 1e12


def _prepare_best(best: dict, impls, timer: _Timer, entries: list) -> dict[str, dict]:
    """The rows of SDPA's backends that the best row chooses from, checked and warmed up (their
    entries added to `entries`). Math, which takes every call and is the slowest where another
    does, only when no fused backend took the call."""
    tried = {}
    best_dtype = getattr(torch, best["dtype"])
    for impl in (impls.flash, impls.efficient, impls.cudnn, impls.math):
        warm = {id(entry.row) for entry in entries}
        if impl is impls.math and any(id(row) in warm for row in tried.values()):
            break
        row = new_row("args", impl, best["shape"], best_dtype, False, best["pass"])
        entries += timer.prepare(row, impl)
        tried[impl.backend] = row
    return tried


def _choose_best(best: dict, tried: dict[str, dict], default: dict) -> None:
    """The fastest backend that took the call, or SDPA's default where it was faster than each
    forced one, into `best`."""
    best["backends"] = {name: {key: row.get(key) for key in _COPIED} for name, row in tried.items()}
    timed = {name: row for name, row in tried.items() if row["median_ms"]}
    if timed and default["median_ms"]:
        timed["default"] = default
    if not timed:
        best["status"] = _none_timed(tried)
        return
    name = min(timed, key=lambda backend: timed[backend]["median_ms"])
    best.update({key: timed[name].get(key) for key in _COPIED}, backend=name)
    # A backend that took the call and got it wrong: said, though another won.
    wrong = [
        f"{other} {row['status']}"
        for other, row in tried.items()
        if row["status"].startswith("WRONG")
    ]
    best["status"] = "; ".join([best["status"], *wrong])


def _none_timed(tried: dict[str, dict]) -> str:
    """The best row's status when no backend was timed: the gravest of the backends' own words
    (WRONG, then skipped, then unavailable), and each backend's status."""
    words = {row["status"].split(":")[0] for row in tried.values()}
    word = next((w for w in ("WRONG", "skipped") if w in words), "unavailable")
    each = "; ".join(f"{name} {row['status']}" for name, row in tried.items())
    return f"{word}: no SDPA backend was timed ({each})"


def _mask(case: Case, len_q: int, len_kv: int, bench) -> torch.Tensor | None:
    if case.mask == "bool":
        return torch.ones(len_q, len_kv, dtype=torch.bool, device=bench.s.device).tril()
    if case.mask == "float":  # a bias per (query, key), broadcast over batch and heads
        return bench.randn((1, 1, len_q, len_kv), torch.bfloat16)
    return None


def _call(impl, sets, kwargs, backward):
    def forward(i):
        q, k, v, _ = sets[i % len(sets)]
        with torch.no_grad():
            return impl.call(q, k, v, **kwargs)

    def forward_backward(i):
        q, k, v, grad = sets[i % len(sets)]
        with torch.enable_grad():
            out = impl.call(q, k, v, **kwargs)
            return out, torch.autograd.grad(out, (q, k, v), grad)

    return forward_backward if backward else forward


def _checks(inputs, kwargs, dtype):
    """Forward and forward+backward checks against SDPA's math backend in float32 (its products
    in float32, never TF32)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, grad = (t.detach().float().requires_grad_() for t in inputs)
    mask = kwargs["attn_mask"]
    mask = mask.float() if mask is not None and mask.is_floating_point() else mask
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            ref_out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=kwargs["enable_gqa"]
            )
        ref_grads = torch.autograd.grad(ref_out, (q, k, v), grad)
    finally:
        torch.set_float32_matmul_precision(precision)
    ref_out = ref_out.detach()
    tolerance = TOLERANCE[dtype]

    def check_forward(out):
        return relative_error(out, ref_out), tolerance

    def check_backward(result):
        out, grads = result
        errors = [relative_error(out, ref_out)]
        errors += [relative_error(g, r) for g, r in zip(grads, ref_grads, strict=True)]
        return max(errors), tolerance

    return check_forward, check_backward
