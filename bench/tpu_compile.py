"""Benchmark: TPU compiles without a TPU. Per chip: memory (does it fit HBM?), FLOPs, collectives.

Each case compiles one program of a real model config ahead of time for a TPU slice
(:mod:`jaxcore.aot`, libtpu's compiler on this CPU machine): the train stage's own step
(``pipelines.deploy.train_program``: AdamW, donated buffers, the stage's objective) or the
generate loop (``jaxcore.sampling.denoise_fn``), with the stage configs a user would type
(``configs/stages/{train,generate}.yml`` plus the overrides below). Each case runs in a fresh
subprocess (``python -m bench.tpu_compile CASE``): its own libtpu, host memory and clock.

The shapes (as MaxDiffusion runs these models):

- Wan 2.1 (1.3B, 14B) train: 480x832, 81 frames (latents [16, 21, 60, 104], 32,760 video
  tokens), 512 text tokens, 1 clip per chip; FSDP over every chip; bf16 weights, moments and
  activations, flash attention (splash on TPU), full rematerialisation.
- Wan 2.1 generate: 480x832, 81 frames, 50 UniPC steps, guidance 5 (CFG: 2 rows per prompt,
  one batched call), 1 prompt per chip, data-parallel (generate.yml's mesh: weights
  replicated), bf16, flash attention.
- Flux.1 dev train: 1024x1024 (latents [16, 128, 128], 4,096 image tokens), 512 text tokens,
  1 image per chip, FSDP, bf16, flash, full remat; generate: 1024x1024, 28 Euler steps,
  embedded guidance 3.5 (no CFG), 1 prompt per chip, data-parallel, bf16, flash.

``full`` (``make bench``): those 3 models x (train, generate) x (v5p-8, v5p-32, v6e-8);
``quick``: Wan 1.3B on v5p-8; ``smoke`` (tests): the tiny Wan model on v5p-8. Without libtpu
every row says "skipped: install the tpu extra" and nothing is compiled.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import BenchContext, value_record

log = logging.getLogger(__name__)

BENCH = "tpu_compile"
REPO = Path(__file__).resolve().parent.parent
SKIPPED = "skipped: install the tpu extra"
WAN_480P_81 = ["input.synthetic_latent_shape=[16, 21, 60, 104]"]
FLUX_1024 = ["input.synthetic_latent_shape=[16, 128, 128]"]
BF16 = ["compute.weights_dtype=bfloat16", "compute.activations_dtype=bfloat16", "attention=flash"]
TRAIN = [
    *BF16,
    "remat_policy=full",
    "per_device_batch_size=1",
    "input.synthetic_text_length=512",
    "ici_data_parallelism=1",
    "ici_fsdp_parallelism=-1",
]
GENERATE = [*BF16, "per_device_batch_size=1", "max_sequence_length=512"]
WAN_GENERATE = ["height=480", "width=832", "num_frames=81", "num_inference_steps=50"]
WAN_GENERATE += ["guidance_scale=5.0"]
FLUX_GENERATE = ["height=1024", "width=1024", "num_frames=1", "num_inference_steps=28"]
FLUX_GENERATE += ["guidance_scale=3.5"]
TINY_TRAIN = ["per_device_batch_size=1", "input.synthetic_text_length=16"]
TINY_GENERATE = ["height=32", "width=32", "num_frames=5", "num_inference_steps=4"]
TINY_GENERATE += ["per_device_batch_size=1", "max_sequence_length=16"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One program of one model for one slice, with the stage config's overrides."""

    model: str  # a short name
    model_config: str  # configs/models/*.yml
    program: str  # "train" or "generate"
    topology: str  # a name of jaxcore.aot.TOPOLOGIES
    overrides: tuple[str, ...]
    # a `difforge fit` row (its overrides are the command's), with MaxDiffusion's published
    # wall time of the same configuration (its README) beside the estimate
    published: str = ""
    # a MaxDiffusion program row: its config YAML and command-line overrides (its README's
    # command for this configuration); compiled by bench/maxdiffusion_tpu.py in its own venv
    peer_yml: str = ""
    peer_overrides: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        suffix = ""
        if self.published:
            suffix = "/maxdiffusion-program" if self.peer_yml else "/maxdiffusion-config"
        return f"{self.model}/{self.program}/{self.topology}{suffix}"


def _cases(model, config, train, generate, topologies) -> list[Case]:
    return [
        Case(model, config, program, topo, tuple(overrides))
        for program, overrides in (("train", train), ("generate", generate))
        for topo in topologies
    ]


