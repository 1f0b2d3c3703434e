"""The sensitivity report on disk: `sensitivity.json`, two PNG pictures and one HTML page.

No plotting library: the PNGs are drawn into a pixel buffer and written with zlib (a heat map is a
grid of coloured cells, the curve a polyline), so the report needs nothing beyond the standard
library and works wherever quantkit installs; the HTML page carries the same pictures as inline SVG
with axes, labels and values on hover (the PNGs have no text). Colour = log10 of predicted KL.
"""
from __future__ import annotations

import html
import json
import math
import os
import struct
import zlib
from pathlib import Path
from typing import Any

JSON_FILE = "sensitivity.json"
HEATMAP_PNG = "sensitivity_heatmap.png"
CURVE_PNG = "sensitivity_size_kl.png"
HTML_FILE = "sensitivity.html"
FILES = (JSON_FILE, HEATMAP_PNG, CURVE_PNG, HTML_FILE)

# a perceptual dark-blue -> green -> yellow ramp (viridis anchors)
_RAMP = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]


def colour(t: float) -> tuple[int, int, int]:
    t = min(max(t, 0.0), 1.0) * (len(_RAMP) - 1)
    i = min(int(t), len(_RAMP) - 2)
    f = t - i
    return tuple(round(a + (b - a) * f) for a, b in zip(_RAMP[i], _RAMP[i + 1]))


def png_bytes(pixels: list[list[tuple[int, int, int]]]) -> bytes:
    """An 8-bit RGB PNG of `pixels` (rows of (r, g, b))."""
    h, w = len(pixels), len(pixels[0])
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _kind(row) -> str:
    """The linear's name inside its decoder layer (self_attn.q_proj), or its full name outside one."""
    return row["linear"] if row["layer"] is None else row["linear"].split(f".{row['layer']}.", 1)[-1]


def heat_grid(rows, labels) -> tuple[list, list[str], dict]:
    """(layers, kinds, {(layer, kind, scheme): log10 predicted KL})."""
    grid, kinds = {}, []
    for r in rows:
        kind = _kind(r)
        if kind not in kinds:
            kinds.append(kind)
        grid[(r["layer"], kind, r["scheme"])] = math.log10(max(r["predicted_kl"], 1e-12))
    layers = sorted({r["layer"] for r in rows}, key=lambda x: (x is None, x or 0))
    return layers, kinds, grid


def _range(values) -> tuple[float, float]:
    vals = [v for v in values if math.isfinite(v)]
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
    return lo, (hi if hi > lo else lo + 1.0)


def heatmap_png(rows, labels, cell: int = 12, gap: int = 10) -> bytes:
    layers, kinds, grid = heat_grid(rows, labels)
    lo, hi = _range(grid.values())
    width = len(labels) * (len(kinds) * cell + gap) - gap
    pixels = [[(255, 255, 255)] * width for _ in range(len(layers) * cell)]
    for si, label in enumerate(labels):
        x0 = si * (len(kinds) * cell + gap)
        for li, layer in enumerate(layers):
            for ki, kind in enumerate(kinds):
                v = grid.get((layer, kind, label))
                c = (200, 200, 200) if v is None else colour((v - lo) / (hi - lo))
                for y in range(li * cell, (li + 1) * cell - 1):
                    row = pixels[y]
                    for x in range(x0 + ki * cell, x0 + (ki + 1) * cell - 1):
                        row[x] = c
    return png_bytes(pixels)


def _curve_points(curve, uniforms):
    xs = [p["bits_per_weight"] for p in curve] + [u["bits_per_weight"] for u in uniforms.values()]
    ys = [math.log10(max(p["predicted_kl"], 1e-12)) for p in curve] + \
         [math.log10(max(u["predicted_kl"], 1e-12)) for u in uniforms.values()]
    return _range(xs), _range(ys)


