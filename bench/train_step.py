"""Benchmark 2: one training step (forward + backward + AdamW) of the Wan transformer.

Uses the train stage's own step (``stages.train.trainer.make_train_step``: flow-matching loss
with shifted timesteps, AdamW, donated buffers) on a one-device mesh, so the figure is the
step ``difforge train`` runs. MFU = 3 x ``flops_per_forward`` / step time / the matmul limit
(added by ``bench.run``); throughput in video tokens per second.
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

from bench.common import BenchContext, block, time_calls, timed_record
from bench.transformer import BENCH_M, BENCH_S, TINY, WAN_1_3B_480P, ForwardCase, video_tokens
from jaxcore import families, sharding
from jaxcore.compute import ComputeConfig
from jaxcore.families import TensorSpec
from jaxcore.models import wan_transformer as wan
from stages.common import records
from stages.common.data import replicated
from stages.common.objective import ObjectiveSection
from stages.train import trainer
from stages.train.config import OptimizerSection

log = logging.getLogger(__name__)

BENCH = "train_step"
CASES = {"smoke": (TINY,), "quick": (BENCH_S,), "full": (BENCH_S, BENCH_M)}
ACCELERATOR_CASES = {"smoke": (TINY,), "quick": (BENCH_S,), "full": (BENCH_S, WAN_1_3B_480P)}


def cases_for(ctx: BenchContext) -> tuple[ForwardCase, ...]:
    return (ACCELERATOR_CASES if ctx.on_accelerator else CASES)[ctx.profile]


def build_step(config: wan.WanTransformerConfig, features, remat_policy: str = "none"):
    """(step, params, opt_state) of the train stage on a mesh of the first device."""
    family = families.get("wan")
    mesh = sharding.make_mesh(sharding.MeshConfig(), devices=jax.devices()[:1])
    compute = ComputeConfig(remat_policy=remat_policy)
    with sharding.mesh_context(mesh):
        module, params = family.init_denoiser(config, jax.random.key(0), compute, mesh)
    param_shardings = jax.tree.map(lambda _: replicated(mesh), params)
    tx, schedule = trainer.make_optimizer(OptimizerSection(), total_steps=1000)
    opt_shardings = trainer.opt_state_shardings(tx, params, param_shardings, mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    step = trainer.make_train_step(
        family,
        module,
        tx,
        schedule,
        ObjectiveSection(),
        mesh,
        param_shardings,
        opt_shardings,
        features,
        seed=0,
    )
    return step, params, opt_state


def run_case(ctx: BenchContext, case: ForwardCase) -> dict:
    config = case.config()
    features = (
        TensorSpec(records.LATENTS, tuple(case.latent_shape[1:])),
        TensorSpec("encoder_hidden_states", (case.text_tokens, config.text_dim)),
    )
    step, params, opt_state = build_step(config, features)
    rng = np.random.default_rng(0)
    batch = {
        f.name: rng.standard_normal((case.latent_shape[0], *f.shape), dtype=np.float32)
        for f in features
    }
    state = {"params": params, "opt_state": opt_state, "step": 0, "loss": None}

    def one_step():
        # params and opt_state are donated: carry the new ones forward every call.
        new_params, new_opt, metrics = step(
            state["params"], state["opt_state"], batch, state["step"]
        )
        block(metrics["loss"])
        state.update(
            params=new_params,
            opt_state=new_opt,
            step=state["step"] + 1,
            loss=float(metrics["loss"]),
        )

    started = time.perf_counter()
    one_step()
    first = time.perf_counter() - started
    times, _ = time_calls(one_step, reps=ctx.reps, warmup=max(ctx.warmup - 1, 0))
    tokens = video_tokens(config, case.latent_shape)
    flops = 3 * wan.flops_per_forward(
        config, case.latent_shape[0], tokens // case.latent_shape[0], case.text_tokens
    )
    return timed_record(
        BENCH,
        case.name,
        "difforge",
        times,
        flops=flops,
        items=tokens,
        item_unit="video tokens",
        first_call_s=first,
        last_loss=state["loss"],
        step_source="stages.train.trainer.make_train_step",
        remat_policy="none",
    )


def run(ctx: BenchContext) -> list[dict]:
    out = []
    for case in cases_for(ctx):
        log.info("train step: case %s", case.name)
        out.append(run_case(ctx, case))
    return out
