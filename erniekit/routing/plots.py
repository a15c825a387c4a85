"""Routing pictures as PNG: a layer x expert load heatmap and a modality x expert usage heatmap,
plus logging a PNG to VisualDL as an image.

matplotlib is imported inside the functions and each figure is drawn on its own Agg canvas
(no display, works on headless training machines, leaves pyplot's global backend and figure
list alone, so nothing accumulates over a long run), and every PNG is written to a temporary file and renamed, so a
reader (VisualDL, a browser) never sees half a picture.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from erniekit.utils.io import atomic_write


def _figure(width: float, height: float):
    """A matplotlib Figure bound to an Agg canvas, outside pyplot (no GUI, no global state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _heatmap(
    matrix: np.ndarray,
    path: str,
    title: str,
    row_labels: Sequence[str],
    row_axis: str,
    colorbar_label: str,
    expert_ids: Sequence[int] | None = None,
) -> str:
    """One heatmap (rows x experts, fractions shown in %; cells annotated on small grids) saved
    atomically as PNG; returns `path`."""
    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim != 2 or m.size == 0:
        raise ValueError(f"heatmap needs a non-empty 2-D matrix, got shape {m.shape}")
    m = 100.0 * m  # shown in percent
    rows, cols = m.shape
    width = min(max(6.0, (0.42 if cols <= 32 else 0.25) * cols + 2.5), 24.0)
    fig = _figure(width, min(max(3.0, 0.38 * rows + 1.8), 24.0))
    ax = fig.add_subplot()
    try:
        vmax = max(float(m.max()), 1e-9)
        im = ax.imshow(m, aspect="auto", cmap="viridis", vmin=0.0, vmax=vmax, interpolation="nearest")
        ax.set_xlabel("expert")
        ax.set_ylabel(row_axis)
        ax.set_title(title, fontsize=10)
        ticks = range(cols) if cols <= 32 else range(0, cols, max(1, cols // 16))
        ax.set_xticks(ticks)
        if expert_ids is not None:  # a modality's group: label its experts by their global ids
            ax.set_xticklabels([str(expert_ids[t]) for t in ticks])
        ax.set_yticks(range(rows))
        ax.set_yticklabels(list(row_labels))
        if rows * cols <= 400:  # numbers stay legible only on small grids
            for (r, c), v in np.ndenumerate(m):
                ax.text(
                    c, r, f"{v:.0f}", ha="center", va="center", fontsize=7, color="black" if v > 0.6 * vmax else "white"
                )
        fig.colorbar(im, ax=ax, label=colorbar_label, fraction=min(0.15, 0.9 / width), pad=0.02)
        fig.tight_layout()
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        fig.clear()  # drop the artists now rather than at garbage collection
    return path


def save_load_heatmap(
    matrix: np.ndarray, path: str, title: str, layer_ids: Sequence[int], expert_ids: Sequence[int] | None = None
) -> str:
    """Heatmap of load[l, e] (fraction of layer l's assignments on expert e; cells in %).
    A balanced layer is one flat colour at 1/E; hot cells are overloaded experts. expert_ids:
    the columns' global expert ids (one modality's group), default 0..E-1."""
    m = np.asarray(matrix)
    if len(layer_ids) != m.shape[0]:
        raise ValueError(f"{len(layer_ids)} layer ids for a matrix of {m.shape[0]} rows")
    uniform = 1.0 / m.shape[1] if m.ndim == 2 and m.shape[1] else 0.0
    return _heatmap(
        m,
        path,
        f"{title}  (uniform = {100 * uniform:.1f}%)",
        [f"layer {i}" for i in layer_ids],
        "decoder layer",
        "% of the layer's assignments",
        expert_ids,
    )


def save_modality_usage(matrix: np.ndarray, path: str, title: str, modality_names: Sequence[str] | None = None) -> str:
    """Heatmap of usage[m, e] (fraction of modality m's assignments on expert e; cells in %)."""
    m = np.asarray(matrix)
    names = list(modality_names) if modality_names else [f"modality {i}" for i in range(m.shape[0])]
    return _heatmap(m, path, title, names, "modality", "% of the modality's assignments")


def png_to_uint8(png_path: str) -> np.ndarray:
    """The PNG as an HWC uint8 RGB array (what VisualDL's add_image expects)."""
    import matplotlib.image as mpimg

    img = mpimg.imread(png_path)  # PNG -> float32 in [0, 1], RGB or RGBA
    if img.dtype != np.uint8:
        img = np.clip(np.rint(img * 255.0), 0, 255).astype(np.uint8)
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    return np.ascontiguousarray(img[:, :, :3])


def log_images_to_visualdl(writer: Any, tag: str, png_path: str, step: int) -> None:
    """Add the PNG at `png_path` to a visualdl LogWriter under `tag` at `step`."""
    writer.add_image(tag=tag, img=png_to_uint8(png_path), step=int(step), dataformats="HWC")