def curve_png(curve, uniforms, w: int = 480, h: int = 320, pad: int = 20) -> bytes:
    (x0, x1), (y0, y1) = _curve_points(curve, uniforms)
    pixels = [[(255, 255, 255)] * w for _ in range(h)]
    to_px = lambda x, y: (pad + round((x - x0) / (x1 - x0) * (w - 2 * pad)),  # noqa: E731
                          h - pad - round((y - y0) / (y1 - y0) * (h - 2 * pad)))
    for x in range(pad, w - pad):  # axes
        pixels[h - pad][x] = (0, 0, 0)
    for y in range(pad, h - pad + 1):
        pixels[y][pad] = (0, 0, 0)
    pts = [to_px(p["bits_per_weight"], math.log10(max(p["predicted_kl"], 1e-12))) for p in curve]
    for (ax, ay), (bx, by) in zip(pts, pts[1:]):
        steps = max(abs(bx - ax), abs(by - ay), 1)
        for s in range(steps + 1):
            x, y = round(ax + (bx - ax) * s / steps), round(ay + (by - ay) * s / steps)
            for dy in (-1, 0, 1):
                if 0 <= y + dy < h:
                    pixels[y + dy][x] = (33, 97, 180)
    for u in uniforms.values():
        cx, cy = to_px(u["bits_per_weight"], math.log10(max(u["predicted_kl"], 1e-12)))
        for y in range(cy - 4, cy + 5):
            for x in range(cx - 4, cx + 5):
                if 0 <= y < h and 0 <= x < w and (x - cx) ** 2 + (y - cy) ** 2 <= 16:
                    pixels[y][x] = (214, 39, 40)
    return png_bytes(pixels)


def _svg_heatmap(rows, labels, cell: int = 14) -> str:
    layers, kinds, grid = heat_grid(rows, labels)
    lo, hi = _range(grid.values())
    left, top, gap = 40, 60, 16
    block = len(kinds) * cell
    w, h = left + len(labels) * (block + gap), top + len(layers) * cell + 10
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-size="10" font-family="sans-serif">']
    for si, label in enumerate(labels):
        x0 = left + si * (block + gap)
        out.append(f'<text x="{x0}" y="12" font-weight="bold">{html.escape(label)}</text>')
        for ki, kind in enumerate(kinds):
            out.append(f'<text transform="translate({x0 + ki * cell + 10},{top - 4}) rotate(-60)">{html.escape(kind)}</text>')
        for li, layer in enumerate(layers):
            for ki, kind in enumerate(kinds):
                v = grid.get((layer, kind, label))
                if v is None:
                    continue
                r, g, b = colour((v - lo) / (hi - lo))
                out.append(f'<rect x="{x0 + ki * cell}" y="{top + li * cell}" width="{cell - 1}" height="{cell - 1}" '
                           f'fill="rgb({r},{g},{b})"><title>layer {layer} {html.escape(kind)} {label}: predicted KL '
                           f'{10 ** v:.3g}</title></rect>')
    for li, layer in enumerate(layers):
        out.append(f'<text x="4" y="{top + li * cell + cell - 3}">{layer}</text>')
    out.append("</svg>")
    return "".join(out) + f"<p>colour: log10 predicted KL, from {lo:.2f} (dark) to {hi:.2f} (yellow)</p>"


