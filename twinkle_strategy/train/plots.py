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


def plot_expert_load(run_dir: str, steps: list[int], counts: list[list[list[float]]]) -> str | None:
    """Heatmap of each expert's share of its layer's tokens (rows: layer x expert) at each logged step.

    ``counts[i]`` is the [layers, experts] global token count of the window logged at ``steps[i]``;
    a share of 1/E everywhere is perfect balance.
    """
    plt = _pyplot()
    if plt is None or not counts:
        return None
    import numpy as np

    load = np.asarray(counts, dtype=float)  # [windows, layers, experts]
    share = load / np.maximum(load.sum(axis=2, keepdims=True), 1e-12)
    windows, layers, experts = share.shape
    image = share.reshape(windows, layers * experts).T
    fig, ax = plt.subplots(figsize=(min(4 + 0.25 * windows, 16), min(2 + 0.12 * layers * experts, 24)))
    shown = ax.imshow(image, aspect="auto", interpolation="nearest", cmap="viridis",
                      extent=(-0.5, windows - 0.5, layers * experts - 0.5, -0.5))
    for layer in range(1, layers):
        ax.axhline(layer * experts - 0.5, color="white", linewidth=0.6)
    ticks = list(range(0, windows, max(1, windows // 10)))
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
    ax.set_yticks([layer * experts + (experts - 1) / 2 for layer in range(layers)],
                  [f"layer {layer}" for layer in range(layers)])
    ax.set_xlabel("step")
    ax.set_title(f"tokens per expert (share of the layer; even = {1 / experts:.3f})")
    fig.colorbar(shown, ax=ax, label="share of the layer's tokens")
    return _save(plt, fig, run_dir, "expert_load.png")
