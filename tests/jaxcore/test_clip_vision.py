"""CLIP vision encoder and image preprocessing vs transformers (and diffusers' Wan I2V use).

Random tiny models with every parameter perturbed, saved with save_pretrained, loaded by our
loader, compared in fp32: every hidden state (hidden_states[-2] is Wan 2.1 I2V's image context),
last_hidden_state, pooler_output, image_embeds. The preprocessing is compared with transformers'
PIL backend, which ``CLIPImageProcessor`` is in this environment (no torchvision).
"""

import functools
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest
import torch
import transformers

from jaxcore import sharding, weights
from jaxcore.models import clip_image_processor as cip
from jaxcore.models import clip_vision

# fp32 on CPU with highest matmul precision (conftest); reached 1.7e-6 max abs over every
# output (|out| ~5), also with interpolated position embeddings; 6.7e-6 at ViT-H widths (1280,
# 16 heads, 224 px, 3 layers; checked once, not a test: 2.5 GB of weights at 32 layers).
ATOL = 1e-5

# 10x10 patches of 3 px, quick_gelu (OpenAI CLIP's activation).
TINY_QUICK_GELU = dict(
    hidden_size=32,
    intermediate_size=37,
    projection_dim=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=30,
    patch_size=3,
    hidden_act="quick_gelu",
)
# Exact gelu (Wan's ViT-H/14), 3 heads of 8, a patch that does not divide the image (28 px in
# 5 px patches: the convolution drops the last 3 px), eps 1e-6.
ODD_GELU = dict(
    hidden_size=24,
    intermediate_size=40,
    projection_dim=7,
    num_hidden_layers=3,
    num_attention_heads=3,
    image_size=28,
    patch_size=5,
    hidden_act="gelu",
    layer_norm_eps=1e-6,
)
# Wan 2.1 I2V's image_encoder: OpenCLIP ViT-H/14 (laion/CLIP-ViT-H-14-laion2B-s32B-b79K's
# vision tower, saved by diffusers' convert_wan_to_diffusers.py as a
# CLIPVisionModelWithProjection; the pipeline loads it as a CLIPVisionModel).
WAN_VIT_H_14 = dict(
    hidden_size=1280,
    intermediate_size=5120,
    projection_dim=1024,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_channels=3,
    image_size=224,
    patch_size=14,
    hidden_act="gelu",
    layer_norm_eps=1e-5,
)
# Parameter counts transformers reports on the meta device.
REAL_PARAMS = {False: 630_766_080, True: 632_076_800}


def _reference_class(with_projection):
    if with_projection:
        return transformers.CLIPVisionModelWithProjection
    return transformers.CLIPVisionModel


def _save_reference(path, config_kwargs, with_projection, seed=0):
    torch.manual_seed(seed)
    model = _reference_class(with_projection)(transformers.CLIPVisionConfig(**config_kwargs))
    model.eval()
    # Every parameter off its init (layer norms are ones/zeros, biases zeros at init).
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(path)
    return model


def _pixels(batch, height, width, seed=0):
    return np.random.default_rng(seed).normal(size=(batch, 3, height, width)).astype(np.float32)


def _torch_outputs(model, pixels, interpolate_pos_encoding=False):
    vision_model = getattr(model, "vision_model", model)
    with torch.no_grad():
        out = vision_model(
            pixel_values=torch.from_numpy(pixels),
            output_hidden_states=True,
            interpolate_pos_encoding=interpolate_pos_encoding,
        )
        result = {
            "last_hidden_state": out.last_hidden_state.numpy(),
            "pooler_output": out.pooler_output.numpy(),
            "hidden_states": [h.numpy() for h in out.hidden_states],
            "image_embeds": None,
        }
        if vision_model is not model:
            projected = model(
                pixel_values=torch.from_numpy(pixels),
                interpolate_pos_encoding=interpolate_pos_encoding,
            )
            result["image_embeds"] = projected.image_embeds.numpy()
    return result


