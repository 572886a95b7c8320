"""The PNG of a domain-shifting stream (`tandem bench shift`, `tandem demo`): rolling acceptance length and tokens/s per mode, domain shifts marked."""
from __future__ import annotations

from pathlib import Path

from tandem.flywheel.stream_stats import rolling


def plot_shift(results: dict[str, list[dict]], cfg, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for mode, rows in results.items():
        x = [r["i"] for r in rows]
        axes[0].plot(x, rolling([r["acceptance_length"] for r in rows], cfg.window), label=mode, linewidth=1.2)
        axes[1].plot(x, rolling([r["tokens_per_s"] for r in rows], cfg.window), label=mode, linewidth=1.2)
    length = max(len(rows) for rows in results.values())
    for ax in axes:
        for start in range(0, length, cfg.block):
            ax.axvline(start, color="grey", linewidth=0.6, linestyle=":")
        ax.grid(alpha=0.3)
    first = next(iter(results.values()))
    for start in range(0, length, cfg.block):
        axes[0].text(start + 0.01 * length, 0.02, first[start]["domain"], transform=axes[0].get_xaxis_transform(), fontsize=8, color="grey")
    axes[0].set_ylabel(f"acceptance length (rolling {cfg.window})")
    axes[1].set_ylabel("tokens/s" + (" (modelled)" if cfg.replay else ""))
    axes[1].set_xlabel("request")
    axes[0].legend(loc="upper right", fontsize=8)
    axes[0].set_title(f"{cfg.model}: domain-shift stream, {length} requests, blocks of {cfg.block}" + (" (replay)" if cfg.replay else " (live)"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
