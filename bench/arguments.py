"""The `args` section: what SDPA's other arguments cost fixed/ against SDPA's default, bfloat16,
forward and forward+backward, at one LLM shape. Each case changes one thing from the plain
D = 128 row: a bool mask (the causal mask as a tensor: half its blocks hidden, which the Hopper
kernels skip), an additive float mask (nothing hidden), grouped-query heads, a head dim the
tensor cores do not take as it is, Ev != E, dropout. Every row runs the tensor-core kernels;
head dim 80 and Ev != E padded to 128 (perf/NOTES.md).

Rows are checked against the float32 math reference with the same arguments, except dropout,
whose keep mask differs from SDPA's by design: those rows say so and are timed unchecked."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench.cases import FWD, FWD_BWD, NO_GPU, TOLERANCE, attention_flops, new_row, relative_error


@dataclass(frozen=True)
class Case:
    name: str
    heads_kv: int | None = None  # under GQA (enable_gqa=True)
    head_dim: int = 128
    head_dim_v: int | None = None  # Ev when it differs from E
    mask: str | None = None  # "bool": the causal mask as a bool tensor; "float": (1, 1, L, S)
    dropout_p: float = 0.0


CASES = (
    Case("plain"),
    Case("bool mask", mask="bool"),
    Case("float mask", mask="float"),
    Case("GQA 16:4", heads_kv=4),
    Case("head dim 80", head_dim=80),
    Case("Ev 64", head_dim_v=64),
    Case("dropout 0.1", dropout_p=0.1),
)


def _mask(case: Case, len_q: int, len_kv: int, bench) -> torch.Tensor | None:
    if case.mask == "bool":
        return torch.ones(len_q, len_kv, dtype=torch.bool, device=bench.s.device).tril()
    if case.mask == "float":  # a bias per (query, key), broadcast over batch and heads
        return bench.randn((1, 1, len_q, len_kv), torch.bfloat16)
    return None


def run_arguments(bench, impls) -> None:
    s, dtype = bench.s, torch.bfloat16
    chosen = (impls.fixed, impls.sdpa)
    batch, heads, seq = s.args_batch, s.llm_heads, s.args_seq
    for case in CASES:
        head_dim_v = case.head_dim_v or case.head_dim
        heads_kv = case.heads_kv or heads
        shape = (batch, heads, seq, case.head_dim)
        groups = {}
        for pass_ in (FWD, FWD_BWD):
            rows = [new_row("args", impl, shape, dtype, False, pass_) for impl in chosen]
            for row in rows:
                row["case"] = case.name
            groups[pass_] = rows
            bench.rows.extend(rows)
        reason = None if s.cuda else f"skipped: {NO_GPU}"
        reason = reason or bench.over_time()
        if reason:
            for row in (r for rows in groups.values() for r in rows):
                row["status"] = reason
            continue
        bench.log(f"bench: args {case.name} {shape} bfloat16")
        shapes = [
            shape,
            (batch, heads_kv, seq, case.head_dim),
            (batch, heads_kv, seq, head_dim_v),
            (batch, heads, seq, head_dim_v),
        ]
        sets = bench.input_sets(shapes, dtype, requires_grad=True)
        mask = _mask(case, seq, seq, bench)
        kwargs = {"attn_mask": mask, "enable_gqa": case.heads_kv is not None}
        check_fwd = check_bwd = None
        if case.dropout_p == 0:
            check_fwd, check_bwd = _checks(sets[0], kwargs)
        for pass_, rows in groups.items():
            backward = pass_ == FWD_BWD
            flops = attention_flops(batch, heads, seq, seq, case.head_dim, backward=backward)
            if head_dim_v != case.head_dim:  # q·kᵀ at E, p·v at Ev
                flops *= (case.head_dim + head_dim_v) / (2 * case.head_dim)
            for impl, row in zip(chosen, rows, strict=True):
                if why := bench.cannot_run(impl):
                    row["status"] = why
                    continue
                function = _function(impl, impls)
                call = _call(function, sets, kwargs, case.dropout_p, backward)
                bench.measure(row, call, len(sets), check_bwd if backward else check_fwd)
                if case.dropout_p and row["status"] == "ok":
                    row["status"] = "ok (unchecked: dropout's mask differs from SDPA's by design)"
                if row["median_ms"]:
                    row["tflops"] = flops / (row["median_ms"] * 1e-3) / 1e12
        del sets
        torch.cuda.empty_cache()


def _function(impl, impls):
    if impl is impls.fixed:
        import fixed

        return fixed.fast_attention
    return F.scaled_dot_product_attention


def _call(function, sets, kwargs, dropout_p, backward):
    def forward(i):
        q, k, v, _ = sets[i % len(sets)]
        with torch.no_grad():
            return function(q, k, v, dropout_p=dropout_p, **kwargs)

    def forward_backward(i):
        q, k, v, grad = sets[i % len(sets)]
        with torch.enable_grad():
            out = function(q, k, v, dropout_p=dropout_p, **kwargs)
            return out, torch.autograd.grad(out, (q, k, v), grad)

    return forward_backward if backward else forward


def _checks(inputs, kwargs):
    """Forward and forward+backward checks against SDPA's math backend in float32."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, grad = (t.detach().float().requires_grad_() for t in inputs)
    mask = kwargs["attn_mask"]
    mask = mask.float() if mask is not None and mask.is_floating_point() else mask
    with sdpa_kernel([SDPBackend.MATH]):
        ref_out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=kwargs["enable_gqa"]
        )
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), grad)
    tolerance = TOLERANCE[torch.bfloat16]

    def check_forward(out):
        return relative_error(out, ref_out), tolerance

    def check_backward(result):
        out, grads = result
        errors = [relative_error(out, ref_out)]
        errors += [relative_error(g, r) for g, r in zip(grads, ref_grads, strict=True)]
        return max(errors), tolerance

    return check_forward, check_backward
