"""The per-layer report: name, shape, scheme or why skipped, bytes before and after, weight SQNR; the totals over
every weight of the model (not only the linears'); and the lint's findings."""

from __future__ import annotations

from fxquant.config import RECIPES
from fxquant.weights import ROLES


def format_rows(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows of strings as left-aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]


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
    lines = [f"weights: quantized {done_before:,} of {total:,} bytes ({100 * done_before / max(total, 1):.0f}%); "
             f"{total:,} -> {after:,} bytes" + (f" ({total / after:.2f}x smaller)" if after else "")]
    held = [f"{label} {nbytes:,}" for label, nbytes in kept.items() if nbytes]
    if already:
        lines.append(f"{ROLES['quantized']}: {already:,} bytes, counted at their quantized size")
    if held:
        lines.append(f"kept in high precision (bytes): {'; '.join(held)}")
    return lines


def format_report(layers, findings=(), weights=()) -> str:
    """The report; `weights` (the pipeline's weight inventory) makes the totals count every weight."""
    rows = [("layer", "shape [E,] N, K", "scheme", "bytes before", "bytes after", "weight SQNR dB (worst channel)")]
    for layer in layers:
        scheme = f"{layer.recipe} ({RECIPES[layer.recipe]})" if layer.recipe else f"skipped: {layer.reason}"
        if layer.recipe and layer.reason:  # quantized before this call, and kept
            scheme += f", {layer.reason}"
        if layer.rows:
            first, stop, of = layer.rows
            scheme += f", rows {first}:{stop} of a merged {of}-row GEMM"
        sqnr = "-" if layer.weight_sqnr is None else f"{layer.weight_sqnr:.1f} ({layer.worst_row_sqnr:.1f})"
        rows.append((layer.fqn, "x".join(map(str, layer.shape)), scheme, f"{layer.bytes_before:,}",
                     f"{layer.bytes_after:,}", sqnr))
    lines = format_rows(rows) + format_totals(layers, weights)
    upcast = [f.where for f in findings if f.kind == "upcast"]
    if upcast:
        lines.append(f"reductions moved to fp32: {', '.join(upcast)}")
    fused = [f.where for f in findings if f.kind == "fused_norm"]
    if fused:
        lines.append(f"norms fused with their fp8 quantizers: {', '.join(fused)}")
    attention = [f.where for f in findings if f.kind == "decode_attention"]
    if attention:
        lines.append(f"decode attention on fxquant's split-KV kernel: {', '.join(attention)}")
    for finding in findings:
        if finding.kind not in ("upcast", "skipped", "fused_norm", "decode_attention"):  # already shown above
            lines.append(f"{finding.severity}: {finding.where}: {finding.message}")
    return "fxquant report\n" + "\n".join(lines)