def _max_errors(got, expected):
    errors = {
        name: np.abs(np.asarray(getattr(got, name)) - expected[name]).max()
        for name in ("last_hidden_state", "pooler_output")
    }
    assert len(got.hidden_states) == len(expected["hidden_states"])
    for i, (g, e) in enumerate(zip(got.hidden_states, expected["hidden_states"], strict=True)):
        errors[f"hidden_states[{i}]"] = np.abs(np.asarray(g) - e).max()
    if expected["image_embeds"] is None:
        assert got.image_embeds is None
    else:
        errors["image_embeds"] = np.abs(
            np.asarray(got.image_embeds) - expected["image_embeds"]
        ).max()
    return errors


def _assert_matches(got, expected, atol=ATOL):
    errors = _max_errors(got, expected)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= atol, f"{worst}: max abs error {errors[worst]:.2e} ({errors})"


# One saved reference of each tiny config, shared by the tests of this module.
REFERENCES = {
    "quick-gelu": (TINY_QUICK_GELU, False),
    "odd-gelu-proj": (ODD_GELU, True),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (directory, transformers model) for each of :data:`REFERENCES`."""
    out = {}
    for name, (config_kwargs, with_projection) in REFERENCES.items():
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, _save_reference(path, config_kwargs, with_projection))
    return out


# --- the encoder -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_matches_transformers(saved, name):
    config_kwargs, with_projection = REFERENCES[name]
    path, model = saved[name]
    size = config_kwargs["image_size"]
    pixels = _pixels(2, size, size)
    expected = _torch_outputs(model, pixels)

    module, params = clip_vision.load_clip_vision(path)
    assert module.with_projection == with_projection
    got = jax.jit(module.apply)({"params": params}, pixels)
    grid = size // config_kwargs["patch_size"]
    assert got.last_hidden_state.shape == (2, grid * grid + 1, config_kwargs["hidden_size"])
    assert len(got.hidden_states) == config_kwargs["num_hidden_layers"] + 1
    _assert_matches(got, expected)

    # Wan I2V's image context: hidden_states[-2], without running the last block (tracing
    # succeeds without its parameters).
    encode = clip_vision.encode_fn(module)
    penultimate = encode(params, pixels)
    error = np.abs(np.asarray(penultimate) - expected["hidden_states"][-2]).max()
    assert error <= ATOL, f"hidden_states[-2]: {error:.2e}"
    last = config_kwargs["num_hidden_layers"] - 1
    without_last = {k: v for k, v in params.items() if k != f"block_{last}"}
    assert jax.eval_shape(encode, without_last, pixels).shape == penultimate.shape


def test_wan_checkpoint_layout_loads_as_clip_vision_model(tmp_path):
    """Wan's image_encoder is a CLIPVisionModelWithProjection checkpoint ("vision_model." keys
    and visual_projection.weight) that diffusers loads as a CLIPVisionModel; old checkpoints
    also hold the position_ids buffer."""
    model = _save_reference(tmp_path, ODD_GELU, with_projection=True, seed=1)
    tensors = weights.SafetensorsReader(tmp_path).as_dict()
    assert "vision_model.post_layernorm.weight" in tensors and "visual_projection.weight" in tensors
    tensors = {k: np.array(v) for k, v in tensors.items()}
    tensors["vision_model.embeddings.position_ids"] = np.arange(26, dtype=np.int64)[None]
    (tmp_path / "model.safetensors").unlink()
    weights.save_safetensors(tensors, tmp_path / "model.safetensors")

    module, params = clip_vision.load_clip_vision(tmp_path, with_projection=False)
    assert not module.with_projection and "visual_projection" not in params
    pixels = _pixels(1, 28, 28, seed=1)
    got = jax.jit(module.apply)({"params": params}, pixels)
    _assert_matches(got, {**_torch_outputs(model, pixels), "image_embeds": None})

    plain = tmp_path / "plain"
    _save_reference(plain, ODD_GELU, with_projection=False)
    with pytest.raises(weights.WeightsError, match="visual_projection.weight"):
        clip_vision.load_clip_vision(plain, with_projection=True)


def test_interpolated_position_embeddings_match(saved):
    """interpolate_pos_encoding=True: torch's bicubic resize of the patch position grid."""
    path, model = saved["quick-gelu"]
    module, params = clip_vision.load_clip_vision(path)
    apply = jax.jit(functools.partial(module.apply, interpolate_pos_encoding=True))
    # A larger square, and a non-square image with the table's patch count (still resized).
    for height, width in [(37, 37), (15, 60)]:
        pixels = _pixels(1, height, width, seed=2)
        got = apply({"params": params}, pixels)
        assert got.last_hidden_state.shape == (1, (height // 3) * (width // 3) + 1, 32)
        _assert_matches(got, _torch_outputs(model, pixels, interpolate_pos_encoding=True))


def test_interpolation_shortcut_keeps_the_table():
    """A square image with the table's patch count is not resampled (transformers' shortcut),
    even at another pixel size (31 px -> 10 patches of 3)."""
    table = jnp.arange(101 * 4, dtype=jnp.float32).reshape(101, 4)
    assert clip_vision.interpolate_positions(table, (10, 10), 31, 31) is table
    resized = clip_vision.interpolate_positions(table, (5, 20), 15, 60)
    assert resized.shape == (101, 4) and not np.allclose(resized, table)
    np.testing.assert_array_equal(resized[0], table[0])


def test_image_size_must_match_without_interpolation():
    module = clip_vision.CLIPVisionEncoder(clip_vision.CLIPVisionConfig(**TINY_QUICK_GELU))
    with pytest.raises(ValueError, match=r"input image size \(30\*33\)"):
        jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 3, 30, 33)))
    with pytest.raises(ValueError, match="pixel_values must be"):
        jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 4, 30, 30)))
    with pytest.raises(ValueError, match="hidden_layer 4"):
        jax.eval_shape(
            functools.partial(module.init, hidden_layer=4),
            jax.random.key(0),
            jnp.zeros((1, 3, 30, 30)),
        )


