"""MaxDiffusion's Wan transformer or Wan VAE, timed one call at a time for
``bench/vs_maxdiffusion.py``.

Runs under MaxDiffusion's own Python (it needs Python >= 3.12 and its own packages) with its
``src`` folder on ``PYTHONPATH``; imports nothing of difforge. Argument: a JSON case whose
``mode`` says what one call is:
- ``forward`` or ``train`` (the transformer): ``config`` holds WanModel keyword arguments,
  ``dtype`` / ``weights_dtype`` the activations' and weights' dtypes, ``latent_shape`` and
  ``text_tokens`` the inputs; ``train`` is the forward and backward, the gradient of a mean
  squared error against a fixed target with respect to every weight;
- ``encode`` or ``decode`` (the VAE): ``config`` holds AutoencoderKLWan keyword arguments,
  ``video_shape`` the [B, 3, T, H, W] video that is encoded, ``latent_shape`` the
  [B, z_dim, F, H', W'] latents that are decoded (difforge's, given: one shape on both sides);
  each call goes through the model's own ``encode`` / ``decode`` with its frame cache, as its
  Wan pipeline calls them (their default chunks: the first frame, then 4 frames per encoder
  call; one latent frame per decoder call, as difforge's and diffusers').
It builds the model with random weights, compiles that call, prints one ``ready`` line (JSON:
the first call's seconds, jax's version), then answers each ``call`` line on stdin with one
call, blocked until done, and a ``done`` line; ``quit`` ends it.
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def transformer_call(case: dict):
    """The forward (or forward + backward) of MaxDiffusion's WanModel: a no-argument call."""
    from maxdiffusion.models.wan.transformers.transformer_wan import WanModel

    mesh = jax.make_mesh((1, 1, 1, 1), ("data", "fsdp", "context", "tensor"))
    with jax.set_mesh(mesh):
        model = WanModel(
            rngs=nnx.Rngs(0),
            mesh=mesh,
            dtype=jnp.dtype(case["dtype"]),
            weights_dtype=jnp.dtype(case["weights_dtype"]),
            **case["config"],
        )
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    batch = case["latent_shape"][0]
    latents = jnp.asarray(rng.standard_normal(case["latent_shape"], dtype=np.float32))
    text_shape = (batch, case["text_tokens"], case["config"]["text_dim"])
    text = jnp.asarray(rng.standard_normal(text_shape, dtype=np.float32))
    timestep = jnp.full((batch,), 500.0, jnp.float32)
    target = jnp.asarray(rng.standard_normal(case["latent_shape"], dtype=np.float32))
    if case["dtype"] == case["weights_dtype"]:  # one dtype throughout: inputs in it too
        latents, text = latents.astype(case["dtype"]), text.astype(case["dtype"])

    def apply(state):
        out = nnx.merge(graphdef, state)(latents, timestep, text, return_dict=False)
        return out[0] if isinstance(out, (tuple, list)) else out

    def loss(state):
        return jnp.mean((apply(state).astype(jnp.float32) - target) ** 2)

    fn = jax.jit(apply if case["mode"] == "forward" else jax.value_and_grad(loss))

    def call():
        with jax.set_mesh(mesh):
            return jax.block_until_ready(fn(state))

    return call


def vae_call(case: dict):
    """MaxDiffusion's AutoencoderKLWan encode or decode: a no-argument call."""
    from maxdiffusion.models.wan.autoencoder_kl_wan import AutoencoderKLWan, AutoencoderKLWanCache

    # the axes its VAE constrains to (its Wan pipeline's VAE mesh), auto-sharded as there
    devices = np.array(jax.devices()[:1]).reshape(1, 1)
    mesh = jax.sharding.Mesh(devices, ("redundant", "vae_spatial"))
    dtype = jnp.dtype(case["dtype"])
    config = case["config"]
    rng = np.random.default_rng(0)
    with jax.set_mesh(mesh):
        vae = AutoencoderKLWan(
            rngs=nnx.Rngs(0), mesh=mesh, dtype=dtype, weights_dtype=dtype, **config
        )
        cache = AutoencoderKLWanCache(vae)
    if case["mode"] == "encode":
        video = rng.uniform(-1, 1, case["video_shape"]).astype(np.float32)
        inputs = jnp.asarray(video, dtype)

        def run():
            return vae.encode(inputs, cache, return_dict=False)[0].mean

    else:
        latents = rng.standard_normal(case["latent_shape"], dtype=np.float32)
        inputs = jnp.asarray(latents, dtype)

        def run():
            return vae.decode(inputs, cache, return_dict=False)[0]

    def call():
        with jax.set_mesh(mesh):
            return jax.block_until_ready(run())

    return call


def main() -> None:
    case = json.loads(sys.argv[1])
    build = vae_call if case["mode"] in ("encode", "decode") else transformer_call
    call = build(case)
    started = time.perf_counter()
    call()
    ready = {"first_call_s": time.perf_counter() - started, "jax": jax.__version__}
    print("ready " + json.dumps(ready), flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        call()
        print("done", flush=True)


if __name__ == "__main__":
    main()
