"""Ahead-of-time compilation for TPU slices without a TPU: does a step fit, and what it costs.

As MaxText's ``train_compile.py`` does it: :mod:`jax.experimental.topologies` builds the
compile-only devices of a TPU slice from libtpu (its compiler; no chip is needed), a program is
lowered with *abstract* arguments (``jax.ShapeDtypeStruct`` carrying their shardings, so
nothing is allocated: a 14B model's weights included) and compiled for those devices. The
compiled program tells, per chip: ``memory_analysis()`` (argument, output, aliased, temporary
and generated-code bytes), ``cost_analysis()`` (FLOPs) and its HLO text, whose collectives
are counted. A program that cannot fit does not compile at all: libtpu refuses it
(``RESOURCE_EXHAUSTED: Ran out of memory ...``); :func:`compile_program` turns that into a
report that does not fit, with the bytes the compiler asked for.

libtpu comes with the ``tpu`` extra (``pip install -e ".[tpu]"``) or, kept out of the
everyday environment so that ``import jax`` never probes for TPU chips, as a folder of its own
(``make tpu-libs``: ``pip install --no-deps --target .venv/tpu-libs libtpu==<the version jax's
tpu extra pins>``, inside the git-ignored venv folder but not on its path: 0.0.50 for the
tested jax 0.12.0.1; where the index lacks the pin, as it lacks 0.12.1's 0.0.53, the newest
release before it, said on stderr):
:func:`libtpu_path` finds either, and only :func:`Topology.devices` loads it.

The programs are the project's own: the generate loop here is :func:`jaxcore.sampling.
denoise_fn` (what :meth:`jaxcore.pipeline.Pipeline.sample` runs); the train step is the train
stage's (built above this library, see ``pipelines.deploy.train_program``) and comes in as a
:class:`Program`.

Caveats of the figures: XLA's FLOP count covers a loop's body once (the generate loop's
``fori_loop`` is one denoising step) and nothing inside custom kernels (Pallas splash
attention on TPU); :attr:`FitReport.model_flops` is the analytic count of the whole call
(the families' ``flops_per_forward``) beside it. Collectives inside a loop body count once too.

The estimated time (:func:`estimate_seconds`) starts from libtpu's own cost-model time of the
compiled program (``cost_analysis()["optimal_seconds"]``, per chip), which has the same
caveats, and mends them:

- loops: the program's time is multiplied by its :attr:`Program.repeats` (the generate loop:
  its steps; the loop's body is nearly all of the program), and where the analytic FLOPs XLA
  should see still exceed XLA's count times the repeats (blocks run as one ``lax.scan``,
  ``compute.scan_layers``, counted once), by that ratio too: the uncounted iterations are
  taken to run at the counted program's seconds per FLOP;
- custom calls: when the program holds Mosaic kernels (splash attention), the attention's
  analytic FLOPs (the families' ``attention_flops_per_forward``) are added at
  ``attention_efficiency`` x the chip's bf16 peak (:data:`DEFAULT_ATTENTION_EFFICIENCY`).

The implied MFU is the analytic FLOPs over (estimated seconds x chips x bf16 peak).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxcore import quantization, sampling, sharding, step_cache

GIB = 2**30
# Share of a chip's HBM a program may not use: the runtime, the infeed and fragmentation need
# some (libtpu's own limit for v6e is 31.25 of 32 GiB), and a step that uses every last byte
# on paper tends to fail on the pod. A report "fits" when its bytes are <= (1 - this) x HBM.
DEFAULT_HEADROOM = 0.05
# libtpu outside the environment (see the module docstring), relative to the repository
LOCAL_LIBTPU = (
    Path(__file__).resolve().parent.parent / ".venv" / "tpu-libs" / "libtpu" / "libtpu.so"
)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Share of a chip's bf16 peak the splash attention kernel is taken to reach (its inside is
# invisible to the cost model). An assumption, not a measurement: below the ~79-86% the cost
# model itself gives a large bf16 GEMM (v5p 2048x8192x8192: 0.755 ms for 275 GFLOP; tpu7x
# 32768^3: 996 TFLOP/s a device), for a kernel that also runs the softmax (exp, max, sums) on the
# vector unit between its two products. `difforge fit attention_efficiency=...` sets another.
DEFAULT_ATTENTION_EFFICIENCY = 0.5
# Where the cost model fails on a program (it returns a negative time for some programs with
# long splash kernels: the v6e 75,776-token attention of bench.tpu_splash, the Wan 14B 720p
# generate loop on tpu7x-8), XLA's counted FLOPs are priced at this share of bf16 peak: the
# cost model's own rate for a large bf16 GEMM (v5p 79%, tpu7x 86%, tests/foundation/test_fit.py)
FALLBACK_XLA_EFFICIENCY = 0.8
# The analytic FLOPs must exceed XLA's count x repeats by this much before a loop counted once
# is inferred (both counts leave out different small things: embeddings, norms, elementwise)
LOOP_EVIDENCE = 1.1
INSTALL_HINT = (
    'install the tpu extra (pip install -e ".[tpu]"), or libtpu alone, off the venv path: '
    "make tpu-libs"
)


class LibtpuMissing(RuntimeError):
    """libtpu (the TPU compiler) is not installed; the message says how to install it."""


class DoesNotFit(ValueError):
    """A program needs more memory per chip than the topology has; names both."""


# --- topologies -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Topology:
    """A slice to compile for: its chips and how much HBM each has.

    ``platform="tpu"``: compile-only devices from libtpu, ``topology`` in its naming
    (``"v5:2x2x1"``) with the chip config and chips per host (MaxText's
    ``accelerator_to_spec_map``). ``platform="cpu"``: the first ``chips`` CPU devices of this
    process (tests), with ``hbm_bytes`` as the budget to check against.
    """

    name: str
    chips: int
    hbm_bytes: int
    platform: str = "tpu"
    topology: str = ""
    chip_config: str = "default"
    chips_per_host: tuple[int, int, int] = (2, 2, 1)
    peak_flops: float = 0.0  # bf16 FLOP/s of one device (0: unknown; CPU topologies)

    def devices(self, num_slices: int = 1) -> list:
        """The devices of ``num_slices`` such slices (TPU: compile-only; loads libtpu)."""
        if self.platform == "cpu":
            found = jax.devices("cpu")
            wanted = self.chips * num_slices
            if len(found) < wanted:
                raise ValueError(
                    f"topology {self.name} needs {wanted} CPU devices, this process has "
                    f"{len(found)} (XLA_FLAGS=--xla_force_host_platform_device_count={wanted})"
                )
            return found[:wanted]
        return list(_tpu_devices(self, num_slices))


# HBM per chip, as Google Cloud's TPU system-architecture pages give it (cloud.google.com/tpu/
# docs/v4, .../v5p, .../v5e, .../v6e). libtpu's compiler keeps a little for itself: its
# out-of-memory refusal for v6e names 31.25 GiB available of the 32.
_V4_HBM = 32 * GIB  # TPU v4: 32 GiB HBM2
_V5P_HBM = 95 * GIB  # TPU v5p: 95 GiB HBM2e
_V5E_HBM = 16 * GIB  # TPU v5e: 16 GiB HBM2
_V6E_HBM = 32 * GIB  # TPU v6e (Trillium): 32 GiB
# TPU7x (Ironwood): 192 GiB HBM a chip, whose two TensorCores JAX sees as two devices of 96
_V7X_HBM = 96 * GIB
# bf16 peak of one device, the same pages: v4 275, v5p 459, v5e 197, v6e 918 TFLOP/s a chip
# (megacore v4 / v5p: one device a chip); TPU7x 2,307 a chip, two devices
_PEAK = {"v4": 275e12, "v5": 459e12, "v5e": 197e12, "v6e": 918e12, "tpu7x": 2307e12 / 2}


def _tpu(name, topology, chips, hbm, chip_config="default", per_host=(2, 2, 1)) -> Topology:
    peak = _PEAK[topology.partition(":")[0]]
    return Topology(name, chips, hbm, "tpu", topology, chip_config, per_host, peak)


# The slices `difforge deploy` knows (pipelines.deploy.TPU_SLICES), by the same names.
# v4 / v5p chips are megacore (two TensorCores as one device); 8-chip v5e / v6e hosts hold a
# 2x4 block of chips, the multi-host ones 2x2 per host.
TOPOLOGIES: dict[str, Topology] = {
    t.name: t
    for t in (
        _tpu("v4-8", "v4:2x2x1", 4, _V4_HBM, "megacore"),
        _tpu("v4-16", "v4:2x2x2", 8, _V4_HBM, "megacore"),
        _tpu("v4-32", "v4:2x2x4", 16, _V4_HBM, "megacore"),
        _tpu("v5p-8", "v5:2x2x1", 4, _V5P_HBM, "megacore"),
        _tpu("v5p-16", "v5:2x2x2", 8, _V5P_HBM, "megacore"),
        _tpu("v5p-32", "v5:2x2x4", 16, _V5P_HBM, "megacore"),
        _tpu("v5p-64", "v5:2x4x4", 32, _V5P_HBM, "megacore"),
        _tpu("v5litepod-8", "v5e:2x4", 8, _V5E_HBM, per_host=(2, 4, 1)),
        _tpu("v5litepod-16", "v5e:4x4", 16, _V5E_HBM),
        _tpu("v5litepod-32", "v5e:4x8", 32, _V5E_HBM),
        _tpu("v6e-4", "v6e:2x2", 4, _V6E_HBM),
        _tpu("v6e-8", "v6e:2x4", 8, _V6E_HBM, per_host=(2, 4, 1)),
        _tpu("v6e-16", "v6e:4x4", 16, _V6E_HBM),
        _tpu("v6e-32", "v6e:4x8", 32, _V6E_HBM),
        _tpu("v6e-64", "v6e:8x8", 64, _V6E_HBM),
        # TPU7x counts TensorCores as v5p does: tpu7x-8 is 4 chips (2x2x1), 8 devices
        _tpu("tpu7x-8", "tpu7x:2x2x1", 8, _V7X_HBM),
        _tpu("tpu7x-16", "tpu7x:2x2x2", 16, _V7X_HBM),
        _tpu("tpu7x-32", "tpu7x:2x2x4", 32, _V7X_HBM),
    )
}


def topology(name: str) -> Topology:
    """The preset called ``name``; an unknown name is an error listing the known ones."""
    try:
        return TOPOLOGIES[name]
    except KeyError:
        raise ValueError(f"unknown TPU topology {name!r}; known: {sorted(TOPOLOGIES)}") from None


def libtpu_path() -> str | None:
    """libtpu.so: ``TPU_LIBRARY_PATH``, else the ``libtpu`` package (the tpu extra), else
    ``.venv/tpu-libs``; None when there is none."""
    given = os.environ.get("TPU_LIBRARY_PATH")
    if given and os.path.isfile(given):
        return given
    try:
        import libtpu  # noqa: PLC0415 - optional: the tpu extra

        return libtpu.get_library_path()
    except ImportError:
        pass
    return str(LOCAL_LIBTPU) if LOCAL_LIBTPU.is_file() else None


def libtpu_pin() -> str:
    """The libtpu release jax's ``tpu`` extra pins (``0.0.50`` for jax 0.12.0.1), from jax's own
    package metadata: the compiler this jax was released with."""
    from importlib import metadata

    for requirement in metadata.requires("jax") or ():
        found = re.match(r"libtpu\s*==\s*([0-9.]+?)(?:\.\*)?\s*;.*extra\s*==\s*.tpu.", requirement)
        if found:
            return found.group(1)
    raise LibtpuMissing(f"jax {jax.__version__}'s metadata pins no libtpu for its tpu extra")


def libtpu_available() -> bool:
    return libtpu_path() is not None


# TPU chips attach as PCI devices with Google's vendor id and one of these device ids (v3 to
# TPU7x and after): the sysfs facts jax itself reads before it loads libtpu.
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICE_IDS = frozenset(
    {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076", "0x007c", "0x0083"}
)


def _tpu_chips_attached(devices: Path = Path("/sys/bus/pci/devices")) -> bool:
    """Whether this host has TPU chips (its PCI devices; no jax internals)."""
    for vendor in devices.glob("*/vendor"):
        try:
            if vendor.read_text().strip() != GOOGLE_PCI_VENDOR:
                continue
            if (vendor.parent / "device").read_text().strip() in TPU_PCI_DEVICE_IDS:
                return True
        except OSError:
            continue
    return False


@functools.cache
def _tpu_devices(slice_: Topology, num_slices: int) -> tuple:
    from jax.experimental import topologies

    path = libtpu_path()
    if path is None:
        raise LibtpuMissing(f"libtpu is not installed: {INSTALL_HINT}")
    os.environ.setdefault("TPU_LIBRARY_PATH", path)
    if not _tpu_chips_attached():
        # no chips here: keep libtpu from asking a metadata server which slice this host is
        # (slow, and a screenful of errors); the topology below says it.
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", slice_.name)
        # and from taking /tmp/libtpu_lockfile: with no chips to guard, several compiling
        # processes (a bench beside a deploy) may load libtpu at once
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    desc = topologies.get_topology_desc(
        topology_name=slice_.topology,
        platform="tpu",
        chip_config_name=slice_.chip_config,
        chips_per_host_bounds=slice_.chips_per_host,
        num_slices=num_slices,
        wrap=(False, False, False),
    )
    if len(desc.devices) != slice_.chips * num_slices:
        raise ValueError(
            f"topology {slice_.name}: libtpu made {len(desc.devices)} devices, expected "
            f"{slice_.chips * num_slices}"
        )
    return tuple(desc.devices)


def topology_mesh(slice_: Topology, mesh_config: sharding.MeshConfig, num_slices: int = 1):
    """The stage's mesh (data, fsdp, context, tensor) over the topology's devices."""
    return sharding.make_mesh(mesh_config, devices=slice_.devices(num_slices))


# --- programs and reports ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Program:
    """A jitted function and abstract arguments to lower it with, on ``mesh`` under ``rules``.

    ``model_flops``: the analytic FLOPs of one call over all chips (None: unknown);
    ``attention_flops``: the part of them in self-attention scores and values (None: unknown);
    ``repeats``: how often the program's loop runs its body (the generate loop: its steps;
    the cost model counts the body once);
    ``details``: what the program is made of (shapes, batch, steps), for the report.
    """

    name: str
    fn: Callable
    args: tuple
    mesh: Mesh
    rules: tuple = sharding.LOGICAL_AXIS_RULES
    model_flops: float | None = None
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    attention_flops: float | None = None
    repeats: int = 1


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The estimated time of one call (see the module docstring), per chip."""

    seconds: float
    xla_seconds: float  # the cost model's time, loops multiplied out
    attention_seconds: float  # the custom-call attention at the stated efficiency
    loop_scale: float  # the cost model's time was multiplied by this
    mfu: float | None
    note: str


