"""How models compute: one ``compute`` config section for every model of a family.

train, evaluate, generate and convert all take a :class:`ComputeConfig` and hand it to every
component they build (denoiser, VAE, text encoders), so dtypes, the attention backend and the
rematerialisation policy are set in one place and checked when the config is read, before any
weights load. :data:`DTYPES` is the one name -> dtype table; :data:`REMAT_POLICIES` the one
table of rematerialisation policies.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxcore import layer_stack, quantization
from jaxcore.attention import check_backend
from jaxcore.kernels import cpu_gemm

DtypeName = Literal["float32", "bfloat16", "float16"]
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


# The name (jax.ad_checkpoint.checkpoint_name) a denoiser block gives its input, first thing
# (Wan's and Flux's blocks), for a remat policy that moves it off the device.
BLOCK_INPUT = "block_input"

# remat_policy name -> jax checkpoint policy ("none" = no remat; "full" = save nothing).
# "offload_block_inputs": full remat, each block's input moved to the host's pinned memory in
# the forward and back for the backward (MaxDiffusion's HIDDEN_STATE_WITH_OFFLOAD without its
# attention residuals: named inside the attention's shard_map, XLA keeps those on the device,
# and Wan 2.1 14B train at 720p x 81 frames, 1 clip a chip on a v5p-8, then asks 99.2 GiB a
# chip instead of 76.1). On that program (libtpu 0.0.50) it moves 3.6 GiB a chip to the host
# and saves no HBM; where XLA's host offloader takes more, it saves what it takes.
REMAT_POLICIES = {
    "none": None,
    "full": None,
    "dots_saveable": cpu_gemm.saving_products(jax.checkpoint_policies.dots_saveable),
    "dots_with_no_batch_dims_saveable": cpu_gemm.saving_products(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    ),
    "offload_block_inputs": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[BLOCK_INPUT],
        offload_src="device",
        offload_dst="pinned_host",
    ),
}


@functools.cache
def cpu_compiler_options(**options) -> dict | None:
    """``options`` (XLA debug options) when running on the CPU backend and this XLA accepts
    them, else None (another backend, or a jaxlib without one of these experimental options,
    compiles as XLA chooses). For ``jax.jit(..., compiler_options=...)``; jax refuses them on
    a jit traced inside another transformation, so only top-level programs take them."""
    if jax.default_backend() != "cpu":
        return None
    try:
        jax.jit(lambda v: v + 1, compiler_options=options).lower(1.0).compile()
    except Exception:  # noqa: BLE001 - any refusal means: compile as XLA chooses
        return None
    return dict(options)


# The training step on CPU (jaxlib 0.10, AVX-512): 512-bit vectors in XLA's own loops and
# XNNPACK for what it takes make the fwd+bwd+AdamW step 7% faster for the demo DiT (batch 32:
# 398 -> 372 ms) and 3% at the Wan bench size S (5.54 -> 5.37 s), on 2 cores, measured
# alternately call by call (the 512-bit vectors alone: no gain); other backends ignore this.
CPU_TRAIN_STEP_OPTIONS = {"xla_cpu_prefer_vector_width": 512, "xla_cpu_use_xnnpack": True}

# The training step on TPU: no "windowed einsum". XLA rewrites the FSDP weight all-gathers and
# gradient reduce-scatters around a matmul into loops of collective-permutes that overlap the
# transfer with the product; with fsdp = 8 it does so for Wan's dense layers, and the loops keep
# extra full-size activations live. Wan 2.1 1.3B train, 480x832 x 81 frames, bf16, full remat,
# 1 clip a chip, v6e-8 fsdp 8 (libtpu 0.0.50, `difforge fit`): 46.8 GiB of temporaries a chip
# with them (655 collective-permutes), 23.8 GiB without; 2 blocks: 5.62 -> 3.43 GiB.
TPU_TRAIN_STEP_OPTIONS = {
    "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
    "xla_tpu_enable_windowed_einsum_for_all_gather": False,
}


def train_step_compiler_options(platform: str) -> dict | None:
    """The train step's XLA options for ``platform`` (its mesh's devices: a TPU slice compiled
    ahead of time from a CPU host takes the TPU's), None for XLA's defaults."""
    if platform == "tpu":
        return dict(TPU_TRAIN_STEP_OPTIONS)
    if platform == "cpu":
        return cpu_compiler_options(**CPU_TRAIN_STEP_OPTIONS)
    return None


def check_remat_policy(name: str, key: str = "remat_policy") -> None:
    if name not in REMAT_POLICIES:
        raise ValueError(
            f"{key}: unknown remat_policy {name!r}; choose one of {list(REMAT_POLICIES)}"
        )


def remat_block(block_cls: type[nn.Module], policy: str) -> type[nn.Module]:
    """``block_cls`` wrapped in ``nn.remat`` for any policy but ``"none"``."""
    check_remat_policy(policy)
    if policy == "none":
        return block_cls
    return nn.remat(block_cls, policy=REMAT_POLICIES[policy], prevent_cse=True)


def run_blocks(parent: nn.Module, blocks: Sequence[nn.Module], carry, call, scan_template=None):
    """``carry`` through ``blocks`` (submodules of ``parent``) in order: ``carry = call(block,
    carry)`` for each. With ``scan_template`` (an unbound copy of the blocks, ``parent=None``,
    same class and config; ``compute.scan_layers``) the same as one ``lax.scan``, compiled once
    for any depth; while ``parent`` initialises, always the loop, which creates the parameters.

    Scanned, the blocks keep their own parameters (``blocks_0``, ``blocks_1``, ... as the
    checkpoint, LoRA and the sharding rules name them); each call stacks them along a new
    leading axis and the scan body applies ``scan_template`` to one slice. The stack is a copy of
    the blocks' weights for the length of the call (sharded as the weights are), the price of
    per-layer names. Parameters already in the stacked layout (``blocks_stacked``,
    :mod:`jaxcore.layer_stack`: how a scanned train run holds them) are sliced instead, with no
    copy, and their gradient is one stack too. ``carry`` is any pytree of arrays whose shapes
    the blocks keep.
    """
    if scan_template is None or parent.is_initializing() or not blocks:
        for block in blocks:
            carry = call(block, carry)
        return carry
    params = parent.variables["params"]
    prefix, start = layer_stack.split_block_name(blocks[0].name)
    held = params.get(layer_stack.stacked_key(prefix))
    if held is not None:
        stop = start + len(blocks)
        stacked = jax.tree.map(lambda leaf: leaf[start:stop], held)
    else:
        stacked = jax.tree.map(
            lambda *leaves: jnp.stack(leaves), *[params[block.name] for block in blocks]
        )

    def body(streams, block_params):
        return scan_template.apply({"params": block_params}, streams, method=call), None

    carry, _ = jax.lax.scan(body, carry, stacked)
    return carry


def block_stack(
    parent: nn.Module,
    block_cls,
    block_args: tuple,
    prefix: str,
    num_layers: int,
    call,
    x,
    run_stack=None,
    scan_layers: bool = False,
):
    """A transformer's one-stream block stack: ``num_layers`` blocks ``block_cls(*block_args)``
    named ``f"{prefix}{i}"`` (submodules of ``parent``, built inside its compact call), ``x``
    carried through them by :func:`run_blocks` (``call(block, h) -> h``; ``scan_layers``: as
    one ``lax.scan``). ``run_stack`` (step caching, :mod:`jaxcore.step_cache`) runs the stack
    instead, as ``run_stack((x,), run_blocks, num_layers) -> ((x,), extra)``. Returns
    ``(x, extra)``; ``extra`` is None without ``run_stack``."""
    blocks = [block_cls(*block_args, name=f"{prefix}{i}") for i in range(num_layers)]
    template = block_cls(*block_args, parent=None) if scan_layers else None

    def run_some(streams, start, stop):
        (h,) = streams
        return (run_blocks(parent, blocks[start:stop], h, call, template),)

    if run_stack is None:
        (x,) = run_some((x,), 0, num_layers)
        return x, None
    (x,), extra = run_stack((x,), run_some, num_layers)
    return x, extra


@dataclasses.dataclass(frozen=True)
class ComputeConfig:
    """Weights and activation dtypes, attention backend and remat policy of every model.

    ``attention`` is a name of ``jaxcore.attention.BACKENDS`` (default ``flash``: exact,
    memory-linear, and the faster one where measured: the Wan train step at bench size S on
    CPU, the forwards at S and M; splash on TPU, cuDNN for bf16 on GPU); ``remat_policy`` one of
    :data:`REMAT_POLICIES` (it applies to the denoiser's blocks when training).
    ``idle_expert``: where a two-expert model (Wan 2.2 A14B) keeps the weights of the expert
    that is not predicting: ``"device"`` (both experts resident; the switch is free) or
    ``"host"`` (one expert's weights on the devices at a time, swapped at the boundary).
    ``quantization``: how generate (and evaluate, scoring checkpoints as generate renders them)
    holds the denoisers' product kernels and runs their products
    (:data:`jaxcore.quantization.MODES`; ``none`` as loaded).
    """

    weights_dtype: DtypeName = "float32"
    activations_dtype: DtypeName = "float32"
    attention: str = "flash"
    remat_policy: str = "none"
    # The denoiser's repeated blocks as one lax.scan (jaxcore.compute.run_blocks): compile
    # time independent of depth; same parameters and checkpoints. Off by default: on CPU the
    # scanned step is slower (bench/compile_layers.py measures both).
    scan_layers: bool = False
    idle_expert: Literal["device", "host"] = "device"
    quantization: str = "none"

    def __post_init__(self):
        check_backend(self.attention)
        check_remat_policy(self.remat_policy)
        quantization.check_mode(self.quantization, "compute.quantization")
        if self.idle_expert not in ("device", "host"):
            raise ValueError(f"idle_expert must be 'device' or 'host', got {self.idle_expert!r}")

    def check_unquantized(self, stage: str) -> None:
        """Raise ValueError for a ``quantization`` in a stage that does not quantize (generate
        and evaluate do; training in fp8 is not built)."""
        if self.quantization != "none":
            raise ValueError(
                f"compute.quantization={self.quantization}: {stage} does not quantize "
                "(generate and evaluate do); leave it at none"
            )

    @property
    def dtype(self):
        """Activation dtype (jnp)."""
        return DTYPES[self.activations_dtype]

    @property
    def param_dtype(self):
        """Weights dtype (jnp)."""
        return DTYPES[self.weights_dtype]

    @property
    def denoiser_kwargs(self) -> dict:
        """The keyword arguments every denoiser module and its load/init functions take."""
        return {
            "dtype": self.dtype,
            "param_dtype": self.param_dtype,
            "attention": self.attention,
            "remat_policy": self.remat_policy,
            "scan_layers": self.scan_layers,
        }
