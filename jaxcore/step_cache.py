"""Step caching for sampling: skip a denoiser's block stack when its output barely changes.

Two methods, with the semantics of diffusers' hooks (``diffusers/hooks/first_block_cache.py``
and ``mag_cache.py``, diffusers 0.42), so the same settings make the same skip decisions on the
same model; written for a jitted loop (no host round-trip per step):

- **First-Block-Cache** (``first_block``; ParaAttention, after TeaCache): every step runs the
  first block. If the relative mean absolute change of its residual (output - input of the
  first stream) since the last *computed* step is ``<= threshold``, the other blocks are
  skipped and their cached residual (last computed stack output - first block output, per
  stream) is added to this step's first-block output. A data-dependent decision: a
  ``lax.cond`` inside the loop.
- **MagCache** (``magcache``; Ma et al. 2025): skip decisions come from per-step magnitude
  ratios of the model's residual (``mag_ratios``, measured once per model by calibration,
  interpolated to the step count by nearest neighbour): past the first ``retention_ratio`` of
  the steps, a step is skipped while the accumulated error ``sum |1 - prod ratios|`` stays
  ``<= threshold`` and at most ``max_skip_steps`` steps in a row are skipped; a skipped step
  adds the last computed stack residual (stack output - stack input, first stream) to its
  input. The schedule is static: it is decided on the host (:func:`magcache_schedule`) and
  enters the loop as data.
- **Calibration** (``calibrate``): every step computes; each step's ratio
  ``mean_tokens(|r_t| / (|r_{t-1}| + 1e-8))`` (norms over channels) is recorded, 1.0 first.

State is per row of the denoiser's batch, and decisions are per row: a row's decision is what
it would be were it rendered alone (diffusers keeps one state per cache context; its
pipelines use one context for the conditional and one for the negative branch, as the rows of
a CFG batch are here). The stack is skipped for the whole batch only when every row skips;
a row that skips inside a computing batch still takes its cached result, so a prompt's pixels
do not depend on its batch. Counters per row: block-stack evaluations run and skipped.

A family's denoiser takes part through ``Family.apply(..., run_stack=...)``: it runs its
blocks as ``run_stack(streams, run_blocks, num_blocks)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcore import sharding

KINDS = ("none", "first_block", "magcache", "calibrate")
# diffusers' defaults (FirstBlockCacheConfig, MagCacheConfig)
DEFAULT_THRESHOLDS = {"first_block": 0.05, "magcache": 0.06}


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The ``cache`` section of generate.

    ``kind``: ``none``, ``first_block``, ``magcache`` or ``calibrate`` (a dense render that
    measures MagCache's ratios; ``difforge calibrate``). ``threshold``: None = diffusers'
    default for the kind (0.05 / 0.06). MagCache: ``max_skip_steps``, ``retention_ratio`` and
    the ratios, given as ``mag_ratios`` or read from a ``calibration`` artifact (a calibrate
    run's) — exactly one of the two.

    Quality gate: ``compare_dense`` renders every prompt dense too (and, with
    ``compute.quantization``, with the float weights) and records PSNR / SSIM of the render
    against it (and the speed-up); ``min_psnr`` / ``min_ssim`` fail the run when a prompt
    falls below them (they need ``compare_dense``). With ``kind=none`` the gate needs a
    quantized run (checked where both are known: the generate config)."""

    kind: str = "none"
    threshold: float | None = None
    max_skip_steps: int = 3
    retention_ratio: float = 0.2
    mag_ratios: tuple[float, ...] | None = None
    calibration: str | None = None
    compare_dense: bool = False
    min_psnr: float | None = None
    min_ssim: float | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"cache.kind must be one of {list(KINDS)}, got {self.kind!r}")
        if self.threshold is not None and not self.threshold >= 0:
            raise ValueError(f"cache.threshold must be >= 0, got {self.threshold}")
        if self.max_skip_steps < 0:
            raise ValueError(f"cache.max_skip_steps must be >= 0, got {self.max_skip_steps}")
        if not 0.0 <= self.retention_ratio <= 1.0:
            raise ValueError(f"cache.retention_ratio must be in [0, 1], got {self.retention_ratio}")
        if self.kind == "magcache":
            if (self.mag_ratios is None) == (self.calibration is None):
                raise ValueError(
                    "cache.kind=magcache needs the model's ratios: cache.mag_ratios=[...] or "
                    "cache.calibration=<a difforge calibrate artifact> (exactly one)"
                )
            if self.mag_ratios is not None and not self.mag_ratios:
                raise ValueError("cache.mag_ratios must not be empty")
        elif self.mag_ratios is not None or self.calibration is not None:
            raise ValueError(
                f"cache.mag_ratios / cache.calibration are for magcache, not {self.kind}"
            )
        if (self.min_psnr is not None or self.min_ssim is not None) and not self.compare_dense:
            raise ValueError("cache.min_psnr / cache.min_ssim need cache.compare_dense=true")
        if self.compare_dense and self.kind == "calibrate":
            raise ValueError("cache.compare_dense compares a cached render: kind=calibrate")

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    @property
    def effective_threshold(self) -> float:
        if self.threshold is not None:
            return float(self.threshold)
        return DEFAULT_THRESHOLDS.get(self.kind, 0.0)


