"""Compact PNG figures for notebooks: matplotlib figures rendered off-screen (Agg), never shown in a window.

``figure()`` makes a figure that belongs to no pyplot state (nothing to close, no backend to
switch); ``PNG(fig)`` renders it once at a modest resolution. A notebook displays a ``PNG``
as an image (``_repr_png_``), so executed notebooks stay small whatever backend the kernel has.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from layerskip.fileio import write_bytes_atomic

DPI = 80


def figure(
    width: float = 6.0, height: float = 4.0, ncols: int = 1, nrows: int = 1, squeeze: bool = True, **kwargs: Any
) -> tuple[Figure, Any]:
    """A figure and its axes (an array of axes when there are several, or always with ``squeeze=False``),
    as ``plt.subplots`` returns them; ``kwargs`` go to ``Figure.subplots`` (``sharey=True`` ...)."""
    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=squeeze, **kwargs)


class PNG:
    """A figure rendered once to PNG bytes: a notebook displays it, ``save`` writes it."""

    def __init__(self, fig: Figure | bytes, dpi: int = DPI) -> None:
        if isinstance(fig, bytes):
            self.data = fig
            return
        buffer = io.BytesIO()
        # No "Software" text chunk: the same figure gives the same bytes under any matplotlib version.
        fig.savefig(buffer, format="png", dpi=dpi, metadata={"Software": None}, pil_kwargs={"optimize": True})
        self.data = buffer.getvalue()

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PNG:
        return cls(Path(path).read_bytes())

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels, from the PNG header."""
        return int.from_bytes(self.data[16:20], "big"), int.from_bytes(self.data[20:24], "big")

    def _repr_png_(self) -> bytes:
        return self.data

    def __repr__(self) -> str:  # stable, so re-executed notebooks diff cleanly
        width, height = self.size
        return f"<PNG {width}x{height}>"

    def save(self, path: str | os.PathLike[str]) -> Path:
        return write_bytes_atomic(path, self.data)


def heatmap(ax: Axes, values: Any, rows: list[str], label: str, vmax: float | None = 1.0, cmap: str = "magma") -> Any:
    """``values[len(rows), columns]`` as a heatmap with named rows and a colour bar."""
    image = ax.imshow(values, aspect="auto", cmap=cmap, vmin=0.0, vmax=vmax, interpolation="nearest")
    ax.set_yticks(range(len(rows)), rows)
    ax.figure.colorbar(image, ax=ax, label=label, shrink=0.9)
    return image


def exit_agreement_plot(report: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Agreement with the full model against exit depth, without and with each adapter kind
    (layerskip-train-exit's report; held-out domains where there are any, else validation)."""
    exits = report["exits"]
    split = "held_out" if any(e["with_adapter"]["held_out"] for e in exits) else "validation"
    fig, ax = figure(6.0, 3.6)
    depths = sorted({e["layer"] for e in exits})
    plain = {e["layer"]: e["without_adapter"][split]["all"]["agreement"] for e in exits}
    ax.plot([d + 1 for d in depths], [plain[d] for d in depths], "o--", color="grey", label="plain exit")
    for kind in sorted({e["kind"] for e in exits}):
        points = sorted((e["layer"], e["with_adapter"][split]["all"]["agreement"]) for e in exits if e["kind"] == kind)
        ax.plot([d + 1 for d, _ in points], [a for _, a in points], "o-", label=f"{kind} adapter")
    ax.set_xlabel("layers the draft runs (exit depth)")
    ax.set_ylabel(f"top-1 agreement ({split.replace('_', '-')})")
    ax.set_ylim(0, 1)
    ax.set_title(str(report.get("model", "")))
    ax.legend()
    return PNG(fig).save(path)