@pytest.mark.parametrize("in_size,out_size", [(10, 15), (10, 5), (7, 7), (4, 13), (13, 4)])
def test_bicubic_matrix_is_torch_interpolate(in_size, out_size):
    x = np.random.default_rng(0).normal(size=(2, in_size, in_size)).astype(np.float32)
    expected = torch.nn.functional.interpolate(
        torch.from_numpy(x)[None], size=(out_size, out_size), mode="bicubic", align_corners=False
    )[0].numpy()
    m = clip_vision.bicubic_matrix(in_size, out_size)
    got = np.einsum("yh,chw,xw->cyx", m, x, m)
    np.testing.assert_allclose(got, expected, atol=2e-6, rtol=0)


def test_config_from_saved_json(tmp_path):
    _save_reference(tmp_path, ODD_GELU, with_projection=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    config = clip_vision.CLIPVisionConfig.from_dict(raw)
    assert config == clip_vision.CLIPVisionConfig(**ODD_GELU)
    assert (config.head_dim, config.grid_size, config.num_positions) == (8, 5, 26)
    reference = transformers.CLIPVisionConfig()
    defaults = clip_vision.CLIPVisionConfig()
    for field in defaults.to_dict():
        if field != "model_type":
            assert getattr(defaults, field) == getattr(reference, field), field
    # transformers 4 dumped the token ids into every sub-config: ignored.
    assert clip_vision.CLIPVisionConfig.from_dict({**raw, "bos_token_id": None}) == config


def test_bad_config_is_named():
    error = clip_vision.CLIPVisionConfigError
    with pytest.raises(error, match="'vocab_size'"):
        clip_vision.CLIPVisionConfig.from_dict({**WAN_VIT_H_14, "vocab_size": 4})
    with pytest.raises(error, match="vision_config"):
        clip_vision.CLIPVisionConfig.from_dict({"model_type": "clip", "vision_config": {}})
    with pytest.raises(error, match="num_attention_heads"):
        clip_vision.CLIPVisionConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(error, match="patch_size"):
        clip_vision.CLIPVisionConfig(patch_size=0)
    with pytest.raises(error, match="hidden_act"):
        clip_vision.CLIPVisionConfig(hidden_act="gelu_10")


def test_weight_map_round_trip_and_logical_axes(saved):
    """Loaded params export back to the checkpoint's tensors, bit for bit; every parameter has
    a rule and logical axis names the sharding rules know."""
    path, _ = saved["odd-gelu-proj"]
    module, params = clip_vision.load_clip_vision(path)
    config = module.config
    assert set(weights._flatten(params)) == set(clip_vision.weight_map(config, True))
    abstract = clip_vision.abstract_variables(module)
    names = jax.tree.leaves(
        jax.tree.map(lambda x: x.names, abstract["params"], is_leaf=lambda x: hasattr(x, "names"))
    )
    assert set(names) - {None} <= {name for name, _ in sharding.LOGICAL_AXIS_RULES}
    exported = weights.export_state_dict(params, clip_vision.weight_map(config, True))
    checkpoint = weights.SafetensorsReader(path)
    assert set(exported) == set(checkpoint.keys())
    for key, value in exported.items():
        np.testing.assert_array_equal(value, checkpoint.get(key), err_msg=key)


@pytest.mark.slow
def test_init_then_export_loads_into_transformers():
    config = clip_vision.CLIPVisionConfig(**ODD_GELU)
    module, params = clip_vision.init_clip_vision(config, jax.random.key(1), with_projection=True)
    tensors = weights.export_state_dict(params, clip_vision.weight_map(config, True))
    reference = transformers.CLIPVisionModelWithProjection(
        transformers.CLIPVisionConfig(**ODD_GELU)
    )
    reference.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()})
    pixels = _pixels(2, 28, 28, seed=3)
    got = jax.jit(module.apply)({"params": params}, pixels)
    _assert_matches(got, _torch_outputs(reference.eval(), pixels))