SLICES = ("v5p-8", "v5p-32", "v6e-8")
FULL = (
    _cases(
        "wan2.1-1.3b",
        "configs/models/wan2.1_t2v_1.3b.yml",
        TRAIN + WAN_480P_81,
        GENERATE + WAN_GENERATE,
        SLICES,
    )
    + _cases(
        "wan2.1-14b",
        "configs/models/wan2.1_t2v_14b.yml",
        TRAIN + WAN_480P_81,
        GENERATE + WAN_GENERATE,
        SLICES,
    )
    + _cases(
        "flux1-dev",
        "configs/models/flux1_dev.yml",
        TRAIN + FLUX_1024,
        GENERATE + FLUX_GENERATE,
        SLICES,
    )
)


def _fit(model, config, program, topology, published, *overrides) -> Case:
    return Case(model, config, program, topology, (f"stage={program}", *overrides), published)


WAN_720P_81 = ("height=720", "width=1280", "num_frames=81")
# MaxDiffusion's documented configurations (issue #46's table), as `difforge fit` commands with
# its defaults for TPU (bf16, block remat in training)
MAXDIFFUSION = (
    _fit(
        "wan2.1-14b",
        "configs/models/wan2.1_t2v_14b.yml",
        "train",
        "v5p-8",
        "~36.0 s/step (global batch 1 over 4 chips, host-offloaded remat)",
        *WAN_720P_81,
        "per_device_batch_size=0.25",
        "ici_fsdp_parallelism=4",
    ),
    _fit(  # the same at 1 clip a chip: MaxDiffusion's trainer fails at a global batch of 1
        "wan2.1-14b-b4",
        "configs/models/wan2.1_t2v_14b.yml",
        "train",
        "v5p-8",
        "- (documents global batch 1, the row above)",
        *WAN_720P_81,
        "per_device_batch_size=1",
        "ici_fsdp_parallelism=4",
    ),
    _fit(
        "flux1-dev",
        "configs/models/flux1_dev.yml",
        "train",
        "v5p-8",
        "1.769 s/step",
        "height=1024",
        "width=1024",
        "per_device_batch_size=2",
        "ici_data_parallelism=1",
        "ici_fsdp_parallelism=4",
    ),
    _fit(
        "flux1-dev",
        "configs/models/flux1_dev.yml",
        "generate",
        "v6e-4",
        "5.5 s (28 steps, batch 4)",
        "height=1024",
        "width=1024",
        "num_inference_steps=28",
    ),
    _fit(
        "flux1-schnell",
        "configs/models/flux1_schnell.yml",
        "generate",
        "v6e-4",
        "0.8 s (4 steps, batch 4)",
        "height=1024",
        "width=1024",
        "num_inference_steps=4",
    ),
    _fit(
        "wan2.1-14b",
        "configs/models/wan2.1_t2v_14b.yml",
        "generate",
        "tpu7x-8",
        "249.3 s (50 steps)",
        *WAN_720P_81,
        "num_inference_steps=50",
        "ici_data_parallelism=2",
        "ici_context_parallelism=4",
    ),
    _fit(
        "wan2.1-14b",
        "configs/models/wan2.1_t2v_14b.yml",
        "generate",
        "tpu7x-16",
        "127.1 s (50 steps)",
        *WAN_720P_81,
        "num_inference_steps=50",
        "ici_data_parallelism=2",
        "ici_context_parallelism=8",
    ),
    _fit(
        "wan2.2-a14b",
        "configs/models/wan2.2_t2v_a14b.yml",
        "generate",
        "tpu7x-8",
        "194.4 s (40 steps)",
        *WAN_720P_81,
        "num_inference_steps=40",
        "ici_data_parallelism=2",
        "ici_context_parallelism=4",
    ),
)
# MaxDiffusion's own program for each of those rows: the YAML and overrides of its README's
# command (run name, output and data folders left out: nothing is read or written). The shapes,
# batch and steps are difforge's row's (the same analytic FLOPs price both); see
# bench/maxdiffusion_tpu.py for what is compiled.
_WAN_GENERATE_PEER = ("attention=flash", "height=720", "width=1280", "num_frames=81")
_WAN_TRAIN_PEER = (
    "base_wan_14b.yml",
    *_WAN_GENERATE_PEER,
    "weights_dtype=bfloat16",
    "activations_dtype=bfloat16",
    "remat_policy=HIDDEN_STATE_WITH_OFFLOAD",
    "flash_min_seq_length=0",
    "ici_data_parallelism=1",
    "ici_fsdp_parallelism=4",
    "ici_tensor_parallelism=1",
)
PEER_CONFIGS = {
    "wan2.1-14b/train/v5p-8": (*_WAN_TRAIN_PEER, "per_device_batch_size=0.25"),
    "wan2.1-14b-b4/train/v5p-8": (*_WAN_TRAIN_PEER, "per_device_batch_size=1"),
    "flux1-dev/train/v5p-8": (
        "base_flux_dev.yml",
        "dataset_type=synthetic",
        "ici_data_parallelism=1",
        "ici_fsdp_parallelism=4",
        "ici_tensor_parallelism=1",
        "train_new_flux=True",
        "resolution=1024",
        "attention_sharding_uniform=False",
        "attention=tokamax_flash",
        "per_device_batch_size=2",
        "use_base2_exp=True",
    ),
    "flux1-dev/generate/v6e-4": ("base_flux_dev.yml", "per_device_batch_size=1"),
    "flux1-schnell/generate/v6e-4": ("base_flux_schnell.yml", "per_device_batch_size=1"),
    "wan2.1-14b/generate/tpu7x-8": (
        "base_wan_14b.yml",
        *_WAN_GENERATE_PEER,
        "ici_data_parallelism=2",
        "ici_context_parallelism=4",
    ),
    "wan2.1-14b/generate/tpu7x-16": (
        "base_wan_14b.yml",
        *_WAN_GENERATE_PEER,
        "ici_data_parallelism=2",
        "ici_context_parallelism=8",
    ),
    "wan2.2-a14b/generate/tpu7x-8": (
        "base_wan_27b.yml",
        *_WAN_GENERATE_PEER,
        "ici_data_parallelism=2",
        "ici_context_parallelism=4",
    ),
}
MAXDIFFUSION_PROGRAMS = tuple(
    dataclasses.replace(
        case,
        peer_yml=PEER_CONFIGS[f"{case.model}/{case.program}/{case.topology}"][0],
        peer_overrides=PEER_CONFIGS[f"{case.model}/{case.program}/{case.topology}"][1:],
    )
    for case in MAXDIFFUSION
)
CASES = {
    "smoke": tuple(
        _cases("wan-tiny", "configs/models/wan_tiny.yml", TINY_TRAIN, TINY_GENERATE, ("v5p-8",))
    ),
    "quick": tuple(c for c in FULL if c.model == "wan2.1-1.3b" and c.topology == "v5p-8"),
    "full": tuple(FULL)
    + tuple(x for pair in zip(MAXDIFFUSION, MAXDIFFUSION_PROGRAMS, strict=True) for x in pair),
}
# seconds a case may compile for (the 14B programs take the longest)
TIMEOUT_S = {"smoke": 600, "quick": 1800, "full": 3600}


