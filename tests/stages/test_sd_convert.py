"""convert with Stable Diffusion / SDXL pipelines: records hold the VAE posterior mean scaled as
the pipelines scale latents, the prompt encodings the pipelines condition on (77 tokens) and,
for SDXL, the pooled text embedding and the size ids; each equal to a direct computation."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcore.artifacts import open_artifact
from jaxcore.families import load_pipeline
from jaxcore.models import autoencoder_kl
from pipelines import cli
from stages.common import data, records
from stages.convert.media import prepare_video
from tests.stages.test_convert_elements import _plain_imagefolder
from tests.support.tiny_sd import build_sd_pipeline, build_sdxl_pipeline

REPO = Path(__file__).resolve().parents[2]
ATOL = 2e-5  # the same fp32 computation in batches padded differently


@pytest.mark.parametrize("xl", [False, True], ids=["sd2", "sdxl"])
def test_sd_records_equal_the_pipelines_encodings(tmp_path, xl):
    build = build_sdxl_pipeline if xl else build_sd_pipeline
    model = build(tmp_path / "model", seed=4)
    folder = _plain_imagefolder(tmp_path / "imgs", [f"img{i}.png" for i in range(5)])
    out = tmp_path / "converted"
    args = [
        "convert",
        str(REPO / "configs/stages/convert.yml"),
        f"source={folder}",
        f"output_dir={out}",
        f"pretrained_model_name_or_path={model}",
        "height=16",
        "width=24",
        "eval_fraction=0.0",
        "-q",
    ]
    assert cli.main(args) == 0
    manifest = open_artifact(str(out), "convert")
    summary = manifest.summary
    assert (
        summary["family"] == "sd" and summary["latents_normalization"]["latent_sampling"] == "mean"
    )
    pipe = load_pipeline(model)
    features = {k: tuple(v["shape"]) for k, v in summary["features"].items()}
    assert features["latents"] == pipe.latent_shape(16, 24, 1)
    assert features["encoder_hidden_states"][0] == 20  # the tiny tokenizer's model_max_length
    assert ("time_ids" in features) == xl and ("text_embeds" in features) == xl

    spec = data.split_spec(manifest, "train")
    dataset = data.tf_dataset(
        spec, 1, seed=0, start_step=0, shuffle_buffer=1, prefetch=1, repeat=False
    )
    rows = [{k: np.asarray(v)[0] for k, v in b.items()} for b in data.iterate_numpy(spec, dataset)]
    assert len(rows) == 5
    vae, vae_params = pipe.components["vae"]
    for row in rows[:2]:
        name = row[records.SOURCE_ID].decode()
        video = prepare_video(str(folder / name), height=16, width=24, num_frames=1, fps=16)
        z = autoencoder_kl.encode(vae, vae_params, video[None, :, 0]).mean
        expected = np.asarray(z, np.float32) * vae.config.scaling_factor
        if xl and vae.config.latents_mean is not None:
            from jaxcore.families.sd import scale_latents

            expected = np.asarray(scale_latents(jnp.asarray(z), vae.config, True))
        np.testing.assert_allclose(row[records.LATENTS], expected[0], atol=ATOL)
        text = pipe.encode_prompts([row[records.CAPTION].decode()], 77)
        for key, value in text.items():
            np.testing.assert_allclose(row[key], value[0], atol=ATOL, err_msg=key)
        if xl:
            np.testing.assert_array_equal(row["time_ids"], [16, 24, 0, 0, 16, 24])
    # the empty caption's tensors (caption dropout) are the pipeline's encoding of ""
    empty = data.empty_prompt(manifest)
    assert {"encoder_hidden_states", "text_embeds"} & set(empty) == (
        {"encoder_hidden_states", "text_embeds"} if xl else {"encoder_hidden_states"}
    )
    for key, value in pipe.encode_prompts([""], 77).items():
        np.testing.assert_allclose(empty[key], value[0], atol=ATOL, err_msg=key)