def estimate_seconds(
    optimal_seconds: float,
    *,
    chips: int,
    peak_flops: float,
    xla_flops: float | None = None,
    model_flops: float | None = None,
    attention_flops: float | None = None,
    repeats: int = 1,
    custom_calls: int = 0,
    attention_efficiency: float = DEFAULT_ATTENTION_EFFICIENCY,
) -> Estimate | None:
    """The step's estimated seconds from the cost model's ``optimal_seconds`` of the compiled
    program (per chip): loops multiplied out and custom-call attention added (module
    docstring). ``model_flops``/``attention_flops`` are analytic, over all ``chips``. None
    when the cost model failed and there are no FLOPs and peak to price instead."""
    if not 0 < attention_efficiency <= 1:
        raise ValueError(f"attention_efficiency must be in (0, 1], got {attention_efficiency}")
    notes = []
    if not (math.isfinite(optimal_seconds) and optimal_seconds > 0):
        if not (xla_flops and peak_flops):
            return None
        notes.append(
            f"the cost model returned {optimal_seconds:.3g} s for this program; XLA's FLOPs "
            f"priced at {FALLBACK_XLA_EFFICIENCY:.0%} of bf16 peak instead"
        )
        optimal_seconds = xla_flops / (peak_flops * FALLBACK_XLA_EFFICIENCY)
    hidden = attention_flops if custom_calls and attention_flops else 0.0
    scale = float(repeats)
    if xla_flops and model_flops:
        # analytic FLOPs XLA should have counted, per chip, against what it counted x repeats
        visible = (model_flops - hidden) / chips
        if visible > xla_flops * repeats * LOOP_EVIDENCE:
            scale = visible / xla_flops
            notes.append(f"loops counted once scaled by the FLOP ratio {scale:.1f}")
    attention = 0.0
    if custom_calls:
        if attention_flops and peak_flops:
            attention = attention_flops / chips / (peak_flops * attention_efficiency)
            notes.append(f"custom-call attention at {attention_efficiency:.0%} of bf16 peak")
        else:
            notes.append(f"{custom_calls} custom call(s) not counted (their FLOPs are unknown)")
    xla = optimal_seconds * scale
    seconds = xla + attention
    mfu = model_flops / (seconds * chips * peak_flops) if model_flops and peak_flops else None
    return Estimate(seconds, xla, attention, scale, mfu, "; ".join(notes))


