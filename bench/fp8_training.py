"""fp8 training against bf16 on the demo's training: ``python -m bench.fp8_training``.

Trains the demo's DiT (``configs/pipelines/demo.yml``'s train step, its settings unchanged) on
the demo's convert artifact twice, with bf16 activations (``compute.activations_dtype=
bfloat16``, float32 weights) and with the same plus ``compute.quantization=fp8`` (the dense
products in float8: e4m3 forward, e5m2 gradients), and writes

- ``docs/fp8_training.png``: both loss curves (the logged steps) and their relative gap;
- ``bench/results/fp8_training.json``: the curves, the mean loss of the last 10% of steps of
  each, their relative difference, and each run's step time.

The data is the demo's convert artifact (``outputs/demo/data``, made by ``make demo``), or
``--data``. On this 2-core CPU the float8 products are emulated (XLA CPU has no float8 GEMM),
so the step times say nothing about a TPU or GPU; the loss is what this measures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
RUNS = {
    "bf16": ["activations_dtype=bfloat16"],
    "fp8": ["activations_dtype=bfloat16", "quantization=fp8"],
}


def _demo_train_overrides(steps: int | None) -> list[str]:
    """The demo pipeline's train step settings as ``key=value`` overrides."""
    pipeline = yaml.safe_load((REPO / "configs/pipelines/demo.yml").read_text())
    (train,) = [s for s in pipeline["steps"] if s["stage"] == "train"]
    settings = dict(train["set"])
    if steps is not None:
        settings["max_train_steps"] = steps
    settings["checkpoint_every"] = settings["max_train_steps"]
    return [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in settings.items()]


def _curve(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def main(argv=None) -> dict:
    from pipelines import cli

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(REPO / "outputs/demo/data"))
    parser.add_argument("--workdir", default=str(REPO / "outputs/bench_fp8_training"))
    parser.add_argument("--steps", type=int, default=None, help="default: the demo's")
    args = parser.parse_args(argv)
    curves = {}
    for name, settings in RUNS.items():
        out = Path(args.workdir) / name
        command = ["train", str(REPO / "configs/stages/train.yml"), f"data={args.data}"]
        command += [f"output_dir={out}", *_demo_train_overrides(args.steps), *settings, "-q"]
        if cli.main(command) != 0:
            raise SystemExit(f"the {name} training run failed")
        curves[name] = _curve(out)
    result = _summary(curves)
    _plot(curves, REPO / "docs/fp8_training.png")
    path = REPO / "bench/results/fp8_training.json"
    path.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "curves"}, indent=1))
    return result


def _summary(curves: dict) -> dict:
    steps = sorted(curves["bf16"])
    tail = steps[-max(1, len(steps) // 10) :]
    means = {n: sum(c[s]["loss"] for s in tail) / len(tail) for n, c in curves.items()}
    return {
        "steps": steps[-1],
        "tail_steps": [tail[0], tail[-1]],
        "tail_mean_loss": means,
        "relative_difference": (means["fp8"] - means["bf16"]) / means["bf16"],
        "step_time_s": {
            n: sum(c[s]["step_time_s"] for s in tail) / len(tail) for n, c in curves.items()
        },
        "curves": {n: {s: c[s]["loss"] for s in steps} for n, c in curves.items()},
    }


def _plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(curves["bf16"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    for name, curve in curves.items():
        top.plot(steps, [curve[s]["loss"] for s in steps], label=name)
    top.set_ylabel("training loss")
    top.legend()
    top.set_title("demo DiT: bf16 vs fp8 products (e4m3 forward, e5m2 gradients)")
    gap = [
        (curves["fp8"][s]["loss"] - curves["bf16"][s]["loss"]) / curves["bf16"][s]["loss"]
        for s in steps
    ]
    bottom.plot(steps, [100 * g for g in gap])
    bottom.axhline(0, color="gray", linewidth=0.5)
    bottom.set_ylabel("fp8 - bf16 (% of bf16)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
