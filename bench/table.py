"""The bench's output for people: the table printed on stdout (one per section, footnotes for
cells that are not a number, the skipped rows) and the chart of the LLM rows."""

from __future__ import annotations

import collections
from pathlib import Path

from bench.cases import FWD, FWD_BWD, LLM_BARS, SETTLE_AGREEMENT, _groups

# ------------------------------------------------------------------------------------ output


def _fmt_ms(ms: float) -> str:
    if ms < 1:
        return f"{ms:.4f}"
    return f"{ms:.3f}" if ms < 100 else f"{ms:.1f}"


def _fmt_tflops(tflops: float) -> str:
    if tflops >= 100:
        return f"{tflops:.0f}"
    return f"{tflops:.1f}" if tflops >= 10 else f"{tflops:.2f}" if tflops >= 1 else f"{tflops:.3f}"


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


# A ratio whose two rows' batches disagree this much (slowest batch median over fastest) is
# marked: one or two slow batches (seen at 2x on an H200, in fixed's rows and cuDNN's alike)
# move a row's median, and the ratio then says more about the machine than the kernels.
UNSTEADY_SPREAD = 1.2
UNSTEADY_MARK = "~"
UNSTEADY_NOTE = (
    f"  {UNSTEADY_MARK} the two rows of this ratio had batch medians more than "
    f"{UNSTEADY_SPREAD - 1:.0%} apart (slowest over fastest; each batch's in JSON): time it "
    "again before reading a change in it"
)


def _unsteady(*rows: dict | None) -> bool:
    for row in rows:
        batches = (row or {}).get("batch_medians_ms") or []
        if len(batches) > 1 and max(batches) > UNSTEADY_SPREAD * min(batches):
            return True
    return False


class Footnotes:
    """A table's cells that are not a number: a word and a number, the reason listed below."""

    def __init__(self):
        self.reasons: dict[str, int] = {}

    def number(self, status: str) -> str:
        return f"[{self.reasons.setdefault(status, len(self.reasons) + 1)}]"

    def mark(self, status: str) -> str:
        return f"{status.split(':')[0]} {self.number(status)}"

    def lines(self) -> list[str]:
        return [_short(f"  [{n}] {status}", 118) for status, n in self.reasons.items()]


_SECTION_TITLES = {
    "overhead": "host overhead",
    "kata": "kata shapes",
    "llm": "LLM shapes",
    "args": "SDPA's arguments",
}
_SECTION_HEADINGS = {key: title[0].upper() + title[1:] for key, title in _SECTION_TITLES.items()}


def _shown(rows: list[dict]) -> list[list[dict]]:
    """The groups a table shows: all but those skipped whole for one reason (--max-seq, the time
    limit, no GPU), which the list of skipped rows gives instead."""
    shown = []
    for group in _groups(rows):
        statuses = {row["status"] for row in group}
        if not (len(statuses) == 1 and next(iter(statuses)).startswith("skipped")):
            shown.append(group)
    return shown


def format_table(report: dict) -> str:
    facts, rows, settings = report["machine"], report["rows"], report["settings"]
    header = f"make bench on {facts['device']}: torch {facts['torch']}"
    if facts["cuda"]:
        header += f", CUDA {facts['cuda']}, driver {facts.get('driver') or 'unknown'}"
    header += f", Python {facts['python']}, {facts['date']}"
    lines = [header + (" (--quick)" if settings["quick"] else "")]
    for section, table in (
        ("overhead", _overhead_table),
        ("kata", _kata_table),
        ("llm", _llm_tables),
        ("args", _args_table),
    ):
        section_rows = [r for r in rows if r["section"] == section]
        if not section_rows:
            continue
        if _shown(section_rows):
            lines += ["", *table(section_rows, report)]
        else:
            reasons = sorted({r["status"] for r in section_rows})
            lines += ["", f"{_SECTION_HEADINGS[section]}: {'; '.join(reasons)}"]
    skipped: dict[str, list[dict]] = {}
    for row in rows:
        if row["status"].startswith("skipped"):
            skipped.setdefault(row["status"].removeprefix("skipped: "), []).append(row)
    if skipped:
        lines += ["", "Skipped rows:"]
        for reason, group in skipped.items():
            sections = ", ".join(sorted({_SECTION_TITLES[r["section"]] for r in group}))
            lines.append(_short(f"  {len(group):3d} {sections}: {reason}", 118))
    return "\n".join(lines)