@dataclasses.dataclass(frozen=True)
class FitReport:
    """Per chip: memory by kind, whether it fits HBM, FLOPs and the collectives.

    ``total_bytes`` = argument + output - aliased (donated) + temporary + generated code, as
    MaxText sums ``memory_analysis``. When libtpu refused the program for memory,
    ``compiled`` is False, ``total_bytes`` is what it asked for, the breakdown is None and
    ``error`` holds its message.
    """

    program: str
    topology: str
    chips: int
    mesh: dict[str, int]
    hbm_bytes: int
    headroom: float
    total_bytes: int
    compiled: bool = True
    argument_bytes: int | None = None
    output_bytes: int | None = None
    alias_bytes: int | None = None
    temp_bytes: int | None = None
    generated_code_bytes: int | None = None
    # pinned host memory the program uses per chip (a remat policy's offloaded activations);
    # not HBM, so not in total_bytes
    host_bytes: int | None = None
    xla_flops: float | None = None  # per chip, loop bodies once (see the module docstring)
    model_flops: float | None = None  # analytic, the whole call over all chips
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)
    optimal_seconds: float | None = None  # libtpu's cost model, loop bodies once
    estimate: Estimate | None = None
    lower_seconds: float = 0.0
    compile_seconds: float = 0.0
    error: str | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def limit_bytes(self) -> int:
        return int(self.hbm_bytes * (1.0 - self.headroom))

    @property
    def fits(self) -> bool:
        return self.compiled and self.total_bytes <= self.limit_bytes

    @property
    def est_seconds(self) -> float | None:
        return None if self.estimate is None else self.estimate.seconds

    def to_dict(self) -> dict:
        """Everything, with the headline keys first (``difforge fit --json``)."""
        headline = {
            "fits": self.fits,
            "hbm_gib_per_chip": self.total_bytes / GIB,
            "hbm_limit_gib": self.limit_bytes / GIB,
            "est_seconds": self.est_seconds,
            "mfu_estimate": None if self.estimate is None else self.estimate.mfu,
        }
        return {**headline, **dataclasses.asdict(self), "limit_bytes": self.limit_bytes}

    def summary(self) -> str:
        """One line: program, topology, GiB per chip against the limit, TFLOPs, collectives."""
        verdict = "fits" if self.fits else "DOES NOT FIT"
        flops = "" if self.xla_flops is None else f", {_flops(self.xla_flops)}/chip (XLA)"
        if self.model_flops:
            flops += f", {_flops(self.model_flops)} model"
        counts = ", ".join(f"{k} {v}" for k, v in self.collectives.items() if v) or "none"
        if self.estimate is not None:
            mfu = "" if self.estimate.mfu is None else f", MFU {self.estimate.mfu:.0%}"
            flops += f"; est {_seconds(self.estimate.seconds)}{mfu}"
        return (
            f"{self.program} on {self.topology} (mesh {_mesh_text(self.mesh)}): "
            f"{self.total_bytes / GIB:.2f} GiB/chip of {self.limit_bytes / GIB:.2f} GiB "
            f"({self.hbm_bytes / GIB:.0f} GiB HBM - {self.headroom:.0%} headroom): {verdict}"
            f"{flops}; collectives: {counts}; compile {self.compile_seconds:.0f}s"
        )

    def breakdown(self) -> str:
        """GiB per chip by kind (or the compiler's refusal)."""
        if not self.compiled:
            return f"not compiled: {self.error}"
        parts = (
            ("arguments", self.argument_bytes),
            ("outputs", self.output_bytes),
            ("aliased", self.alias_bytes),
            ("temporaries", self.temp_bytes),
            ("code", self.generated_code_bytes),
        )
        text = ", ".join(f"{name} {(b or 0) / GIB:.2f}" for name, b in parts) + " GiB"
        if self.host_bytes:
            text += f"; pinned host {self.host_bytes / GIB:.2f} GiB"
        return text

    def check(self) -> None:
        """Raise :class:`DoesNotFit` (naming program, topology, bytes needed and HBM)."""
        if self.fits:
            return
        raise DoesNotFit(
            f"{self.program} does not fit {self.topology}: it needs "
            f"{self.total_bytes / GIB:.2f} GiB per chip, the limit is "
            f"{self.limit_bytes / GIB:.2f} GiB ({self.hbm_bytes / GIB:.0f} GiB HBM less "
            f"{self.headroom:.0%} headroom)" + (f"; {self.error}" if self.error else "")
        )


