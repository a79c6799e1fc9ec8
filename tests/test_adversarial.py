"""Adversarial candidates: known-bad wrappers must fail and known-good ones pass, each for the
reason its author states (as rustlings checks its exercises and KernelBench its evaluator).

Every file in tests/adversarial/ replaces attention_wrapper.py in a copy of the shipped flawed/
(vendor sources and the built library included) and is reviewed like a candidate's submission.
Its leading comment block says what it is and the verdict the harness must give, per flaw id:

    # expect ID: STATUS ["evidence substring"]      on every machine
    # expect cpu ID: STATUS ["evidence substring"]  on a machine without a GPU
    # expect gpu ID: STATUS ["evidence substring"]  on a GPU machine
    # expect ID: STATUS "one" | "another"           either substring will do
    # timeout [cpu|gpu]: SECONDS                    the probes' time limit (default: the harness's)
    # must not create: PATH                         outside the copy (~: the user's real home);
                                                    removed after the review if it was created
    # focus: ID, ID, ...                            the ids it is about (default: all it states)
    # xfail: REASON                                 a hole the harness knowingly leaves open

STATUS is fixed, present or partial (partial only where the catalog gives partial points); an
evidence substring, when given, must occur in the evidence verbatim (one of them, where a header
gives alternatives: a candidate whose attack works only against an in-process judge fails for
one reason there and another where its code runs in a process of its own). Every file states a
verdict for every catalog id on both kinds of machine; ids this machine cannot run
(Machine.skip_reason) are left out of its review. Add a candidate by adding a file: `pytest -k
NAME` runs one; tests/adversarial/README.md describes the families.

By default (`make test`, CI) every candidate is reviewed on every id it states that this machine
can run. KATA_ADVERSARIAL=focus reviews only each candidate's focus ids (what it is about), a
few minutes instead of about ten on two cores, for quick iteration. KATA_ADVERSARIAL_IDS=ID,ID
reviews only those ids of every candidate (the multi-gpu verdicts on a two-GPU machine, say).
KATA_ADVERSARIAL_SEED=N reruns with the seed a failure printed.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kata.harness.catalog import BY_ID, CATALOG
from kata.harness.review import Machine, resolve_implementation, run_review
from kata.toolchain import builders, shipped

CORPUS = Path(__file__).resolve().parent / "adversarial"
CANDIDATES = sorted(CORPUS.glob("*.py"))
MACHINES = ("cpu", "gpu")
STATUSES = ("fixed", "present", "partial")
PER_ARGUMENT = frozenset(flaw.id for flaw in CATALOG if getattr(flaw, "partial_points", 0))

_EXPECT = re.compile(
    r"# expect(?: (?P<machine>\w+))? (?P<id>[\w-]+): (?P<status>\w+)"
    r'(?: (?P<evidence>"[^"]+"(?: \| "[^"]+")*))?'
)
_TIMEOUT = re.compile(r"# timeout(?: (?P<machine>\w+))?: (?P<seconds>\d+(?:\.\d+)?)")
_XFAIL = re.compile(r"# xfail: (?P<reason>\S.*)")
_OUTSIDE = re.compile(r"# must not create: (?P<path>\S+)")
_FOCUS = re.compile(r"# focus: (?P<ids>[\w-]+(?:, [\w-]+)*)")
HOME = Path(pwd.getpwuid(os.getuid()).pw_dir)  # the real one, whatever $HOME says


class HeaderError(ValueError):
    """A candidate's header that does not say unambiguously what it expects."""


@dataclass(frozen=True)
class Expect:
    status: str
    evidence: tuple[str, ...]  # substrings, any of which will do; () for none
    line: int  # where the header states it

    def __str__(self) -> str:
        shown = " or ".join(f'"{text}"' for text in self.evidence)
        return self.status + (f" with {shown}" if shown else "")

    def matches(self, status: str, evidence: str) -> bool:
        return status == self.status and (
            not self.evidence or any(text in evidence for text in self.evidence)
        )


