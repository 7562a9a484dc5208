"""generate stage, pure tier: prompt files, names, seeds, batch planning, config YAML."""

from __future__ import annotations

import json

import pytest

from jaxcore.config import ConfigError, load_config
from jaxcore.families import Geometry
from stages.common.errors import StageInputError
from stages.generate.config import GenerateConfig, SamplingSection
from stages.generate.prompts import derive_seed, parse_prompts, safe_name
from stages.generate.render import global_batch_size, plan_batches

DEFAULTS = SamplingSection(
    height=16, width=16, num_frames=1, num_inference_steps=2, guidance_scale=5.0
)
WAN_GEOMETRY = Geometry(spatial_multiple=16, temporal_multiple=4)  # Wan 2.1's VAE x patch


def _jsonl(*records) -> list[str]:
    return [r if isinstance(r, str) else json.dumps(r) for r in records]


def test_txt_skips_blank_and_comment_lines():
    lines = ["# header", "a red circle", "", "   ", "  # indented comment", "blue square"]
    specs = parse_prompts("p.txt", lines, DEFAULTS)
    assert [(s.prompt, s.line, s.id) for s in specs] == [
        ("a red circle", 2, "00000"),
        ("blue square", 6, "00001"),
    ]
    assert specs[0].seed == derive_seed(0, "00000") != specs[1].seed


def test_jsonl_fields_override_defaults():
    lines = _jsonl(
        {"id": "one", "prompt": "x", "seed": 5, "height": 32, "guidance_scale": 1},
        {"prompt": "y", "num_frames": 5, "latents": "noise/y.npy"},
    )
    one, two = parse_prompts("gs://b/dir/p.jsonl", lines, DEFAULTS)
    assert (one.id, one.seed, one.height, one.width, one.guidance_scale) == ("one", 5, 32, 16, 1.0)
    assert two.num_frames == 5 and two.latents == "gs://b/dir/noise/y.npy"
    assert one.group_key != two.group_key


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"prompt": "x",', "malformed JSON"),
        ('{"prompt": "x", "colour": "red"}', "unknown field"),
        ('{"prompt": "x", "num_inference_steps": -3}', "num_inference_steps must be >= 1"),
        ('{"prompt": "   "}', "empty prompt"),
        ('{"prompt": "x", "height": 20}', "height must be a positive multiple of 16"),
        ('{"prompt": "x", "num_frames": 4}', "num_frames"),
        ('{"prompt": "x", "seed": "7"}', "seed must be an integer"),
        ('["x"]', "expected a JSON object"),
        ('{"negative_prompt": "x"}', "missing field 'prompt'"),
        ('{"prompt": "x", "original_size": [64]}', "original_size must be two integers"),
        ('{"prompt": "x", "target_size": [8, -1]}', "target_size must not be negative"),
        ('{"prompt": "x", "guidance_scale": NaN}', "guidance_scale must be a finite number"),
        ('{"prompt": "x", "flow_shift": -Infinity}', "flow_shift must be a finite number"),
        (
            '{"prompt": "x", "spatio_temporal_guidance_blocks": [28, 1.5]}',
            "spatio_temporal_guidance_blocks must be a list of block indices",
        ),
    ],
)
def test_bad_line_is_named_before_rendering(bad_line, message):
    lines = _jsonl({"prompt": "fine"}, "# comment", bad_line, {"prompt": "also fine"})
    with pytest.raises(StageInputError, match=message) as err:
        parse_prompts("prompts.jsonl", lines, DEFAULTS, geometry=WAN_GEOMETRY)
    assert "prompts.jsonl line 3" in str(err.value)


def test_model_defaults_fill_what_the_config_leaves_open():
    model_defaults = {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 50}
    model_defaults |= {"guidance_scale": 5.0, "flow_shift": 3.0}
    (spec,) = parse_prompts("p.txt", ["x"], SamplingSection(width=64), model_defaults)
    assert (spec.height, spec.width, spec.num_frames) == (480, 64, 81)
    assert (spec.num_inference_steps, spec.guidance_scale, spec.flow_shift) == (50, 5.0, 3.0)
    with pytest.raises(StageInputError, match="p.txt line 1: no height"):
        parse_prompts("p.txt", ["x"], SamplingSection())


