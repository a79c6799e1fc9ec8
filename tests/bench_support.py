"""What tests/test_bench.py and tests/test_bench_args.py share: the mark of the checks that only
the CPU run can make, and the bench's settings for the GPU-only rows' logic on the CPU (tiny
bfloat16 shapes; SDPA's CPU flash kernel stands in for the GPU's, and cuDNN refuses)."""

from __future__ import annotations

import pytest
import torch

from bench import backends, cases, cli

CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="checks the CPU run; on this GPU machine run `python -m kata bench --quick` instead",
)


def cpu_settings_and_implementations():
    args = cli.build_parser().parse_args(["--quick"])
    settings = cases.make_settings(args, torch.device("cpu"))
    return settings, backends.Implementations(["llm"])