@dataclass
class CandidateSpec:
    path: Path
    # (machine, flaw id) -> what the review must say there
    expects: dict[tuple[str, str], Expect] = field(default_factory=dict)
    timeouts: dict[str, float] = field(default_factory=dict)  # machine -> seconds
    xfail: str | None = None
    outside: list[Path] = field(default_factory=list)  # paths it must not manage to create
    focus: frozenset[str] | None = None  # the ids it is about; None: every id it states

    @property
    def name(self) -> str:
        return self.path.stem

    def on(self, machine: str) -> dict[str, Expect]:
        return {flaw_id: e for (where, flaw_id), e in self.expects.items() if where == machine}

    def missing(self) -> list[str]:
        """'machine id' for every catalog id this candidate leaves unjudged."""
        return [
            f"{machine} {flaw.id}"
            for flaw in CATALOG
            for machine in MACHINES
            if (machine == "gpu" or flaw.cpu_visible) and (machine, flaw.id) not in self.expects
        ]


def parse_header(path: Path) -> CandidateSpec:
    """The expectations stated in `path`'s leading comment block; HeaderError if malformed."""
    spec = CandidateSpec(path)
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.startswith("#"):
            break
        line = line.rstrip()
        where = f"{path.name}:{number}"
        if line.startswith("# expect"):
            _parse_expect(spec, line, where, number)
        elif line.startswith("# timeout"):
            if not (match := _TIMEOUT.fullmatch(line)):
                raise HeaderError(f"{where}: malformed, expected '# timeout [cpu|gpu]: SECONDS'")
            for machine in _machines(match["machine"], where):
                spec.timeouts[machine] = float(match["seconds"])
        elif line.startswith("# xfail"):
            if not (match := _XFAIL.fullmatch(line)):
                raise HeaderError(f"{where}: malformed, expected '# xfail: REASON'")
            spec.xfail = match["reason"]
        elif line.startswith("# focus"):
            if not (match := _FOCUS.fullmatch(line)):
                raise HeaderError(f"{where}: malformed, expected '# focus: ID, ID, ...'")
            if unknown := [i for i in match["ids"].split(", ") if i not in BY_ID]:
                raise HeaderError(f"{where}: unknown flaw id {unknown[0]!r} in focus")
            spec.focus = frozenset(match["ids"].split(", "))
        elif line.startswith("# must not create"):
            if not (match := _OUTSIDE.fullmatch(line)):
                raise HeaderError(f"{where}: malformed, expected '# must not create: PATH'")
            path_text = match["path"]
            outside = HOME / path_text[2:] if path_text.startswith("~/") else Path(path_text)
            if not outside.is_absolute():
                raise HeaderError(f"{where}: {path_text} is neither absolute nor under ~/")
            spec.outside.append(outside)
    if not spec.expects:
        raise HeaderError(f"{path.name}: no '# expect' lines in its leading comment block")
    return spec


def _parse_expect(spec: CandidateSpec, line: str, where: str, number: int) -> None:
    match = _EXPECT.fullmatch(line)
    if not match:
        raise HeaderError(
            f"{where}: malformed, expected '# expect [cpu|gpu] ID: STATUS [\"evidence\"]': {line}"
        )
    flaw_id, status = match["id"], match["status"]
    if flaw_id not in BY_ID:
        raise HeaderError(f"{where}: unknown flaw id {flaw_id!r}; known: {', '.join(BY_ID)}")
    if status not in STATUSES:
        raise HeaderError(f"{where}: status {status!r} is not one of {', '.join(STATUSES)}")
    if status == "partial" and flaw_id not in PER_ARGUMENT:
        raise HeaderError(f"{where}: {flaw_id} gives no partial credit")
    machines = _machines(match["machine"], where)
    if not BY_ID[flaw_id].cpu_visible:
        if match["machine"] == "cpu":
            raise HeaderError(f"{where}: {flaw_id} never runs without a GPU")
        machines = ["gpu"]
    for machine in machines:
        if (machine, flaw_id) in spec.expects:
            first = spec.expects[machine, flaw_id].line
            raise HeaderError(f"{where}: a second verdict for {machine} {flaw_id} (line {first})")
        evidence = tuple(re.findall(r'"([^"]+)"', match["evidence"] or ""))
        spec.expects[machine, flaw_id] = Expect(status, evidence, number)