_OVERHEAD_NAMES = {
    "flawed": "flawed: attention_wrapper.fast_attention (ctypes)",
    "fixed": "fixed.fast_attention",
    "fixed raw op": "torch.ops.fixed_attention.attention_forward",
    "sdpa": "torch.nn.functional.scaled_dot_product_attention",
}


def _overhead_table(rows, report) -> list[str]:
    facts, overhead = report["machine"], report["settings"]["overhead"]
    lines = [
        f"Per-call host overhead: {tuple(overhead['shape'])} float32 on {facts['device']}; wall "
        f"clock, median of {overhead['batches']} batches of {overhead['calls_per_batch']} calls",
        f"  {'what is called':<50}{'µs/call':>9}  status",
    ]
    for row in rows:
        value = f"{row['us_per_call']:.1f}" if row["median_ms"] else "-"
        name = _OVERHEAD_NAMES.get(row["implementation"], row["label"])
        lines.append(f"  {name:<50}{value:>9}  {_short(row['status'], 55)}")
    return lines + _sdpa_ran(report, "overhead float32")


def _sdpa_ran(report, family) -> list[str]:
    """One line: the backend SDPA's default call used for a shape family, and its first kernel."""
    entry = report["sdpa_kernels"].get(family)
    if not entry:
        return []
    names = entry.get("kernels") or entry.get("ops") or []
    first = f" ({_short(names[0], 70)})" if names else ""
    return [f"  SDPA default ran: {entry['backend']}{first}"]


def _kata_table(rows, report) -> list[str]:
    notes = Footnotes()
    order = ["flawed", "fixed", "sdpa", "host round trip"]
    labels = {r["implementation"]: r["label"] for r in rows}
    lines = [
        f"Kata shapes: float32 (B, S, 64), B={rows[0]['shape'][0]}, forward, on "
        f"{report['machine']['device']}: ms per call (TFLOP/s), median of the runs",
        f"  {'S':>6}  " + "".join(f"{labels[key]:<21}" for key in order) + "fixed vs flawed",
    ]
    for group in _shown(rows):
        by_impl = {r["implementation"]: r for r in group}
        cells = []
        for key in order:
            row = by_impl[key]
            if row["median_ms"]:
                tflops = f" ({_fmt_tflops(row['tflops'])})" if row["tflops"] else ""
                cells.append(f"{_fmt_ms(row['median_ms']) + ' ms' + tflops:<21}")
            else:
                cells.append(f"{notes.mark(row['status']):<21}")
        flawed, fixed = by_impl["flawed"]["median_ms"], by_impl["fixed"]["median_ms"]
        speedup = f"{flawed / fixed:.2f}×" if flawed and fixed else "-"
        lines.append(f"  {group[0]['shape'][1]:>6}  " + "".join(cells) + speedup)
    return lines + notes.lines() + _sdpa_ran(report, "kata float32")


_BACKEND_NAMES = {
    "flash": "flash",
    "efficient": "efficient",
    "cudnn": "cuDNN",
    "math": "math",
    "default": "default",
}


def _args_table(rows, report) -> list[str]:
    """One line per case, D, S and pass: fixed's ms (TFLOP/s), SDPA's default's and its best
    backend's ms, and each one's time over fixed's."""
    notes = Footnotes()
    heads = rows[0]["shape"][1]
    batches = {row["shape"][2]: row["shape"][0] for row in rows}
    lines = [
        f"SDPA's arguments: bfloat16 but the float32 case (B, H={heads}, S, D), "
        + ", ".join(f"B={batch} at S={seq}" for seq, batch in batches.items())
        + ": ms per call (fixed's TFLOP/s)",
        "  x/fixed: SDPA's time over fixed's (over 1: fixed is faster); best: SDPA's fastest "
        "backend that took the call, forced, or its default where that was faster",
        f"  {'case':<12}{'D':>4}{'S':>6}  {'pass':<9}{'fixed':<21}{'SDPA default':<15}"
        f"{'default/fixed':<14}{'SDPA best':<24}best/fixed",
    ]
    previous_seq, marked = None, False
    for group in _shown(rows):
        by_impl = {r["implementation"]: r for r in group}
        fixed, default, best = by_impl["fixed"], by_impl["sdpa"], by_impl["sdpa best"]
        tflops = f" ({_fmt_tflops(fixed['tflops'])})" if fixed["tflops"] else ""
        backend = f" {_BACKEND_NAMES.get(best['backend'], best['backend'])}"
        to_default = _ratio(fixed["ratio_to_sdpa"], _unsteady(fixed, default))
        to_best = _ratio(fixed["ratio_to_best"], _unsteady(fixed, best))
        marked = marked or UNSTEADY_MARK in to_default + to_best
        cells = [
            f"{_args_cell(fixed, notes, tflops):<21}",
            f"{_args_cell(default, notes):<15}",
            f"{to_default:<14}",
            f"{_args_cell(best, notes, backend):<24}",
            to_best,
        ]
        head = group[0]
        _, _, seq, dim = head["shape"]
        if previous_seq not in (None, seq):  # a blank line between the sequence lengths
            lines.append("")
        previous_seq = seq
        lines.append(f"  {head['case']:<12}{dim:>4}{seq:>6}  {head['pass']:<9}" + "".join(cells))
    return lines + ([UNSTEADY_NOTE] if marked else []) + notes.lines()


