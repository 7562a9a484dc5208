"""Training metrics: metrics.jsonl, TensorBoard events, a PNG loss curve, and MFU.

MFU = achieved model FLOP/s per device / peak FLOP/s per device, with model FLOPs counted
analytically (``wan_transformer.flops_per_forward``; training = 3x forward, as MaxDiffusion).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxcore import storage

log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s per chip for the accelerators we know (vendor figures).
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
}


def measure_peak_flops(n: int = 512, repeats: int = 5) -> float:
    """Achieved matmul FLOP/s of one device (the CPU's 'peak' for MFU)."""
    x = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        f(x).block_until_ready()
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def peak_flops_per_device(configured: float | None) -> float:
    """The configured figure, else a known chip's, else measured on this device."""
    if configured:
        return float(configured)
    kind = jax.devices()[0].device_kind
    for name, flops in PEAK_FLOPS.items():
        if kind.startswith(name):
            return flops
    return measure_peak_flops()


class MetricsLog:
    """Keeps every logged row; appends them to metrics.jsonl (only the rows not yet written:
    a run of 50k steps never re-sends its history) and writes TensorBoard events under a
    local folder that is uploaded when the output is gs://.

    A resumed run keeps the rows up to its checkpoint's step; when the file holds later rows
    (steps redone after the resume) it is rewritten once."""

    def __init__(self, output_dir: str, local_dir: Path, write: bool = True):
        self.output_dir = output_dir
        self.local_dir = local_dir
        self.write = write  # False on every process but the first of a multi-host run
        self.rows: list[dict] = []
        self._written = 0  # rows of self.rows already in metrics.jsonl
        self._rewrite = False  # metrics.jsonl holds rows that must go
        self._writer = None

    @property
    def uri(self) -> str:
        return storage.join(self.output_dir, "metrics.jsonl")

    def resume_from(self, step: int) -> None:
        """Keep the rows of steps <= ``step`` from an earlier (interrupted) run."""
        if not storage.exists(self.uri):
            return
        text = storage.read_text(self.uri)
        rows = _parse_rows(text)
        self.rows = [r for r in rows if r["step"] <= step]
        self._written = len(self.rows)
        self._rewrite = len(self.rows) != len(rows) or not text.endswith("\n")

    def _tensorboard(self):
        if self._writer is None:
            import tensorflow as tf

            self.local_dir.mkdir(parents=True, exist_ok=True)
            self._writer = tf.summary.create_file_writer(str(self.local_dir / "tensorboard"))
        return self._writer

    def log(self, row: dict) -> None:
        import tensorflow as tf
        from tensorflow.core.framework import summary_pb2

        # tf.summary.scalar needs the tensorboard package; the core writer with the scalars
        # plugin's metadata produces the same events without it.
        scalars = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
        )
        self.rows.append(row)
        if not self.write:
            return
        with self._tensorboard().as_default():
            for key, value in row.items():
                if key != "step" and isinstance(value, int | float):
                    tf.summary.write(
                        key, tf.constant(value, tf.float32), step=row["step"], metadata=scalars
                    )

    def flush(self) -> None:
        """Append the new rows to metrics.jsonl; write the TensorBoard files to the output."""
        if not self.write:
            return
        if self._rewrite:
            storage.write_text(self.uri, _lines(self.rows))
            self._rewrite = False
        else:
            storage.append_text(self.uri, _lines(self.rows[self._written :]))
        self._written = len(self.rows)
        if self._writer is not None:
            self._writer.flush()
            if storage.is_gcs(self.output_dir):
                for path in (self.local_dir / "tensorboard").glob("*"):
                    storage.upload_file(
                        path, storage.join(self.output_dir, "tensorboard", path.name)
                    )

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _lines(rows: list[dict]) -> str:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)


def _parse_rows(text: str) -> list[dict]:
    """The rows of a metrics.jsonl; a torn last line (a crash mid-append) is skipped."""
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def plot_loss_curve(rows: list[dict], uri: str, title: str = "training loss") -> None:
    """PNG of loss against step (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import io

    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows if "loss" in r]
    losses = [r["loss"] for r in rows if "loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, losses)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    storage.write_bytes(uri, buf.getvalue())
