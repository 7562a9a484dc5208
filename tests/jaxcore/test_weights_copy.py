"""``jaxcore.weights.contiguous_copy``: the slab copy of transposed views equals numpy's own
contiguous copy, bit for bit, for every layout the weight transforms produce."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jaxcore import weights


def _views():
    rng = np.random.default_rng(0)
    conv3d = rng.standard_normal((130, 70, 3, 3, 3), np.float32)
    linear = rng.standard_normal((200, 150), np.float32)
    return {
        # torch Conv3d [O, I, T, H, W] -> flax [T, H, W, I, O]: blocked along I
        "conv3d_kernel": conv3d.transpose(2, 3, 4, 1, 0),
        # torch Linear [O, I] -> flax Dense [I, O]
        "linear_kernel": linear.T,
        "linear_bf16": linear.astype(ml_dtypes.bfloat16).T,
        "flipped_and_transposed": linear[::-1].T,
        "strided_rows": linear[::2],  # last axis already fastest: numpy's own copy
        "small": linear[:10, :12].T,  # no axis over the block size
        "contiguous": linear,
        "vector": linear[:, 3],
    }


@pytest.mark.parametrize("name", list(_views()))
def test_contiguous_copy_equals_numpy(name):
    view = _views()[name]
    got = weights.contiguous_copy(view)
    assert got.flags.c_contiguous
    assert got.dtype == view.dtype and got.shape == view.shape
    assert np.array_equal(got.view(np.uint8), np.ascontiguousarray(view).view(np.uint8))


def test_transposed_kernels_take_the_slab_copy(monkeypatch):
    """Which axis is cut, and uneven slabs (a block of 7: the last one is short)."""
    views = _views()
    assert weights.slab_axis(views["conv3d_kernel"]) == 3  # I: stride 27, O: 27 x 70
    assert weights.slab_axis(views["linear_kernel"]) == 0
    for name in ("strided_rows", "small", "contiguous", "vector"):
        assert weights.slab_axis(views[name]) is None, name
    monkeypatch.setattr(weights, "COPY_BLOCK", 7)
    view = views["conv3d_kernel"]
    assert weights.slab_axis(view) == 3
    assert np.array_equal(weights.contiguous_copy(view), np.ascontiguousarray(view))
