"""The only process that runs the implementation under test: `python -I runner.py`, started by
the probe's judge (kata.harness.child), which never imports the implementation itself.

The judge sends requests (an operation and tensors); this process runs the implementation on
them and answers with what it saw: the output, the exception's type and message, the gradients,
the profiler's events. It knows nothing of the verdict: not the reference, not what a loud
message must name, not the vendor kernel's answer. So code under test that reads or rewrites
what it finds in this process (its frames, its modules) learns nothing that earns points; the
judge decides in a process that code never ran in.

Run as a plain script (`python -P`, so kata/ is not on its path), not as part of the kata
package: nothing here imports the harness.
Frames on stdin/stdout: an 8-byte length, a JSON header line, then the tensors: torch.save'd from
the judge; to the judge, a JSON line of (name, dtype, sizes) and their raw bytes (_write).
"""

import contextlib
import ctypes
import importlib.util
import io
import json
import mmap
import os
import struct
import sys
import traceback
from pathlib import Path

import torch


def _read(stream) -> tuple[dict, dict]:
    size = stream.read(8)
    if len(size) < 8:
        raise EOFError
    (length,) = struct.unpack("<Q", size)
    frame = stream.read(length)
    header, _, blob = frame.partition(b"\n")
    tensors = torch.load(io.BytesIO(blob), weights_only=True) if blob else {}
    return json.loads(header), tensors


def _write(stream, header: dict, tensors: dict | None = None) -> None:
    """A frame for the judge: the header line, a line listing each tensor (name, dtype, sizes),
    then their bytes in that order. Raw bytes, not torch.save: the judge unpickles and unzips
    nothing this process sends (a deflated archive inflates a thousandfold)."""
    table, chunks = [], []
    for name, tensor in (tensors or {}).items():
        dense = tensor.detach().to("cpu").contiguous()
        table.append([name, str(dense.dtype).removeprefix("torch."), list(dense.shape)])
        chunks.append(ctypes.string_at(dense.data_ptr(), dense.numel() * dense.element_size()))
    lines = json.dumps(header).encode() + b"\n" + json.dumps(table).encode() + b"\n"
    frame = lines + b"".join(chunks)
    stream.write(struct.pack("<Q", len(frame)) + frame)
    stream.flush()


def unpack(spec: dict, tensors: dict, name: str, guards=None) -> torch.Tensor:
    """A tensor the judge sent: its storage, then a view with the sender's sizes and strides on
    the sender's device (a transposed or expanded view stays one). With `guards` (InputGuards),
    the storage ends where its mapping ends."""
    if spec["device"] == "meta":
        dtype = getattr(torch, spec["dtype"])
        return torch.empty_strided(spec["size"], spec["stride"], dtype=dtype, device="meta")
    if guards is not None:
        base = guards.place(tensors[name], torch.device(spec["device"]))
    else:
        base = tensors[name].to(spec["device"])
    return base.as_strided(spec["size"], spec["stride"], spec["offset"])


