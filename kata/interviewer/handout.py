"""`python -m kata handout DEST` (make handout): the candidate's copy of the repository.

flawed/ as shipped, the kata's tools without what holds answers or serves only the interviewer,
CANDIDATE.md as its README and handout.mk as its Makefile. The catalog's hints are sealed (see
kata/harness/catalog.py): the hint command still reads them, plain text does not show them.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from kata import REPO_ROOT, KataError

KATA_DIR = REPO_ROOT / "kata"
BRIEF = REPO_ROOT / "CANDIDATE.md"  # becomes the handout's README.md
HANDOUT_MAKEFILE = Path(__file__).resolve().with_name("handout.mk")  # the handout's Makefile
# Files of kata/ that hold answers or only make sense in the interviewer's repository. A module
# that holds round-two answers belongs here; tests/test_candidate_loop.py greps every handout.
INTERVIEWER_ONLY = ("harness/round2.py", "interviewer/handout.mk")


def handout_files(round_number: int = 1) -> dict[str, str]:
    """relative path -> text of every file of the candidate's copy."""
    from kata.toolchain import shipped

    if not BRIEF.is_file() or not HANDOUT_MAKEFILE.is_file():
        raise KataError("make handout works in the interviewer's repository, not in a handout")
    # flawed/ from the shipped manifest, never the working copy: no local edits, no build output.
    # The proposed fix of round two fixes round-one flaws: a round-one copy must not hold it,
    # nor its manifest (make reset would write it back).
    flawed = shipped.shipped()
    if round_number == 1:
        skip = shipped.ROUND2_SUBDIR + "/"
        flawed = {name: text for name, text in flawed.items() if not name.startswith(skip)}
    files = {f"flawed/{name}": text for name, text in flawed.items()}
    for path in sorted(KATA_DIR.rglob("*")):
        relative = path.relative_to(KATA_DIR)
        if not path.is_file() or "__pycache__" in relative.parts or path.suffix == ".pyc":
            continue
        if relative.as_posix() not in INTERVIEWER_ONLY:
            files[f"kata/{relative.as_posix()}"] = path.read_text()
    files["kata/harness/catalog.py"] = sealed_catalog(files["kata/harness/catalog.py"])
    files[shipped.MANIFEST.relative_to(REPO_ROOT).as_posix()] = (
        json.dumps(flawed, indent=1, sort_keys=True) + "\n"
    )
    files["Makefile"] = HANDOUT_MAKEFILE.read_text()
    files["README.md"] = BRIEF.read_text()
    files["pyproject.toml"] = _candidate_pyproject((REPO_ROOT / "pyproject.toml").read_text())
    gitignore = (REPO_ROOT / ".gitignore").read_text().splitlines()
    files[".gitignore"] = "".join(f"{line}\n" for line in gitignore if "fixed" not in line)
    return files


def sealed_catalog(source: str) -> str:
    """catalog.py for a handout: each flaw's `where=` and `hints=` replaced by SEALED, their
    texts in _SEALED_ANSWERS, encoded (see catalog.py). The answers come from the catalog
    as imported, the places to cut from the source's syntax tree: comments and layout stay."""
    from kata.harness import catalog

    answers = {f.id: {"where": f.where, "hints": list(f.hints)} for f in catalog.CATALOG}
    blob = catalog.seal(answers)
    chunks = "".join(f'    "{blob[i : i + 90]}"\n' for i in range(0, len(blob), 90))
    encoded = source.encode()  # the tree's columns count UTF-8 bytes
    starts = [0]
    for line in encoded.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))

    def span(node: ast.expr) -> tuple[int, int]:
        start = starts[node.lineno - 1] + node.col_offset
        return start, starts[node.end_lineno - 1] + node.end_col_offset

    cuts: list[tuple[tuple[int, int], str]] = []
    sealed: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_flaw":
            values = [kw.value for kw in node.keywords if kw.arg in ("where", "hints")]
            cuts += [(span(value), "SEALED") for value in values]
            sealed += [ast.literal_eval(node.args[0])] * len(values)
        elif (
            isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_SEALED_ANSWERS"
        ):
            cuts.append((span(node.value), f"(\n{chunks})"))
    # Every flaw sealed twice, and the blob placed once: anything else would leak or not run.
    if sorted(sealed) != sorted([*answers] * 2) or len(cuts) != len(sealed) + 1:
        raise KataError(
            "kata/harness/catalog.py has changed shape: make handout cannot seal its hints"
        )
    for (start, end), text in sorted(cuts, reverse=True):
        encoded = encoded[:start] + text.encode() + encoded[end:]
    return encoded.decode()


def _candidate_pyproject(text: str) -> str:
    """pyproject.toml without what points at fixed/: its description and its lint exclusion."""
    description = "An attention wrapper to review and repair: run `make kata`."
    text = re.sub(r"^description = .*$", f'description = "{description}"', text, flags=re.M)
    return re.sub(r'"fixed/[^"]*",\s*', "", text)


def build_handout(dest: Path, round_number: int = 1) -> Path:
    dest = dest.expanduser().resolve()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise KataError(f"{dest} is not an empty directory; give make handout a new or empty one")
    files = handout_files(round_number)
    for name, text in files.items():
        path = dest / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return dest
