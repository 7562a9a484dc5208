"""Every safetensors file is validated by the ``safetensors`` library before any tensor is
used: a truncated or padded file, overlapping offsets, a broken header, an unknown dtype, and
a sharded checkpoint missing a shard are each one clear error naming the file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from jaxcore import weights

TENSORS = {
    "a.weight": torch.arange(36 * 56, dtype=torch.float32).reshape(36, 56),
    "b.bias": torch.linspace(-1, 1, 10).to(torch.bfloat16),
}


def _file(tmp_path: Path, name: str = "model.safetensors") -> Path:
    path = tmp_path / name
    save_file(TENSORS, str(path))
    return path


def _rewrite(path: Path, edit) -> None:
    """Rewrite the header of ``path`` with ``edit(header)``, keeping the data bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])


def test_a_valid_file_reads_every_tensor_exactly(tmp_path):
    f = weights.SafetensorsFile(_file(tmp_path))
    np.testing.assert_array_equal(f.get("a.weight"), TENSORS["a.weight"].numpy())
    bias = f.get("b.bias")
    assert bias.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bias.astype(np.float32), TENSORS["b.bias"].float().numpy())


def test_a_truncated_file_is_refused_on_open_naming_it(tmp_path):
    """The issue's case: half a diffusion_pytorch_model.safetensors (an interrupted copy) was
    'cannot reshape array of size 691 into shape (36,56)' on first use."""
    path = _file(tmp_path, "diffusion_pytorch_model.safetensors")
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(
        weights.WeightsError, match=r"diffusion_pytorch_model.safetensors: .*truncated"
    ):
        weights.SafetensorsReader(tmp_path)


def test_a_file_longer_than_its_header_says_is_refused(tmp_path):
    path = _file(tmp_path)
    path.write_bytes(path.read_bytes() + b"\0" * 16)
    with pytest.raises(weights.WeightsError, match="model.safetensors: .*longer than its header"):
        weights.SafetensorsFile(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h: h["b.bias"].update(data_offsets=[0, 20]), "invalid"),  # overlaps a.weight
        (lambda h: h["a.weight"].update(shape=[36, 55]), "invalid"),  # size != offsets
        (lambda h: h["b.bias"].update(dtype="F4"), "invalid|unsupported dtype"),
    ],
    ids=["overlap", "shape", "dtype"],
)
def test_inconsistent_headers_are_refused_naming_the_file(tmp_path, edit, message):
    path = _file(tmp_path)
    _rewrite(path, edit)
    with pytest.raises(weights.WeightsError, match=f"model.safetensors: .*({message})"):
        weights.SafetensorsFile(path)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"\x01\x02", "shorter than its header"),
        (struct.pack("<Q", 1 << 40) + b"{}", "header length"),
        (struct.pack("<Q", 4) + b"{not", "corrupt safetensors header"),
        (struct.pack("<Q", 8) + b"[1, 2]  ", "not a JSON object"),
    ],
    ids=["short", "length", "json", "list"],
)
def test_broken_headers_are_refused_naming_the_file(tmp_path, raw, message):
    path = tmp_path / "model.safetensors"
    path.write_bytes(raw)
    with pytest.raises(weights.WeightsError, match=f"model.safetensors: .*{message}"):
        weights.SafetensorsFile(path)


def _sharded(tmp_path: Path) -> Path:
    save_file({"a.weight": TENSORS["a.weight"]}, str(tmp_path / "m-00001-of-00002.safetensors"))
    save_file({"b.bias": TENSORS["b.bias"]}, str(tmp_path / "m-00002-of-00002.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {
            "a.weight": "m-00001-of-00002.safetensors",
            "b.bias": "m-00002-of-00002.safetensors",
        },
    }
    path = tmp_path / "m.safetensors.index.json"
    path.write_text(json.dumps(index))
    return path


def test_a_sharded_checkpoint_reads_across_shards(tmp_path):
    _sharded(tmp_path)
    reader = weights.SafetensorsReader(tmp_path)
    np.testing.assert_array_equal(reader.get("a.weight"), TENSORS["a.weight"].numpy())
    assert reader.get("b.bias").shape == (10,)


def test_a_sharded_checkpoint_missing_a_shard_names_it(tmp_path):
    _sharded(tmp_path)
    (tmp_path / "m-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        weights.WeightsError,
        match=r"shard m-00002-of-00002.safetensors \(holding 'b.bias'\) is missing",
    ):
        weights.SafetensorsReader(tmp_path)


def test_a_broken_index_names_it(tmp_path):
    index = _sharded(tmp_path)
    index.write_text('{"weight_map": ')
    with pytest.raises(
        weights.WeightsError, match="m.safetensors.index.json: not a readable JSON index"
    ):
        weights.SafetensorsReader(tmp_path)
    index.write_text('{"weight_map": ["a"]}')
    with pytest.raises(weights.WeightsError, match="m.safetensors.index.json: no 'weight_map'"):
        weights.SafetensorsReader(tmp_path)
    index.write_text(json.dumps({"weight_map": {"b.bias": "m-00001-of-00002.safetensors"}}))
    with pytest.raises(
        weights.WeightsError,
        match="'b.bias' is mapped to m-00001-of-00002.safetensors, which does not hold it",
    ):
        weights.SafetensorsReader(tmp_path)
