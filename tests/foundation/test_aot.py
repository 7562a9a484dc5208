"""Ahead-of-time fit checks (jaxcore.aot): reports, collective counting, the real train step and
generate loop compiled through the same path on the 8 CPU devices, deploy's refusal and skip
paths; with libtpu installed, the TPU topologies themselves."""

from __future__ import annotations

import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcore import aot, sharding
from jaxcore.config import load_config
from pipelines import deploy
from stages.train.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]
TINY = "configs/models/wan_tiny.yml"
CPU8 = aot.Topology("cpu-8", chips=8, hbm_bytes=16 * aot.GIB, platform="cpu")
needs_libtpu = pytest.mark.skipif(
    not aot.libtpu_available(), reason=f"libtpu is not installed ({aot.INSTALL_HINT})"
)


def _report(**kw) -> aot.FitReport:
    values = dict(
        program="train_step",
        topology="v6e-8",
        chips=8,
        mesh={"data": 1, "fsdp": 8, "context": 1, "tensor": 1},
        hbm_bytes=32 * aot.GIB,
        headroom=0.05,
        total_bytes=20 * aot.GIB,
    )
    return aot.FitReport(**{**values, **kw})


def test_report_fits_against_hbm_less_headroom():
    fits = _report(total_bytes=int(30.4 * aot.GIB))  # 32 GiB x 0.95 = 30.4 GiB
    assert fits.fits and fits.limit_bytes == int(32 * aot.GIB * 0.95)
    fits.check()
    big = _report(total_bytes=31 * aot.GIB)
    assert not big.fits and big.to_dict()["fits"] is False
    with pytest.raises(aot.DoesNotFit, match=r"train_step does not fit v6e-8: it needs 31.00 GiB"):
        big.check()
    assert "DOES NOT FIT" in big.summary() and "fsdp8" in big.summary()
    refused = _report(compiled=False, total_bytes=10 * aot.GIB, error="RESOURCE_EXHAUSTED: ...")
    assert not refused.fits and "not compiled" in refused.breakdown()


def test_count_collectives_counts_async_pairs_once():
    hlo = """
  %all-gather.3 = bf16[64,128]{1,0} all-gather(bf16[8,128]{1,0} %p), channel_id=1, dimensions={0}
  %ars = (f32[4], f32[4]) all-reduce-start(f32[4] %a), channel_id=2, to_apply=%add
  %ard = f32[4] all-reduce-done((f32[4], f32[4]) %ars)
  %rs = f32[2] reduce-scatter(f32[16] %b), channel_id=3, dimensions={0}
  %cp = (f32[4], f32[4], u32[], u32[]) collective-permute-start(f32[4] %c), source_target_pairs={{0,1}}
  %cpd = f32[4] collective-permute-done(%cp)
  %a2a = f32[8] all-to-all(f32[8] %d), dimensions={0}
  %all-reduce.9 = f32[] add(f32[] %x, f32[] %y)
"""
    assert aot.count_collectives(hlo) == {
        "all-reduce": 1,
        "all-gather": 1,
        "reduce-scatter": 1,
        "all-to-all": 1,
        "collective-permute": 1,
    }


def test_parse_out_of_memory_reads_both_refusals():
    temps = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (45.00G) exceeds available HBM (31.25G)."
    )
    assert aot.parse_out_of_memory(temps) == (45 * aot.GIB, int(31.25 * aot.GIB))
    used = "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 100.5G of 95.74G hbm."
    assert aot.parse_out_of_memory(used) == (int(100.5 * aot.GIB), int(95.74 * aot.GIB))
    assert aot.parse_out_of_memory("INVALID_ARGUMENT: bad shapes") is None


def test_topology_presets_cover_the_deploy_slices():
    assert set(aot.TOPOLOGIES) == set(deploy.TPU_SLICES)
    for name, (_, shape, hosts, per_host) in deploy.TPU_SLICES.items():
        cores = 2 if name.startswith("tpu7x") else 1  # TPU7x: two devices a chip
        assert (
            aot.topology(name).chips
            == hosts * per_host * cores
            == math.prod(int(n) for n in shape.split("x")) * cores
        )
    assert aot.topology("v5p-8").hbm_bytes == 95 * aot.GIB
    with pytest.raises(ValueError, match="unknown TPU topology 'v9-8'"):
        aot.topology("v9-8")


def _train_config(*overrides) -> TrainConfig:
    return load_config(
        TrainConfig,
        REPO / "configs/stages/train.yml",
        [f"model.model_config={TINY}", "output_dir=/tmp/unused", *overrides],
    )