def stage_config(case: Case):
    """The train / generate stage config of the case (the shipped YAML + its overrides)."""
    from jaxcore.config import load_config

    if case.program == "train":
        from stages.train.config import TrainConfig

        overrides = [
            f"model.model_config={case.model_config}",
            "dataset_type=synthetic",
            "output_dir=/tmp/difforge-aot",
            *case.overrides,
        ]
        return load_config(TrainConfig, REPO / "configs/stages/train.yml", overrides)
    from stages.generate.config import GenerateConfig

    overrides = [
        f"pretrained_model_name_or_path={case.model_config}",
        "prompt_file=prompts.txt",  # not read: only the loop compiles
        "output_dir=/tmp/difforge-aot",
        *case.overrides,
    ]
    return load_config(GenerateConfig, REPO / "configs/stages/generate.yml", overrides)


def compile_case(case: Case) -> dict:
    """Compile the case in this process; its report as a dict."""
    from jaxcore import aot
    from pipelines.deploy import fit_model, generate_program, train_program

    if case.published:  # a `difforge fit` row: the command's own config and program
        from jaxcore.config import ConfigError, load_config
        from pipelines import fit

        if case.peer_yml and not peer_environment():
            return {"skipped": PEER_SKIPPED}
        overrides = [f"model={case.model_config}", f"slice={case.topology}", *case.overrides]
        cfg = load_config(fit.FitConfig, None, overrides)
        try:
            built, slice_ = fit.build(cfg)
        except ConfigError as err:
            return {"unsupported": str(err)}  # a configuration difforge cannot build yet
        if case.peer_yml:
            return compile_peer(case, cfg, built, slice_)
        return fit.compile_report(cfg, built, slice_).to_dict()
    config = stage_config(case)
    slice_ = aot.topology(case.topology)
    mesh = aot.topology_mesh(slice_, config.mesh)
    model = fit_model(case.model_config)
    if case.program == "train":
        program = train_program(config, model, mesh)
    else:
        program = generate_program(config, model, mesh)
    return aot.compile_program(program, slice_).to_dict()


