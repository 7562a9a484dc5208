"""Benchmark 2: one training step (forward + backward + AdamW) of the Wan transformer.

Uses the train stage's own step (``stages.train.trainer.make_train_step``: flow-matching loss
with shifted timesteps, AdamW, donated buffers) on a one-device mesh, so the figure is the
step ``difforge train`` runs. On CPU every case is timed alternately, call by call, with
PyTorch (diffusers' ``WanTransformer3DModel`` of the same config, the same flow-matching step
with torch's AdamW and clipping), eager and, at S and M, with the model under torch.compile.
MFU = 3 x ``flops_per_forward`` / step time / the matmul limit (added by ``bench.run``);
throughput in video tokens per second.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from bench.common import (
    BenchContext,
    block,
    interleaved_times,
    set_torch_threads,
    time_calls,
    timed_record,
)
from bench.transformer import BENCH_M, BENCH_S, TINY, WAN_1_3B_480P, ForwardCase, video_tokens
from jaxcore import families, sharding
from jaxcore.compute import ComputeConfig
from jaxcore.families import TensorSpec
from jaxcore.layer_stack import LayerStack
from jaxcore.models import wan_transformer as wan
from stages.common import records
from stages.common.data import replicated
from stages.common.objective import ObjectiveSection
from stages.train import trainer
from stages.train.config import OptimizerSection

log = logging.getLogger(__name__)

BENCH = "train_step"
# The CPU demo's DiT (`make demo`): batch 32 of 64 tokens; its step time decides how many
# images the demo's training sees in its budget.
DEMO = ForwardCase("demo b32", "configs/models/wan_demo.yml", (32, 4, 1, 16, 16), 16)
# mixed precision: float32 weights and AdamW state, bf16 activations (MaxDiffusion's and the
# diffusers training scripts' --mixed_precision=bf16, i.e. torch.autocast on the PyTorch side)
BENCH_S_MIXED = dataclasses.replace(BENCH_S, name="S-bf16-mixed", dtype="bfloat16")
BENCH_M_MIXED = dataclasses.replace(BENCH_M, name="M-bf16-mixed", dtype="bfloat16")
CASES = {
    "smoke": (TINY,),
    "quick": (DEMO, BENCH_S),
    "full": (DEMO, BENCH_S, BENCH_M, BENCH_S_MIXED, BENCH_M_MIXED),
}
# cases also timed against torch.compile (the S and M, fp32 and bf16; compiling the
# model's forward and backward takes ~45-55 s a case here)
COMPILED_CASES = {"S", "M", "S-bf16-mixed", "M-bf16-mixed"}
ACCELERATOR_CASES = {"smoke": (TINY,), "quick": (BENCH_S,), "full": (BENCH_S, WAN_1_3B_480P)}


def cases_for(ctx: BenchContext) -> tuple[ForwardCase, ...]:
    return (ACCELERATOR_CASES if ctx.on_accelerator else CASES)[ctx.profile]


def build_step(config: wan.WanTransformerConfig, features, compute: ComputeConfig | None = None):
    """(step, params, opt_state) of the train stage on a mesh of the first device."""
    family = families.get("wan")
    mesh = sharding.make_mesh(sharding.MeshConfig(), devices=jax.devices()[:1])
    compute = compute or ComputeConfig()
    with sharding.mesh_context(mesh):
        module, params = family.init_denoiser(config, jax.random.key(0), compute, mesh)
    layers = LayerStack.of(module, params)  # with scan_layers: the train stage's stacked layout
    if layers is not None:
        params = layers.stack(params)
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


def step_inputs(case: ForwardCase, config: wan.WanTransformerConfig):
    """(features, batch): the train step's record features for this case and a random batch."""
    features = (
        TensorSpec(records.LATENTS, tuple(case.latent_shape[1:])),
        TensorSpec("encoder_hidden_states", (case.text_tokens, config.text_dim)),
    )
    rng = np.random.default_rng(0)
    batch = {
        f.name: rng.standard_normal((case.latent_shape[0], *f.shape), dtype=np.float32)
        for f in features
    }
    return features, batch


