"""MaxDiffusion's Wan transformer, timed one call at a time for ``bench/vs_maxdiffusion.py``.

Runs under MaxDiffusion's own Python (it needs Python >= 3.12 and its own packages) with its
``src`` folder on ``PYTHONPATH``; imports nothing of difforge. Argument: a JSON case
(``config``: WanModel keyword arguments, ``latent_shape``, ``text_tokens``). It builds the model
with random weights, compiles the forward and the forward + backward (the gradient of a mean
squared error against a fixed target, with respect to every weight), prints one ``ready`` line
(JSON: compile seconds, output shape), then answers each ``forward`` / ``backward`` line on
stdin with one call, blocked until done, and a ``done`` line; ``quit`` ends it.
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
        model = WanModel(rngs=nnx.Rngs(0), mesh=mesh, **case["config"])
        graphdef, state = nnx.split(model)
        rng = np.random.default_rng(0)
        latents = jnp.asarray(rng.standard_normal(case["latent_shape"], dtype=np.float32))
        text_shape = (case["latent_shape"][0], case["text_tokens"], case["config"]["text_dim"])
        text = jnp.asarray(rng.standard_normal(text_shape, dtype=np.float32))
        timestep = jnp.full((case["latent_shape"][0],), 500.0, jnp.float32)
        target = jnp.asarray(rng.standard_normal(case["latent_shape"], dtype=np.float32))

        def apply(state):
            out = nnx.merge(graphdef, state)(latents, timestep, text, return_dict=False)
            return out[0] if isinstance(out, (tuple, list)) else out

        forward = jax.jit(apply)
        backward = jax.jit(jax.value_and_grad(lambda state: jnp.mean((apply(state) - target) ** 2)))
        started = time.perf_counter()
        out = jax.block_until_ready(forward(state))
        forward_compile = time.perf_counter() - started
        started = time.perf_counter()
        jax.block_until_ready(backward(state))
        backward_compile = time.perf_counter() - started
        calls = {
            "forward": lambda: jax.block_until_ready(forward(state)),
            "backward": lambda: jax.block_until_ready(backward(state)),
        }
        ready = {
            "forward_first_call_s": forward_compile,
            "backward_first_call_s": backward_compile,
            "output_shape": list(out.shape),
            "jax": jax.__version__,
        }
        print("ready " + json.dumps(ready), flush=True)
        for line in sys.stdin:
            command = line.strip()
            if command == "quit":
                break
            calls[command]()
            print("done", flush=True)


if __name__ == "__main__":
    main()