def _args_cell(row: dict, notes: Footnotes, suffix: str = "") -> str:
    """A timed row's ms and suffix, with a footnote where its status says more than ok (dropout:
    unchecked); else its status's first word and footnote."""
    if not row["median_ms"]:
        return notes.mark(row["status"])
    text = f"{_fmt_ms(row['median_ms'])} ms{suffix}"
    return text if row["status"] == "ok" else f"{text} {notes.number(row['status'])}"


def _ratio(ratio: float | None, unsteady: bool = False) -> str:
    if not ratio:
        return "-"
    return f"{ratio:.2f}×" + (UNSTEADY_MARK if unsteady else "")


def _llm_tables(rows, report) -> list[str]:
    order = ["fixed", "sdpa", "sdpa flash", "sdpa cudnn"]
    labels = {r["implementation"]: r["label"] for r in rows}
    batch, heads = rows[0]["shape"][:2]
    lines = [_llm_instrument(rows, report)]
    for pass_ in (FWD, FWD_BWD):
        notes, marked = Footnotes(), False
        title = "forward" if pass_ == FWD else "forward+backward"
        lines += [
            f"LLM shapes: bfloat16 (B={batch}, H={heads}, S, D), {title}: TFLOP/s (ratio to "
            "SDPA flash), flash's ms per call, and fixed's speed over cuDNN's (the bar: the "
            "faster of the cuDNN backend and SDPA's default)",
            f"  {'D':>4} {'causal':<7}{'S':>6}  "
            + "".join(f"{labels[key]:<18}" for key in order)
            + f"{'flash ms':>10}{'fixed/cuDNN':>13}",
        ]
        groups = _shown([r for r in rows if r["pass"] == pass_])
        groups.sort(key=lambda g: (g[0]["shape"][3], g[0]["causal"], g[0]["shape"][2]))
        for i, group in enumerate(groups):
            family = (group[0]["shape"][3], group[0]["causal"])
            if i and family != (groups[i - 1][0]["shape"][3], groups[i - 1][0]["causal"]):
                lines.append("")
            by_impl = {r["implementation"]: r for r in group}
            cells = []
            for key in order:
                row = by_impl[key]
                if row["median_ms"]:
                    ratio = row["ratio_to_flash"]
                    text = _fmt_tflops(row["tflops"]) + (f" ({ratio:.2f}×)" if ratio else "")
                    cells.append(f"{text:<18}")
                else:
                    cells.append(f"{notes.mark(row['status']):<18}")
            flash_ms = by_impl["sdpa flash"]["median_ms"]
            to_cudnn = by_impl["fixed"].get("ratio_to_cudnn")
            ratio = _ratio(to_cudnn, _unsteady(by_impl["fixed"], _cudnn_bar(by_impl)))
            marked = marked or UNSTEADY_MARK in ratio
            _, _, seq, dim = group[0]["shape"]
            causal = "yes" if group[0]["causal"] else "no"
            line = (
                f"  {dim:>4} {causal:<7}{seq:>6}  "
                + "".join(cells)
                + f"{_fmt_ms(flash_ms) if flash_ms else '-':>10}"
                + f"{f'{ratio:<6}':>14}"  # a mark past the column: the ratios stay aligned
            )
            lines.append(line.rstrip())
        lines += [*([UNSTEADY_NOTE] if marked else []), *notes.lines(), ""]
    families = {k: v for k, v in report["sdpa_kernels"].items() if k.startswith("llm")}
    if families:
        lines.append("SDPA default ran (torch.profiler, one call per family; all names in JSON):")
        for family, entry in families.items():
            names = entry.get("kernels") or entry.get("ops") or []
            shown = _short(", ".join(names), 60)
            lines.append(f"  {family:<38} {_short(entry['backend'], 12):<12} {shown}")
    return lines