def test_family_block_lists_reach_the_family_as_tuples():
    """A line's ``spatio_temporal_guidance_blocks`` (else the model's default) lands in its
    micro-conditioning as a tuple beside the seed; a model whose family has no such default
    refuses it naming the line."""
    model_defaults = {"height": 32, "width": 32, "num_frames": 9, "num_inference_steps": 2}
    model_defaults |= {"guidance_scale": 3.0, "spatio_temporal_guidance_blocks": (28,)}
    lines = _jsonl({"prompt": "x", "spatio_temporal_guidance_blocks": [3, 1]}, {"prompt": "y"})
    given, default = parse_prompts("p.jsonl", lines, SamplingSection(), model_defaults)
    assert dict(given.micro_conditioning)["spatio_temporal_guidance_blocks"] == (3, 1)
    assert dict(default.micro_conditioning)["spatio_temporal_guidance_blocks"] == (28,)
    del model_defaults["spatio_temporal_guidance_blocks"]
    with pytest.raises(StageInputError, match="p.jsonl line 1: spatio_temporal_guidance_blocks"):
        parse_prompts("p.jsonl", lines, SamplingSection(), model_defaults)


def test_images_only_geometry_refuses_frames():
    lines = _jsonl({"prompt": "x", "num_frames": 5})
    with pytest.raises(StageInputError, match="line 1: num_frames must be 1"):
        parse_prompts("p.jsonl", lines, DEFAULTS, geometry=Geometry(16, 0))


def test_duplicate_ids_and_empty_files_are_errors():
    with pytest.raises(StageInputError, match="line 2: duplicate id 'a' .*line 1"):
        parse_prompts(
            "p.jsonl", _jsonl({"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}), DEFAULTS
        )
    with pytest.raises(StageInputError, match="holds no prompts"):
        parse_prompts("p.txt", ["# nothing"], DEFAULTS)
    with pytest.raises(StageInputError, match=r"\.txt or \.jsonl"):
        parse_prompts("p.csv", ["x"], DEFAULTS)


@pytest.mark.parametrize("prompt_id", ["../../etc/passwd", "a/b", ".hidden", "a b", "", "x" * 200])
def test_safe_name_has_no_traversal(prompt_id):
    name = safe_name(prompt_id)
    assert "/" not in name and not name.startswith(".") and 0 < len(name) <= 80
    assert name != safe_name(prompt_id + "!")  # distinct ids -> distinct names


def test_safe_ids_are_kept():
    assert safe_name("cat_01.v2") == "cat_01.v2"


def test_plan_batches_groups_pads_and_splits_hosts():
    lines = _jsonl(*[{"prompt": f"p{i}", "num_frames": 1 if i % 2 else 5} for i in range(7)])
    specs = parse_prompts("p.jsonl", lines, DEFAULTS)
    batches = plan_batches(specs, batch_size=3, batch_ways=4)
    assert [[s.index for s in b.specs] for b in batches] == [[0, 2, 4], [6], [1, 3, 5]]
    assert all(b.padded_size == 4 and b.local_rows == (0, 1, 2, 3) for b in batches)
    assert batches[1].row_spec(3).index == 6  # padding repeats the last prompt
    assert [r for r, _ in batches[1].local_real()] == [0]
    host1 = plan_batches(specs, batch_size=3, batch_ways=4, process_index=1, process_count=2)
    assert host1[0].local_rows == (2, 3) and [s.index for _, s in host1[0].local_real()] == [4]
    assert global_batch_size(0.125, 8) == 1 and global_batch_size(1, 8) == 8


def test_stage_yaml_loads_and_validates():
    config = load_config(GenerateConfig, "configs/stages/generate.yml", ["guidance_scale=1"])
    assert config.sampling.guidance_scale == 1.0 and config.sampling.scheduler is None
    with pytest.raises(ConfigError, match="num_inference_steps"):
        load_config(GenerateConfig, "configs/stages/generate.yml", ["num_inference_steps=0"])
    with pytest.raises(ConfigError, match="prompt_file is required"):
        load_config(GenerateConfig, "configs/stages/generate.yml", ["prompt_file="])
