"""Tables and plots of results: one markdown/plain table writer and one line-plot writer for every report."""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Sequence


def number(x: float | None, digits: int = 3) -> str:
    """``x`` with ``digits`` significant digits (all digits before the point kept); ``—`` for None."""
    if x is None:
        return "—"
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    magnitude = math.floor(math.log10(abs(x)))
    return f"{x:.{max(0, digits - 1 - magnitude)}f}" if magnitude < digits else f"{x:.0f}"


LARGEST_LOSS = math.log(sys.float_info.max)  # the largest loss whose perplexity is a float


def perplexity(loss: float) -> float:
    """``e ** loss``; infinite past the floats' range (a diverged model), where ``math.exp`` raises."""
    return math.exp(loss) if loss < LARGEST_LOSS else math.inf


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless there is one: ``1 document``, ``3 documents``, ``1,951 tokens``."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def length_label(n: int) -> str:
    """``4096`` -> ``4K``; lengths that are not a multiple of 1024 stay as they are."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None,
                   notes: Sequence[str] = ()) -> str:
    """A markdown table; ``align`` is one character per column, ``l`` or ``r`` (default: first column left,
    the others right). ``notes`` are listed under the table as ``[1] ...``, ``[2] ...``: cells refer to them by
    those marks (e.g. why a cell is empty)."""
    align = align or "l" + "r" * (len(header) - 1)
    if len(align) != len(header) or any(len(row) != len(header) for row in rows):
        raise ValueError(f"every row needs {len(header)} cells, as the header has")
    rule = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(str(cell) for cell in line) + " |" for line in [header, rule, *rows]]
    if notes:
        lines += [""] + [f"[{i}] {note}" for i, note in enumerate(notes, 1)]
    return "\n".join(lines)


def text_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table for the terminal: the first column left-aligned, the others right-aligned."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    head = line(cells[0])
    return "\n".join([head, "-" * len(head)] + [line(row) for row in cells[1:]])


def _drawable(series: dict[str, Sequence[tuple[float, float]]], logy: bool) -> dict[str, list[tuple[float, float]]]:
    """``series`` with its points sorted by x, less those with ``y`` None or (on a log axis) ``<= 0``, and less the
    series left empty."""
    lines = {label: sorted((x, y) for x, y in points if y is not None and (y > 0 or not logy))
             for label, points in series.items()}
    return {label: points for label, points in lines.items() if points}


def _save(figure, path: str | os.PathLike) -> Path:
    import matplotlib.pyplot as plt
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def line_plot(series: dict[str, Sequence[tuple[float, float]]], path: str | os.PathLike, *, xlabel: str,
              ylabel: str, title: str, logx: bool = True, logy: bool = False, vline: tuple[float, str] | None = None,
              dashed: Sequence[str] = (), length_ticks: bool = False) -> Path | None:
    """One line per entry of ``series`` (label -> ``(x, y)`` points; points with ``y`` None or, on a log axis,
    ``<= 0`` are left out), saved as a PNG. ``vline`` draws a labelled vertical line (a reference such as the
    training length); labels in ``dashed`` are drawn dashed;
    ``length_ticks`` labels the x ticks 1K, 2K, .... Returns the path, or None when nothing is left to draw."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = _drawable(series, logy)
    if not lines:
        return None
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for label, points in lines.items():
        axes.plot(*zip(*points), "--" if label in dashed else "-", marker="o", markersize=3, label=label)
    if vline is not None:
        axes.axvline(vline[0], color="grey", linestyle=":", linewidth=1, label=vline[1])
    axes.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if logx:
        axes.set_xscale("log", base=2)
    if logy:
        axes.set_yscale("log")
    if length_ticks:
        ticks = sorted({x for points in lines.values() for x, _ in points})
        axes.set_xticks(ticks, [length_label(int(x)) for x in ticks])
        axes.minorticks_off()
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return _save(figure, path)


def panel_plot(panels: dict[str, dict[str, Sequence[tuple[float, float]]]], path: str | os.PathLike, *,
               xlabel: str, ylabel: str, title: str, hlines: dict[str, float] | None = None,
               columns: int = 4, markers: bool = True) -> Path | None:
    """Small multiples on shared axes: one panel per entry of ``panels`` (panel title -> series, as
    :func:`line_plot` takes them), ``columns`` panels a row. A series label has the same colour in every panel
    (e.g. one colour per seed) and one legend serves them all. ``hlines`` (series label -> y) draws a dotted
    horizontal line in that series' colour in every panel (a reference that depends on the series, such as each
    seed's floor). ``markers=False`` draws lines only (for series of thousands of points). Returns the path, or
    None when no panel has a point to draw."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawable = {name: lines for name, series in panels.items() if (lines := _drawable(series, logy=False))}
    if not drawable:
        return None
    labels = list(dict.fromkeys(label for lines in drawable.values() for label in lines))
    colours = dict(zip(labels, plt.rcParams["axes.prop_cycle"].by_key()["color"] * len(labels)))
    columns = min(columns, len(drawable))  # no empty columns beside fewer panels
    rows = -(-len(drawable) // columns)
    # at least two panels wide: the title and the legend share the top line
    figure, grid = plt.subplots(rows, columns, figsize=(max(2.6 * columns, 5.2), 2.2 * rows + 0.6), sharex=True,
                                sharey=True, squeeze=False)
    for axes, (name, lines) in zip(grid.flat, drawable.items()):
        for label, points in lines.items():
            axes.plot(*zip(*points), marker="o" if markers else None, markersize=2, color=colours[label],
                      label=label)
        for label, y in (hlines or {}).items():
            axes.axhline(y, color=colours.get(label, "black"), linestyle=":", linewidth=1)
        axes.set_title(name, fontsize=9)
        axes.grid(True, alpha=0.3)
    for axes in grid.flat[len(drawable):]:
        axes.set_visible(False)
    for axes in grid[-1]:
        axes.set_xlabel(xlabel, fontsize=8)
    for axes in grid[:, 0]:
        axes.set_ylabel(ylabel, fontsize=8)
    legend = {}
    for axes in grid.flat:
        for handle, label in zip(*axes.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    figure.legend(legend.values(), legend.keys(), fontsize=8, loc="upper right", ncol=len(legend))
    figure.suptitle(title, x=0.02, ha="left")
    return _save(figure, path)
