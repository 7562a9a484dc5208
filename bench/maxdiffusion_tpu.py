"""MaxDiffusion's own programs compiled for a TPU slice without a TPU, for ``bench/tpu_compile.py``.

Runs under MaxDiffusion's own Python (``make maxdiffusion-venv``) with its ``src`` folder on
``PYTHONPATH``; imports nothing of difforge. Argument: one JSON case (``bench.tpu_compile.
maxdiffusion_case`` writes it):

- ``kind``: ``wan_generate``, ``flux_generate``, ``wan_train`` or ``flux_train``;
- ``yml``: MaxDiffusion's config (``configs/base_wan_14b.yml``, ...) and ``overrides``: its
  ``key=value`` command-line overrides, read by MaxDiffusion's own ``pyconfig`` (so its
  logical-axis rules get the sequence-sharding rules its ``attention_sharding_uniform`` adds);
- ``transformer``: the transformer's diffusers ``config.json`` keys (MaxDiffusion reads them
  from the Hugging Face hub; none is reachable here);
- ``batch`` (videos / images of the step), ``latent_shape`` ([C, F, H, W] or [C, H, W]),
  ``text_length``, ``guidance_scale``;
- ``topology``: libtpu's slice (``name``, ``topology``, ``chip_config``, ``chips_per_host``,
  ``libtpu``): the compile-only devices come from ``jax.experimental.topologies``;
- ``hlo_path``: where the compiled HLO text goes (the caller counts collectives and kernels).

What is compiled (each its pipeline's or trainer's own function, on abstract arguments:
``nnx.eval_shape`` / ``jax.eval_shape`` state with MaxDiffusion's logical shardings, nothing
allocated):

- ``wan_generate``: one denoising step, ``wan_pipeline.transformer_forward_pass_full_cfg``
  (what ``run_inference_2_1`` / ``run_inference_2_2`` call each step without caches): the
  WanModel on the latents doubled for CFG and [prompt; negative prompt], the guidance mix;
  the RoPE tables as the pipeline passes them (computed once, outside the step). A two-expert
  model (Wan 2.2) runs one expert a step; the other's weights stay in HBM, counted in
  ``resident_bytes`` (its per-chip parameter bytes) and in ``total_bytes``.
- ``flux_generate``: one iteration of ``generate_flux.loop_body`` (the transformer on the
  packed latents with embedded guidance, no CFG, and the Euler update) with the transformer
  state of ``max_utils.get_abstract_state`` (``setup_initial_state``'s own path).
- ``wan_train``: ``trainers/wan_trainer.train_step`` (its ``step_optimizer``: flow-match
  noise, forward with the config's remat policy, MSE with the training weight,
  ``nnx.value_and_grad``, gradient norms, AdamW ``apply_gradients``), imported and jitted as
  its ``get_train_step`` does (the module needs TensorFlow, scikit-image and jaxopt in the
  venv: its data pipeline and SSIM).
- ``flux_train``: ``trainers/flux_trainer._train_step`` (imported) with the AdamW train state
  of ``get_abstract_state`` and the batch of ``FluxTrainer.get_shaped_batch``.

Prints one JSON line: the memory analysis, ``flops`` and ``optimal_seconds`` of the cost
analysis, lower / compile seconds, ``compiled`` (what the program is, in words); a libtpu
out-of-memory refusal prints ``refused`` with its message instead (the caller parses it).
"""

import functools
import inspect
import json
import os
import sys
import time


def tpu_devices(topo: dict) -> list:
    """The compile-only devices of the slice (as ``jaxcore.aot._tpu_devices`` makes them)."""
    from jax.experimental import topologies

    os.environ.setdefault("TPU_LIBRARY_PATH", topo["libtpu"])
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", topo["name"])
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    desc = topologies.get_topology_desc(
        topology_name=topo["topology"],
        platform="tpu",
        chip_config_name=topo["chip_config"],
        chips_per_host_bounds=tuple(topo["chips_per_host"]),
        num_slices=1,
        wrap=(False, False, False),
    )
    return list(desc.devices)


