"""How a probe's process ended, in words: its signal or last error line, and the sandbox's cap
it ran into. Apart from remote.py, which imports torch: the review process words a judge's end
without importing torch (it never needs it, and importing it would slow every review's start)."""

from __future__ import annotations

import re
import signal

STDERR_MARK = "@@kata-case"  # on a judge's stderr before each case: what was said before it is
# not the case's evidence (torch's import-time warnings, say)


# A warning as Python prints it ("path:12: UserWarning: ..."), and the source line after it.
_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")


def _own_lines(stderr: bytes) -> list[str]:
    """What the process said on stderr during its last case: not what importing torch printed
    before (a missing numpy, say), and no warnings, which are not why a process dies."""
    lines = stderr.decode(errors="replace").splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith(STDERR_MARK)]
    if marks:
        lines = lines[marks[-1] + 1 :]
    kept, skip_next = [], False
    for line in lines:
        if _WARNING.match(line):
            skip_next = True  # the warning's source line follows, indented
            continue
        if skip_next and line.startswith(" "):
            skip_next = False
            continue
        skip_next = False
        kept.append(line)
    return kept


def cap_reached(told: str, returncode: int = 0) -> str | None:
    """The sandbox's cap (sandbox.py) that a process's last words or its end show it ran into,
    as the evidence names it; None when they show none."""
    from kata.harness import sandbox

    caps = [
        (("MemoryError", "can't allocate memory", "Cannot allocate memory"), "memory"),
        (("No space left on device",), "tmp"),
        (("File too large",), "file"),  # EFBIG: Python ignores SIGXFSZ
        (("can't start new thread",), "processes"),
    ]
    if "Resource temporarily unavailable" in told and re.search(r"fork|spawn|Popen|thread", told):
        caps.append((("Resource temporarily unavailable",), "processes"))  # EAGAIN
    reached = next((cap for words, cap in caps if any(word in told for word in words)), None)
    if returncode == -signal.SIGXFSZ:
        reached = "file"
    cap = {
        "memory": f"the sandbox's memory cap ({sandbox.memory_cap() / 2**30:.0f} GiB a process)",
        "tmp": f"the private /tmp's {sandbox.TMP_CAP / 2**30:.0f} GiB (or the disk's space)",
        "file": f"the sandbox's file-size cap ({sandbox.FILE_CAP / 2**30:.0f} GiB)",
        "processes": "the sandbox's process cap",
    }.get(reached)
    return f"{cap} was reached" if cap else None


def death(returncode: int, stderr: bytes) -> str:
    """Say how a probe's process ended without a verdict: a signal, or its last error line; and
    the sandbox's cap it ran into, where its end or its error shows one."""
    own = [line.strip() for line in _own_lines(stderr) if line.strip()]
    cap = cap_reached("\n".join(own), returncode)
    reached = f"; {cap}" if cap else ""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        lines = _own_lines(stderr)
        # What the C library said before faulthandler's report, e.g. "free(): invalid pointer".
        end = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python")), 0)
        said = [line.strip() for line in lines[:end] if line.strip()]
        return f"process died with {name}" + (f" ({said[-1][:160]})" if said else "") + reached
    if returncode == 0:
        return "the process exited (code 0) before the probe's verdict: the implementation ended it"
    interesting = [line for line in own if not line.startswith(("File ", "Traceback", "^"))]
    last = interesting[-1] if interesting else "no output"
    return f"process exited with code {returncode}: {last[:240]}{reached}"
