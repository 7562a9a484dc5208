"""Caption dropout (``proportion_empty_prompts``): training swaps the empty caption's tensors
(the convert artifact's ``empty_prompt.safetensors``) into a share of the rows, so the model
learns the unconditional prediction classifier-free guidance needs.

Proven: the swap takes whole rows (every caption tensor of a row together), the share is the
configured one within 4 standard deviations, the rest of the batch is untouched; a train step
with proportion 1 equals (1e-6) a step on the batch with the empty caption written in by hand,
and proportion 0 leaves the step's draws unchanged (bit-identical). The convert side (the file
equals the text encoder's encoding of "") is tested in test_convert_pipeline.py.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from jaxcore import sharding
from jaxcore.artifacts import open_artifact
from jaxcore.config import load_config
from jaxcore.families import TensorSpec
from stages.common.errors import StageInputError
from stages.train import trainer
from stages.train.config import ModelSection, TrainConfig
from tests.support import train_steps
from tests.support.convert_artifacts import TinyDataConfig, write_convert_artifact
from tests.support.wan_variants import write_one_layer_wan_yaml

TEXT = "encoder_hidden_states"
TRAIN_YML = Path(__file__).resolve().parents[2] / "configs" / "stages" / "train.yml"


def _batch(rows: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(0)
    batch = {
        "latents": rng.standard_normal((rows, 2, 3)).astype(np.float32),
        TEXT: rng.standard_normal((rows, 3, 2)).astype(np.float32),
        "pooled": rng.standard_normal((rows, 4)).astype(np.float32),
    }
    empty = {TEXT: np.full((3, 2), -7.0, np.float32), "pooled": np.full((4,), -9.0, np.float32)}
    return batch, empty


def test_whole_rows_are_swapped_at_the_configured_share():
    rows, share = 4000, 0.25
    batch, empty = _batch(rows)
    out = jax.device_get(trainer.drop_captions(batch, empty, share, jax.random.key(3)))
    text_dropped = np.all(out[TEXT] == -7.0, axis=(1, 2))
    pooled_dropped = np.all(out["pooled"] == -9.0, axis=1)
    np.testing.assert_array_equal(text_dropped, pooled_dropped)  # a row's tensors go together
    sigma = np.sqrt(share * (1 - share) / rows)
    assert abs(text_dropped.mean() - share) < 4 * sigma, text_dropped.mean()
    np.testing.assert_array_equal(out[TEXT][~text_dropped], batch[TEXT][~text_dropped])
    np.testing.assert_array_equal(out["latents"], batch["latents"])
    again = jax.device_get(trainer.drop_captions(batch, empty, share, jax.random.key(3)))
    np.testing.assert_array_equal(again[TEXT], out[TEXT])  # drawn from the key alone
    other = jax.device_get(trainer.drop_captions(batch, empty, share, jax.random.key(4)))
    assert not np.array_equal(other[TEXT], out[TEXT])
    everything = jax.device_get(trainer.drop_captions(batch, empty, 1.0, jax.random.key(3)))
    assert np.all(everything[TEXT] == -7.0) and np.all(everything["pooled"] == -9.0)
    nothing = jax.device_get(trainer.drop_captions(batch, empty, 0.0, jax.random.key(3)))
    np.testing.assert_array_equal(nothing[TEXT], batch[TEXT])


FEATURES = (TensorSpec("latents", (4, 1, 8, 8)), TensorSpec(TEXT, (8, 32)))


@pytest.fixture(scope="module")
def one_layer_model(tmp_path_factory) -> str:
    return write_one_layer_wan_yaml(tmp_path_factory.mktemp("model"))


def _step(model_yaml, host_batch, **dropout):
    mesh = sharding.make_mesh(sharding.MeshConfig(), devices=jax.devices()[:1])
    section = ModelSection(model_config=model_yaml)
    return train_steps.one_step(section, mesh, FEATURES, host_batch, step=5, **dropout)


def test_a_step_with_every_caption_dropped_is_a_step_on_empty_captions(one_layer_model):
    host = train_steps.random_batch(FEATURES, rows=4, seed=1)
    empty = {TEXT: np.random.default_rng(2).standard_normal((8, 32)).astype(np.float32)}
    by_hand = {**host, TEXT: np.broadcast_to(empty[TEXT], host[TEXT].shape).copy()}

    dropped = _step(one_layer_model, host, empty_prompt=empty, proportion_empty_prompts=1.0)
    reference = _step(one_layer_model, by_hand)
    assert dropped[1] == pytest.approx(reference[1], abs=1e-6)
    worst = max(
        jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), dropped[0], reference[0]))
    )
    assert worst < 1e-6, worst
    # proportion 0 draws nothing: the same step as without the option
    off = _step(one_layer_model, host, empty_prompt=empty, proportion_empty_prompts=0.0)
    plain = _step(one_layer_model, host)
    assert off[1] == plain[1] and off[1] != reference[1]


def _config(tmp_path, data_uri, *extra) -> TrainConfig:
    overrides = [
        f"output_dir={tmp_path / 'out'}",
        f"data={data_uri}",
        "dataset_type=tfrecord",
        "max_train_steps=2",
        "per_device_batch_size=1",
        *extra,
    ]
    return load_config(TrainConfig, TRAIN_YML, overrides)


def test_the_train_stage_reads_the_empty_caption_from_the_convert_artifact(
    tmp_path, one_layer_model
):
    from stages.train import loop

    with_empty = str(tmp_path / "with")
    write_convert_artifact(with_empty, TinyDataConfig(empty_prompt=True))
    config = _config(
        tmp_path,
        with_empty,
        f"model.model_config={one_layer_model}",
        "proportion_empty_prompts=0.5",
    )
    result = loop.train(config, str(tmp_path / "out"), open_artifact(with_empty, "convert"))
    assert result.final_step == 2 and np.isfinite(result.final_loss)

    without = str(tmp_path / "without")
    write_convert_artifact(without, TinyDataConfig())
    config = _config(
        tmp_path, without, f"model.model_config={one_layer_model}", "proportion_empty_prompts=0.1"
    )
    with pytest.raises(StageInputError, match=f"{without}.*no empty_prompt.*convert again"):
        loop.prepare(config, str(tmp_path / "out2"), open_artifact(without, "convert"))


def test_the_proportion_is_checked_when_the_config_is_read(tmp_path):
    with pytest.raises(ValueError, match=r"proportion_empty_prompts must be in \[0, 1\], got 1.5"):
        _config(tmp_path, "unused", "proportion_empty_prompts=1.5")