def _cudnn_bar(by_impl: dict[str, dict]) -> dict | None:
    """The row ratio_to_cudnn divided by: the faster timed one of its bars (cases.LLM_BARS)."""
    timed = [by_impl[key] for key in LLM_BARS["ratio_to_cudnn"] if by_impl[key]["median_ms"]]
    return min(timed, key=lambda row: row["median_ms"], default=None)


def _llm_instrument(rows, report) -> str:
    """How the LLM rows were timed (bench/alternate.py) and the SM clock range they saw."""
    settings = report.get("settings", {})
    rounds, settle = settings.get("alternate_rounds"), settings.get("alternate_settle_ms")
    most = settings.get("alternate_settle_max_ms") or settle  # a run from before: a fixed settle
    text = "LLM rows: the median of all runs"
    if rounds:
        text += f" over {rounds} alternating batches (fixed, SDPA, its backends in balanced orders"
        if settle and most and most > settle:
            text += (
                f"; each batch after its own calls untimed, in {settle:g} ms chunks until two "
                f"agree within {SETTLE_AGREEMENT:.0%}, at most {most:g} ms)"
            )
        else:
            text += f"; each batch after {settle:g} ms of its own calls untimed)" if settle else ")"
    # Each batch's reading where the run kept them (batch_sm_clock_mhz), else each row's median
    # (a run from before them: its table as it printed then).
    per_batch = [mhz for r in rows for mhz in r.get("batch_sm_clock_mhz") or [] if mhz]
    clocks = per_batch or [r["sm_clock_mhz"] for r in rows if r.get("sm_clock_mhz")]
    if clocks:
        low, high = min(clocks), max(clocks)
        where = "each batch's" if per_batch else "per row"
        text += f"; SM clock after each batch {low:.0f}-{high:.0f} MHz ({where} in JSON)"
    elif report.get("sm_clock"):
        text += f"; SM clock: {report['sm_clock']}"
    read = [names for r in rows for names in r.get("batch_clock_limits") or [] if names is not None]
    if read:
        counts = collections.Counter(name for names in read for name in names)
        held = ", ".join(f"{name} in {n} of {len(read)}" for name, n in counts.most_common())
        text += f"; its limits then (NVML): {held or f'none in {len(read)}'} batches"
    return text


def write_chart(rows: list[dict], path: Path) -> str:
    """TFLOP/s of the LLM rows against S, one panel per pass, head dim and causality."""
    timed = [r for r in rows if r["section"] == "llm" and r["tflops"]]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no chart"
    if not timed:
        return "no chart: no LLM rows were timed"
    panels = sorted({(r["pass"], r["shape"][3], r["causal"]) for r in timed})
    passes = sorted({p for p, _, _ in panels})
    columns = sorted({(d, c) for _, d, c in panels})
    figure, axes = plt.subplots(
        len(passes), len(columns), figsize=(4 * len(columns), 3.5 * len(passes)), squeeze=False
    )
    for i, pass_ in enumerate(passes):
        for j, (dim, causal) in enumerate(columns):
            ax = axes[i][j]
            for color, impl in enumerate(dict.fromkeys(r["implementation"] for r in timed)):
                points = sorted(
                    (r["shape"][2], r["tflops"])
                    for r in timed
                    if r["implementation"] == impl
                    and r["pass"] == pass_
                    and r["shape"][3] == dim
                    and r["causal"] == causal
                )
                if points:
                    label = next(r["label"] for r in timed if r["implementation"] == impl)
                    ax.plot(*zip(*points, strict=True), marker="o", label=label, color=f"C{color}")
            seqs = sorted({r["shape"][2] for r in timed})
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqs, [str(seq) for seq in seqs], fontsize=7)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{pass_}, D={dim}, {'causal' if causal else 'non-causal'}", fontsize=9)
            ax.set_xlabel("S")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    batch, heads = timed[0]["shape"][:2]
    figure.suptitle(f"Attention TFLOP/s, bfloat16 (B={batch}, H={heads}, S, D)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"chart: {path}"