@dataclasses.dataclass(frozen=True)
class CachePlan:
    """What the jitted loop needs to know statically: the method and, for First-Block-Cache,
    its threshold (hashable: part of the compiled program's key). ``calibrate`` records
    ratios and skips nothing."""

    kind: str = "none"
    threshold: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.kind != "none"


NO_CACHE = CachePlan()
CALIBRATE = CachePlan("calibrate")


def plan_of(config: CacheConfig) -> CachePlan:
    if config.kind == "first_block":
        return CachePlan("first_block", config.effective_threshold)
    return CachePlan(config.kind)


def fingerprint(config: CacheConfig, ratios: Sequence[float] | None = None) -> dict:
    """What of the cache settings decides a render's pixels (for resume fingerprints)."""
    if not config.enabled:
        return {}
    out = {"kind": config.kind, "threshold": config.effective_threshold}
    if config.kind == "magcache":
        out.update(
            max_skip_steps=config.max_skip_steps,
            retention_ratio=config.retention_ratio,
            mag_ratios=None if ratios is None else [float(r) for r in ratios],
        )
    return out


# --- MagCache's static schedule (host) ------------------------------------------------------


def nearest_interp(ratios: Sequence[float], length: int) -> np.ndarray:
    """``ratios`` resampled to ``length`` steps by nearest neighbour (diffusers'
    ``nearest_interp``: indices ``round(i * (n - 1) / (length - 1))`` in float32, halves to
    even; one step takes the last ratio)."""
    src = np.asarray(ratios, np.float32)
    if length == 1:
        return src[-1:]
    scale = (len(src) - 1) / (length - 1)
    index = np.round(np.arange(length, dtype=np.float32) * np.float32(scale)).astype(np.int64)
    return src[index]


def magcache_schedule(
    ratios: Sequence[float],
    num_steps: int,
    threshold: float,
    max_skip_steps: int,
    retention_ratio: float,
) -> np.ndarray:
    """``[num_steps]`` bool: which steps run the block stack (MagCacheHeadHook's rule, in
    float32 as diffusers' tensors compute it)."""
    ratios = np.asarray(ratios, np.float32)
    if len(ratios) != num_steps:
        ratios = nearest_interp(ratios, num_steps)
    retention = int(retention_ratio * num_steps + 0.5)
    one, limit = np.float32(1.0), np.float32(threshold)
    acc_ratio, acc_err, acc_steps = one, np.float32(0.0), 0
    have_residual = False
    compute = np.ones(num_steps, bool)
    for step in range(num_steps):
        if step >= retention:
            scale = ratios[step] if step < len(ratios) else one
            acc_ratio = np.float32(acc_ratio * scale)
            acc_steps += 1
            acc_err = np.float32(acc_err + np.abs(one - acc_ratio))
            if have_residual and acc_err <= limit and acc_steps <= max_skip_steps:
                compute[step] = False
            else:
                acc_ratio, acc_err, acc_steps = one, np.float32(0.0), 0
        have_residual = have_residual or bool(compute[step])
    return compute


def schedule_for(config: CacheConfig, ratios: Sequence[float] | None, num_steps: int):
    """The loop's per-step data: MagCache's compute mask, else None."""
    if config.kind != "magcache":
        return None
    return magcache_schedule(
        ratios, num_steps, config.effective_threshold, config.max_skip_steps, config.retention_ratio
    )


# --- state and runners (traced) ---------------------------------------------------------------


def _rows(mask, like):
    """A ``[R]`` mask broadcast against ``like`` ``[R, ...]``."""
    return mask.reshape(mask.shape[:1] + (1,) * (like.ndim - 1))


