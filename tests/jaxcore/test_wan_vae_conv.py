"""The Wan VAE's conv formulations vs the plain ones they replace (fp32, CPU).

``_time_valid_conv`` (a 3-D conv as one 2-D conv per time tap, or with the taps stacked on
channels for few channels) must equal XLA's 3-D conv, and ``_nearest_up2_conv`` (nearest 2x
upsampling folded into a 2x2 sub-pixel conv) must equal upsample-then-conv; odd and
non-square sizes, batch 2. The model-level parity with diffusers is in test_wan_vae.py /
test_wan_vae22.py, whose tiny models have few channels (stacked taps); the per-tap path of
real widths is forced here in one non-square, odd-latent-size model case.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcore import compute
from jaxcore.models import wan_vae
from tests.support import wan_vae_reference as ref

# Summation order only (fp32, values ~1-10): reached <= 2e-6.
ATOL = 1e-5
TINY = {
    "base_dim": 8,
    "z_dim": 4,
    "dim_mult": [1, 2],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [True],
    "latents_mean": [0.0] * 4,
    "latents_std": [1.0] * 4,
}


def _random(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _conv3d(x, kernel, bias, strides, pad_hw):
    y = jax.lax.conv_general_dilated(
        x, kernel, strides, [(0, 0), *pad_hw], dimension_numbers=("NDHWC", "DHWIO", "NDHWC")
    )
    return y + bias


@pytest.fixture(params=["per_tap", "stacked"])
def tap_path(request, monkeypatch):
    """Run a test with each of _time_valid_conv's two paths, whatever the channel count."""
    limit = 0 if request.param == "per_tap" else 1 << 20
    monkeypatch.setattr(wan_vae, "STACK_TAPS_MAX_CHANNELS", limit)
    wan_vae._chunk_step.cache_clear()  # steps traced under another limit
    yield request.param
    wan_vae._chunk_step.cache_clear()


def _count_convs(fn, *args) -> int:
    eqns = jax.make_jaxpr(fn)(*args).eqns
    return sum(e.primitive.name in ("conv_general_dilated", "dot_general") for e in eqns)


@pytest.mark.parametrize(
    ("x_shape", "kernel_size", "strides", "pad"),
    [
        ((2, 6, 5, 7, 3), (3, 3, 3), (1, 1, 1), 1),  # the causal 3x3x3 conv, 4 frames + context
        ((1, 3, 9, 4, 5), (3, 3, 3), (1, 1, 1), 1),  # 1 frame + context
        ((2, 5, 3, 4, 6), (3, 1, 1), (2, 1, 1), 0),  # downsample3d's time conv: stride 2
        ((2, 4, 3, 5, 6), (3, 1, 1), (1, 1, 1), 0),  # upsample3d's time conv
        ((2, 3, 5, 3, 4), (1, 1, 1), (1, 1, 1), 0),  # 1x1x1 shortcut: a matmul
    ],
)
def test_time_valid_conv_matches_conv3d(x_shape, kernel_size, strides, pad, tap_path):
    x = _random(x_shape, 0)
    kernel = _random((*kernel_size, x_shape[-1], 4), 1) * 0.3
    bias = _random((4,), 2)
    pad_hw = ((pad, pad), (pad, pad))

    got = wan_vae._time_valid_conv(x, kernel, bias, strides, pad_hw, 0, jnp.float32)
    expected = _conv3d(x, kernel, bias, strides, pad_hw)

    assert got.shape == expected.shape
    assert ref.max_err(got, np.asarray(expected)) < ATOL


@pytest.mark.parametrize("frames", [1, 4])
def test_zero_context_taps_are_skipped_exactly(frames, tap_path):
    """A fresh cache is zeros: the taps that read only zeros are left out, same result."""
    x = _random((2, frames, 5, 6, 3), 3)
    kernel = _random((3, 3, 3, 3, 4), 4) * 0.3
    bias = _random((4,), 5)
    padded = jnp.concatenate([jnp.zeros((2, 2, 5, 6, 3)), x], axis=1)
    pad_hw = ((1, 1), (1, 1))

    def conv(x_, zero_frames):
        return wan_vae._time_valid_conv(
            x_, kernel, bias, (1,) * 3, pad_hw, zero_frames, jnp.float32
        )

    skipped = conv(padded, 2)
    expected = _conv3d(padded, kernel, bias, (1, 1, 1), pad_hw)

    assert ref.max_err(skipped, np.asarray(expected)) < ATOL
    # One frame after 2 zero frames needs only the last tap; longer chunks need all three,
    # as three convs or one on stacked taps.
    all_taps = 3 if tap_path == "per_tap" else 1
    assert _count_convs(lambda x_: conv(x_, 2), padded) == (1 if frames == 1 else all_taps)
    assert _count_convs(lambda x_: conv(x_, 0), padded) == all_taps


@pytest.mark.parametrize(
    ("shape", "out"), [((2, 5, 7, 6), 4), ((1, 1, 1, 3), 5), ((1, 4, 4, 8), 8)]
)
def test_nearest_up2_conv_matches_upsample_then_conv(shape, out):
    x = _random(shape, 6)
    kernel = _random((3, 3, shape[-1], out), 7) * 0.3
    bias = _random((out,), 8)
    upsampled = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)

    got = wan_vae._nearest_up2_conv(x, kernel, bias, jnp.float32)
    expected = wan_vae._conv(upsampled, kernel, bias, (1, 1), [(1, 1), (1, 1)], jnp.float32)

    assert got.shape == (shape[0], 2 * shape[1], 2 * shape[2], out)
    assert ref.max_err(got, np.asarray(expected)) < ATOL


def test_nearest_up2_conv_refuses_other_geometries():
    module = wan_vae.Conv2d(4, strides=(2, 2), nearest_up2=True)
    with pytest.raises(ValueError, match="nearest_up2"):
        module.init(jax.random.key(0), jnp.zeros((1, 4, 4, 3)))


def test_non_square_odd_latents_batch_two_match_diffusers(tmp_path, tap_path):
    """Odd latent sizes (7 x 11) through every reformulated conv, both directions."""
    model = ref.save_reference(tmp_path, TINY, seed=9)
    module, params = wan_vae.load_wan_vae(tmp_path)
    video = ref.video((2, 3, 5, 14, 22), seed=9)
    ref.assert_matches_reference(model, module, params, video, (2, 4, 3, 7, 11), 10, ATOL)


def test_cpu_compiler_options_are_accepted_here():
    """On CPU the chunk steps compile convs outside YNNPACK (the option must be one this XLA
    takes, or the chunk steps silently compile as before)."""
    assert compute.cpu_compiler_options(**wan_vae.CPU_COMPILER_OPTIONS) == (
        wan_vae.CPU_COMPILER_OPTIONS
    )


def test_encode_and_decode_run_inside_other_transformations(tmp_path):
    """The top-level chunk steps carry compiler options, which jax refuses on a nested jit:
    under jax.jit / eval_shape the steps are compiled without them."""
    ref.save_reference(tmp_path, TINY)
    module, params = wan_vae.load_wan_vae(tmp_path)
    video = jnp.asarray(ref.video((1, 3, 5, 8, 8), seed=14))
    z = wan_vae.encode(module, params, video).mean

    shape = jax.eval_shape(lambda v: wan_vae.encode(module, params, v).mean, video)
    decoded = jax.jit(lambda z_: wan_vae.decode(module, params, z_))(z)

    assert shape.shape == z.shape
    assert ref.max_err(decoded, np.asarray(wan_vae.decode(module, params, z))) < 1e-6
