"""Do two checkouts give the same bits? fixed.fast_attention's output and its gradients dQ, dK
and dV over SDPA's arguments, compared case by case: the check for a kernel change meant to
leave every result as it was (perf/NOTES.md v44). From the repository root of any checkout:

    python perf/ab_bits.py A_DIR B_DIR [--device cuda|cpu]

Runs this file with --fingerprint in each checkout in turn, importing that checkout's fixed/
(built as perf/ab.py needs it), same seeds in both. Per case it prints two integer sums of each
tensor's bits (plain, and weighted by position), then which tensors differ. The cases: head dims
64, 128 and 256, L = S = 1000 and 2048; plain, causal, a bool and a float mask, dropout 0.1, GQA
8:2, Ev = 64 (D > 64), scale -0.3; bf16, B = 2, H = 8. `--device cpu`: float32, head dim 64,
L = S = 100 and 129 (a quick run, for tests). On CUDA the backward adds up dQ by atomics in no
fixed order (fixed/csrc/attention_cuda.cu), so dQ can differ between two runs of one checkout:
a case where only dQ differs is reported as such and does not count as a difference.
Exit status 0: the same bits; 1: some case differs; 2: bad input or a failed run (one line)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ab import Failure, run_in  # perf/ab.py: a script's own directory is on sys.path

HERE = Path(__file__).resolve()
TENSORS = ("out", "dq", "dk", "dv")
KINDS = ("plain", "causal", "bool", "float", "dropout", "gqa", "ev64", "neg")


def cases(device: str) -> list[tuple[int, int, str]]:
    """(head dim, L = S, kind) in the order printed."""
    dims, lengths = ((64, 128, 256), (1000, 2048)) if device == "cuda" else ((64,), (100, 129))
    return [
        (dim, length, kind)
        for dim in dims
        for length in lengths
        for kind in KINDS
        if not (kind == "ev64" and dim == 64)
    ]


def fingerprint(tensor) -> str:
    """Two sums of the tensor's bits as integers: exact, so equal bits give equal sums (int64
    arithmetic wraps the same way in both runs)."""
    import torch

    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    bits = tensor.detach().contiguous().view(as_int).flatten().long()
    weights = torch.arange(bits.numel(), device=bits.device) % 1000003
    return f"{int(bits.sum())}:{int((bits * weights).sum())}"


def print_fingerprints(device: str) -> None:
    """The --fingerprint run, inside a checkout: one line per case."""
    sys.path.insert(0, os.getcwd())  # the checkout run in, not the one holding this file
    import torch

    import fixed

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for dim, length, kind in cases(device):
        torch.manual_seed(1234 + dim + length)
        batch, heads = 2, 8
        kv_heads = 2 if kind == "gqa" else heads
        value_dim = 64 if kind == "ev64" else dim

        q, k, v = (
            torch.randn(batch, count, length, width, device=device, dtype=dtype).requires_grad_()
            for count, width in ((heads, dim), (kv_heads, dim), (kv_heads, value_dim))
        )
        options = {
            "causal": {"is_causal": True},
            "bool": {"attn_mask": torch.rand(batch, 1, length, length, device=device) > 0.3},
            "float": {
                "attn_mask": torch.randn(1, heads, length, length, device=device, dtype=dtype)
            },
            "dropout": {"dropout_p": 0.1},
            "gqa": {"enable_gqa": True},
            "neg": {"scale": -0.3},
        }.get(kind, {})
        torch.manual_seed(99)  # dropout's bits
        out = fixed.fast_attention(q, k, v, **options)
        out.backward(torch.randn_like(out))
        sums = " ".join(fingerprint(t) for t in (out, q.grad, k.grad, v.grad))
        print(f"{dim} {length} {kind} {sums}", flush=True)


def run_checkout(directory: Path, device: str, timeout: float) -> dict[str, list[str]]:
    """This file's --fingerprint run in `directory`: case -> the four tensors' sums."""
    output = run_in(directory, HERE, ["--fingerprint", "--device", device], timeout)
    rows = {}
    for line in output.splitlines():
        fields = line.split()
        if len(fields) == 3 + len(TENSORS):
            rows[" ".join(fields[:3])] = fields[3:]
    if len(rows) != len(cases(device)):
        raise Failure(f"{directory}: {len(rows)} of {len(cases(device))} cases printed")
    return rows


def compare(a: dict[str, list[str]], b: dict[str, list[str]], device: str) -> tuple[list[str], int]:
    """One line per case, and how many cases differ (dQ alone on CUDA does not count)."""
    lines, differing = [], 0
    for case, sums in a.items():
        changed = [name for name, x, y in zip(TENSORS, sums, b[case], strict=True) if x != y]
        if not changed:
            lines.append(f"{case:24s} same")
        elif changed == ["dq"] and device == "cuda":
            lines.append(f"{case:24s} same but dq (atomics: dq can differ run to run)")
        else:
            differing += 1
            lines.append(f"{case:24s} DIFFER: {', '.join(changed)}")
    return lines, differing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("checkouts", type=Path, nargs="*", metavar="DIR", help="A, then B")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per checkout")
    parser.add_argument("--fingerprint", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fingerprint:
        print_fingerprints(args.device)
        return 0
    try:
        if len(args.checkouts) != 2:
            raise Failure(f"{len(args.checkouts)} checkouts given: two, A and B")
        for directory in args.checkouts:
            if not (directory / "fixed" / "__init__.py").is_file():
                raise Failure(f"{directory}: no fixed/__init__.py (a checkout's root?)")
        a, b = (run_checkout(path, args.device, args.timeout) for path in args.checkouts)
    except Failure as failure:
        print(f"ab_bits: {failure}", file=sys.stderr)
        return 2
    lines, differing = compare(a, b, args.device)
    print(f"A = {args.checkouts[0]}, B = {args.checkouts[1]}; {args.device}")
    print("\n".join(lines))
    print(f"{differing} of {len(lines)} cases differ")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