def test_sharded_load_matches_unsharded(tmp_path):
    """fsdp=2 x tensor=2 x data=2 on the 8 forced CPU devices gives the same outputs (the
    intermediate size must divide by the tensor axis: 36, not 37)."""
    model = _save_reference(tmp_path, {**TINY_QUICK_GELU, "intermediate_size": 36}, False)
    pixels = _pixels(2, 30, 30, seed=4)
    mesh = sharding.make_mesh(
        sharding.MeshConfig(
            ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2
        )
    )
    module, params = clip_vision.load_clip_vision(tmp_path, mesh=mesh)
    q_kernel = params["block_0"]["attention"]["q"]["kernel"]
    assert q_kernel.sharding.spec == jax.sharding.PartitionSpec(("fsdp", "context"), "tensor", None)
    with sharding.mesh_context(mesh):
        got = jax.jit(module.apply)({"params": params}, pixels)
    _assert_matches(got, _torch_outputs(model, pixels))


@pytest.mark.parametrize("with_projection", [False, True], ids=["vision-model", "with-projection"])
def test_real_config_parameter_count_matches_transformers(with_projection):
    with torch.device("meta"):
        reference = _reference_class(with_projection)(transformers.CLIPVisionConfig(**WAN_VIT_H_14))
    expected = sum(p.numel() for p in reference.parameters())
    config = clip_vision.CLIPVisionConfig(**WAN_VIT_H_14)
    assert (config.grid_size, config.num_positions) == (16, 257)
    ours = clip_vision.count_params(config, with_projection)
    assert ours == expected == REAL_PARAMS[with_projection]


# --- the image processor -----------------------------------------------------------------------


