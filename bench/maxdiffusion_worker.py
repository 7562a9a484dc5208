"""MaxDiffusion's Wan transformer, timed one call at a time for ``bench/vs_maxdiffusion.py``.

Runs under MaxDiffusion's own Python (it needs Python >= 3.12 and its own packages) with its
``src`` folder on ``PYTHONPATH``; imports nothing of difforge. Argument: a JSON case
(``config``: WanModel keyword arguments; ``dtype`` / ``weights_dtype``: activations and
weights; ``latent_shape``, ``text_tokens``; ``mode``: ``forward``, or ``train``: the forward and
backward, the gradient of a mean squared error against a fixed target with respect to every
weight). It builds the model with random weights, compiles that call, prints one ``ready`` line
(JSON: the first call's seconds, jax's version), then answers each ``call`` line on stdin with
one call, blocked until done, and a ``done`` line; ``quit`` ends it.
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def main() -> None:
    from maxdiffusion.models.wan.transformers.transformer_wan import WanModel

    case = json.loads(sys.argv[1])
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
        started = time.perf_counter()
        jax.block_until_ready(fn(state))
        ready = {"first_call_s": time.perf_counter() - started, "jax": jax.__version__}
        print("ready " + json.dumps(ready), flush=True)
        for line in sys.stdin:
            if line.strip() == "quit":
                break
            jax.block_until_ready(fn(state))
            print("done", flush=True)


if __name__ == "__main__":
    main()