def unpack_all(specs: list[dict], tensors: dict, prefix: str, guards=None) -> list[torch.Tensor]:
    """The tensors the judge packed as prefix0, prefix1, ... (remote.pack_all)."""
    return [unpack(spec, tensors, f"{prefix}{i}", guards) for i, spec in enumerate(specs)]


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("handle_types", ctypes.c_int),
        ("location", _Location),
        ("win32_metadata", ctypes.c_void_p),
        ("flags", ctypes.c_ubyte * 8),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _CudaArray:
    """A device address torch.as_tensor can wrap (the CUDA array interface, public)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "data": (address, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 2,
        }


class InputGuards:
    """Probe inputs placed at the very end of a mapping of their own, with unmapped memory after
    it: a kernel that reads past an input faults (SIGSEGV on the host, an illegal address on a
    GPU), where in the allocators' blocks it would read a neighbour's bytes and go unseen, and a
    wrapper that checks its inputs only after the launch would pass. Host: an anonymous mapping
    with its last page made inaccessible. GPU: CUDA's virtual memory management, through the
    driver API. Where either is refused, plain tensors."""

    PINNED, ON_DEVICE, READ_WRITE = 1, 1, 3  # CUDA's enum values

    def __init__(self):
        self.mappings = []  # device: (address, reserved bytes, handle, mapped bytes)

    def place(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        nbytes = host.numel() * host.element_size()
        if nbytes == 0:
            return host.to(device)
        try:
            if device.type == "cpu":
                return self._place_on_host(host, nbytes)
            if device.type == "cuda":
                return self._place_on_device(host, device, nbytes)
        except (OSError, AttributeError, RuntimeError, ValueError, BufferError):
            pass
        return host.to(device)

    @staticmethod
    def _place_on_host(host, nbytes):
        page = mmap.PAGESIZE
        mapped = -(-nbytes // page) * page
        region = mmap.mmap(-1, mapped + page)
        anchor = ctypes.c_char.from_buffer(region)
        address = ctypes.addressof(anchor)
        del anchor  # the tensor below keeps the mapping alive, as long as it lives
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.mprotect(address + mapped, page, 0) != 0:  # PROT_NONE
            raise OSError(ctypes.get_errno(), "mprotect")
        offset = mapped - (-(-nbytes // 16) * 16)  # 16-byte aligned, ending at the guard page
        raw = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
        placed = raw.view(host.dtype).view(host.shape)
        placed.copy_(host)
        return placed

    def _place_on_device(self, host, device, nbytes):
        cuda = ctypes.CDLL("libcuda.so.1")
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.empty(0, device=device)  # the context, current in this thread
        location = _Location(self.ON_DEVICE, index)
        prop = _AllocationProp(self.PINNED, 0, location)
        granule = ctypes.c_size_t()
        _driver(cuda.cuMemGetAllocationGranularity(ctypes.byref(granule), ctypes.byref(prop), 0))
        step = granule.value
        mapped = -(-nbytes // step) * step
        handle, address = ctypes.c_ulonglong(), ctypes.c_ulonglong()
        _driver(
            cuda.cuMemCreate(
                ctypes.byref(handle),
                ctypes.c_size_t(mapped),
                ctypes.byref(prop),
                ctypes.c_ulonglong(0),
            )
        )
        reserved = mapped + step  # the granule after the mapping stays unmapped
        if cuda.cuMemAddressReserve(
            ctypes.byref(address),
            ctypes.c_size_t(reserved),
            ctypes.c_size_t(0),
            ctypes.c_ulonglong(0),
            ctypes.c_ulonglong(0),
        ):
            cuda.cuMemRelease(handle)
            raise RuntimeError("cuMemAddressReserve failed")
        self.mappings.append((address.value, reserved, handle.value, 0))
        _driver(
            cuda.cuMemMap(
                address, ctypes.c_size_t(mapped), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0)
            )
        )
        self.mappings[-1] = (address.value, reserved, handle.value, mapped)
        access = _AccessDesc(location, self.READ_WRITE)
        _driver(
            cuda.cuMemSetAccess(
                address, ctypes.c_size_t(mapped), ctypes.byref(access), ctypes.c_size_t(1)
            )
        )
        start = address.value + mapped - (-(-nbytes // 16) * 16)  # 16-byte aligned, at the end
        raw = torch.as_tensor(_CudaArray(start, nbytes), device=device)
        placed = raw.view(host.dtype).view(host.shape)
        placed.copy_(host)
        return placed

    def release(self) -> None:
        """Unmap every device input (after the call's work is done; a poisoned context may
        refuse). Host inputs go with the last tensor that uses them."""
        if not self.mappings:
            return
        cuda = ctypes.CDLL("libcuda.so.1")
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        for address, reserved, handle, mapped in self.mappings:
            if mapped:
                cuda.cuMemUnmap(ctypes.c_ulonglong(address), ctypes.c_size_t(mapped))
            cuda.cuMemAddressFree(ctypes.c_ulonglong(address), ctypes.c_size_t(reserved))
            cuda.cuMemRelease(ctypes.c_ulonglong(handle))
        self.mappings.clear()


def _driver(status: int) -> None:
    if status != 0:
        raise RuntimeError(f"CUDA driver error {status}")


def pack_result(result, tensors: dict, name: str) -> dict:
    """What the implementation returned, as the judge will see it."""
    if not isinstance(result, torch.Tensor):
        return {"type": type(result).__name__}
    spec = {"type": "Tensor", "device": str(result.device), "dtype": str(result.dtype)}
    spec["size"] = list(result.shape)
    spec["grad_fn"] = result.grad_fn is not None
    if result.device.type != "meta":
        tensors[name] = result.detach().to("cpu").clone()
    return spec


def raised(error: BaseException) -> dict:
    return {
        "type": type(error).__name__,
        "mro": [cls.__name__ for cls in type(error).__mro__],
        "message": str(error)[:4000],
    }


def cuda_failure() -> str | None:
    """Kernels fail after the call returns: synchronise so the failure lands on this call."""
    if not torch.cuda.is_initialized():
        return None
    try:
        torch.cuda.synchronize()
    except Exception as error:
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
    return None


class Runner:
    def __init__(self, implementation: dict):
        self.implementation = implementation
        self.functions = {}

    def load(self, module_name: str):
        if module_name not in self.functions:
            if self.implementation["kind"] == "fixed":
                import fixed

                self.functions[module_name] = fixed.fast_attention
            else:
                path = Path(self.implementation["path"]) / "attention_wrapper.py"
                spec = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[module_name] = module
                spec.loader.exec_module(module)
                self.functions[module_name] = module.fast_attention
        return self.functions[module_name]

    # -- operations: each takes the request's header and tensors, returns (header, tensors)

    def op_load(self, request, tensors):
        if request.get("chdir"):
            os.chdir(request["chdir"])
        try:
            self.load(request.get("module", "candidate_attention_wrapper"))
        except BaseException as error:
            if isinstance(error, SyntaxError) and error.filename:
                where = f"{Path(error.filename).name}:{error.lineno}"
                return {"import_error": f"syntax error at {where}: {error.msg}"}, {}
            if isinstance(error, SystemExit | KeyboardInterrupt):
                raise
            return {"import_error": f"{type(error).__name__}: {_first(error)}"}, {}
        return {"loaded": True}, {}

    def op_call(self, request, tensors):
        """One call; the output, or what it raised, and whether CUDA failed after it."""
        fast_attention = self.load(request.get("module", "candidate_attention_wrapper"))
        guards = InputGuards() if request.get("guarded") else None
        try:
            return self._call(
                fast_attention, request, unpack_all(request["inputs"], tensors, "in", guards)
            )
        finally:
            if guards is not None:
                guards.release()

    def _call(self, fast_attention, request, inputs):
        if request.get("chdir"):
            os.chdir(request["chdir"])
        if request.get("set_device") is not None:
            torch.cuda.set_device(request["set_device"])
        before = [t.clone() if t.device.type != "meta" else None for t in inputs]
        out = {}
        try:
            answer = {"result": pack_result(fast_attention(*inputs), out, "result")}
        except Exception as error:
            answer = {"raised": raised(error)}
        answer["cuda_failed"] = cuda_failure()
        # The caller's tensors are the caller's: an answer written over them is corruption.
        answer["overwritten"] = [
            i
            for i, (now, then) in enumerate(zip(inputs, before, strict=True))
            if then is not None and not answer["cuda_failed"] and not torch.equal(now, then)
        ]
        return answer, out

    def op_gradients(self, request, tensors):
        """A loss that mixes the output with other terms, backpropagated; with torch.compile
        when asked. The output and the three gradients."""
        fast_attention = self.load("candidate_attention_wrapper")
        if request.get("compile"):
            fast_attention = torch.compile(fast_attention, fullgraph=True, backend="aot_eager")
        q, k, v = (
            t.detach().requires_grad_(True) for t in unpack_all(request["inputs"], tensors, "in")
        )
        weight = tensors["weight"].to(q.device)
        out = {}
        try:
            output = fast_attention(q, k, v)
            answer = {"result": pack_result(output, out, "result")}
            loss = (output * weight).sum() + (q * q).sum() + k.sin().sum() + 0.5 * v.sum()
            loss.backward()
        except Exception as error:
            return {"raised": raised(error), "cuda_failed": cuda_failure()}, out
        for name, tensor in (("query", q), ("key", k), ("value", v)):
            if tensor.grad is not None:
                out[f"grad_{name}"] = tensor.grad.detach().to("cpu")
        answer["cuda_failed"] = cuda_failure()
        return answer, out

    def op_planted(self, request, tensors):
        """Import and call from a directory holding a planted library."""
        os.chdir(request["chdir"])
        answer = self.op_load({"module": request["module"]}, {})[0]
        if "import_error" not in answer:
            # failing here is fine; loading the planted library is what matters
            with contextlib.suppress(Exception):
                self.op_call({"module": request["module"], "inputs": request["inputs"]}, tensors)
        return answer, {}  # whether it was loaded, the judge sees for itself

    def op_host_alloc(self, request, tensors):
        """One warmed-up call under the profiler (every event name inside the call, by the
        profiler's clock), then one under set_sync_debug_mode('error')."""
        from torch.autograd.profiler import record_function
        from torch.profiler import ProfilerActivity, profile

        fast_attention = self.load("candidate_attention_wrapper")
        inputs = unpack_all(request["inputs"], tensors, "in")
        fast_attention(*inputs)
        torch.cuda.synchronize()
        label = "kata: the call under test"
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            with record_function(label):
                result = fast_attention(*inputs)
            torch.cuda.synchronize()
        events = profiler.events()
        window = next((e for e in events if e.name == label), None)
        inside = sorted(
            {
                e.name
                for e in events
                if window is not None
                and window.time_range.start <= e.time_range.start <= window.time_range.end
            }
        )
        answer = {"window": window is not None, "inside": inside}
        answer["all"] = sorted({e.name for e in events if "Memcpy" in e.name})
        out = {}
        answer["result"] = pack_result(result, out, "result")
        answer["waited"] = _waits_for_the_device(fast_attention, inputs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            fast_attention(*inputs)
            answer["sync_debug"] = None
        except RuntimeError as error:
            answer["sync_debug"] = f"{type(error).__name__}: {_first(error)}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
        answer["cuda_failed"] = cuda_failure() or _fresh_cuda_failure()
        return answer, out

    def op_stream(self, request, tensors):
        """Inputs made on a side stream, the call, the output consumed there at once."""
        fast_attention = self.load("candidate_attention_wrapper")
        shape, seed = request["shape"], request["seed"]
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            generator = torch.Generator(device="cuda").manual_seed(seed)
            inputs = [torch.randn(shape, device="cuda", generator=generator) for _ in range(3)]
            consumed = fast_attention(*inputs).clone()
        torch.cuda.synchronize()
        return {"result": {"type": "Tensor"}}, {"result": consumed.to("cpu")}

    def op_graph(self, request, tensors):
        """One call captured in a CUDA graph (warmed up outside), replayed on new inputs."""
        fast_attention = self.load("candidate_attention_wrapper")
        static = unpack_all(request["inputs"], tensors, "in")
        fresh = unpack_all(request["fresh"], tensors, "new")
        try:
            warm = torch.cuda.Stream()
            warm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(warm):
                fast_attention(*static)
            torch.cuda.current_stream().wait_stream(warm)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_output = fast_attention(*static)
            for target, source in zip(static, fresh, strict=True):
                target.copy_(source)
            graph.replay()
            torch.cuda.synchronize()
        except Exception as error:
            return {"raised": raised(error), "cuda_failed": _fresh_cuda_failure()}, {}
        out = {}
        return {"result": pack_result(static_output, out, "result")}, out

    def op_big(self, request, tensors):
        """The int32-sizes call: inputs made here from the seed (too large to send), the
        output's sampled rows sent back."""
        fast_attention = self.load("candidate_attention_wrapper")
        generator = torch.Generator(device="cuda").manual_seed(request["seed"])
        shape = request["shape"]
        inputs = [torch.randn(shape, device="cuda", generator=generator) for _ in range(3)]
        try:
            result = fast_attention(*inputs)
        except Exception as error:
            return {"raised": raised(error), "cuda_failed": cuda_failure()}, {}
        out = {}
        answer = {"cuda_failed": cuda_failure()}
        if isinstance(result, torch.Tensor) and list(result.shape) == shape:
            rows = result[request["batches"]][:, request["rows"]]
            answer["result"] = {"type": "Tensor", "device": str(result.device), "size": shape}
            answer["result"]["dtype"] = str(result.dtype)
            out["sample"] = rows.detach().to("cpu")
        else:
            answer["result"] = pack_result(result, {}, "result")
        return answer, out

    def op_health(self, request, tensors):
        return {"cuda_failed": _fresh_cuda_failure()}, {}


# About half a second of one SM at an H100's clock: far longer than a call that does not wait.
BUSY_CYCLES = 1_000_000_000


def _waits_for_the_device(fast_attention, inputs) -> bool:
    """Whether a call returns only once work queued before it is done. The device is kept busy
    first (a spin kernel on the current stream; torch.cuda._sleep is private, but it is the one
    way to hold the device for a known time, and tests/test_torch_support.py pins it), then the
    call. A call that does not wait leaves that work running; a synchronize, a blocking copy or
    polling an event in a loop all wait, whatever the profiler lists."""
    torch.cuda.synchronize()
    busy = torch.cuda.Event()
    torch.cuda._sleep(BUSY_CYCLES)
    busy.record()
    fast_attention(*inputs)
    finished = busy.query()
    torch.cuda.synchronize()
    return finished


def _first(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else ""


def _fresh_cuda_failure() -> str | None:
    """A fresh CUDA operation must still work after the calls (no poisoned context)."""
    if not torch.cuda.is_initialized():
        return None
    try:
        if torch.ones(4, device="cuda").add_(1).sum().item() != 8:
            return "a fresh CUDA operation gave a wrong result afterwards"
    except Exception as error:
        return f"the process's CUDA context is poisoned afterwards: {_first(error)}"
    return None


def main() -> None:
    # The answers go out on a descriptor of their own; what the implementation prints goes to
    # stderr, where the judge keeps it apart from the protocol.
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    implementation = json.loads(sys.argv[1])
    runner = Runner(implementation)
    while True:
        try:
            request, tensors = _read(requests)
        except EOFError:
            return
        operation = getattr(runner, "op_" + request["op"])
        try:
            header, out = operation(request, tensors)
        except Exception as error:  # a failure outside the call itself: say where
            header, out = {"stopped": f"{type(error).__name__}: {_first(error)}"}, {}
            traceback.print_exc()
        _write(answers, header, out)


if __name__ == "__main__":
    main()