def _constrain(x):
    if x.ndim == 3:
        return sharding.constrain(x, ("activation_batch", "activation_length", "activation_embed"))
    return x


def init_state(plan: CachePlan, stream_shapes: Sequence[jax.ShapeDtypeStruct]) -> dict:
    """The cache state for a batch whose block stack carries streams of these shapes."""
    if not plan.enabled:
        return {}
    rows = stream_shapes[0].shape[0]
    zeros = [jnp.zeros(s.shape, s.dtype) for s in stream_shapes]
    state: dict[str, Any] = {
        "computed": jnp.zeros((rows,), jnp.int32),
        "skipped": jnp.zeros((rows,), jnp.int32),
        "valid": jnp.zeros((rows,), bool),
        "residual": _constrain(zeros[0]),
    }
    if plan.kind == "first_block":
        state["tail"] = tuple(_constrain(z) for z in zeros)
    return state


def _count(state: dict, compute) -> dict:
    return {
        **state,
        "computed": state["computed"] + compute.astype(jnp.int32),
        "skipped": state["skipped"] + (~compute).astype(jnp.int32),
    }


def runner(plan: CachePlan, state: dict, compute_now=None):
    """``run_stack`` for one denoiser call; its ``extra`` is ``(new state, info)`` where
    info is the calibration ratio per row (``calibrate``) or None.

    ``compute_now``: MagCache's schedule entry for this step (a traced bool)."""
    if plan.kind == "first_block":
        return _first_block(plan.threshold, state)
    if plan.kind == "magcache":
        return _magcache(state, compute_now)
    if plan.kind == "calibrate":
        return _calibrate(state)
    raise ValueError(f"no runner for cache kind {plan.kind!r}")


def _first_block(threshold: float, state: dict):
    def run(streams, run_blocks, num_blocks):
        if num_blocks < 2:
            raise ValueError("first_block caching needs a denoiser with at least 2 blocks")
        head = run_blocks(streams, 0, 1)
        residual = head[0] - streams[0]
        previous = state["residual"]
        axes = tuple(range(1, residual.ndim))
        change = jnp.mean(jnp.abs(residual - previous), axis=axes)
        diff = change / jnp.mean(jnp.abs(previous), axis=axes)
        compute = ~state["valid"] | (diff > threshold)
        cached = tuple(h + t for h, t in zip(head, state["tail"], strict=True))

        def full():
            out = run_blocks(head, 1, num_blocks)
            return out, tuple(o - h for o, h in zip(out, head, strict=True))

        out, tail = jax.lax.cond(jnp.any(compute), full, lambda: (cached, state["tail"]))
        out = tuple(jnp.where(_rows(compute, o), o, c) for o, c in zip(out, cached, strict=True))
        tail = tuple(
            _constrain(jnp.where(_rows(compute, t), t, old))
            for t, old in zip(tail, state["tail"], strict=True)
        )
        new = _count(state, compute)
        new.update(
            residual=_constrain(jnp.where(_rows(compute, residual), residual, previous)),
            tail=tail,
            valid=state["valid"] | compute,
        )
        return out, (new, None)

    return run


def _magcache(state: dict, compute_now):
    def run(streams, run_blocks, num_blocks):
        def full():
            out = run_blocks(streams, 0, num_blocks)
            return out, out[0] - streams[0]

        def skip():
            return (streams[0] + state["residual"], *streams[1:]), state["residual"]

        out, residual = jax.lax.cond(compute_now, full, skip)
        rows = state["valid"].shape[0]
        compute = jnp.broadcast_to(compute_now, (rows,))
        new = _count(state, compute)
        new.update(residual=_constrain(residual), valid=state["valid"] | compute)
        return out, (new, None)

    return run


def _calibrate(state: dict):
    def run(streams, run_blocks, num_blocks):
        out = run_blocks(streams, 0, num_blocks)
        residual = out[0] - streams[0]
        norm = jnp.linalg.norm(residual.astype(jnp.float32), axis=-1)
        before = jnp.linalg.norm(state["residual"].astype(jnp.float32), axis=-1)
        axes = tuple(range(1, norm.ndim))
        ratio = jnp.mean(norm / (before + 1e-8), axis=axes)
        ratio = jnp.where(state["valid"], ratio, 1.0)
        compute = jnp.ones_like(state["valid"])
        new = _count(state, compute)
        new.update(residual=_constrain(residual), valid=compute)
        return out, (new, ratio)

    return run
