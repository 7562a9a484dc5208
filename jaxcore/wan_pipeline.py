"""Wan 2.1 text-to-video inference in JAX: the twin of diffusers' ``WanPipeline``.

Reference: ``diffusers/pipelines/wan/pipeline_wan.py`` (``WanPipeline.__call__``):

1. prompts -> UMT5 embeddings, trimmed to each prompt's length and zero-padded to
   ``max_sequence_length`` (512) (:mod:`jaxcore.text`);
2. initial noise ``[B, z_dim, (num_frames - 1) // 4 + 1, height // 8, width // 8]``;
3. the denoising loop: at each scheduler timestep the transformer predicts the flow velocity;
   with classifier-free guidance (``guidance_scale > 1``) a second pass on the negative prompt
   gives ``uncond + scale * (cond - uncond)``; the scheduler steps the latents;
4. latents ``* latents_std + latents_mean`` -> VAE decode -> ``video / 2 + 0.5`` clipped to
   [0, 1], laid out ``[B, F, H, W, 3]`` (diffusers' ``output_type="np"``).

Step 3 is ONE jitted function (``lax.fori_loop`` with the scheduler state in the carry), so a
whole sampling run is a single dispatch; it is compiled once per (shape, steps, CFG on/off).

Initial noise is drawn per prompt from its seed alone (:func:`initial_latents`), never from a
batch-level key, so outputs do not depend on batch composition, batch size or device count.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxcore import sharding, storage, weights
from jaxcore.models import umt5, wan_transformer, wan_vae
from jaxcore.schedulers import make_scheduler

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
# What a Hugging Face snapshot needs (no pickles, no code).
HUB_ALLOW_PATTERNS = [
    "model_index.json",
    "*/config.json",
    "*/*.safetensors",
    "*/*.safetensors.index.json",
    "scheduler/scheduler_config.json",
    "tokenizer/*.json",
    "tokenizer/*.model",
    "tokenizer/*.txt",
]


class PipelineError(weights.WeightsError):
    """A pipeline directory that cannot be loaded; the message names the path or key."""


# --- noise and shapes ---------------------------------------------------------------------------


def latent_shape(
    z_dim: int, height: int, width: int, num_frames: int, *, temporal: int = 4, spatial: int = 8
) -> tuple[int, int, int, int]:
    """Per-sample latent shape ``[z_dim, (num_frames - 1) // 4 + 1, height // 8, width // 8]``
    (``WanPipeline.prepare_latents``)."""
    return (z_dim, (num_frames - 1) // temporal + 1, height // spatial, width // spatial)


def initial_latents(seed: int, shape: Sequence[int]) -> np.ndarray:
    """Standard-normal float32 noise of ``shape`` that depends on ``seed`` alone.

    numpy's PCG64 generator on the host: the same numbers on every machine, device count and
    batch layout (a device-side key split per batch would tie noise to batch composition).
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    return np.random.Generator(np.random.PCG64(seed)).standard_normal(shape, np.float32)


def to_uint8(video: np.ndarray) -> np.ndarray:
    """[0, 1] float frames -> uint8 (round to nearest, as diffusers' ``numpy_to_pil``)."""
    return np.clip(np.round(np.asarray(video) * 255.0), 0, 255).astype(np.uint8)


# --- schedulers ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class UniPCOptions:
    """The UniPC settings read from ``scheduler_config.json`` (diffusers names)."""

    solver_order: int = 2
    solver_type: str = "bh2"
    lower_order_final: bool = True
    disable_corrector: tuple[int, ...] = ()
    num_train_timesteps: int = 1000


def _unipc_options(config: Mapping[str, Any], where: str) -> UniPCOptions:
    """Check the config is the flow-matching UniPC we implement; refuse anything else."""
    expected = {
        "prediction_type": "flow_prediction",
        "use_flow_sigmas": True,
        "predict_x0": True,
        "final_sigmas_type": "zero",
        "thresholding": False,
    }
    for key, want in expected.items():
        if key in config and config[key] != want:
            raise PipelineError(
                f"{where}: {key}={config[key]!r} is not supported (only {key}={want!r}, as Wan)"
            )
    return UniPCOptions(
        solver_order=int(config.get("solver_order", 2)),
        solver_type=str(config.get("solver_type", "bh2")),
        lower_order_final=bool(config.get("lower_order_final", True)),
        disable_corrector=tuple(config.get("disable_corrector") or ()),
        num_train_timesteps=int(config.get("num_train_timesteps", 1000)),
    )


# --- the jitted denoising loop --------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _denoise_fn(module: wan_transformer.WanTransformer, step_fn, use_cfg: bool):
    """jit(params, latents, text, neg_text, guidance[B], state) -> latents; one per module/CFG."""

    def velocity(params, latents, timestep, text):
        out = module.apply({"params": params}, latents, timestep, text)
        return out.astype(jnp.float32)

    def denoise(params, latents, text, neg_text, guidance_b, state):
        batch = latents.shape[0]
        scale = guidance_b.reshape(batch, 1, 1, 1, 1)

        def body(i, carry):
            x, st = carry
            t = jnp.broadcast_to(st.timesteps[i].astype(jnp.float32), (batch,))
            cond = velocity(params, x, t, text)
            if use_cfg:
                uncond = velocity(params, x, t, neg_text)
                # diffusers applies CFG only when guidance_scale > 1; keep that per sample.
                v = jnp.where(scale > 1.0, uncond + scale * (cond - uncond), cond)
            else:
                v = cond
            x, st = step_fn(st, v, x)
            return x, st

        x, _ = jax.lax.fori_loop(0, state.timesteps.shape[0], body, (latents, state))
        return x

    return jax.jit(denoise)


# --- the pipeline -------------------------------------------------------------------------------


@dataclasses.dataclass
class WanPipelineJax:
    """Loaded components and the three inference phases (encode, sample, decode)."""

    transformer: wan_transformer.WanTransformer
    transformer_params: Any
    vae: wan_vae.WanVAE
    vae_params: Any
    text_encoder: umt5.UMT5Encoder
    text_encoder_params: Any
    tokenizer: Any
    scheduler_config: dict
    mesh: jax.sharding.Mesh | None = None
    rules: tuple = sharding.LOGICAL_AXIS_RULES
    source: str = ""

    # shapes -----------------------------------------------------------------------------------
    @property
    def z_dim(self) -> int:
        return self.transformer.config.in_channels

    def latent_shape(self, height: int, width: int, num_frames: int) -> tuple[int, ...]:
        """Per-sample latent shape for a render of ``num_frames`` x ``height`` x ``width``."""
        vae = self.vae.config
        return latent_shape(
            self.z_dim,
            height,
            width,
            num_frames,
            temporal=vae.temporal_compression,
            spatial=vae.spatial_compression,
        )

    @property
    def default_flow_shift(self) -> float:
        """``flow_shift`` (UniPC) or ``shift`` (Euler) from scheduler_config.json, else 1."""
        cfg = self.scheduler_config
        return float(cfg.get("flow_shift", cfg.get("shift", 1.0)) or 1.0)

    @property
    def batch_ways(self) -> int:
        """How many ways a batch is split over the mesh (batches must be a multiple)."""
        return 1 if self.mesh is None else sharding.batch_axis_size(self.mesh, self.rules)

    # placement --------------------------------------------------------------------------------
    def _context(self):
        """Mesh + logical rules active while tracing, so activation constraints apply."""
        import contextlib

        stack = contextlib.ExitStack()
        if self.mesh is not None:
            stack.enter_context(jax.set_mesh(self.mesh))
            stack.enter_context(nn.logical_axis_rules(self.rules))
        return stack

    def shard_batch(self, x: np.ndarray) -> jax.Array:
        """Place a host batch (this process's rows) with its leading axis over the batch axes."""
        if self.mesh is None:
            return jnp.asarray(x)
        logical = ("activation_batch",) + (None,) * (np.ndim(x) - 1)
        target = sharding.logical_sharding(self.mesh, logical, self.rules)
        return jax.make_array_from_process_local_data(target, np.asarray(x))

    # phases -----------------------------------------------------------------------------------
    def encode_prompts(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None = None,
        max_sequence_length: int = 512,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """(text_emb, neg_text_emb) ``[B, max_sequence_length, d_model]`` float32 on the host.

        ``negative_prompts=None`` skips the negative pass (no guidance).
        """
        from jaxcore import text

        prompts = list(prompts)
        everything = prompts + list(negative_prompts or [])
        # Outside the mesh context: the text encoder's activation constraints fail under the
        # logical rules (umt5 SelfAttention constrains a rank-2 value with a rank-3 spec); its
        # params are replicated, so nothing is lost.
        emb, _ = text.encode_prompts(
            self.tokenizer,
            self.text_encoder,
            self.text_encoder_params,
            everything,
            max_sequence_length,
        )
        if negative_prompts is None:
            return emb, None
        if len(negative_prompts) != len(prompts):
            raise ValueError(f"{len(negative_prompts)} negative prompts for {len(prompts)} prompts")
        return emb[: len(prompts)], emb[len(prompts) :]

    def sample(
        self,
        latents,
        text_emb,
        neg_text_emb=None,
        *,
        num_inference_steps: int,
        guidance_scale: float | Sequence[float] = 5.0,
        flow_shift: float | None = None,
        scheduler: str = "unipc",
    ) -> jax.Array:
        """Run the whole denoising loop (one jitted call); returns the final latents.

        ``guidance_scale`` may be one value or one per sample; CFG runs when any is > 1 (then
        ``neg_text_emb`` is required) and applies only to samples whose scale is > 1.
        """
        latents = latents if isinstance(latents, jax.Array) else self.shard_batch(latents)
        batch = latents.shape[0]
        scales = np.broadcast_to(np.asarray(guidance_scale, np.float32), (batch,))
        use_cfg = bool((scales > 1.0).any())
        if use_cfg and neg_text_emb is None:
            raise ValueError("guidance_scale > 1 needs neg_text_emb (the negative prompts)")
        if not isinstance(text_emb, jax.Array):
            text_emb = self.shard_batch(text_emb)
        if neg_text_emb is None:
            neg_text_emb = text_emb
        elif not isinstance(neg_text_emb, jax.Array):
            neg_text_emb = self.shard_batch(neg_text_emb)
        shift = self.default_flow_shift if flow_shift is None else float(flow_shift)
        if scheduler == "unipc":
            options = dataclasses.asdict(
                _unipc_options(self.scheduler_config, f"{self.source}/scheduler")
            )
        else:
            options = {"num_train_timesteps": UniPCOptions().num_train_timesteps}
        state, step_fn = make_scheduler(
            scheduler, num_inference_steps, shift, sample_shape=latents.shape, **options
        )
        fn = _denoise_fn(self.transformer, step_fn, use_cfg)
        with self._context():
            return fn(
                self.transformer_params,
                latents.astype(jnp.float32),
                text_emb,
                neg_text_emb,
                self.shard_batch(scales),
                state,
            )

    def decode(self, latents) -> jax.Array:
        """Latents -> video ``[B, F, H, W, 3]`` float32 in [0, 1] (diffusers ``output_type="np"``)."""
        z = wan_vae.denormalize_latents(jnp.asarray(latents, jnp.float32), self.vae.config)
        with self._context():
            video_bcfhw = wan_vae.decode(self.vae, self.vae_params, z.astype(self.vae.dtype))
        video = jnp.clip(video_bcfhw.astype(jnp.float32) / 2 + 0.5, 0.0, 1.0)
        return jnp.transpose(video, (0, 2, 3, 4, 1))

    def __call__(
        self,
        prompts: Sequence[str],
        *,
        negative_prompts: Sequence[str] | None = None,
        seeds: Sequence[int] | None = None,
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        num_inference_steps: int = 50,
        guidance_scale: float = 5.0,
        flow_shift: float | None = None,
        scheduler: str = "unipc",
        max_sequence_length: int = 512,
    ) -> np.ndarray:
        """Convenience: prompts -> float video ``[B, F, H, W, 3]`` (batch must fit the mesh)."""
        prompts = list(prompts)
        seeds = list(seeds) if seeds is not None else list(range(len(prompts)))
        shape = self.latent_shape(height, width, num_frames)
        latents = np.stack([initial_latents(s, shape) for s in seeds])
        negatives = None
        if guidance_scale > 1.0:
            negatives = list(negative_prompts or [""] * len(prompts))
        emb, neg = self.encode_prompts(prompts, negatives, max_sequence_length)
        z = self.sample(
            latents,
            emb,
            neg,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            flow_shift=flow_shift,
            scheduler=scheduler,
        )
        return np.asarray(self.decode(z))


# --- loading --------------------------------------------------------------------------------------


def resolve_pipeline_dir(path_or_uri_or_repo_id: str) -> Path:
    """A local pipeline directory for a local path, a ``gs://`` URI, a Hugging Face repo id, or
    ``tiny`` (the random-init tiny pipeline of ``configs/models/wan_tiny.yml``).

    gs:// trees are copied into the local cache once; repo ids are resolved with
    ``huggingface_hub.snapshot_download`` limited to json/safetensors/tokenizer files (it reads
    the local cache when offline; nothing with code or pickles is fetched).
    """
    source = str(path_or_uri_or_repo_id)
    if source == "tiny":  # the random-init tiny pipeline (tests, demos), built once and cached
        from jaxcore.tiny_pipeline import cached_tiny_pipeline

        return cached_tiny_pipeline()
    if storage.is_gcs(source):
        return storage.local_copy(source)
    local = Path(source).expanduser()
    if local.exists():
        return local
    if source.count("/") == 1 and not source.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(source, allow_patterns=HUB_ALLOW_PATTERNS))
        except Exception as err:  # offline and not cached, unknown repo, ...
            raise PipelineError(
                f"pretrained_model_name_or_path {source}: not a local path, and the Hugging "
                f"Face snapshot could not be resolved ({type(err).__name__}: {err})"
            ) from None
    raise PipelineError(f"pretrained_model_name_or_path {source} does not exist")


def read_model_index(directory: Path) -> dict:
    """model_index.json of a diffusers WanPipeline, checked for what we can run."""
    index = weights.read_config(directory, "model_index.json")
    where = directory / "model_index.json"
    if index.get("_class_name") not in (None, "WanPipeline"):
        raise PipelineError(f"{where}: _class_name {index.get('_class_name')!r} is not WanPipeline")
    second = index.get("transformer_2")
    if second and any(second):
        raise PipelineError(f"{where}: transformer_2 (Wan 2.2 two-stage) is not supported")
    if index.get("expand_timesteps"):
        raise PipelineError(f"{where}: expand_timesteps=true (Wan 2.2 TI2V) is not supported")
    missing = [c for c in COMPONENTS if not (directory / c).is_dir()]
    if missing:
        raise PipelineError(f"{directory}: missing component folder(s) {missing}")
    return index


def load_wan_pipeline(
    path_or_uri_or_repo_id: str | os.PathLike,
    *,
    dtype: str = "float32",
    weights_dtype: str | None = None,
    attention: str = "dot_product",
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
    transformer_path: str | None = None,
    transformer_params: Any = None,
) -> WanPipelineJax:
    """Load a diffusers-format Wan 2.1 pipeline (local, gs:// or hub id) into JAX.

    ``dtype``: activations ("float32" or "bfloat16"); ``weights_dtype`` defaults to it.
    ``transformer_path``: a diffusers transformer folder (e.g. exported by a train run) that
    replaces the pipeline's; ``transformer_params``: a params tree (e.g. a restored train
    checkpoint) that replaces the loaded transformer weights.
    """
    if dtype not in DTYPES or (weights_dtype or dtype) not in DTYPES:
        raise PipelineError(
            f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}/{weights_dtype!r}"
        )
    act, wdt = DTYPES[dtype], DTYPES[weights_dtype or dtype]
    rules = tuple(rules) if rules is not None else sharding.LOGICAL_AXIS_RULES
    directory = resolve_pipeline_dir(str(path_or_uri_or_repo_id))
    read_model_index(directory)
    t_dir = directory / "transformer"
    if transformer_path is not None:
        t_dir = storage.local_copy(str(transformer_path))
    try:
        transformer, t_params = wan_transformer.load_wan_transformer(
            t_dir, dtype=act, param_dtype=wdt, attention=attention, mesh=mesh, rules=rules
        )
        vae, v_params = wan_vae.load_wan_vae(directory / "vae", dtype=act, mesh=mesh, rules=rules)
        text_encoder, e_params = umt5.load_umt5(directory / "text_encoder", mesh=mesh)
    except (
        wan_transformer.WanConfigError,
        wan_vae.WanVAEConfigError,
        umt5.UMT5ConfigError,
    ) as err:
        raise PipelineError(f"{directory}: {err}") from None
    if transformer_params is not None:
        t_params = transformer_params
    if transformer.config.in_channels != vae.config.z_dim:
        raise PipelineError(
            f"{directory}: transformer in_channels {transformer.config.in_channels} != "
            f"vae z_dim {vae.config.z_dim}"
        )
    from jaxcore import text

    tokenizer = text.load_tokenizer(directory / "tokenizer")
    scheduler_config = json.loads((directory / "scheduler/scheduler_config.json").read_text())
    return WanPipelineJax(
        transformer=transformer,
        transformer_params=t_params,
        vae=vae,
        vae_params=v_params,
        text_encoder=text_encoder,
        text_encoder_params=e_params,
        tokenizer=tokenizer,
        scheduler_config=scheduler_config,
        mesh=mesh,
        rules=rules,
        source=str(directory),
    )
