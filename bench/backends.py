"""The implementations timed (flawed/'s ctypes wrapper, fixed/, SDPA and its forced backends),
why SDPA refused a call, which backend the profiler's kernel names show, and the machine's facts."""

from __future__ import annotations

import datetime
import importlib.util
import math
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from bench.cases import Impl
from kata import FLAWED_DIR


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def load_flawed() -> tuple[Callable | None, str | None]:
    """flawed/attention_wrapper.fast_attention, loaded as the kata loads it: the vendor library
    built for this machine, imported with flawed/ as the working directory (the wrapper opens
    ./custom_attention.so). Returns (function, None) or (None, why not)."""
    from kata.toolchain import builders

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


def sdpa(query, key, value, causal=False, **kwargs):
    """SDPA; kwargs (attn_mask, dropout_p, enable_gqa) go to it as they are."""
    # (B, S, E) inputs go in as (B, 1, S, E): SDPA's fused kernels take 4-D inputs only.
    if query.dim() == 3:
        out = F.scaled_dot_product_attention(
            query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), is_causal=causal, **kwargs
        )
        return out.squeeze(1)
    return F.scaled_dot_product_attention(query, key, value, is_causal=causal, **kwargs)


def sdpa_forced(backend):
    from torch.nn.attention import sdpa_kernel

    def call(query, key, value, causal=False, **kwargs):
        with sdpa_kernel([backend]):
            return sdpa(query, key, value, causal, **kwargs)

    return call


def host_round_trip(query, key, value, causal=False):
    return torch.empty_like(query, device="cpu").to(query.device)


class Implementations:
    """Loaded once per run: flawed, fixed (and its raw operator), SDPA and its backends. Every
    `call` takes (query, key, value, causal) and, but for flawed's, the raw operator's and the host
    round trip's, SDPA's other keyword arguments (attn_mask, dropout_p, enable_gqa)."""

    def __init__(self, sections: Iterable[str]):
        from torch.nn.attention import SDPBackend

        sections = set(sections)
        flawed, flawed_missing = (None, None)
        if sections & {"overhead", "kata"}:
            flawed, flawed_missing = load_flawed()
        fixed, fixed_missing = load_fixed()

        def fixed_call(query, key, value, causal=False, **kwargs):
            return fixed.fast_attention(query, key, value, is_causal=causal, **kwargs)

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
        self.efficient = Impl(
            "sdpa efficient",
            "SDPA efficient",
            sdpa_forced(SDPBackend.EFFICIENT_ATTENTION),
            backend="efficient",
        )
        self.math = Impl("sdpa math", "SDPA math", sdpa_forced(SDPBackend.MATH), backend="math")
        self.round_trip = Impl("host round trip", "host round trip", host_round_trip, checked=False)


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