def _machines(qualifier: str | None, where: str) -> list[str]:
    if qualifier is None:
        return list(MACHINES)
    if qualifier not in MACHINES:
        raise HeaderError(f"{where}: machine {qualifier!r} is not one of {', '.join(MACHINES)}")
    return [qualifier]


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def machine() -> Machine:
    return Machine.detect()


@pytest.fixture(scope="session")
def pristine(tmp_path_factory) -> Path:
    """The shipped flawed/ (from kata's manifest, whatever the working copy holds), its vendor
    library built once for this machine: each candidate gets a copy of it."""
    directory = tmp_path_factory.mktemp("shipped") / "flawed"
    for name, text in shipped.shipped().items():
        if name.startswith(shipped.ROUND2_SUBDIR + "/"):
            continue  # round two's code: no part of a round-one candidate's copy
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    builders.build_vendor_library(directory)
    return directory


def _chosen_ids() -> set[str] | None:
    """KATA_ADVERSARIAL_IDS, checked against the catalog: a typo must not skip the whole corpus."""
    setting = os.environ.get("KATA_ADVERSARIAL_IDS", "").strip()
    if not setting:
        return None
    chosen = {flaw_id.strip() for flaw_id in setting.split(",") if flaw_id.strip()}
    if unknown := sorted(chosen - set(BY_ID)):
        names = ", ".join(unknown)
        pytest.fail(f"KATA_ADVERSARIAL_IDS names no catalog id: {names}", pytrace=False)
    return chosen


# --------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("path", CANDIDATES, ids=lambda path: path.stem)
def test_candidate_gets_the_verdicts_it_states(path, pristine, machine, tmp_path, request):
    spec = parse_header(path)
    if spec.xfail:
        request.applymarker(pytest.mark.xfail(reason=spec.xfail, strict=True))
    where = "gpu" if machine.probe_device == "cuda" else "cpu"
    everything = os.environ.get("KATA_ADVERSARIAL", "all") != "focus"
    chosen = _chosen_ids()
    expected = {
        flaw_id: expect
        for flaw_id, expect in spec.on(where).items()
        if machine.skip_reason(BY_ID[flaw_id]) is None
        and (everything or spec.focus is None or flaw_id in spec.focus)
        and (chosen is None or flaw_id in chosen)
    }
    if not expected and chosen is not None:
        pytest.skip(f"KATA_ADVERSARIAL_IDS={','.join(sorted(chosen))}: none of them runs here")
    if not expected:
        focus = ", ".join(sorted(spec.focus or ()))
        pytest.skip(
            f"{spec.name} is about {focus}, which this machine cannot run "
            "(KATA_ADVERSARIAL=focus); without it, the rest of what it states is checked"
        )
    copy = tmp_path / "candidate"
    shutil.copytree(pristine, copy)
    shutil.copyfile(path, copy / "attention_wrapper.py")
    seed = os.environ.get("KATA_ADVERSARIAL_SEED")
    options = {"seed": int(seed) if seed else None, "only": list(expected)}
    if where in spec.timeouts:
        options["timeout"] = spec.timeouts[where]
    for escape in spec.outside:
        escape.unlink(missing_ok=True)
    review = run_review(resolve_implementation(str(copy)), **options)
    results = {report.flaw.id: report.result for report in review.reports}
    wrong = []
    for escape in spec.outside:
        if escape.exists():
            escape.unlink()
            wrong.append(f"  it created {escape}, outside its copy (removed now)")
    for flaw_id, expect in expected.items():
        result = results.get(flaw_id)
        status, evidence = (result.status, result.evidence) if result else ("missing", "")
        if not expect.matches(status, evidence):
            wrong.append(
                f"  {flaw_id} (line {expect.line}): expected {expect}\n    got {status}: {evidence}"
            )
    if wrong:
        mode = "" if everything else "KATA_ADVERSARIAL=focus "
        rerun = f"{mode}KATA_ADVERSARIAL_SEED={review.seed} pytest {__file__} -k {spec.name}"
        pytest.fail(
            f"tests/adversarial/{path.name} on {machine.device}, seed {review.seed} "
            f"(rerun: {rerun}):\n" + "\n".join(wrong),
            pytrace=False,
        )