def _seconds(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def _flops(value: float) -> str:
    return f"{value / 1e12:.3g} TFLOP" if value >= 1e11 else f"{value / 1e9:.3g} GFLOP"


def _mesh_text(mesh: Mapping[str, int]) -> str:
    return "x".join(f"{k}{v}" for k, v in mesh.items() if v > 1) or "1 device"


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many of each collective an HLO module holds (async pairs count once, by their
    ``-start``; ops inside a loop body count once)."""
    kinds = "|".join(COLLECTIVES)
    found = re.findall(rf"\s({kinds})(-start)?\(", hlo_text)
    return {kind: sum(1 for k, _ in found if k == kind) for kind in COLLECTIVES}


_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# libtpu's refusals: "... HLO temporaries (45.00G) exceeds available HBM (31.25G)" and
# "Used 100.5G of 95.74G hbm. Exceeded hbm capacity by 4.76G."
_OOM_PATTERNS = (
    re.compile(r"\(([\d.]+)([KMGT]?)i?B?\)\s*exceeds available HBM \(([\d.]+)([KMGT]?)i?B?\)"),
    re.compile(r"Used ([\d.]+)([KMGT]?)i?B? of ([\d.]+)([KMGT]?)i?B? hbm"),
)


def parse_out_of_memory(message: str) -> tuple[int, int] | None:
    """(bytes asked for, bytes available) from libtpu's out-of-memory refusal, else None."""
    if "RESOURCE_EXHAUSTED" not in message and "out of memory" not in message.lower():
        return None
    for pattern in _OOM_PATTERNS:
        found = pattern.search(message)
        if found:
            used, used_unit, have, have_unit = found.groups()
            return int(float(used) * _UNITS[used_unit]), int(float(have) * _UNITS[have_unit])
    return None


def _cost(compiled, key: str) -> float | None:
    """One figure of ``compiled.cost_analysis()`` (per chip), None where it has none."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, Sequence) and not isinstance(analysis, Mapping):
        analysis = analysis[0] if analysis else None
    if not analysis or key not in analysis:
        return None
    return float(analysis[key])


MEMORY_KINDS = (
    "argument_bytes",
    "output_bytes",
    "alias_bytes",
    "temp_bytes",
    "generated_code_bytes",
)


# each kind's field in jax's memory analysis (``host_`` + the same: in pinned host memory)
_ANALYSIS_FIELD = {kind: kind.replace("_bytes", "_size_in_bytes") for kind in MEMORY_KINDS}


def total_bytes(kinds: Mapping[str, int]) -> int:
    """A program's bytes per chip from its memory analysis by kind (:data:`MEMORY_KINDS`):
    arguments + outputs - aliased (donated) + temporaries + code, as MaxText sums them."""
    return (
        kinds["argument_bytes"]
        + kinds["output_bytes"]
        - kinds["alias_bytes"]
        + kinds["temp_bytes"]
        + kinds["generated_code_bytes"]
    )


def count_custom_kernels(hlo_text: str) -> int:
    """Mosaic (Pallas) kernels in a compiled TPU program: its splash attention."""
    return hlo_text.count('custom_call_target="tpu_custom_call"')


def compile_program(
    program: Program,
    slice_: Topology,
    *,
    headroom: float = DEFAULT_HEADROOM,
    attention_efficiency: float = DEFAULT_ATTENTION_EFFICIENCY,
) -> FitReport:
    """Lower and compile ``program`` for its mesh's devices; the report of what it needs."""
    started = time.perf_counter()
    with sharding.mesh_context(program.mesh, program.rules):
        lowered = program.fn.lower(*program.args)
    lowered_at = time.perf_counter()
    common = {
        "program": program.name,
        "topology": slice_.name,
        "chips": int(program.mesh.size),
        "mesh": {k: int(v) for k, v in program.mesh.shape.items()},
        "hbm_bytes": int(slice_.hbm_bytes),
        "headroom": float(headroom),
        "model_flops": program.model_flops,
        "details": dict(program.details),
        "lower_seconds": lowered_at - started,
    }
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as err:
        refused = parse_out_of_memory(str(err))
        if refused is None:
            raise
        return FitReport(
            **common,
            total_bytes=refused[0],
            compiled=False,
            compile_seconds=time.perf_counter() - lowered_at,
            error=str(err).strip().splitlines()[0][:500],
        )
    seconds = time.perf_counter() - lowered_at
    memory = compiled.memory_analysis()
    kinds = {kind: int(getattr(memory, _ANALYSIS_FIELD[kind])) for kind in MEMORY_KINDS}
    total = total_bytes(kinds)
    host = {kind: int(getattr(memory, "host_" + _ANALYSIS_FIELD[kind])) for kind in MEMORY_KINDS}
    text = compiled.as_text()
    xla_flops, optimal = _cost(compiled, "flops"), _cost(compiled, "optimal_seconds")
    estimate = None
    if optimal is not None:  # TPU programs (XLA's CPU cost analysis has no time)
        estimate = estimate_seconds(
            optimal,
            chips=int(program.mesh.size),
            peak_flops=slice_.peak_flops,
            xla_flops=xla_flops,
            model_flops=program.model_flops,
            attention_flops=program.attention_flops,
            repeats=program.repeats,
            custom_calls=count_custom_kernels(text),
            attention_efficiency=attention_efficiency,
        )
    return FitReport(
        **common,
        **kinds,
        total_bytes=total,
        host_bytes=total_bytes(host),
        xla_flops=xla_flops,
        collectives=count_collectives(text),
        optimal_seconds=optimal,
        estimate=estimate,
        compile_seconds=seconds,
    )


# --- abstract arguments -----------------------------------------------------------------------


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def abstract(tree, sharding_for):
    """Every array leaf of ``tree`` (numpy, jax or a Python scalar) as a ShapeDtypeStruct with
    ``sharding_for(leaf)``; already abstract leaves keep theirs."""

    def one(leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        dtype = jnp.result_type(leaf)
        weak = isinstance(leaf, bool | int | float)
        return jax.ShapeDtypeStruct(
            np.shape(leaf), dtype, sharding=sharding_for(leaf), weak_type=weak
        )

    return jax.tree.map(one, tree)


def batch_array(mesh: Mesh, shape: Sequence[int], dtype=jnp.float32, rules=None):
    """An abstract batch-leading array, its batch axis over the mesh's batch axes."""
    logical = ("activation_batch",) + (None,) * (len(shape) - 1)
    where = sharding.logical_sharding(mesh, logical, rules)
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=where)


def abstract_denoiser(family, config, compute, mesh: Mesh, rules=None):
    """(module, params) of a family's denoiser on ``mesh`` with params as ShapeDtypeStructs
    in the weights dtype, sharded by the logical-axis rules; nothing is allocated."""
    module = family.make_denoiser(config, compute, mesh)
    boxed = family.abstract_params(module)
    shardings = nn.meta.unbox(sharding.param_shardings(mesh, boxed, rules))
    params = jax.tree.map(
        lambda s, where: jax.ShapeDtypeStruct(s.shape, module.param_dtype, sharding=where),
        nn.meta.unbox(boxed),
        shardings,
    )
    return module, params


# --- the generate loop ------------------------------------------------------------------------


def generate_program(
    family,
    configs: Mapping[str, Any],
    scheduler_config: Mapping,
    compute,
    mesh: Mesh,
    *,
    batch: int,
    height: int,
    width: int,
    num_frames: int,
    num_inference_steps: int,
    guidance_scale: float,
    true_cfg_scale: float = 1.0,
    text_length: int = 512,
    scheduler: str | None = None,
    shift: float | None = None,
    batched_cfg: bool = True,
    rules=None,
    guidance_rescale: float = 0.0,
    settings: Mapping[str, Any] | None = None,
) -> Program:
    """The denoising loop generate runs (:func:`jaxcore.sampling.denoise_fn`, one jitted call
    over every step) for ``batch`` prompts of one size, with abstract weights and inputs.

    The pipeline's other components (text encoders, VAE) are not part of it: they run before
    and after the loop, in programs of their own. A two-expert model's second expert is on
    the devices (``idle_expert=device``). The conditioning is the family's tensors and its size
    conditioning at the pipeline's defaults (SDXL's ``time_ids``, LTX-Video's RoPE scale and
    decode settings), or at ``settings``: every prompt's family settings (the micro-
    conditioning generate resolves: LTX-2's modality guidance adds a pass, its audio scale may
    switch CFG on).
    """
    from jaxcore.pipeline import Pipeline

    rules = tuple(rules) if rules is not None else sharding.LOGICAL_AXIS_RULES
    name = family.denoiser_component
    module, params = abstract_denoiser(family, configs[name], compute, mesh, rules)
    params = quantization.abstract_quantized(params, compute.quantization)
    pipe = Pipeline(family, module, params, {}, dict(configs), dict(scheduler_config), mesh, rules)
    settings = dict(settings or {})
    size = (height, width, num_frames)
    shape = _checked_latent_shape(pipe, family, module, mesh, batch, size, settings)
    guidance = pipe.guidance(guidance_scale, true_cfg_scale, None, guidance_rescale, settings)
    state, step_fn = family.make_seeded_schedule(
        pipe,
        scheduler or pipe.default_scheduler,
        num_inference_steps,
        pipe.default_shift if shift is None else float(shift),
        (batch, *shape),
        seeds=list(range(batch)),
    )
    cond = _abstract_conditioning(
        family, module, configs, guidance, mesh, batch, text_length, shape, rules
    )
    sized, _ = family.size_conditioning(configs, height, width, [settings] * batch, num_frames)
    for key, value in sized.items():  # what depends on the size and the render settings
        cond.setdefault(key, batch_array(mesh, np.shape(value), np.asarray(value).dtype, rules))
    second_module, second = _abstract_second_expert(family, configs, compute, mesh, batch, rules)
    fn = sampling.denoise_fn(
        family,
        module,
        step_fn,
        guidance.uses_cfg,
        second_module,
        step_cache.NO_CACHE,
        batched_cfg,
        quantization.quantizes_products(compute.quantization),
    )
    args = _loop_args(mesh, rules, params, (batch, *shape), cond, state, second)
    rows = batch * (2 if guidance.uses_cfg else 1)
    forward, attention = _forward_flops(family, module.config, rows, shape, cond)
    details = _loop_details(compute, batch, size, shape, num_inference_steps, guidance, text_length)
    return Program(
        "generate_loop",
        fn,
        args,
        mesh,
        rules,
        float(num_inference_steps * forward),
        details,
        attention_flops=None if attention is None else float(num_inference_steps * attention),
        repeats=num_inference_steps,
    )


def _checked_latent_shape(pipe, family, module, mesh: Mesh, batch, size, settings):
    """The latents' shape (batch axis left out) of one prompt of this ``size`` (height, width,
    frames) and family ``settings``, after checking that the size suits the model, the batch
    splits over the mesh's batch ways and the attention heads over its tensor axis."""
    pipe.geometry.check(*size, where="generate_program")
    shape = pipe.latent_shape(*size, settings)
    ways = pipe.batch_ways
    if batch % ways:
        raise sharding.ShardingError(
            f"a generate batch of {batch} does not split over the mesh's {ways} batch ways"
        )
    family.check_heads(module.config, mesh)
    return shape


def _abstract_conditioning(
    family, module, configs, guidance, mesh: Mesh, batch, text_length, shape, rules
) -> dict:
    """The denoiser's conditioning for ``batch`` prompts as abstract batch arrays by name:
    the family's tensors and the scalars the guidance embeds (Flux dev's guidance)."""
    cond = {
        spec.name: batch_array(mesh, (batch, *spec.shape), jnp.float32, rules)
        for spec in family.conditioning_specs(
            module.config, text_length, shape, family.image_tokens(configs)
        )
    }
    for embedded in guidance.embedded:
        cond[embedded] = batch_array(mesh, (batch,), jnp.float32, rules)
    return cond


def _abstract_second_expert(family, configs, compute, mesh: Mesh, batch, rules):
    """(module, (params, boundary, its guidance scale per row)) of a two-expert model's second
    expert, abstract as the first; (None, None) for a model of one."""
    component = family.second_expert_component(configs)
    if component is None:
        return None, None
    module, params = abstract_denoiser(family, configs[component], compute, mesh, rules)
    params = quantization.abstract_quantized(params, compute.quantization)
    boundary = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated(mesh))  # traced: any value
    return module, (params, boundary, batch_array(mesh, (batch,), jnp.float32, rules))