def load_config(case: dict):
    """MaxDiffusion's HyperParameters from its YAML and overrides (its own pyconfig)."""
    import maxdiffusion
    from maxdiffusion import pyconfig

    yml = os.path.join(os.path.dirname(maxdiffusion.__file__), "configs", case["yml"])
    overrides = ["skip_jax_distributed_system=True", *case["overrides"]]
    # unittest=True: no jax.distributed.initialize (one process, no TPU hosts to find)
    pyconfig.initialize([None, yml, *overrides], unittest=True)
    return pyconfig.config


def accepted(cls, config: dict) -> dict:
    """The keys of a diffusers config.json the MaxDiffusion class takes."""
    names = inspect.signature(cls.__init__).parameters
    if hasattr(cls, "__dataclass_fields__"):  # a linen module: its fields
        names = cls.__dataclass_fields__
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in config.items() if k in names}


def sds(shape, dtype, sharding):
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def per_chip_bytes(tree) -> int:
    """Bytes one chip holds of an abstract tree's sharded leaves (a shard each)."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shard)) * np.dtype(leaf.dtype).itemsize
    return total


# --- Wan ----------------------------------------------------------------------------------------


def abstract_wan(config, mesh, transformer: dict):
    """(graphdef, abstract sharded params, abstract rest) of a WanModel: steps 1-3 of
    ``wan_pipeline.create_sharded_logical_transformer`` (eval_shape, ``nnx.get_partition_spec``
    and the logical rules), with the architecture given instead of read from the hub."""
    import jax
    from flax import linen as nn
    from flax import nnx
    from maxdiffusion.max_utils import get_flash_block_sizes, get_precision
    from maxdiffusion.models.wan.transformers.transformer_wan import WanModel

    wan_config = accepted(WanModel, transformer)
    wan_config.update(
        mesh=mesh,
        dtype=config.activations_dtype,
        weights_dtype=config.weights_dtype,
        attention=config.attention,
        precision=get_precision(config),
        flash_block_sizes=get_flash_block_sizes(config),
        remat_policy=config.remat_policy,
        names_which_can_be_saved=config.names_which_can_be_saved,
        names_which_can_be_offloaded=config.names_which_can_be_offloaded,
        flash_min_seq_length=config.flash_min_seq_length,
        dropout=config.dropout,
        mask_padding_tokens=config.mask_padding_tokens,
        scan_layers=config.scan_layers,
        enable_jax_named_scopes=config.enable_jax_named_scopes,
        attention_config={
            "use_base2_exp": config.use_base2_exp,
            "use_experimental_scheduler": config.use_experimental_scheduler,
            "ulysses_shards": getattr(config, "ulysses_shards", -1),
            "ulysses_attention_chunks": getattr(config, "ulysses_attention_chunks", 1),
        },
    )
    model = nnx.eval_shape(lambda rngs: WanModel(**wan_config, rngs=rngs), rngs=nnx.Rngs(0))
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    spec = nnx.get_partition_spec(state)
    shardings = nn.logical_to_mesh_sharding(spec, mesh, config.logical_axis_rules)
    # the weights in their final dtype (the loader casts every Param to weights_dtype but the
    # few its cast_with_exclusion keeps in float32: norms' scales, biases of the embedders)
    from maxdiffusion.pipelines.wan.wan_pipeline import _final_param_dtype

    def one(path, leaf, where):
        key = tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)
        dtype = _final_param_dtype(key, config.weights_dtype)
        return sds(leaf.shape, dtype, where)

    params = jax.tree_util.tree_map_with_path(one, state, shardings)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    rest = jax.tree.map(lambda x: sds(x.shape, x.dtype, replicated), rest)
    return model, graphdef, params, rest


def wan_generate(case, config, mesh):
    """One CFG denoising step of the Wan pipeline (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    from maxdiffusion.pipelines.wan.wan_pipeline import transformer_forward_pass_full_cfg

    model, graphdef, params, rest = abstract_wan(config, mesh, case["transformer"])
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    batch, (c, f, h, w) = case["batch"], case["latent_shape"]
    rows = 2 * batch  # CFG: [cond; uncond] in one call
    # the pipeline's latents and prompt embeddings are put with P() (its data_sharding test,
    # global // per_device == 0, is false for these batches), the doubling is eager
    latents = sds((rows, c, f, h, w), jnp.float32, rep)
    timestep = sds((rows,), jnp.int32, rep)
    text = sds((rows, case["text_length"], case["transformer"]["text_dim"]), jnp.float32, rep)
    rotary = jax.eval_shape(model.rope, jax.ShapeDtypeStruct((rows, f, h, w, c), jnp.float32))
    rotary = jax.tree.map(lambda x: sds(x.shape, x.dtype, rep), rotary)
    fn = transformer_forward_pass_full_cfg.jitted  # aot_cache.cached_jit's jax.jit
    args = (graphdef, params, rest, latents, timestep, text)
    kwargs = {"guidance_scale": float(case["guidance_scale"]), "rotary_emb": rotary}
    resident = per_chip_bytes(params) if case.get("experts", 1) == 2 else 0
    what = (
        f"wan_pipeline.transformer_forward_pass_full_cfg: WanModel forward on {rows} rows "
        f"({batch} videos x CFG 2) of latents {[c, f, h, w]}, text {case['text_length']} tokens, "
        f"attention={config.attention}, {config.weights_dtype} weights, "
        f"{config.activations_dtype} activations, mesh {dict(mesh.shape)}"
    )
    if resident:
        what += "; + the idle second expert's weights resident (resident_bytes)"
    return fn, args, kwargs, what, resident


def wan_train(case, config, mesh):
    """``wan_trainer.step_optimizer`` on an abstract TrainState (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from maxdiffusion.schedulers import FlaxFlowMatchScheduler
    from maxdiffusion.trainers import wan_trainer
    from maxdiffusion.trainers.base_wan_trainer import TrainState

    _, graphdef, params, rest = abstract_wan(config, mesh, case["transformer"])
    tx = optimizer(config)
    state = jax.eval_shape(
        lambda p: TrainState.create(
            apply_fn=graphdef.apply, params=p, tx=tx, graphdef=graphdef, rest_of_state=rest
        ),
        params,
    )
    state = shard_like_params(state, params, mesh)
    scheduler = FlaxFlowMatchScheduler(dtype=jnp.float32)
    scheduler_state = scheduler.set_timesteps(
        scheduler.create_state(), num_inference_steps=1000, training=True
    )
    rep = NamedSharding(mesh, P())
    scheduler_state = jax.tree.map(
        lambda x: sds(jnp.shape(x), jnp.result_type(x), rep), scheduler_state
    )
    # the trainer loads global_batch_size_to_load rows (a fractional per_device_batch_size
    # loads as if it were 1) and its step trains on the first global_batch_size_to_train_on
    batch = max(case["batch"], config.global_batch_size_to_load)
    c, f, h, w = case["latent_shape"]
    data_sharding = NamedSharding(mesh, P(*config.data_sharding))
    data = {
        "latents": sds((batch, c, f, h, w), jnp.float32, data_sharding),
        "encoder_hidden_states": sds(
            (batch, case["text_length"], case["transformer"]["text_dim"]),
            jnp.float32,
            data_sharding,
        ),
    }
    rng = sds((2,), jnp.uint32, rep)

    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    data_shardings = jax.tree.map(lambda x: x.sharding, data)
    # wan_trainer.get_train_step's jit of its train_step: state donated, its shardings in and out
    fn = jax.jit(
        functools.partial(wan_trainer.train_step, scheduler=scheduler, config=config),
        in_shardings=(state_shardings, data_shardings, None, None),
        out_shardings=(state_shardings, None, None, None),
        donate_argnums=(0,),
    )
    c_, f_, h_, w_ = case["latent_shape"]
    what = (
        "wan_trainer.train_step (its step_optimizer): flow-match noise, WanModel forward + backward "
        f"(remat_policy={config.remat_policy}), weighted MSE, grad norms, AdamW apply_gradients "
        f"(optax.adamw, {config.weights_dtype} params and moments as the params), batch {batch} "
        f"of latents {[c_, f_, h_, w_]}, text {case['text_length']} tokens, "
        f"attention={config.attention}, mesh {dict(mesh.shape)}"
    )
    return fn, (state, data, rng, scheduler_state), {}, what, 0


def shard_like_params(state, params, mesh):
    """Every leaf of an abstract train state with its parameter's sharding (the optimizer's
    moments mirror the params; what has no parameter of its path, the step count, is
    replicated): the placement ``nnx.get_partition_spec(state)`` gives MaxDiffusion's state."""
    import jax

    def key(path):
        return tuple(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path)

    by_path = {key(p): leaf.sharding for p, leaf in jax.tree_util.tree_leaves_with_path(params)}
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def one(path, leaf):
        k = key(path)
        for n in range(len(k)):
            if k[n:] in by_path:
                return sds(leaf.shape, leaf.dtype, by_path[k[n:]])
        return sds(leaf.shape, leaf.dtype, rep)

    return jax.tree_util.tree_map_with_path(one, state)