PEER_PYTHON_ENV = "DIFFORGE_MAXDIFFUSION_PYTHON"
PEER_SRC_ENV = "DIFFORGE_MAXDIFFUSION_SRC"
PEER_SKIPPED = (
    f"skipped: set {PEER_PYTHON_ENV} and {PEER_SRC_ENV} (make maxdiffusion-venv; MaxDiffusion "
    "is not on PyPI)"
)
PEER_SCRIPT = Path(__file__).resolve().parent / "maxdiffusion_tpu.py"


def peer_environment() -> tuple[str, str] | None:
    """(MaxDiffusion's interpreter, its src folder), or None where they are not set."""
    python, src = os.environ.get(PEER_PYTHON_ENV), os.environ.get(PEER_SRC_ENV)
    if not python or not src or not os.path.isfile(python) or not os.path.isdir(src):
        return None
    return python, src


def peer_case(case: Case, cfg, built, slice_) -> dict:
    """What bench/maxdiffusion_tpu.py compiles for ``case``: MaxDiffusion's YAML and
    overrides, with the shapes, batch and steps of difforge's program for the row."""
    from jaxcore import aot
    from pipelines import deploy, fit

    model = deploy.fit_model(cfg.model)
    kind = f"{model.family.name}_{case.program}"  # wan_generate, flux_train, ...
    transformer = dataclasses.asdict(model.configs["transformer"])
    details = built.details
    out = {
        "kind": kind,
        "yml": case.peer_yml,
        "overrides": list(case.peer_overrides),
        "transformer": {k: v for k, v in transformer.items() if not k.startswith("_")},
        "batch": int(details["batch"]),
        "latent_shape": list(fit.latent_shape(cfg, model)),
        "text_length": int(cfg.text_length),
        "steps": int(built.repeats),
        "experts": 2 if "transformer_2" in model.configs else 1,
        "guidance_scale": float(
            cfg.guidance_scale
            if cfg.guidance_scale is not None
            else model.family.sampling_defaults(model.configs).get("guidance_scale", 5.0)
        ),
        "topology": {
            "name": slice_.name,
            "topology": slice_.topology,
            "chip_config": slice_.chip_config,
            "chips_per_host": list(slice_.chips_per_host),
            "chips": slice_.chips,
            "libtpu": aot.libtpu_path(),
        },
    }
    return out


def compile_peer(case: Case, cfg, built, slice_, timeout: float = 3000) -> dict:
    """MaxDiffusion's program for the row compiled in its own interpreter, reported as
    difforge's rows are (a :class:`jaxcore.aot.FitReport`'s dict), priced by
    :func:`jaxcore.aot.estimate_seconds` with difforge's row's analytic FLOPs and repeats."""
    import tempfile

    from jaxcore import aot

    python, src = peer_environment()
    spec = peer_case(case, cfg, built, slice_)
    hlo = Path(tempfile.mkdtemp(prefix="difforge-peer-")) / "compiled.hlo.txt"
    spec["hlo_path"] = str(hlo)
    env = {**os.environ, "PYTHONPATH": src, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        # -P: not this folder first on the path (it holds modules named like MaxDiffusion's)
        [python, "-P", str(PEER_SCRIPT), json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        raise RuntimeError(f"MaxDiffusion's compile failed: {done.stderr.strip()[-3000:]}")
    peer = json.loads(lines[-1])
    details = {
        "maxdiffusion_compiled": peer["compiled_program"],
        "maxdiffusion_yml": case.peer_yml,
        "maxdiffusion_overrides": list(case.peer_overrides),
        "maxdiffusion_logical_axis_rules": peer["logical_axis_rules"],
        "batch": spec["batch"],
        "latent_shape": spec["latent_shape"],
        "text_length": spec["text_length"],
        "repeats": built.repeats,
        "resident_bytes": peer["resident_bytes"],
    }
    common = {
        "program": f"maxdiffusion:{spec['kind']}",
        "topology": slice_.name,
        "chips": slice_.chips,
        "mesh": peer["mesh"],
        "hbm_bytes": int(slice_.hbm_bytes),
        "headroom": float(cfg.headroom),
        "model_flops": built.model_flops,
        "details": details,
        "lower_seconds": peer["lower_seconds"],
        "compile_seconds": peer["compile_seconds"],
    }
    if "refused" in peer:
        refused = aot.parse_out_of_memory(peer["refused"])
        if refused is None:
            raise RuntimeError(f"MaxDiffusion's compile failed: {peer['refused'][:2000]}")
        report = aot.FitReport(
            **common,
            total_bytes=refused[0] + peer["resident_bytes"],
            compiled=False,
            error=peer["refused"].strip().splitlines()[0][:500],
        )
        return report.to_dict()
    text = hlo.read_text()
    estimate = None
    if peer["optimal_seconds"] is not None:
        estimate = aot.estimate_seconds(
            peer["optimal_seconds"],
            chips=slice_.chips,
            peak_flops=slice_.peak_flops,
            xla_flops=peer["flops"],
            model_flops=built.model_flops,
            attention_flops=built.attention_flops,
            repeats=built.repeats,
            custom_calls=aot.count_custom_kernels(text),
            attention_efficiency=cfg.attention_efficiency,
        )
    details["custom_calls"] = aot.count_custom_kernels(text)
    kinds = {k: int(peer[k]) for k in aot.MEMORY_KINDS}
    total = aot.total_bytes(kinds) + peer["resident_bytes"]
    report = aot.FitReport(
        **common,
        **kinds,
        total_bytes=total,
        xla_flops=peer["flops"],
        collectives=aot.count_collectives(text),
        optimal_seconds=peer["optimal_seconds"],
        estimate=estimate,
    )
    hlo.unlink()
    hlo.parent.rmdir()
    return report.to_dict()


def _run_subprocess(case: Case, timeout: float) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "bench.tpu_compile", case.name],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"timed_out_after_s": timeout}
    if done.returncode:  # this case's failure; the other cases still run
        log.error("%s: the compile subprocess failed:\n%s", case.name, done.stderr[-4000:])
        return {"error": done.stderr.strip().splitlines()[-1][:500] if done.stderr else "failed"}
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["wall_s"] = time.perf_counter() - started
    return report


