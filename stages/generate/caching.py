"""Step caching in generate: the ``cache`` section resolved for a run (MagCache ratios from a
calibration artifact), MagCache schedules per prompt group, and the calibration a
``cache.kind=calibrate`` run (``difforge calibrate``) leaves in its manifest.

A calibration artifact is a generate artifact whose summary has ``magcache_calibration``: one
entry per (scheduler, flow_shift, num_inference_steps) the prompts used, with the conditional
branch's ratios averaged over its prompts (the negative branch's beside them). MagCache in a
later run takes the entry with its scheduler and shift and, preferring its own step count,
resamples the ratios to the step count (nearest neighbour, as diffusers does).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from jaxcore import step_cache
from jaxcore.artifacts import ArtifactError, open_artifact
from stages.common.errors import StageInputError

log = logging.getLogger(__name__)

CALIBRATION_KEY = "magcache_calibration"


@dataclasses.dataclass(frozen=True)
class CacheRun:
    """The cache settings of one generate run, with the calibration they read."""

    config: step_cache.CacheConfig
    calibration: tuple[dict, ...] = ()

    @property
    def plan(self) -> step_cache.CachePlan:
        return step_cache.plan_of(self.config)

    def ratios(self, scheduler: str, flow_shift: float | None, steps: int) -> list[float] | None:
        """MagCache's ratios for prompts rendered with these settings (None: not MagCache)."""
        if self.config.kind != "magcache":
            return None
        if self.config.mag_ratios is not None:
            return list(self.config.mag_ratios)
        same = [
            e
            for e in self.calibration
            if e["scheduler"] == scheduler and _same_shift(e["flow_shift"], flow_shift)
        ]
        if not same:
            have = [
                (e["scheduler"], e["flow_shift"], e["num_inference_steps"])
                for e in self.calibration
            ]
            raise StageInputError(
                f"cache.calibration={self.config.calibration} has no ratios for scheduler "
                f"{scheduler} with flow_shift {flow_shift}; it has (scheduler, shift, steps) "
                f"{have}: calibrate with these settings"
            )
        exact = [e for e in same if e["num_inference_steps"] == steps]
        return list((exact or same)[0]["ratios"])

    def schedule(self, scheduler: str, flow_shift: float | None, steps: int) -> np.ndarray | None:
        ratios = self.ratios(scheduler, flow_shift, steps)
        return step_cache.schedule_for(self.config, ratios, steps)

    def fingerprint(self, scheduler: str, flow_shift: float | None, steps: int) -> dict:
        """What of the settings decides a prompt's pixels."""
        return step_cache.fingerprint(self.config, self.ratios(scheduler, flow_shift, steps))


def prepare(config: step_cache.CacheConfig) -> CacheRun:
    """Read the calibration artifact a MagCache run names (errors name it)."""
    if config.calibration is None:
        return CacheRun(config)
    try:
        manifest = open_artifact(config.calibration, "generate")
    except ArtifactError as err:
        raise StageInputError(f"cache.calibration: {err}") from None
    entries = manifest.summary.get(CALIBRATION_KEY)
    if not entries:
        raise StageInputError(
            f"cache.calibration={config.calibration} holds no MagCache ratios: make one with "
            "difforge calibrate (generate with cache.kind=calibrate)"
        )
    return CacheRun(config, tuple(entries))


def calibration_summary(records: Iterable[Mapping], scheduler: str) -> list[dict]:
    """The calibrate run's ratios per (flow_shift, steps), averaged over its prompts."""
    groups: dict[tuple, list[Mapping]] = {}
    for record in records:
        ratios = (record.get("cache") or {}).get("ratios")
        if ratios is None:
            continue
        params = record["params"]
        groups.setdefault((params["flow_shift"], params["num_inference_steps"]), []).append(
            record["cache"]
        )
    out = []
    for (shift, steps), members in sorted(groups.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1])):
        entry = {
            "scheduler": scheduler,
            "flow_shift": None if shift is None else float(shift),
            "num_inference_steps": int(steps),
            "prompts": len(members),
            "ratios": _mean([m["ratios"] for m in members]),
        }
        negatives = [m["negative_ratios"] for m in members if m.get("negative_ratios")]
        if negatives:
            entry["negative_ratios"] = _mean(negatives)
        out.append(entry)
    return out


def _same_shift(a: float | None, b: float | None) -> bool:
    """Shifts as prompts record them (None: the pipeline's own, e.g. Flux's dynamic shift)."""
    if a is None or b is None:
        return a is None and b is None
    return bool(np.isclose(a, b))


def _mean(rows: Sequence[Sequence[float]]) -> list[float]:
    return [round(float(v), 6) for v in np.mean(np.asarray(rows, np.float64), axis=0)]


def compared(kind: str, quantization: str) -> str:
    """What the quality gate compares with the dense float render: ``cached``,
    ``int8_weights``, ``cached int8_weights``."""
    return " ".join(["cached"] * (kind != "none") + [quantization] * (quantization != "none"))


def quality_summary(
    records: Sequence[Mapping], config: step_cache.CacheConfig, quantization: str = "none"
) -> dict | None:
    """The quality gate's table: per prompt PSNR / SSIM / evaluations, overall figures.
    ``compared`` says what was compared with the dense (float) render."""
    rows = [r for r in records if (r.get("cache") or {}).get("psnr") is not None]
    if not rows:
        return None
    runs = sum(r["cache"].get("block_stack_runs", 0) for r in rows)
    skips = sum(r["cache"].get("block_stack_skips", 0) for r in rows)
    total = runs + skips
    # wall time from the batches that did not compile (None in the others)
    timed = [r for r in rows if r["cache"].get("cached_seconds") is not None]
    dense_s = sum(r["cache"]["dense_seconds"] for r in timed)
    cached_s = sum(r["cache"]["cached_seconds"] for r in timed)
    psnrs = [r["cache"]["psnr"] for r in rows]
    ssims = [r["cache"]["ssim"] for r in rows]
    failed = [
        r["id"]
        for r in rows
        if (config.min_psnr is not None and r["cache"]["psnr"] < config.min_psnr)
        or (config.min_ssim is not None and r["cache"]["ssim"] < config.min_ssim)
    ]
    return {
        "prompts": [
            {
                "id": r["id"],
                "psnr": r["cache"]["psnr"],
                "ssim": r["cache"]["ssim"],
                "block_stack_runs": r["cache"].get("block_stack_runs"),
                "block_stack_skips": r["cache"].get("block_stack_skips"),
            }
            for r in rows
        ],
        "mean_psnr": float(np.mean(psnrs)),
        "min_psnr": float(np.min(psnrs)),
        "mean_ssim": float(np.mean(ssims)),
        "min_ssim": float(np.min(ssims)),
        "evaluation_ratio": total / runs if runs else None,  # dense evaluations / cached ones
        # dense / cached device seconds over the batches that did not compile (None: all did)
        "wall_speedup": dense_s / cached_s if cached_s else None,
        "floors": {"min_psnr": config.min_psnr, "min_ssim": config.min_ssim},
        "compared": compared(config.kind, quantization),
        "below_floor": failed,
    }