def test_every_candidate_states_a_verdict_for_every_flaw():
    """Nothing in the corpus is silently unjudged: every catalog id on both kinds of machine."""
    assert CANDIDATES, f"no candidates in {CORPUS}"
    unjudged = {}
    for path in CANDIDATES:
        try:
            spec = parse_header(path)
        except HeaderError as error:
            unjudged[path.name] = str(error)
            continue
        if missing := spec.missing():
            unjudged[path.name] = "no verdict for " + ", ".join(missing)
    assert not unjudged, "\n".join(f"{name}: {why}" for name, why in unjudged.items())


GOOD_HEADER = (
    "# A candidate.\n"
    '# expect dtype: partial "key and value unchecked"\n'
    "# expect cpu device: fixed\n"
    '# expect gpu device: present "cpu inputs" | "meta inputs"\n'
    "# expect gpu stream: present\n"
    "# timeout cpu: 20\n"
    "# must not create: ~/.kata-adversarial-test\n"
    "# focus: dtype, stream\n"
    "# xfail: a known hole\n"
    "import torch\n"
    "# expect shape: this line is code's comment, not the header's\n"
)


def test_header_parser_reads_a_well_formed_header(tmp_path):
    path = tmp_path / "good.py"
    path.write_text(GOOD_HEADER)
    spec = parse_header(path)
    assert spec.expects == {
        ("cpu", "dtype"): Expect("partial", ("key and value unchecked",), 2),
        ("gpu", "dtype"): Expect("partial", ("key and value unchecked",), 2),
        ("cpu", "device"): Expect("fixed", (), 3),
        ("gpu", "device"): Expect("present", ("cpu inputs", "meta inputs"), 4),
        ("gpu", "stream"): Expect("present", (), 5),
    }
    gpu_device = spec.expects["gpu", "device"]
    assert gpu_device.matches("present", "meta inputs: wrong result")
    assert not gpu_device.matches("present", "a valid float32 call raised")
    assert not gpu_device.matches("fixed", "cpu inputs")
    assert spec.timeouts == {"cpu": 20.0}
    assert spec.outside == [HOME / ".kata-adversarial-test"]
    assert spec.focus == {"dtype", "stream"}
    assert spec.xfail == "a known hole"
    assert "cpu shape" in spec.missing() and "gpu multi-gpu" in spec.missing()
    assert "cpu stream" not in spec.missing()  # stream never runs without a GPU


@pytest.mark.parametrize(
    ("line", "complaint"),
    [
        ("# expect dtype fixed", "malformed"),
        ("# expect dtype: fixed evidence without quotes", "malformed"),
        ('# expect dtype: present "unterminated', "malformed"),
        ('# expect dtype: present "one" or "another"', "malformed"),
        ('# expect dtype: present "one" |', "malformed"),
        ("# expect dtypes: fixed", "unknown flaw id 'dtypes'"),
        ("# expect dtype: passed", "status 'passed' is not one of"),
        ("# expect dtype: skipped", "status 'skipped' is not one of"),
        ("# expect tpu dtype: fixed", "machine 'tpu' is not one of"),
        ("# expect autograd: partial", "autograd gives no partial credit"),
        ("# expect cpu stream: present", "stream never runs without a GPU"),
        ("# expect dtype: fixed\n# expect cpu dtype: present", "a second verdict for cpu dtype"),
        ("# timeout: soon", "malformed"),
        ("# xfail:", "malformed"),
        ("# must not create: relative/path", "neither absolute nor under ~/"),
        ("# must not create:", "malformed"),
        ("# focus: dtype,shape", "malformed"),
        ("# focus: dtype, shapes", "unknown flaw id 'shapes' in focus"),
        ("# just a comment", "no '# expect' lines"),
    ],
)
def test_header_parser_rejects_a_malformed_header(tmp_path, line, complaint):
    path = tmp_path / "bad.py"
    path.write_text(line + "\nimport torch\n")
    with pytest.raises(HeaderError, match=re.escape(complaint)):
        parse_header(path)