def _shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs (the first device's shard)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total


def test_train_step_on_cpu_mesh_matches_what_jax_reports():
    """The train stage's real step for the tiny Wan model, FSDP over the 8 CPU devices, through
    the same path as a TPU slice; its figures are jax's own for the same program."""
    config = _train_config("ici_data_parallelism=1", "ici_fsdp_parallelism=-1")
    mesh = aot.topology_mesh(CPU8, config.mesh)
    program = deploy.train_program(config, deploy.fit_model(TINY), mesh)
    assert program.details["batch"] == 8 and program.model_flops > 0
    report = aot.compile_program(program, CPU8)
    with sharding.mesh_context(mesh):
        direct = program.fn.lower(*program.args).compile()
    memory = direct.memory_analysis()
    assert report.argument_bytes == memory.argument_size_in_bytes
    assert report.temp_bytes == memory.temp_size_in_bytes
    assert report.alias_bytes == memory.alias_size_in_bytes > 0  # params + moments donated
    assert report.xla_flops == pytest.approx(direct.cost_analysis()["flops"])
    # the arguments are each device's shards: params, AdamW moments and the batch rows
    assert report.argument_bytes == _shard_bytes(program.args)
    assert report.collectives == aot.count_collectives(direct.as_text())
    assert report.collectives["all-gather"] > 0 and report.collectives["all-reduce"] > 0
    assert report.fits and report.mesh["fsdp"] == 8 and report.compiled
    assert report.total_bytes == (
        report.argument_bytes
        + report.output_bytes
        - report.alias_bytes
        + report.temp_bytes
        + report.generated_code_bytes
    )


def test_scanned_train_step_is_checked_as_the_run_holds_it():
    """With compute.scan_layers the fit check compiles the step a scanned run executes: the
    blocks' weights and moments as stacks (sharded as each block is), the same bytes per
    device as the per-layer step."""
    fsdp = ("ici_data_parallelism=1", "ici_fsdp_parallelism=-1")
    mesh = aot.topology_mesh(CPU8, _train_config(*fsdp).mesh)
    plain = deploy.train_program(_train_config(*fsdp), deploy.fit_model(TINY), mesh)
    config = _train_config(*fsdp, "compute.scan_layers=true")
    program = deploy.train_program(config, deploy.fit_model(TINY), mesh)
    params = program.args[0]
    assert "blocks_stacked" in params and "blocks_0" not in params
    kernel = params["blocks_stacked"]["attn1"]["to_q"]["kernel"]
    assert kernel.shape[0] == 2 and kernel.sharding.spec[0] is None
    assert ("fsdp", "context") in tuple(kernel.sharding.spec)
    assert _shard_bytes(program.args) == _shard_bytes(plain.args)
    assert aot.compile_program(program, CPU8).compiled


def test_train_step_with_prior_preservation_takes_a_class_batch():
    data = ("data=gs://bucket/instances", "dataset_type=tfrecord")
    config = _train_config(*data, "prior_preservation.data=gs://bucket/class-data")
    mesh = aot.topology_mesh(CPU8, config.mesh)
    features = deploy._train_features(_train_config(), deploy.fit_model(TINY), [], None)
    plain = deploy.train_program(_train_config(*data), deploy.fit_model(TINY), mesh, features)
    program = deploy.train_program(config, deploy.fit_model(TINY), mesh, features)
    assert program.details["prior_preservation"] and program.model_flops == 2 * plain.model_flops
    assert _shard_bytes(program.args) > _shard_bytes(plain.args)  # the class rows


def _tiny_generate_program(model, compute):
    """The tiny model's generate loop on 8 CPU devices: CFG, one 32x32x5 clip per device."""
    mesh = sharding.make_mesh(sharding.MeshConfig(), devices=CPU8.devices())
    return aot.generate_program(
        model.family,
        model.configs,
        model.scheduler_config,
        compute,
        mesh,
        batch=8,
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=3,
        guidance_scale=5.0,
        text_length=8,
    )


def test_generate_loop_on_cpu_mesh():
    """The generate loop (jaxcore.sampling.denoise_fn) with CFG, one prompt per device."""
    model = deploy.fit_model(TINY)
    program = _tiny_generate_program(model, _train_config().compute)
    assert program.details["cfg"] and program.details["latent_shape"] == [4, 3, 16, 16]
    report = aot.compile_program(program, CPU8)
    assert (
        report.compiled
        and report.fits
        and report.argument_bytes
        == _shard_bytes([a for a in jax.tree.leaves(program.args) if hasattr(a, "sharding")])
    )
    # 3 steps x 2 rows per prompt (CFG batched) x the denoiser's forward FLOPs
    forward = model.family.flops_per_forward(
        model.configs["transformer"], 16, (4, 3, 16, 16), {"encoder_hidden_states": (8, 32)}
    )
    assert program.model_flops == 3 * forward


def test_generate_loop_of_a_size_conditioned_family_compiles():
    """LTX-Video's denoiser reads its RoPE scale from the size conditioning: the abstract loop
    carries the family's size conditioning (at the pipeline's defaults) and compiles."""
    model = deploy.fit_model("configs/models/ltx_tiny.yml")
    mesh = sharding.make_mesh(sharding.MeshConfig(), devices=CPU8.devices())
    program = aot.generate_program(
        model.family,
        model.configs,
        model.scheduler_config,
        _train_config().compute,
        mesh,
        batch=8,
        height=32,
        width=64,
        num_frames=9,
        num_inference_steps=2,
        guidance_scale=3.0,
        text_length=8,
    )
    assert "rope_interpolation_scale" in program.args[2]
    assert aot.compile_program(program, CPU8).compiled


def test_generate_loop_with_int8_kernels_holds_them_in_int8():
    """compute.quantization=int8_weights: the loop's kernels are int8 with float32 scales, as
    the run holds them, so the program's arguments shrink by what the kernels do; its
    denoiser FLOPs are the float program's."""
    import dataclasses

    from jaxcore import quantization

    model = deploy.fit_model(TINY)
    compute = _train_config().compute

    def program(mode):
        return _tiny_generate_program(model, dataclasses.replace(compute, quantization=mode))

    plain, int8 = program("none"), program("int8_weights")
    params = int8.args[0]
    assert quantization.is_quantized(params) and int8.details["quantization"] == "int8_weights"
    kernels = [q for q in jax.tree.leaves(params, is_leaf=quantization.is_quantized_kernel)]
    assert all(q.qvalue.dtype == jnp.int8 for q in kernels if quantization.is_quantized_kernel(q))
    saved = quantization.weight_bytes(plain.args[0]) - quantization.weight_bytes(params)
    assert saved > 0 and int8.model_flops == plain.model_flops
    reports = [aot.compile_program(p, CPU8) for p in (plain, int8)]
    assert all(r.compiled for r in reports)
    assert reports[0].argument_bytes - reports[1].argument_bytes == saved
    # int8 (products quantized too): the same arguments, and the products' operands int8
    products = program("int8")
    assert products.details["quantization"] == "int8"
    with sharding.mesh_context(products.mesh, products.rules):
        text = products.fn.lower(*products.args).as_text()
    assert re.search(r"dot_general[^\n]*\(tensor<[^>]*xi8>, tensor<[^>]*xi8>\)", text)


# --- deploy -----------------------------------------------------------------------------------

PIPELINE = """
name: fit
root: gs://bucket/runs/fit
steps:
  - name: train_tiny
    stage: train
    config: configs/stages/train.yml
    set: {max_train_steps: 5}
"""


@pytest.fixture
def deploy_cfg(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    path = tmp_path / "fit.yml"

    def make(pipeline_text=PIPELINE, **kw):
        path.write_text(pipeline_text)
        overrides = [
            f"pipeline={path}",
            f"out={tmp_path / 'deploy'}",
            "run_xpk_dry_run=false",
            "target=xpk",
            "step=train_tiny",
        ]
        overrides += [f"{k}={v}" for k, v in kw.items()]
        return load_config(deploy.DeployConfig, "configs/deploy/cluster.yml", overrides)

    return make


def _cpu_slice(monkeypatch):
    """Make the v5p-8 fit check run on 4 CPU devices, whatever is installed."""
    monkeypatch.setattr(aot, "libtpu_available", lambda: True)
    monkeypatch.setattr(
        aot,
        "topology_mesh",
        lambda slice_, mesh_config, num_slices=1: sharding.make_mesh(
            mesh_config, devices=jax.devices()[: slice_.chips]
        ),
    )


def test_deploy_refuses_a_step_that_does_not_fit(deploy_cfg, monkeypatch, tmp_path, capsys):
    _cpu_slice(monkeypatch)
    seen = {}

    def too_big(program, slice_, headroom):
        seen["program"] = program
        return _report(
            program=program.name,
            topology=slice_.name,
            hbm_bytes=slice_.hbm_bytes,
            headroom=headroom,
            total_bytes=120 * aot.GIB,
        )

    monkeypatch.setattr(aot, "compile_program", too_big)
    with pytest.raises(deploy.FitCheckError) as err:
        deploy.run(deploy_cfg())
    message = str(err.value)
    assert "step 'train_tiny' (train) on v5p-8 refused" in message
    assert "needs 120.00 GiB per chip" in message and "90.25 GiB (95 GiB HBM" in message
    assert seen["program"].name == "train_step"  # the train stage's step was built for it
    assert not (tmp_path / "deploy" / "train_tiny-xpk.sh").exists()  # nothing was written
    assert (tmp_path / "deploy" / "train_tiny-fit.json").exists()
    assert "DOES NOT FIT" in capsys.readouterr().out
    # off: no check, the workload is written
    deploy.run(deploy_cfg(fit_check="off"))
    assert (tmp_path / "deploy" / "train_tiny-xpk.sh").exists()


def test_deploy_fit_check_passes_and_skips(deploy_cfg, monkeypatch, tmp_path, capsys):
    _cpu_slice(monkeypatch)
    monkeypatch.setattr(
        aot, "compile_program", lambda p, s, headroom: _report(topology=s.name, total_bytes=1)
    )
    deploy.run(deploy_cfg())
    assert "fits" in capsys.readouterr().out
    assert (tmp_path / "deploy" / "train_tiny-xpk.sh").exists()

    monkeypatch.setattr(aot, "libtpu_available", lambda: False)
    deploy.run(deploy_cfg())
    assert "skipped: libtpu is not installed" in capsys.readouterr().out
    with pytest.raises(deploy.FitCheckError, match="fit_check=required.*libtpu"):
        deploy.run(deploy_cfg(fit_check="required"))
    with pytest.raises(deploy.FitCheckError, match="h100-80gb-8 is not a TPU slice"):
        deploy.run(deploy_cfg(fit_check="required", **{"xpk.tpu_type": "h100-80gb-8"}))


def test_deploy_skips_a_model_known_only_at_run_time(deploy_cfg, monkeypatch, capsys):
    _cpu_slice(monkeypatch)
    later = "{model.model_config: null, model.init_from: gs://bucket/runs/x/train}"
    cfg = deploy_cfg(pipeline_text=PIPELINE.replace("{max_train_steps: 5}", later))
    deploy.run(cfg)
    assert "known only at run time; set fit_check_model" in capsys.readouterr().out
    seen = {}
    monkeypatch.setattr(
        aot, "compile_program", lambda p, s, headroom: seen.setdefault("r", _report(total_bytes=1))
    )
    deploy.run(
        deploy_cfg(
            pipeline_text=PIPELINE.replace("{max_train_steps: 5}", later), fit_check_model=TINY
        )
    )
    assert "r" in seen  # checked with the model named in the deploy config


def test_bench_rows_say_skipped_without_libtpu(monkeypatch, tmp_path):
    from bench import tpu_compile
    from bench.common import BenchContext, check_record

    monkeypatch.setattr(aot, "libtpu_available", lambda: False)
    records = tpu_compile.run(BenchContext(profile="full", reps=1, workdir=tmp_path))
    # 3 models x (train, generate) x 3 slices, and MaxDiffusion's 7 documented configurations
    # plus Wan 14B training at 1 clip a chip, twice: difforge's program and MaxDiffusion's own
    assert len(records) == 18 + 8 + 8
    for record in records:
        check_record(record)
        assert record["skipped"] == "skipped: install the tpu extra"
    peers = [r for r in records if r["case"].endswith("/maxdiffusion-program")]
    assert len(peers) == 8 and {r["impl"] for r in peers} == {"maxdiffusion"}


# --- with libtpu ------------------------------------------------------------------------------


@needs_libtpu
def test_tpu_topologies_build_their_devices():
    for name, preset in aot.TOPOLOGIES.items():
        assert len(preset.devices()) == preset.chips, name
    assert "TPU v5" in aot.topology("v5p-8").devices()[0].device_kind
    assert "v6" in aot.topology("v6e-8").devices()[0].device_kind
    fsdp = sharding.MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=-1)
    assert dict(aot.topology_mesh(aot.topology("v5p-32"), fsdp).shape)["fsdp"] == 16
    # two slices: the data axis spans them (dcn), fsdp stays inside each
    mesh = aot.topology_mesh(aot.topology("v5p-8"), fsdp, num_slices=2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "context": 1, "tensor": 1}


@needs_libtpu
def test_tpu_refuses_what_does_not_fit():
    """libtpu's out-of-memory refusal becomes a report that does not fit."""
    slice_ = aot.topology("v6e-8")
    mesh = sharding.make_mesh(sharding.MeshConfig(), devices=slice_.devices())
    rows = jax.ShapeDtypeStruct(
        (8 * 10 * 2**30 // 4,), np.float32, sharding=aot.batch_array(mesh, (8,)).sharding
    )
    fn = jax.jit(lambda a: (a * 2, a + 1, a - 1, a * 3))
    report = aot.compile_program(aot.Program("big", fn, (rows,), mesh), slice_)
    assert not report.compiled and not report.fits
    assert report.total_bytes > slice_.hbm_bytes and "RESOURCE_EXHAUSTED" in report.error


@needs_libtpu
def test_tpu_report_counts_what_a_remat_policy_offloads_to_the_host():
    """Blocks whose inputs the offload_block_inputs policy moves to pinned host memory: the
    report's host_bytes counts them, whole block inputs ([4096, 512] bf16 a chip: 4 MiB; XLA
    moves those it finds worth moving, 5 of the 8 here), and the same blocks under full remat
    put nothing on the host."""
    from jax.ad_checkpoint import checkpoint_name

    from jaxcore import compute

    slice_ = aot.topology("v5p-8")
    mesh = sharding.make_mesh(sharding.MeshConfig(), devices=slice_.devices())

    def grad_program(policy):
        def block(w, x):
            x = checkpoint_name(x, compute.BLOCK_INPUT)
            return x + jnp.tanh(jnp.tanh(x @ w) @ w.T)

        step = jax.checkpoint(block, policy=compute.REMAT_POLICIES[policy])

        def loss(ws, x):
            for w in ws:
                x = step(w, x)
            return jnp.mean(x.astype(jnp.float32) ** 2)

        ws = [jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)] * 8
        x = aot.batch_array(mesh, (4 * 4096, 512), jnp.bfloat16)
        return aot.Program(policy, jax.jit(jax.grad(loss)), (ws, x), mesh)

    offloaded = aot.compile_program(grad_program("offload_block_inputs"), slice_)
    one_input = 4096 * 512 * 2
    assert offloaded.fits and offloaded.host_bytes >= one_input
    assert offloaded.host_bytes % one_input == 0
    assert "pinned host" in offloaded.breakdown()
    assert not aot.compile_program(grad_program("full"), slice_).host_bytes


@pytest.mark.slow
@needs_libtpu
def test_tpu_train_step_of_the_tiny_model(deploy_cfg, tmp_path):
    """The deploy check end to end on a real v5p-8 topology (compiled by libtpu)."""
    report = deploy.fit_check(deploy_cfg(), *_only_step(deploy_cfg()), out=tmp_path)
    assert report.fits and report.topology == "v5p-8" and report.chips == 4
    assert report.xla_flops > 0 and report.collectives["all-reduce"] > 0  # data-parallel grads


def _only_step(cfg):
    from pipelines.config import load_pipeline_spec

    steps = load_pipeline_spec(deploy._pipeline(cfg))
    return steps, steps[0]


@needs_libtpu
def test_tpu_splash_bench_compiles_our_kernel_for_a_chip(monkeypatch):
    """bench.tpu_splash: jax's splash kernel compiles for one v5p chip, forward + backward, and
    the cost model does not see inside it (its FLOPs are far under the attention's)."""
    from bench import tpu_splash

    monkeypatch.setitem(tpu_splash.CASES, "tiny", (1_000, 2, 128))
    # the suite's "highest" matmul precision (conftest) is one Mosaic's bf16 products refuse
    with jax.default_matmul_precision("default"):
        record = tpu_splash.compile_case("jax_splash", "v5p-8", "tiny")
    assert record["compiles"], record.get("error")
    assert record["tokens"] == 1_024  # padded to the 512 block
    assert record["temp_gib"] < 0.1 and record["argument_gib"] > 0
    assert record["xla_flops"] < 0.1 * record["attention_flops"]


def test_tpu_chips_are_found_by_their_pci_ids(tmp_path):
    """A host's TPU chips are PCI devices of Google's vendor id with a TPU device id; Google's
    virtual NIC (the same vendor, another id) is not one."""

    def device(name, vendor, device_id):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "vendor").write_text(vendor + "\n")
        (folder / "device").write_text(device_id + "\n")

    device("0000:00:04.0", "0x1ae0", "0x0042")  # gVNIC
    device("0000:00:05.0", "0x8086", "0x0062")  # another vendor, a TPU's id
    assert not aot._tpu_chips_attached(tmp_path)
    device("0000:00:06.0", "0x1ae0", "0x0062")  # a v5p chip
    assert aot._tpu_chips_attached(tmp_path)