def _images():
    """Non-square images in every mode the conversion handles (uint8, random)."""
    rng = np.random.default_rng(5)
    palette = PIL.Image.fromarray(rng.integers(0, 256, (31, 44, 3), dtype=np.uint8)).convert("P")
    palette.info["transparency"] = 7
    return {
        "rgb-37x53": PIL.Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)),
        "rgb-61x29": PIL.Image.fromarray(rng.integers(0, 256, (61, 29, 3), dtype=np.uint8)),
        "rgba": PIL.Image.fromarray(rng.integers(0, 256, (41, 33, 4), dtype=np.uint8), "RGBA"),
        "greyscale": PIL.Image.fromarray(rng.integers(0, 256, (45, 38), dtype=np.uint8), "L"),
        "palette-transparency": palette,
        "array-rgb": rng.integers(0, 256, (37, 53, 3), dtype=np.uint8),
        "array-rgba": rng.integers(0, 256, (50, 44, 4), dtype=np.uint8),
        "array-grey": rng.integers(0, 256, (50, 44, 1), dtype=np.uint8),
    }


PROCESSOR_CONFIGS = {
    "shortest-edge": dict(size={"shortest_edge": 20}, crop_size={"height": 18, "width": 18}),
    "crop-larger-than-image": dict(
        size={"shortest_edge": 24}, crop_size={"height": 30, "width": 26}
    ),
    "exact-size-bilinear": dict(
        size={"height": 17, "width": 23},
        crop_size={"height": 16, "width": 20},
        resample=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    ),
    "int-sizes": dict(size=22, crop_size=19, rescale_factor=1 / 127.5),
}


