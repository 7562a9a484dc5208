"""LTX-2 vocoders vs diffusers' LTX2Vocoder / LTX2VocoderWithBWE (tiny random models, fp32).

Every diffusers parameter is perturbed, and so are the persistent buffers (the anti-alias
``filter`` taps and the MelSTFT bases, which diffusers initialises to zeros), before
save_pretrained: our side must read them from the checkpoint, not recompute them. Our side
loads the saved directory through :func:`ltx2_vocoder.load_ltx2_vocoder`.
"""

import jax
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLLTX2Audio
from diffusers.pipelines.ltx2.vocoder import (
    LTX2Vocoder,
    LTX2VocoderWithBWE,
    UpSample1d,
    kaiser_sinc_filter1d,
)

from jaxcore import weights
from jaxcore.models import ltx2_audio_vae as lav
from jaxcore.models import ltx2_vocoder as voc

# fp32 on CPU, highest matmul precision (conftest); relative to the reference's max |value|.
RTOL = 1e-5

# (a) LTX-2.0-style HiFi-GAN: leaky ReLU (non-default slope), tanh; a transposed conv whose
# k - stride is odd (2 T + 1 samples) and blocks with different dilation counts.
V20 = dict(
    in_channels=16,
    hidden_channels=32,
    out_channels=2,
    upsample_kernel_sizes=(7, 5),
    upsample_factors=(3, 2),
    resnet_kernel_sizes=(3, 5),
    resnet_dilations=((1, 2), (1, 3, 5)),
    act_fn="leaky_relu",
    leaky_relu_negative_slope=0.2,
    final_act_fn="tanh",
    final_bias=True,
)
# (b) LTX-2.3-style BigVGAN generator: anti-aliased SnakeBeta (non-default filter length),
# no final activation, no conv_out bias.
V23 = dict(
    V20,
    upsample_kernel_sizes=(7, 4),
    act_fn="snakebeta",
    antialias=True,
    antialias_kernel_size=8,
    final_act_fn=None,
    final_bias=False,
)
# (c) plain snake (alpha only) without anti-aliasing in the blocks, clamp at the end; the
# head is still diffusers' anti-aliased SnakeBeta (ratio 3 here). An even block kernel
# (torch's "same" pads it one more on the right) and a width that halves unevenly (30, 15, 7).
SNAKE = dict(
    V23,
    hidden_channels=30,
    resnet_kernel_sizes=(3, 4),
    act_fn="snake",
    antialias=False,
    antialias_ratio=3,
    final_act_fn="clamp",
)
CONFIGS = {"v20": V20, "v23": V23, "snake": SNAKE}

# LTX2VocoderWithBWE, shrunk with its invariants: stage 1 gives 2 T + 1 samples per 16 kHz
# (so the hop padding runs), bwe_in_channels = out_channels * num_mel_channels, and
# prod(bwe_upsample_factors) = (48 / 16) * hop_length.
BWE = dict(
    in_channels=16,
    hidden_channels=32,
    out_channels=2,
    upsample_kernel_sizes=(11, 5),
    upsample_factors=(5, 2),
    resnet_kernel_sizes=(3, 5),
    resnet_dilations=((1, 3), (1, 2)),
    antialias_kernel_size=8,
    bwe_in_channels=12,
    bwe_hidden_channels=16,
    bwe_out_channels=2,
    bwe_upsample_kernel_sizes=(11, 7, 4),
    bwe_upsample_factors=(5, 3, 2),
    bwe_resnet_kernel_sizes=(3,),
    bwe_resnet_dilations=((1, 2),),
    filter_length=32,
    hop_length=10,
    window_length=32,
    num_mel_channels=6,
    input_sampling_rate=16000,
    output_sampling_rate=48000,
)


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and persistent buffer moved off its init (bases: random, mel_basis
    non-negative as a filterbank)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.3 if name.endswith((".alpha", ".beta")) else 0.05
            param.add_(scale * torch.randn_like(param))
        for name, buf in model.state_dict().items():
            if name.endswith(".filter"):
                buf.add_(0.01 * torch.randn_like(buf))
            elif name.endswith("_basis") and name.endswith("mel_basis"):
                buf.copy_(0.2 * torch.rand_like(buf))
            elif name.endswith("_basis"):
                buf.copy_(0.3 * torch.randn_like(buf))


