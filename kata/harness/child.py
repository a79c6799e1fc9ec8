"""The judge of one probe: `python -m kata.harness.child SPEC_JSON`, started by isolation.py.

It never imports the implementation under test: that runs in a runner process of its own
(runner.py, started here from the spec's command, sandboxed for a candidate's code), and
every answer comes back as data (remote.py). So nothing the implementation does in its process
reaches this one, and the verdict is decided where its code never ran.

Speaks JSON lines on stdout, each prefixed with MARKER: {"case": name} before each case (so a
crash can be placed), {"failure": text} as failures are found, then {"verdict": ...}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

MARKER = "@@kata "


def emit(message: dict) -> None:
    os.write(1, (MARKER + json.dumps(message) + "\n").encode())  # unbuffered: survives a crash


def machine_facts() -> dict:
    """What a review needs to know of the machine's GPUs (review.Machine). Found in a child of the
    judge zygote, so that the review process never imports torch: on two cores its import
    competed with the zygotes' for the cores and delayed every probe."""
    import torch

    if not torch.cuda.is_available():
        return {"gpu_count": 0}
    count = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    free_bytes, total_bytes = torch.cuda.mem_get_info(0)
    return {"gpu_count": count, "name": name, "free_bytes": free_bytes, "total_bytes": total_bytes}


def main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    if spec.get("probe") == "machine":
        emit({"machine": machine_facts()})
        return
    from kata.harness.endings import STDERR_MARK
    from kata.harness.judging import ImplementationImportError, first_line
    from kata.harness.kernel_check import VendorKernel
    from kata.harness.probes import PROBES, ProbeContext
    from kata.harness.remote import Remote, RunnerStopped

    def report_case(name: str, lane: int) -> None:
        os.write(2, f"\n{STDERR_MARK} {name}\n".encode())
        emit({"case": name, "lane": lane})

    runner = spec["runner"]
    env = dict(os.environ, **runner["env"])
    for name in runner.get("unset", []):
        env.pop(name, None)
    remote = Remote(
        runner["command"], Path(runner["cwd"]), env, runner["signal_exits"], runner.get("zygote")
    )
    kernel = None
    if spec.get("kernel_library"):
        kernel = VendorKernel(Path(spec["kernel_library"]), spec["device"])
    context = ProbeContext(
        remote=remote,
        seed=spec["seed"],
        device=spec["device"],
        probe=spec["probe"],
        report_case=report_case,
        report_failure=lambda text: emit({"failure": text}),
        report_lane_done=lambda lane: emit({"lane_done": lane}),
        planted_library=Path(spec["planted_library"]) if spec.get("planted_library") else None,
        kernel=kernel,
    )
    try:
        verdict = PROBES[spec["probe"]](context)
        result = {"status": verdict.status, "evidence": verdict.evidence}
    except ImplementationImportError as error:
        result = {"status": "present", "evidence": str(error), "import_failure": error.cause}
    except RunnerStopped as error:
        emit({"stopped": str(error)})  # the parent joins this to the failures already reported
        return
    except Exception as error:
        emit({"stopped": f"the probe could not go on: {first_line(error)}"})
        return
    finally:
        remote.close()
    if kernel is not None:
        result["kernel"] = kernel.summary()
    emit({"verdict": result})


if __name__ == "__main__":
    main(sys.argv[1])
