"""Evaluate outputs: metrics.json, a CSV of bucket means, and PNG plots (matplotlib, Agg)."""

from __future__ import annotations

import io
import json

from jaxcore import storage


def write_metrics(uri: str, results: dict[int, dict]) -> None:
    """metrics.json: {checkpoint step: {eval_loss, bucket_means, bucket_counts}}."""
    data = {str(step): r for step, r in sorted(results.items())}
    storage.write_text(storage.join(uri, "metrics.json"), json.dumps(data, indent=2) + "\n")


def write_csv(uri: str, results: dict[int, dict]) -> None:
    """eval_loss.csv: one row per (checkpoint step, timestep), plus an 'all' row per step."""
    lines = ["checkpoint_step,timestep,mean_loss,records"]
    for step, r in sorted(results.items()):
        for t, mean in r["bucket_means"].items():
            lines.append(f"{step},{t},{mean:.8g},{r['bucket_counts'][t]}")
        total = sum(r["bucket_counts"].values())
        lines.append(f"{step},all,{r['eval_loss']:.8g},{total}")
    storage.write_text(storage.join(uri, "eval_loss.csv"), "\n".join(lines) + "\n")


def _save(fig, uri: str) -> None:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    storage.write_bytes(uri, buf.getvalue())


def write_plots(uri: str, results: dict[int, dict]) -> None:
    """loss_per_timestep.png (one line per checkpoint) and eval_loss_vs_step.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for step, r in sorted(results.items()):
        ts = [int(t) for t in r["bucket_means"]]
        ax.plot(ts, list(r["bucket_means"].values()), marker="o", label=f"step {step}")
    ax.set_xlabel("timestep")
    ax.set_ylabel("mean eval loss")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    _save(fig, storage.join(uri, "loss_per_timestep.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    steps = sorted(results)
    ax.plot(steps, [results[s]["eval_loss"] for s in steps], marker="o")
    ax.set_xlabel("training step")
    ax.set_ylabel("eval loss (mean of timestep means)")
    ax.grid(alpha=0.3)
    _save(fig, storage.join(uri, "eval_loss_vs_step.png"))
