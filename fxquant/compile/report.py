"""The per-layer report: name, shape, recipe, bytes before and after, weight SQNR, with why a layer was kept and what
recipe="auto" measured under its row; the totals over every weight of the model (not only the linears'); and the
lint's findings. Lines fit WIDTH columns: notes and findings wrap, a name too long for its row gets a line of its own.
"""

from __future__ import annotations

import math
import textwrap
from collections import Counter

from fxquant.compile.weights import ROLES
from fxquant.config import RECIPES

WIDTH = 120  # a terminal's width: the report is read there, and in logs
ALREADY = "already quantized, kept"  # a layer quantize_ or a checkpoint quantized before this call
HEADER = ("layer", "shape [E,] N, K", "recipe", "bytes before", "bytes after", "weight SQNR dB")
SQNR_LEGEND = "weight SQNR dB (worst channel): the quantized weight against the original, whole and its worst row"
NO_SQNR = {ALREADY: "quantized before this call (quantize_ or a checkpoint): no high-precision weight is left to "
                    "measure it against; fxquant.inspect measures a layer before it is quantized",
           "": "not measured: quantize_ measures the linear layers it quantizes, not experts; fxquant.inspect "
               "measures both"}


def format_rows(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows of strings as left-aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def wrapped(text: str, indent: str = "  ", first: str = "") -> list[str]:
    """text in lines of at most WIDTH columns, the first after `first`, the rest after `indent`."""
    return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=indent, break_on_hyphens=False)


def format_totals(layers, weights=()) -> list[str]:
    """Quantized bytes out of all weight bytes, and what stays in high precision, by role."""
    quantized = [layer for layer in layers if layer.recipe]
    already = sum(w.nbytes for w in weights if w.role == "quantized")  # their high-precision size is gone
    done_before = sum(layer.bytes_before for layer in quantized) + already
    done_after = sum(layer.bytes_after for layer in quantized) + already
    kept = {"linear weights kept (see above)": sum(layer.bytes_before for layer in layers if not layer.recipe)}
    for role, label in ROLES.items():
        if role not in ("linear", "quantized"):
            kept[label] = sum(w.nbytes for w in weights if w.role == role)
    total = done_before + sum(kept.values())
    after = total - done_before + done_after
    share = f"weights: quantized {done_before:,} of {total:,} bytes ({100 * done_before / max(total, 1):.0f}%)"
    lines = [f"{share}; {total:,} -> {after:,} bytes ({total / after:.2f}x smaller)" if done_before and after
             else f"{share}: nothing quantized, the model keeps its size"]
    held = [f"{label} {nbytes:,}" for label, nbytes in kept.items() if nbytes]
    if already:
        lines.append(f"{ROLES['quantized']}: {already:,} bytes, counted at their quantized size")
    if held:
        lines += wrapped(f"kept in high precision (bytes): {'; '.join(held)}")
    return lines


def _auto_lines(auto) -> tuple[dict[str, str], list[str]]:
    """recipe="auto"'s measurements (measure.LayerError, chosen_by_auto): a note per layer it chose for, and one line
    of what it chose."""
    chosen = [m for m in auto if m.chosen_by_auto]
    if not chosen:
        return {}, []
    notes = {m.fqn: f"auto chose it: output SQNR {_db(m.out_sqnr)} dB" for m in chosen if m.recipe}
    counts = Counter(m.recipe or "kept (no recipe reaches the floor)" for m in chosen)
    summary = ", ".join(f"{recipe} x {n}" for recipe, n in counts.most_common())
    return notes, wrapped(f"recipe='auto' measured {len(chosen)} layer(s) on the sample inputs: {summary}")


def _db(value: float | None) -> str:
    return "-" if value is None else "exact" if math.isinf(value) else f"{value:.1f}"


def format_report(layers, findings=(), weights=(), auto=()) -> str:
    """The report; `weights` (the pipeline's weight inventory) makes the totals count every weight; `auto` holds
    recipe="auto"'s measurements (fxquant.compile.measure.LayerError), where it chose."""
    auto_notes, auto_summary = _auto_lines(auto)
    rows, notes, missing = [HEADER], [[]], set()
    for layer in layers:
        sqnr = "-" if layer.weight_sqnr is None else f"{layer.weight_sqnr:.1f} ({layer.worst_row_sqnr:.1f})"
        rows.append((layer.fqn, "x".join(map(str, layer.shape)), layer.recipe or "kept", f"{layer.bytes_before:,}",
                     f"{layer.bytes_after:,}", sqnr))
        why = [f"kept in high precision: {layer.reason}" if not layer.recipe else layer.reason]
        if layer.rows:
            first, stop, of = layer.rows
            why.append(f"rows {first}:{stop} of a merged {of}-row GEMM")
        why.append(auto_notes.get(layer.fqn, ""))
        notes.append(wrapped("; ".join(w for w in why if w), indent="    ", first="    "))
        if layer.recipe and layer.weight_sqnr is None:
            missing.add(layer.reason if layer.reason in NO_SQNR else "")
    # A name too long for its row goes on a line of its own, over the row's other cells.
    others = [max(len(row[i]) for row in rows) for i in range(1, len(HEADER))]
    name_room = WIDTH - sum(others) - 2 * len(others)
    table = format_rows([("" if len(row[0]) > name_room else row[0], *row[1:]) for row in rows])
    lines = []
    for row, line, row_notes in zip(rows, table, notes, strict=True):
        lines += ([row[0]] if len(row[0]) > name_room else []) + [line] + row_notes
    lines.append("")  # the table ends
    legend = [f"{recipe}: {RECIPES[recipe]}" for recipe in dict.fromkeys(layer.recipe for layer in layers) if recipe]
    if legend:
        lines += wrapped("recipes: " + "; ".join(legend))
    if any(layer.weight_sqnr is not None for layer in layers):
        lines.append(SQNR_LEGEND)
    lines += [line for why in sorted(missing) for line in wrapped(f"weight SQNR -: {NO_SQNR[why]}")]
    lines += auto_summary + format_totals(layers, weights)
    listed = (("upcast", "reductions moved to fp32"), ("fused_norm", "norms fused with their fp8 quantizers"),
              ("rotary_cache", "rotary embedding and cache write in one kernel"),
              ("cache_length", "the cache's length counted in that kernel"),
              ("decode_attention", "decode attention on fxquant's split-KV kernel"))
    for kind, label in listed:
        found = [f.where for f in findings if f.kind == kind]
        if found:
            lines += wrapped(f"{label}: {', '.join(found)}")
    for finding in findings:
        if finding.kind != "skipped" and finding.kind not in dict(listed):  # already shown above
            lines += wrapped(f"{finding.severity}: {finding.where}: {finding.message}", indent="    ")
    return "fxquant report\n" + "\n".join(lines)