# --- Flux ---------------------------------------------------------------------------------------


def flux_model(config, mesh, transformer: dict):
    from maxdiffusion.max_utils import get_flash_block_sizes, get_precision
    from maxdiffusion.models.flux.transformers.transformer_flux_flax import FluxTransformer2DModel

    # generate_flux.run's FluxTransformer2DModel.from_config(...) keyword arguments (from_config
    # drops its split_head_dim: no field of the module)
    return FluxTransformer2DModel(
        **accepted(FluxTransformer2DModel, transformer),
        mesh=mesh,
        attention_kernel=config.attention,
        flash_block_sizes=get_flash_block_sizes(config),
        dtype=config.activations_dtype,
        weights_dtype=config.weights_dtype,
        precision=get_precision(config),
        remat_policy=config.remat_policy,
        names_which_can_be_saved=config.names_which_can_be_saved,
        names_which_can_be_offloaded=config.names_which_can_be_offloaded,
    )


def flux_inputs(case, config, mesh, dtype):
    """The packed latents, ids and text of the batch, as generate_flux / get_shaped_batch."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    batch, (c, h, w) = case["batch"], case["latent_shape"]
    tokens, channels = (h // 2) * (w // 2), c * 4
    data = NamedSharding(mesh, P(*config.data_sharding))
    rep = NamedSharding(mesh, P())
    length = case["text_length"]
    return {
        "latents": sds((batch, tokens, channels), dtype, data),
        "img_ids": sds((batch, tokens, 3), dtype, rep),
        "text": sds((batch, length, case["transformer"]["joint_attention_dim"]), dtype, data),
        "txt_ids": sds((batch, length, 3), dtype, rep),
        "vec": sds((batch, case["transformer"]["pooled_projection_dim"]), dtype, data),
        "guidance": sds((batch,), jnp.bfloat16, data),
    }, jax


def flux_generate(case, config, mesh):
    """One iteration of generate_flux.loop_body (see the module docstring)."""
    import jax.numpy as jnp
    from flax.linen import partitioning as nn_partitioning
    from maxdiffusion import generate_flux, max_utils

    transformer = flux_model(config, mesh, case["transformer"])
    rng = jax_key()
    init = functools.partial(
        transformer.init_weights, rngs=rng, max_sequence_length=case["text_length"], eval_only=False
    )
    state, _, _ = max_utils.get_abstract_state(
        transformer, None, config, mesh, init, training=False
    )
    x, jax = flux_inputs(case, config, mesh, jnp.bfloat16)
    # generate_flux.run: latents bf16 with data_sharding; ids put with no sharding (one device
    # there: replicated here); text / pooled / guidance with data_sharding
    ts = sds(
        (case["steps"],),
        jnp.float32,
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
    )

    def step(state, latents, img_ids, text, txt_ids, vec, guidance, c_ts, p_ts, index):
        with mesh, nn_partitioning.axis_rules(config.logical_axis_rules):
            latents, _, _, _ = generate_flux.loop_body(
                index,
                (latents, state, c_ts, p_ts),
                transformer=transformer,
                latent_image_ids=img_ids,
                prompt_embeds=text,
                txt_ids=txt_ids,
                vec=vec,
                guidance_vec=guidance,
            )
        return latents

    index = sds((), jnp.int32, ts.sharding)
    args = (
        state,
        x["latents"],
        x["img_ids"],
        x["text"],
        x["txt_ids"],
        x["vec"],
        x["guidance"],
        ts,
        ts,
        index,
    )
    what = (
        f"generate_flux.loop_body (one of its fori_loop's steps): FluxTransformer2DModel on "
        f"{case['batch']} images, latents {case['latent_shape']} packed to "
        f"{x['latents'].shape[1:]}, text {case['text_length']} tokens, embedded guidance "
        f"(no CFG), Euler update; attention={config.attention}, {config.weights_dtype}, "
        f"mesh {dict(mesh.shape)}"
    )
    return jax.jit(step), args, {}, what, 0


def flux_train(case, config, mesh):
    """flux_trainer._train_step on get_abstract_state's AdamW state (module docstring)."""
    import jax
    import jax.numpy as jnp
    from flax import struct
    from maxdiffusion import max_utils
    from maxdiffusion.schedulers.scheduling_euler_discrete_flax import FlaxEulerDiscreteScheduler
    from maxdiffusion.trainers import flux_trainer

    transformer = flux_model(config, mesh, case["transformer"])
    tx = optimizer(config)
    init = functools.partial(
        transformer.init_weights, rngs=jax_key(), max_sequence_length=case["text_length"]
    )
    state, _, state_shardings = max_utils.get_abstract_state(
        transformer, tx, config, mesh, init, training=True
    )
    dtype = config.activations_dtype
    x, _ = flux_inputs(case, config, mesh, dtype)
    batch = {
        "pixel_values": x["latents"],
        "text_embeds": x["text"],
        "input_ids": x["txt_ids"],
        "prompt_embeds": x["vec"],
        "img_ids": x["img_ids"],
    }
    data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*config.data_sharding))
    batch = {k: sds(v.shape, v.dtype, data) for k, v in batch.items()}  # get_data_shardings

    @struct.dataclass
    class SchedulerState:  # the Euler scheduler state's one field the step reads
        timesteps: jax.Array

    class Pipeline:  # the pipeline's two attributes the step reads
        pass

    pipeline = Pipeline()
    pipeline.flux = transformer
    # set_timesteps(num_inference_steps, timestep_spacing="flux") in the trainer; the values
    # do not change the program, the length does (it bounds the sampled index)
    scheduler = SchedulerState(jnp.linspace(1.0, 0.0, config.num_inference_steps))
    guidance = jnp.full((case["batch"],), config.guidance_scale, dtype=dtype)

    def add_noise(state, original, noise, timesteps, flux=False):
        # FlaxEulerDiscreteScheduler.add_noise (its flux branch reads only the state)
        return FlaxEulerDiscreteScheduler.add_noise(None, state, original, noise, timesteps, flux)

    pipeline.scheduler = type("S", (), {"add_noise": staticmethod(add_noise)})
    step = functools.partial(
        flux_trainer._train_step,
        guidance_vec=guidance,
        pipeline=pipeline,
        scheduler=scheduler,
        config=config,
    )
    # flux_trainer.compile_train_step's jit
    fn = jax.jit(
        step,
        in_shardings=(state_shardings, {k: data for k in batch}, None),
        out_shardings=(state_shardings, None, None),
        donate_argnums=(0, 1),
    )
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
    what = (
        "flux_trainer._train_step: flow-match noise, FluxTransformer2DModel forward + backward "
        f"(remat_policy={config.remat_policy}), MSE, AdamW apply_gradients (TrainState of "
        f"get_abstract_state), batch {case['batch']} of latents {case['latent_shape']}, text "
        f"{case['text_length']} tokens, attention={config.attention}, mesh {dict(mesh.shape)}"
    )
    return fn, (state, batch, rng), {}, what, 0