def rel_err(got, expected) -> float:
    got = np.asarray(got)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def mel(shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(size=shape).astype(np.float32)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_vocoder_waveform_matches_diffusers(tmp_path, name):
    model = LTX2Vocoder(**CONFIGS[name]).eval()
    perturb(model, seed=0)
    model.save_pretrained(tmp_path)
    module, params = voc.load_ltx2_vocoder(tmp_path)
    assert isinstance(module, voc.LTX2Vocoder)
    x = mel((2, 2, 7, 8), seed=1)  # [B, C, T, M], C * M = in_channels, odd T
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    got = voc.vocode(module, params, x)
    assert got.shape == (2, 2, voc.output_samples(module.config, 7))
    assert rel_err(got, ref) < RTOL  # REACHED <= 1e-6


def test_bwe_vocoder_waveform_matches_diffusers(tmp_path):
    model = LTX2VocoderWithBWE(**BWE).eval()
    perturb(model, seed=2)
    model.save_pretrained(tmp_path)
    module, params = voc.load_ltx2_vocoder(tmp_path)
    assert isinstance(module, voc.LTX2VocoderWithBWE)
    x = mel((2, 2, 5, 8), seed=3)
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
        stage1 = model.vocoder(torch.from_numpy(x)).numpy()
    assert stage1.shape[-1] % BWE["hop_length"]  # the zero padding to a hop multiple runs
    got = voc.vocode(module, params, x)
    assert got.shape == (2, 2, voc.output_samples(module.config, 5))
    assert 0.0 < np.abs(ref).max() <= 1.0
    assert rel_err(got, ref) < RTOL


def test_audio_vae_decode_then_vocoder_is_the_pipelines_chain(tmp_path):
    """LTX2Pipeline: ``vocoder(audio_vae.decode(z))`` with mel [B, 2, 4 L - 3, mel_bins]."""
    vae_cfg = dict(
        base_channels=8,
        output_channels=2,
        ch_mult=(1, 2, 2),
        num_res_blocks=1,
        latent_channels=2,
        mel_bins=8,
    )
    torch.manual_seed(4)
    vae = AutoencoderKLLTX2Audio(**vae_cfg).eval()
    perturb(vae, seed=4)
    vae.save_pretrained(tmp_path / "audio_vae")
    vocoder = LTX2Vocoder(**V20).eval()
    perturb(vocoder, seed=5)
    vocoder.save_pretrained(tmp_path / "vocoder")
    z = mel((1, 2, 3, 2), seed=6)
    with torch.no_grad():
        ref = vocoder(vae.decode(torch.from_numpy(z), return_dict=False)[0]).numpy()
    vae_module, vae_params = lav.load_ltx2_audio_vae(tmp_path / "audio_vae")
    voc_module, voc_params = voc.load_ltx2_vocoder(tmp_path / "vocoder")
    decoded = lav.decode(vae_module, vae_params, z)
    assert decoded.shape == (1, 2, 4 * 3 - 3, 8)
    assert rel_err(voc.vocode(voc_module, voc_params, decoded), ref) < RTOL


@pytest.mark.parametrize(
    "cutoff, half_width, size", [(0.25, 0.3, 12), (1 / 6, 0.2, 8), (0.2, 0.1, 9)]
)
def test_kaiser_filter_equals_diffusers(cutoff, half_width, size):
    ref = kaiser_sinc_filter1d(cutoff, half_width, size).numpy()
    np.testing.assert_allclose(voc.kaiser_sinc_filter(cutoff, half_width, size), ref, atol=1e-7)


@pytest.mark.parametrize("ratio", [2, 3])
def test_hann_resampler_filter_equals_diffusers(ratio):
    ref = UpSample1d(ratio=ratio, window_type="hann").filter.reshape(-1).numpy()
    np.testing.assert_allclose(voc.hann_sinc_filter(ratio), ref, atol=1e-7)


@pytest.mark.parametrize("release", ["ltx2.0", "ltx2.3"])
def test_parameter_counts_of_the_released_configs_equal_diffusers(release):
    """LTX-2.0: LTX2Vocoder's defaults (= diffusers scripts/convert_ltx2_to_diffusers.py,
    get_ltx2_vocoder_config("2.0")); LTX-2.3: LTX2VocoderWithBWE's defaults (its docstring:
    the LTX-2.X vocoder). Ours from eval_shape, diffusers' on the meta device."""
    with torch.device("meta"):
        model = LTX2Vocoder() if release == "ltx2.0" else LTX2VocoderWithBWE()
    config = voc.LTX2VocoderConfig() if release == "ltx2.0" else voc.LTX2VocoderWithBWEConfig()
    expected = sum(p.numel() for p in model.parameters())
    assert voc.count_params(config) == expected
    persistent = sum(b.numel() for b in model.state_dict().values()) - expected
    if release == "ltx2.3":  # CausalSTFT.inverse_basis: in the file, never read
        persistent -= model.mel_stft.stft_fn.inverse_basis.numel()
    assert voc.count_params(config, include_buffers=True) == expected + persistent


def test_weight_maps_name_every_checkpoint_key():
    model = LTX2VocoderWithBWE(**BWE)
    keys = {src for src, _ in voc.weight_map(voc.LTX2VocoderWithBWEConfig(**BWE)).values()}
    assert keys == set(model.state_dict()) - {"mel_stft.stft_fn.inverse_basis"}
    model = LTX2Vocoder(**V23)
    assert {src for src, _ in voc.weight_map(voc.LTX2VocoderConfig(**V23)).values()} == set(
        model.state_dict()
    )


def test_configs_from_json_and_released_defaults():
    v20 = LTX2Vocoder()
    assert voc.LTX2VocoderConfig.from_dict(dict(v20.config)) == voc.LTX2VocoderConfig()
    v23 = voc.LTX2VocoderWithBWEConfig.from_dict(dict(LTX2VocoderWithBWE(**BWE).config))
    assert v23 == voc.LTX2VocoderWithBWEConfig(**BWE)
    assert v23.vocoder.output_sampling_rate == 16000 and v23.bwe.in_channels == 12
    released = voc.LTX2VocoderWithBWEConfig()
    # 100 mel frames / s -> 16 kHz (x160) -> 48 kHz.
    assert released.vocoder.upsample_factor == 160 and released.resample_ratio == 3
    assert voc.output_samples(voc.LTX2VocoderConfig(), 501) == 501 * 240


def test_init_uses_the_diffusers_starting_values():
    """Random init: the anti-alias filters are their Kaiser taps, snake parameters 0 (exp: 1),
    as diffusers' constructor leaves them; the module then runs."""
    cfg = voc.LTX2VocoderConfig(**V23)
    module, params = voc.init_ltx2_vocoder(cfg, jax.random.key(0))
    act = params["generator"]["resnets_0"]["acts1_0"]
    np.testing.assert_allclose(
        act["upsample"]["filter"], kaiser_sinc_filter1d(0.25, 0.3, 8).numpy(), atol=1e-7
    )
    np.testing.assert_array_equal(act["act"]["alpha"], np.zeros(16))
    wave = voc.vocode(module, params, mel((1, 2, 3, 8), seed=0))
    assert wave.shape == (1, 2, voc.output_samples(cfg, 3)) and np.isfinite(wave).all()


@pytest.mark.parametrize(
    "cls, change, message",
    [
        (voc.LTX2VocoderConfig, dict(antialias=True), "nests"),
        (voc.LTX2VocoderConfig, dict(upsample_factors=(6, 5)), "upsample_factors"),
        (voc.LTX2VocoderConfig, dict(act_fn="gelu"), "act_fn"),
        (voc.LTX2VocoderConfig, dict(final_act_fn="sigmoid"), "final_act_fn"),
        (voc.LTX2VocoderWithBWEConfig, dict(hop_length=100), "bwe_upsample_factors"),
        (voc.LTX2VocoderWithBWEConfig, dict(bwe_act_fn="relu"), "bwe_act_fn"),
        (voc.LTX2VocoderWithBWEConfig, dict(filter_length=256), "window_length"),
    ],
)
def test_bad_config_is_an_error_naming_the_key(cls, change, message):
    with pytest.raises(voc.LTX2VocoderConfigError, match=message):
        cls(**change)


def test_loader_and_input_errors(tmp_path):
    (tmp_path / "config.json").write_text('{"_class_name": "HifiGan"}')
    with pytest.raises(weights.WeightsError, match="HifiGan"):
        voc.load_ltx2_vocoder(tmp_path)
    with pytest.raises(ValueError, match="in_channels = 16"):
        voc.check_mel(16, (1, 2, 5, 7))