def record(case: Case, report: dict) -> dict:
    """The bench record of a case's report (or of its skip / timeout)."""
    base = {"model_config": case.model_config, "program": case.program, "slice": case.topology}
    if case.published:
        base["maxdiffusion_published"] = case.published
    impl = "maxdiffusion" if case.peer_yml else "difforge"
    if "skipped" in report:
        return value_record(BENCH, case.name, impl, float("nan"), "skipped", **base, **report)
    if "unsupported" in report:
        return value_record(BENCH, case.name, impl, float("nan"), "unsupported", **base, **report)
    if "timed_out_after_s" in report:
        return value_record(BENCH, case.name, impl, float("nan"), "timed out", **base, **report)
    if "total_bytes" not in report:  # the subprocess failed: an error row (bench.run exits 1)
        return value_record(BENCH, case.name, impl, float("nan"), "error", **base, **report)
    keep = (
        "fits",
        "compiled",
        "hbm_bytes",
        "limit_bytes",
        "headroom",
        "argument_bytes",
        "output_bytes",
        "alias_bytes",
        "temp_bytes",
        "generated_code_bytes",
        "host_bytes",
        "xla_flops",
        "model_flops",
        "optimal_seconds",
        "est_seconds",
        "mfu_estimate",
        "estimate",
        "collectives",
        "mesh",
        "lower_seconds",
        "compile_seconds",
        "wall_s",
        "error",
        "details",
    )
    extra = {k: report[k] for k in keep if report.get(k) is not None}
    if "error" in extra:  # libtpu's out-of-memory refusal: a result, not a failure
        extra["refusal"] = extra.pop("error")
    return value_record(
        BENCH,
        case.name,
        impl,
        float(report["total_bytes"]),
        "bytes per chip",
        **base,
        **extra,
    )


def run(ctx: BenchContext) -> list[dict]:
    from jaxcore import aot

    cases = CASES[ctx.profile]
    if not aot.libtpu_available():
        return [record(case, {"skipped": SKIPPED}) for case in cases]
    out = []
    for case in cases:
        log.info("tpu compile: %s", case.name)
        out.append(record(case, _run_subprocess(case, TIMEOUT_S[ctx.profile])))
    return out


def main(argv=None) -> int:
    """``python -m bench.tpu_compile CASE``: compile one case, print its report (JSON)."""
    argv = sys.argv[1:] if argv is None else argv
    by_name = {c.name: c for profile in CASES.values() for c in profile}
    if len(argv) != 1 or argv[0] not in by_name:
        print(f"usage: python -m bench.tpu_compile CASE; cases: {sorted(by_name)}", file=sys.stderr)
        return 2
    print(json.dumps(compile_case(by_name[argv[0]]), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