def optimizer(config):
    """Its trainers' optimizer: ``max_utils.create_optimizer`` on the config's schedule."""
    from maxdiffusion import max_utils

    schedule = max_utils.create_learning_rate_schedule(
        config.learning_rate,
        config.learning_rate_schedule_steps,
        config.warmup_steps_fraction,
        config.max_train_steps,
    )
    return max_utils.create_optimizer(config, schedule)


def jax_key():
    import jax

    return jax.random.key(0)


# --- compile ------------------------------------------------------------------------------------

BUILDERS = {
    "wan_generate": wan_generate,
    "wan_train": wan_train,
    "flux_generate": flux_generate,
    "flux_train": flux_train,
}


def main() -> None:
    case = json.loads(sys.argv[1])
    chips = int(case["topology"]["chips"])
    # MaxDiffusion's pyconfig sizes its global batch from len(jax.devices()) (and init_weights
    # its dummy batch): this process's CPU devices stand in for the slice's chips, so its
    # arithmetic is the slice's. The program itself is placed on the TPU devices below.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={chips}"
    )
    import jax
    from flax.linen import partitioning as nn_partitioning
    from jax.sharding import Mesh

    devices = tpu_devices(case["topology"])
    config = load_config(case)
    from maxdiffusion import max_utils

    mesh = Mesh(max_utils.create_device_mesh(config, devices=devices), config.mesh_axes)
    started = time.perf_counter()
    # as MaxDiffusion's generate / train scripts run their steps: its mesh and logical rules
    with mesh, nn_partitioning.axis_rules(config.logical_axis_rules):
        fn, args, kwargs, what, resident = BUILDERS[case["kind"]](case, config, mesh)
        lowered = fn.lower(*args, **kwargs)
    lowered_at = time.perf_counter()
    out = {
        "compiled_program": what,
        "mesh": {k: int(v) for k, v in mesh.shape.items()},
        "logical_axis_rules": [list(map(str, r)) for r in config.logical_axis_rules],
        "lower_seconds": lowered_at - started,
        "resident_bytes": resident,
        "jax": jax.__version__,
    }
    try:
        compiled = lowered.compile()
    except Exception as err:  # noqa: BLE001 - libtpu's refusal is a result; others re-raised
        text = str(err)
        if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
            raise
        out.update(refused=text[:4000], compile_seconds=time.perf_counter() - lowered_at)
        print(json.dumps(out))
        return
    out["compile_seconds"] = time.perf_counter() - lowered_at
    memory = compiled.memory_analysis()
    out.update(
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        generated_code_bytes=int(memory.generated_code_size_in_bytes),
    )
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    cost = cost or {}
    out["flops"] = float(cost["flops"]) if "flops" in cost else None
    out["optimal_seconds"] = float(cost["optimal_seconds"]) if "optimal_seconds" in cost else None
    with open(case["hlo_path"], "w") as f:
        f.write(compiled.as_text())
    out["hlo_path"] = case["hlo_path"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