def _reference_processor(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.CLIPImageProcessorPil(**kwargs)


@pytest.mark.parametrize("name", sorted(PROCESSOR_CONFIGS))
def test_preprocess_matches_pil_backend_exactly(name):
    kwargs = PROCESSOR_CONFIGS[name]
    reference = _reference_processor(**kwargs)
    config = cip.CLIPImageProcessorConfig(**kwargs)
    images = _images()
    for label, image in images.items():
        expected = reference(images=image, return_tensors="pt")["pixel_values"].numpy()
        got = cip.preprocess(image, config)
        assert got.dtype == np.float32 and got.shape == expected.shape, label
        np.testing.assert_array_equal(got, expected, err_msg=label)
    batch = [images["rgb-37x53"], images["greyscale"], images["array-rgba"]]
    expected = reference(images=batch, return_tensors="pt")["pixel_values"].numpy()
    np.testing.assert_array_equal(cip.preprocess(batch, config), expected)


def test_preprocessor_config_round_trip(tmp_path):
    """A preprocessor_config.json written by transformers reads back to the same processing,
    and ``CLIPImageProcessor.from_pretrained`` (what diffusers loads) agrees with ours."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        written = transformers.CLIPImageProcessor(
            size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30}
        )
        written.save_pretrained(tmp_path)
        loaded = transformers.CLIPImageProcessor.from_pretrained(tmp_path)
    config = cip.CLIPImageProcessorConfig.from_pretrained(tmp_path)
    assert config == cip.CLIPImageProcessorConfig(size=30, crop_size=30)
    assert config.output_size == (30, 30)
    image = _images()["rgba"]
    expected = loaded(images=image, return_tensors="pt")["pixel_values"].numpy()
    got = cip.preprocess(image, config)
    if loaded.backend == "pil":
        np.testing.assert_array_equal(got, expected)
    else:
        # The torchvision backend resizes with its own antialiased bicubic: measured at most
        # 2 levels of 255 apart, 0.029 after normalization (std ~0.27).
        np.testing.assert_allclose(got, expected, atol=3 / 255 / min(cip.OPENAI_CLIP_STD))


def test_default_config_is_transformers_default():
    reference = _reference_processor()
    config = cip.CLIPImageProcessorConfig()
    assert config.size == {"shortest_edge": reference.size.shortest_edge}
    assert (config.crop_size["height"], config.crop_size["width"]) == (
        reference.crop_size.height,
        reference.crop_size.width,
    )
    assert config.resample == reference.resample
    assert config.image_mean == tuple(reference.image_mean)
    assert config.image_std == tuple(reference.image_std)
    assert config.rescale_factor == reference.rescale_factor


def test_bad_processor_input_is_named():
    with pytest.raises(cip.CLIPImageProcessorConfigError, match="'do_pad'"):
        cip.CLIPImageProcessorConfig.from_dict({"do_pad": True})
    with pytest.raises(cip.CLIPImageProcessorConfigError, match="crop_size"):
        cip.CLIPImageProcessorConfig(crop_size={"shortest_edge": 3})
    with pytest.raises(TypeError, match="uint8"):
        cip.preprocess(np.zeros((8, 8, 3), np.float32))
    with pytest.raises(ValueError, match="differ in shape"):
        cip.preprocess(
            [np.zeros((8, 8, 3), np.uint8), np.zeros((8, 12, 3), np.uint8)],
            cip.CLIPImageProcessorConfig(size=8, do_center_crop=False),
        )


# --- Wan 2.1 I2V's encode_image, end to end ----------------------------------------------------


def _save_wan_components(path):
    """A Wan-like image_encoder (a CLIPVisionModelWithProjection checkpoint, as diffusers'
    conversion writes it) and image_processor (30 px, else CLIP defaults)."""
    _save_reference(path / "image_encoder", TINY_QUICK_GELU, with_projection=True, seed=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.CLIPImageProcessor(size=30, crop_size=30).save_pretrained(
            path / "image_processor"
        )


def _ours_encode_image(path, images):
    module, params = clip_vision.load_clip_vision(path / "image_encoder", with_projection=False)
    config = cip.CLIPImageProcessorConfig.from_pretrained(path / "image_processor")
    return np.asarray(clip_vision.encode_fn(module)(params, cip.preprocess(images, config)))


def test_wan_encode_image_path_matches_transformers(tmp_path):
    """What ``WanImageToVideoPipeline.encode_image`` runs, with transformers classes loaded
    from the saved directories: ``image_processor(images=..., return_tensors="pt")``, then
    ``image_encoder(**image, output_hidden_states=True).hidden_states[-2]``."""
    _save_wan_components(tmp_path)
    images = _images()
    batch = [images["rgb-37x53"], images["rgba"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        processor = transformers.CLIPImageProcessor.from_pretrained(tmp_path / "image_processor")
        encoder = transformers.CLIPVisionModel.from_pretrained(tmp_path / "image_encoder")
    with torch.no_grad():
        inputs = processor(images=batch, return_tensors="pt")
        expected = encoder.eval()(**inputs, output_hidden_states=True).hidden_states[-2].numpy()
    got = _ours_encode_image(tmp_path, batch)
    assert got.shape == expected.shape == (2, 101, 32)
    # Bit-identical pixels with the PIL backend; the torchvision one differs by a few levels.
    atol = ATOL if processor.backend == "pil" else 1e-1
    error = np.abs(got - expected).max()
    assert error <= atol, f"encode_image: max abs error {error:.2e}"


@pytest.mark.slow
def test_wan_encode_image_matches_diffusers(tmp_path):
    """diffusers ``WanImageToVideoPipeline.encode_image`` itself (importing diffusers' Wan
    pipeline costs seconds, hence slow)."""
    from diffusers import WanImageToVideoPipeline

    _save_wan_components(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = WanImageToVideoPipeline(
            tokenizer=None,
            text_encoder=None,
            vae=None,
            scheduler=None,
            transformer=None,
            image_encoder=transformers.CLIPVisionModel.from_pretrained(tmp_path / "image_encoder"),
            image_processor=transformers.CLIPImageProcessor.from_pretrained(
                tmp_path / "image_processor"
            ),
        )
    images = _images()
    batch = [images["rgb-37x53"], images["greyscale"]]
    with torch.no_grad():
        expected = pipe.encode_image(batch, device=torch.device("cpu")).numpy()
    got = _ours_encode_image(tmp_path, batch)
    assert got.shape == expected.shape == (2, 101, 32)
    atol = ATOL if pipe.image_processor.backend == "pil" else 1e-1
    error = np.abs(got - expected).max()
    assert error <= atol, f"encode_image: max abs error {error:.2e}"
