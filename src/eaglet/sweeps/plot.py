"""Heatmaps of a sweep: τ and predicted speedup over serving draft length x draft vocab size.

One column of panels per trained TTT step count, rows τ and speedup. A failed trial's row is hatched; the
recommended cell is outlined. Several trials with the same settings (an optuna study may repeat one) show
the best of them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eaglet.sweeps.report import Recommendation, Row


def _grid(rows: list[Row], ttt: int, vocabs: list[int], k_max: int, metric: str) -> np.ndarray:
    grid = np.full((len(vocabs), k_max), np.nan)
    for r in rows:
        if r.ttt_steps != ttt or r.draft_vocab_size not in vocabs:
            continue
        values = getattr(r, metric)
        i = vocabs.index(r.draft_vocab_size)
        for k, v in enumerate(values):
            grid[i, k] = v if np.isnan(grid[i, k]) else max(grid[i, k], v)
    return grid


def plot_heatmaps(rows: list[Row], rec: Recommendation | None, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttts = sorted({r.ttt_steps for r in rows if r.ttt_steps is not None})
    vocabs = sorted({r.draft_vocab_size for r in rows if r.draft_vocab_size is not None})
    k_max = max((len(r.tau) for r in rows), default=0) or 1
    metrics = (("tau", "τ"), ("speedup", "predicted speedup"))
    fig, axes = plt.subplots(
        len(metrics),
        max(len(ttts), 1),
        figsize=(1.0 + 0.75 * k_max * max(len(ttts), 1), 1.4 + 1.1 * len(metrics) * max(len(vocabs), 1)),
        squeeze=False,
    )
    for m, (metric, label) in enumerate(metrics):
        grids = [_grid(rows, ttt, vocabs, k_max, metric) for ttt in ttts]
        finite = np.concatenate([g[np.isfinite(g)] for g in grids]) if grids else np.zeros(0)
        vmin, vmax = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        for c, (ttt, grid) in enumerate(zip(ttts, grids, strict=True)):
            ax = axes[m][c]
            image = ax.imshow(
                grid, cmap="viridis", vmin=vmin, vmax=vmax or 1.0, aspect="auto", origin="lower"
            )
            for i, vocab in enumerate(vocabs):
                failed = (
                    any(r.ttt_steps == ttt and r.draft_vocab_size == vocab and not r.tau for r in rows)
                    and np.isnan(grid[i]).all()
                )
                if failed:
                    ax.axhspan(i - 0.5, i + 0.5, facecolor="none", hatch="//", edgecolor="grey")
                    ax.text((k_max - 1) / 2, i, "failed", ha="center", va="center", fontsize=8)
                for k in range(k_max):
                    if np.isfinite(grid[i, k]):
                        # Dark text on the bright end of the colour map.
                        color = "black" if grid[i, k] > (vmin + vmax) / 2 else "white"
                        ax.text(k, i, f"{grid[i, k]:.2f}", ha="center", va="center", fontsize=7, color=color)
            if rec is not None and rec.row.ttt_steps == ttt and rec.row.draft_vocab_size in vocabs:
                i = vocabs.index(rec.row.draft_vocab_size)
                k = rec.draft_length - 1
                ax.add_patch(
                    plt.Rectangle((k - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2)
                )
            ax.set_xticks(range(k_max), [str(k) for k in range(1, k_max + 1)])
            ax.set_yticks(range(len(vocabs)), [str(v) for v in vocabs])
            ax.set_xlabel("draft length")
            if c == 0:
                ax.set_ylabel(f"{label}\ndraft vocab size")
            ax.set_title(f"trained ttt_steps={ttt}", fontsize=9)
            fig.colorbar(image, ax=ax, fraction=0.05)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
