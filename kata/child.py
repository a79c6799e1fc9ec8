"""The isolated side of a probe: `python -m kata.child SPEC_JSON`, started by kata.isolation.

Speaks JSON lines on stdout, each prefixed with MARKER so the implementation's own prints are
ignored: {"case": name} before each case (so a crash can be placed), then {"verdict": ...}.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

MARKER = "@@kata "


def emit(message: dict) -> None:
    os.write(1, (MARKER + json.dumps(message) + "\n").encode())  # unbuffered: survives a crash


def make_loader(implementation: dict):
    from kata.probes import ImplementationImportError

    def load(module_name: str):
        try:
            if implementation["kind"] == "fixed":
                import fixed

                return fixed.fast_attention
            path = Path(implementation["path"]) / "attention_wrapper.py"
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
            return module.fast_attention
        except Exception as error:
            from kata.probes import _first_line

            raise ImplementationImportError(_first_line(error)) from error

    return load


def main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    from kata.probes import PROBES, ImplementationImportError, ProbeContext

    context = ProbeContext(
        load=make_loader(spec["implementation"]),
        seed=spec["seed"],
        device=spec["device"],
        report_case=lambda name: emit({"case": name}),
        report_failure=lambda text: emit({"failure": text}),
        planted_library=Path(spec["planted_library"]) if spec.get("planted_library") else None,
    )
    try:
        verdict = PROBES[spec["probe"]](context)
        result = {"status": verdict.status, "evidence": verdict.evidence}
    except ImplementationImportError as error:
        result = {"status": "present", "evidence": str(error)}
    except Exception as error:
        # The implementation left the process unable to go on (a poisoned CUDA context, say):
        # the parent joins this to the failures already reported.
        from kata.probes import _first_line

        emit({"stopped": f"the probe could not go on: {_first_line(error)}"})
        return
    emit({"verdict": result})


if __name__ == "__main__":
    main(sys.argv[1])