def _loop_args(mesh: Mesh, rules, params, latents_shape, cond, state, second) -> tuple:
    """The denoise loop's arguments in its order, abstract: params, latents, conditioning and
    the negative branch's, per-row flags and scales, the scheduler state, the step range,
    the second expert and no step cache."""
    rep = replicated(mesh)
    batch = latents_shape[0]
    index = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep, weak_type=True)
    return (
        params,
        batch_array(mesh, latents_shape, jnp.float32, rules),
        cond,
        cond,  # the negative branch has the conditioning's shapes
        batch_array(mesh, (batch,), jnp.bool_, rules),
        batch_array(mesh, (batch,), jnp.float32, rules),
        abstract(state, lambda _: rep),
        index,
        index,
        second,
        None,
    )


def _loop_details(compute, batch, size, shape, steps, guidance, text_length) -> dict:
    """What the generate loop is made of, for the report."""
    return {
        "batch": batch,
        "size": list(size),
        "latent_shape": list(shape),
        "steps": steps,
        "cfg": guidance.uses_cfg,
        "text_length": text_length,
        "weights_dtype": compute.weights_dtype,
        "quantization": compute.quantization,
        "attention": compute.attention,
    }


def _forward_flops(family, config, rows: int, shape, cond) -> tuple[float, float | None]:
    """(FLOPs, attention FLOPs or None) of one denoiser forward over ``rows`` rows."""
    shapes = {k: tuple(v.shape[1:]) for k, v in cond.items()}
    forward = family.flops_per_forward(config, rows, shape, shapes)
    attention = family.attention_flops_per_forward(config, rows, shape, shapes)
    return forward, attention


def param_count(params) -> int:
    """Parameters in an (abstract) tree."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