def _difforge_step(case: ForwardCase, compute: ComputeConfig | None = None):
    """(one_step(), state) of the train stage's step on this case's shapes (a bf16 case:
    bf16 activations, float32 weights)."""
    config = case.config()
    features, batch = step_inputs(case, config)
    if compute is None and case.dtype == "bfloat16":
        compute = ComputeConfig(activations_dtype="bfloat16")
    step, params, opt_state = build_step(config, features, compute)
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

    return one_step, state


def _step_flops_and_tokens(case: ForwardCase) -> tuple[float, int]:
    config = case.config()
    tokens = video_tokens(config, case.latent_shape)
    flops = 3 * wan.flops_per_forward(
        config, case.latent_shape[0], tokens // case.latent_shape[0], case.text_tokens
    )
    return flops, tokens


def run_case(ctx: BenchContext, case: ForwardCase) -> dict:
    one_step, state = _difforge_step(case)
    started = time.perf_counter()
    one_step()
    first = time.perf_counter() - started
    times, _ = time_calls(one_step, reps=ctx.reps, warmup=max(ctx.warmup - 1, 0))
    flops, tokens = _step_flops_and_tokens(case)
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


def _torch_step(case: ForwardCase, compiled: bool = False):
    """diffusers' WanTransformer3DModel of the same config, one flow-matching step with
    torch's AdamW and gradient clipping (as the train stage's defaults), eager, or with the
    model under ``torch.compile`` (its forward and, through AOTAutograd, its backward; the
    optimizer eager, as the diffusers training scripts run it); a bf16 case runs the forward
    and loss under ``torch.autocast(bfloat16)`` (float32 weights)."""
    import torch
    from diffusers import WanTransformer3DModel

    set_torch_threads()
    config = case.config()
    torch.manual_seed(0)
    model = WanTransformer3DModel(**config.to_dict()).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    forward = torch.compile(model) if compiled else model
    generator = torch.Generator().manual_seed(0)
    batch = case.latent_shape[0]
    latents = torch.randn(case.latent_shape, generator=generator)
    text = torch.randn((batch, case.text_tokens, config.text_dim), generator=generator)

    def one_step():
        noise = torch.randn(latents.shape, generator=generator)
        sigma = torch.rand((batch,), generator=generator)
        noisy = (1 - sigma[:, None, None, None, None]) * latents + sigma[
            :, None, None, None, None
        ] * noise
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.dtype == "bfloat16"):
            out = forward(noisy, sigma * 1000, text, return_dict=False)[0]
        loss = torch.mean((out.float() - (noise - latents)) ** 2)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return one_step


def run_alternating(ctx: BenchContext, case: ForwardCase) -> list[dict]:
    """difforge's step and PyTorch's, timed call by call in turn
    (:func:`bench.common.interleaved_times`): this VM's speed drifts by 20-30% within an hour,
    which one side timed after the other would read as a ratio."""
    ours, state = _difforge_step(case)
    calls = {"difforge": ours, "pytorch eager": _torch_step(case)}
    if case.name in COMPILED_CASES and ctx.profile != "smoke":
        calls["pytorch compile"] = _torch_step(case, compiled=True)
    firsts = {}
    for name, fn in calls.items():
        started = time.perf_counter()
        fn()
        firsts[name] = time.perf_counter() - started
    times = interleaved_times(calls, reps=max(ctx.reps, 5), warmup=max(ctx.warmup - 1, 0))
    flops, tokens = _step_flops_and_tokens(case)
    return [
        timed_record(
            BENCH,
            case.name,
            name,
            times[name],
            flops=flops,
            items=tokens,
            item_unit="video tokens",
            first_call_s=firsts[name],
            timing="alternating call by call",
            **({"last_loss": state["loss"]} if name == "difforge" else {}),
        )
        for name in times
    ]


def run(ctx: BenchContext) -> list[dict]:
    out = []
    for case in cases_for(ctx):
        log.info("train step: case %s", case.name)
        if not ctx.on_accelerator:
            out.extend(run_alternating(ctx, case))
        else:
            out.append(run_case(ctx, case))
    return out