def _svg_curve(curve, uniforms, w: int = 560, h: int = 360, pad: int = 50) -> str:
    (x0, x1), (y0, y1) = _curve_points(curve, uniforms)
    px = lambda x: pad + (x - x0) / (x1 - x0) * (w - 2 * pad)  # noqa: E731
    py = lambda y: h - pad - (y - y0) / (y1 - y0) * (h - 2 * pad)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-size="11" font-family="sans-serif">',
           f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
           f'<text x="{w / 2 - 60}" y="{h - 12}">bits per weight (packed)</text>',
           f'<text transform="translate(14,{h / 2 + 60}) rotate(-90)">log10 predicted KL</text>',
           f'<text x="{pad - 4}" y="{h - pad + 14}">{x0:.2f}</text><text x="{w - pad - 20}" y="{h - pad + 14}">{x1:.2f}</text>',
           f'<text x="4" y="{h - pad}">{y0:.2f}</text><text x="4" y="{pad + 4}">{y1:.2f}</text>']
    pts = " ".join(f"{px(p['bits_per_weight']):.1f},{py(math.log10(max(p['predicted_kl'], 1e-12))):.1f}" for p in curve)
    out.append(f'<polyline points="{pts}" fill="none" stroke="rgb(33,97,180)" stroke-width="2"/>')
    for label, u in uniforms.items():
        x, y = px(u["bits_per_weight"]), py(math.log10(max(u["predicted_kl"], 1e-12)))
        out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="rgb(214,39,40)"><title>uniform {label}: '
                   f'{u["bits_per_weight"]:.3f} bits, predicted KL {u["predicted_kl"]:.4g}</title></circle>'
                   f'<text x="{x + 6:.1f}" y="{y - 6:.1f}">{html.escape(label)}</text>')
    out.append("</svg>")
    return "".join(out)


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_report(folder: Path, report: dict[str, Any]) -> list[str]:
    """Write the JSON, both PNGs and the HTML page into `folder`; returns the file names written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows, labels, curve, uniforms = report["rows"], report["schemes"], report["curve"], report["uniform"]
    _write(folder / JSON_FILE, json.dumps(report, indent=1).encode())
    _write(folder / HEATMAP_PNG, heatmap_png(rows, labels))
    _write(folder / CURVE_PNG, curve_png(curve, uniforms))
    check = report.get("proxy_check", {})
    page = ["<!doctype html><html><head><meta charset='utf-8'><title>quantkit sensitivity</title></head><body>",
            f"<h1>Sensitivity of {html.escape(str(report.get('model')))}</h1>",
            f"<p>method {html.escape(str(report.get('method')))}, format {html.escape(str(report.get('format')))}; "
            f"predicted KL calibrated per {html.escape(str(report.get('calibration_mode')))}; proxy check on the "
            f"sampled linears: {html.escape(json.dumps(check))}; whole-model check on allocated mixtures: "
            f"{html.escape(json.dumps((report.get('interaction') or {}).get('check', [])))}</p>",
            "<h2>Predicted KL increase per linear (rows: decoder layers)</h2>", _svg_heatmap(rows, labels),
            "<h2>Size against predicted KL (best mixture per budget; dots: uniform schemes)</h2>",
            _svg_curve(curve, uniforms),
            f"<p>Data: <a href='{JSON_FILE}'>{JSON_FILE}</a>; pictures as PNG: <a href='{HEATMAP_PNG}'>{HEATMAP_PNG}</a>, "
            f"<a href='{CURVE_PNG}'>{CURVE_PNG}</a>.</p></body></html>"]
    _write(folder / HTML_FILE, "\n".join(page).encode())
    return list(FILES)


def card_section(report: dict[str, Any], allocation: dict[str, Any] | None = None) -> str:
    """Markdown for the model card: the pictures and files, and the allocation when there is one."""
    lines = ["", "## Sensitivity and mixed precision", ""]
    if allocation:
        lines += [f"- allocation target: {allocation['target']}",
                  f"- packed linears: {allocation['packed_bytes']} bytes, {allocation['bits_per_weight']} bits per weight",
                  f"- predicted KL on the report's held-out windows: {allocation['predicted_kl']:.5f} (the sum of "
                  f"per-linear KLs, {allocation.get('predicted_kl_sum', allocation['predicted_kl']):.5f}, through the "
                  "measured whole-model mapping)",
                  f"- schemes: {', '.join(f'{k} x {v}' for k, v in sorted(allocation['schemes'].items()))}", ""]
    lines += [f"![per-layer sensitivity heat map]({HEATMAP_PNG})", "", f"![size against KL]({CURVE_PNG})", "",
              f"Table: [`{JSON_FILE}`]({JSON_FILE}) (one row per linear and scheme); page: [`{HTML_FILE}`]({HTML_FILE}).", ""]
    return "\n".join(lines)


def append_card(folder: Path, text: str) -> None:
    card = Path(folder) / "README.md"
    body = card.read_text() if card.exists() else ""
    _write(card, (body.rstrip("\n") + "\n" + text).encode())
