"""Draws the bar chart of docs/performance.md from that page's own table.

Reads the table under the heading "## Latest full run" in docs/performance.md (one row per case:
jax_kernels' time, its ratio to the floor, and each peer's time with "peer / jk" in parentheses)
and writes docs/img/performance-latest-run.svg: per case, the speed-up of jax_kernels over the
pure-JAX peer (jnp / lax.conv) and over PyTorch (torch / torchvision), on a log scale (> 1: jax_kernels
is faster). Every number drawn is a number of that table; nothing else goes in. The "jk atomic"
entries (our own non-deterministic path, not a peer) are left out.

    python tools/performance_chart.py           # rewrite the SVG
    python tools/performance_chart.py --check   # exit 1 if the SVG is not what the table gives

Plain Python (no plotting library): the SVG is written by hand, so the output is byte-stable.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import re
import sys
from xml.sax.saxutils import escape

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "performance.md"
IMAGE = ROOT / "docs" / "img" / "performance-latest-run.svg"
HEADING = "## Latest full run"

# Peer name in the table -> the series it is drawn in.
SERIES = {
    "jnp gather": "pure JAX",
    "jnp": "pure JAX",
    "jnp.tile": "pure JAX",
    "lax.conv": "pure JAX",
    "pure JAX": "pure JAX",
    "torch": "PyTorch",
    "torchvision": "PyTorch",
}
COLOURS = {"pure JAX": "#3f7fbf", "PyTorch": "#e0792b"}
PEER = re.compile(r"^(?P<name>.+?) (?P<ms>[0-9.]+) \((?P<ratio>[0-9.]+)\)$")


def read_table(text: str) -> tuple[str, list[tuple[str, dict[str, float]]]]:
    """The heading line and, per row, (case, {series: peer / jk})."""
    start = text.index(HEADING)
    heading = text[start:].splitlines()[0].lstrip("# ").strip()
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("## "):
            break
        if not line.startswith("|") or line.startswith("|---") or line.startswith("| case"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        case, peers = cells[0], cells[-1]
        ratios: dict[str, float] = {}
        for entry in peers.split(";"):
            match = PEER.match(entry.strip())
            if match is None:
                raise ValueError(f"unreadable peer entry {entry!r} in row {case!r}")
            series = SERIES.get(match["name"])
            if series is not None:
                if series in ratios:
                    raise ValueError(f"two {series} peers in row {case!r}")
                ratios[series] = float(match["ratio"])
        rows.append((case, ratios))
    if not rows:
        raise ValueError(f"no table rows under {HEADING!r} in {PAGE}")
    return heading, rows


def svg(heading: str, rows: list[tuple[str, dict[str, float]]]) -> str:
    label_w, plot_w, right = 470, 380, 20
    top, row_h, bar_h = 90, 24, 9
    lo, hi = -2, 6  # log2 of the axis ends: 1/4 to 64
    width = label_w + plot_w + right
    height = top + row_h * len(rows) + 40

    def x(ratio: float) -> float:
        clamped = min(max(math.log2(ratio), lo), hi)
        return label_w + (clamped - lo) / (hi - lo) * plot_w

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="10" y="18" font-size="13" font-weight="bold">Speed-up of jax_kernels over '
        f'each peer (peer time / jax_kernels time, log scale; right of 1 = jax_kernels faster)</text>',
        f'<text x="10" y="36">{escape(heading)}</text>',
        '<text x="10" y="52">From the table of that run in docs/performance.md, drawn by '
        'tools/performance_chart.py</text>',
    ]
    legend_x = label_w
    for name, colour in COLOURS.items():
        out.append(f'<rect x="{legend_x}" y="64" width="12" height="10" fill="{colour}"/>')
        out.append(f'<text x="{legend_x + 16}" y="73">{name}</text>')
        legend_x += 90
    bottom = top + row_h * len(rows)
    for power in range(lo, hi + 1):
        gx = x(2.0 ** power)
        label = f"{2 ** power:g}" if power >= 0 else f"1/{2 ** -power}"
        stroke = "#000" if power == 0 else "#ddd"
        out.append(f'<line x1="{gx:.1f}" y1="{top - 4}" x2="{gx:.1f}" y2="{bottom}" '
                   f'stroke="{stroke}" stroke-width="1"/>')
        out.append(f'<text x="{gx:.1f}" y="{bottom + 14}" text-anchor="middle">{label}</text>')
    for i, (case, ratios) in enumerate(rows):
        y = top + i * row_h
        out.append(f'<text x="{label_w - 6}" y="{y + row_h / 2 + 4:.1f}" '
                   f'text-anchor="end">{escape(case)}</text>')
        for j, (series, colour) in enumerate(COLOURS.items()):
            if series not in ratios:
                continue
            ratio = ratios[series]
            x0, x1 = sorted((x(1.0), x(ratio)))
            by = y + 3 + j * (bar_h + 1)
            out.append(f'<rect x="{x0:.1f}" y="{by}" width="{max(x1 - x0, 1):.1f}" '
                       f'height="{bar_h}" fill="{colour}"><title>{escape(case)}: {series} '
                       f'{ratio:g}x</title></rect>')
            tx, anchor = (x1 + 3, "start") if ratio >= 1 else (x0 - 3, "end")
            out.append(f'<text x="{tx:.1f}" y="{by + bar_h - 1}" font-size="9" '
                       f'text-anchor="{anchor}">{ratio:g}</text>')
    out.append(f'<text x="{label_w + plot_w / 2}" y="{bottom + 30}" text-anchor="middle">'
               f'peer / jax_kernels</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the committed SVG differs from what the table gives")
    args = parser.parse_args(argv)
    image = svg(*read_table(PAGE.read_text(encoding="utf-8")))
    if args.check:
        if not IMAGE.exists() or IMAGE.read_text(encoding="utf-8") != image:
            print(f"{IMAGE.relative_to(ROOT)} is out of date: run tools/performance_chart.py",
                  file=sys.stderr)
            return 1
        return 0
    IMAGE.parent.mkdir(parents=True, exist_ok=True)
    IMAGE.write_text(image, encoding="utf-8")
    print(f"wrote {IMAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
