"""The run's pictures: the loss curve and the expert-load heatmap, under <run dir>/images/."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plots")
        return None
    return plt


def _save(plt, fig, run_dir: str, name: str) -> str:
    os.makedirs(os.path.join(run_dir, "images"), exist_ok=True)
    out = os.path.join(run_dir, "images", name)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out


def plot_loss(run_dir: str, steps: list[int], losses: list[float]) -> str | None:
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, losses, marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.set_title("train loss")
    ax.grid(alpha=0.3)
    return _save(plt, fig, run_dir, "train_loss.png")


# Rows (layer x expert) up to which every expert has its own label; beyond, every k-th expert of each layer.
MAX_LABELLED_ROWS = 256


def expert_row_labels(layers: int, experts: int) -> list[str]:
    """The heatmap's row labels, top to bottom: ``layer L expert E`` on each layer's first row, ``expert E``
    on the others; past :data:`MAX_LABELLED_ROWS` rows, only every k-th expert (and each layer's first row)."""
    every = max(1, -(-layers * experts // MAX_LABELLED_ROWS))
    return [f"layer {layer} expert {expert}" if expert == 0 else (f"expert {expert}" if expert % every == 0 else "")
            for layer in range(layers) for expert in range(experts)]


def expert_load_figure(plt, steps: list[int], counts: list[list[list[float]]]):
    """The expert-load heatmap as a matplotlib figure (see :func:`plot_expert_load`)."""
    import numpy as np

    load = np.asarray(counts, dtype=float)  # [windows, layers, experts]
    share = load / np.maximum(load.sum(axis=2, keepdims=True), 1e-12)
    windows, layers, experts = share.shape
    rows = layers * experts
    image = share.reshape(windows, rows).T
    fig, ax = plt.subplots(figsize=(min(5 + 0.25 * windows, 16), min(2 + 0.14 * min(rows, MAX_LABELLED_ROWS), 40)))
    shown = ax.imshow(image, aspect="auto", interpolation="nearest", cmap="viridis",
                      extent=(-0.5, windows - 0.5, rows - 0.5, -0.5))
    for layer in range(1, layers):
        ax.axhline(layer * experts - 0.5, color="white", linewidth=0.6)
    ticks = list(range(0, windows, max(1, windows // 10)))
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
    labels = expert_row_labels(layers, experts)
    rows_labelled = [row for row, label in enumerate(labels) if label]
    ax.set_yticks(rows_labelled, [labels[row] for row in rows_labelled], fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("layer, expert")
    ax.set_title(f"tokens per expert (share of the layer; even = {1 / experts:.3f})")
    fig.colorbar(shown, ax=ax, label="share of the layer's tokens")
    return fig


def plot_expert_load(run_dir: str, steps: list[int], counts: list[list[list[float]]]) -> str | None:
    """Heatmap of each expert's share of its layer's tokens (rows: layer x expert, each labelled) at each
    logged step, saved as <run dir>/images/expert_load.png.

    ``counts[i]`` is the [layers, experts] global token count of the window logged at ``steps[i]``;
    a share of 1/E everywhere is perfect balance.
    """
    plt = _pyplot()
    if plt is None or not counts:
        return None
    return _save(plt, expert_load_figure(plt, steps, counts), run_dir, "expert_load.png")
