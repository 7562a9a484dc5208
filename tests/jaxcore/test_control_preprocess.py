"""jaxcore.control_preprocess.canny against cv2.Canny, bit for bit, and ControlPreprocess."""

import itertools

import cv2
import numpy as np
import pytest
from PIL import Image

from jaxcore.control_preprocess import ControlPreprocess, canny

# Threshold pairs for aperture 3 / L1; other apertures scale them (their gradients are larger).
THRESHOLDS = [
    (100, 200),  # diffusers' ControlNet canny example
    (50, 50),  # equal thresholds
    (200, 100),  # low > high: cv2 swaps
    (30.7, 90.2),  # fractional: cv2 floors
    (0.5, 0.9),  # both floor to 0
    (0, 0),  # every local maximum with a nonzero gradient
    (0, 120),
    (-5, 10),  # negative low: cv2 accepts it
]
# Sobel 5x5 / 7x7 gradients are ~8x / ~10x those of 3x3 (aperture 7 is scaled by 1/16 in cv2).
APERTURE_SCALE = {3: 1, 5: 8, 7: 10}
VARIANTS = list(itertools.product([3, 5, 7], [False, True]))


def assert_matches_cv2(image, low, high, aperture_size=3, l2_gradient=False):
    """canny() equals cv2.Canny exactly, and the comparison is not vacuous for real edges."""
    expected = cv2.Canny(np.ascontiguousarray(image), low, high, None, aperture_size, l2_gradient)
    got = canny(image, low, high, aperture_size=aperture_size, l2_gradient=l2_gradient)
    assert got.dtype == np.uint8 and got.shape == image.shape[:2]
    mismatches = int((got != expected).sum())
    assert mismatches == 0, (
        f"{mismatches} pixels differ: shape={image.shape} low={low} high={high} "
        f"aperture={aperture_size} l2={l2_gradient}"
    )
    return expected


def smooth_scene(height, width, channels, seed):
    """A gradient with a disc, a rectangle and noise: real edges, and plateaus on the shapes."""
    rng = np.random.default_rng(seed)
    rows, cols = np.mgrid[:height, :width]
    scene = (cols * 2.0 + rows) % 256
    disc = (cols - width * 0.6) ** 2 + (rows - height * 0.4) ** 2 < (min(height, width) / 4) ** 2
    scene = np.where(disc, 220.0, scene)
    box = (rows > height // 2) & (rows < height * 0.9) & (cols > width // 6) & (cols < width // 2)
    scene = np.where(box, 40.0, scene) + rng.normal(0, 6, scene.shape)
    planes = [scene, 0.6 * scene + 50, 255 - scene][:channels]
    return np.clip(np.stack(planes, axis=2), 0, 255).astype(np.uint8)


def random_image(shape, seed):
    """Uniform noise: every pixel an edge candidate, the hardest case for tie rules."""
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


@pytest.mark.parametrize(("aperture_size", "l2_gradient"), VARIANTS)
@pytest.mark.parametrize("shape", [(37, 53), (53, 37, 3), (29, 31, 1)])
def test_random_images_match_cv2(shape, aperture_size, l2_gradient):
    image = random_image(shape, seed=sum(shape))
    scale = APERTURE_SCALE[aperture_size]
    for low, high in THRESHOLDS:
        assert_matches_cv2(image, low * scale, high * scale, aperture_size, l2_gradient)


@pytest.mark.parametrize(("aperture_size", "l2_gradient"), VARIANTS)
@pytest.mark.parametrize(("height", "width", "channels"), [(61, 83, 1), (47, 66, 3)])
def test_smooth_scenes_match_cv2(height, width, channels, aperture_size, l2_gradient):
    image = smooth_scene(height, width, channels, seed=height)
    scale = APERTURE_SCALE[aperture_size]
    for low, high in THRESHOLDS:
        edges = assert_matches_cv2(image, low * scale, high * scale, aperture_size, l2_gradient)
    # The shapes' contours are found at the last pair's thresholds, so the match is not trivial.
    assert edges.any()


def test_grayscale_2d_equals_single_channel_3d():
    image = smooth_scene(40, 50, 1, seed=3)
    np.testing.assert_array_equal(canny(image, 50, 150), canny(image[:, :, 0], 50, 150))
    assert_matches_cv2(image[:, :, 0], 50, 150)


@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (3, 2), (1, 9), (9, 1), (2, 2, 3), (1, 5, 3)])
def test_tiny_and_one_pixel_wide_images_match_cv2(shape):
    image = random_image(shape, seed=7)
    for (aperture_size, l2_gradient), (low, high) in itertools.product(VARIANTS, THRESHOLDS):
        scale = APERTURE_SCALE[aperture_size]
        assert_matches_cv2(image, low * scale, high * scale, aperture_size, l2_gradient)


def test_plateaus_and_straight_steps_match_cv2():
    """Ties decide the strict / non-strict comparisons of non-maximum suppression."""
    rows, cols = np.mgrid[:40, :44]
    images = [
        ((cols > 20) * 255).astype(np.uint8),  # vertical step
        ((rows > 17) * 255).astype(np.uint8),  # horizontal step
        ((cols + rows > 40) * 255).astype(np.uint8),  # anti-diagonal step
        ((cols - rows > 3) * 200).astype(np.uint8),  # main-diagonal step
        (((cols // 5 + rows // 5) % 2) * 255).astype(np.uint8),  # checkerboard
        (random_image((20, 22), seed=11) // 86 * 100).astype(np.uint8),  # three levels
        np.zeros((6, 6), np.uint8),  # no gradient at all
    ]
    for image, (aperture_size, l2_gradient) in itertools.product(images, VARIANTS):
        for low, high in [(0, 0), (1, 1), (100, 300), (-3, -1)]:
            scale = APERTURE_SCALE[aperture_size]
            assert_matches_cv2(image, low * scale, high * scale, aperture_size, l2_gradient)


def test_large_thresholds_match_cv2():
    """L2 clamps thresholds to 32767 before squaring; nothing passes thresholds this high."""
    image = random_image((30, 30, 3), seed=5)
    for aperture_size, l2_gradient in VARIANTS:
        for low, high in [(4e4, 5e4), (0, 1e9), (-1e9, 5)]:
            assert_matches_cv2(image, low, high, aperture_size, l2_gradient)


def test_rgb_channel_with_largest_gradient_wins():
    """Edges in only one channel are found, as cv2 takes the strongest channel per pixel."""
    image = np.zeros((30, 30, 3), np.uint8)
    image[:, 15:, 2] = 255
    image[10:, :, 0] = 120
    edges = assert_matches_cv2(image, 100, 200)
    # A step between columns 14 and 15 gives a two-pixel ridge; the tie rule keeps column 14.
    assert edges[:, 14].all() and not edges[:, 15].any()
    assert edges[9, :14].all()


@pytest.mark.parametrize("aperture_size", [-1, 1, 4, 9])
def test_unsupported_aperture_is_a_value_error(aperture_size):
    with pytest.raises(ValueError, match="aperture_size"):
        canny(random_image((8, 8), seed=0), 10, 20, aperture_size=aperture_size)


@pytest.mark.parametrize(
    ("image", "match"),
    [
        (np.zeros((8, 8), np.float32), "uint8"),
        (np.zeros((8, 8, 4), np.uint8), "shape"),
        (np.zeros((8,), np.uint8), "shape"),
    ],
)
def test_unsupported_image_is_a_value_error(image, match):
    with pytest.raises(ValueError, match=match):
        canny(image, 10, 20)


def test_non_finite_threshold_is_a_value_error():
    with pytest.raises(ValueError, match="finite"):
        canny(random_image((8, 8), seed=0), float("nan"), 20)


def test_apply_equals_the_diffusers_cv2_pipeline():
    rgb = smooth_scene(48, 64, 3, seed=9)
    photo = Image.fromarray(rgb)
    edges = cv2.Canny(np.array(photo), 100, 200)
    expected = np.concatenate([edges[:, :, None]] * 3, axis=2)
    result = ControlPreprocess(low=100, high=200).apply(photo)
    assert result.mode == "RGB" and result.size == photo.size
    np.testing.assert_array_equal(np.asarray(result), expected)
    assert expected.any()


@pytest.mark.parametrize("mode", ["L", "RGBA", "P"])
def test_apply_converts_other_modes_to_rgb_first(mode):
    photo = Image.fromarray(smooth_scene(32, 40, 3, seed=4)).convert(mode)
    rgb = np.array(photo.convert("RGB"))
    expected = cv2.Canny(rgb, 60, 120)
    result = np.asarray(ControlPreprocess(low=60, high=120).apply(photo))
    for channel in range(3):
        np.testing.assert_array_equal(result[:, :, channel], expected)


def test_from_dict_defaults_and_values():
    assert ControlPreprocess.from_dict({}, "job.control") == ControlPreprocess("canny", 100, 200)
    config = ControlPreprocess.from_dict(
        {"kind": "canny", "low": 50.5, "high": 50.5}, "job.control"
    )
    assert (config.kind, config.low, config.high) == ("canny", 50.5, 50.5)
    assert ControlPreprocess.from_dict({"low": np.int64(0), "high": 0}, "x").high == 0


@pytest.mark.parametrize(
    ("mapping", "match"),
    [
        ({"kind": "canny", "threshold": 3}, r"job\.control: unknown key.*threshold"),
        ({"kind": "depth"}, r"job\.control\.kind: .*'depth'"),
        ({"low": "100"}, r"job\.control\.low: must be a number"),
        ({"high": None}, r"job\.control\.high: must be a number"),
        ({"low": True}, r"job\.control\.low: must be a number"),
        ({"low": -1}, r"job\.control\.low: .*>= 0"),
        ({"high": float("inf")}, r"job\.control\.high: .*finite"),
        ({"low": 200, "high": 100}, r"job\.control\.low: must be <= high"),
        (["low", "high"], r"job\.control: expected a mapping"),
    ],
)
def test_from_dict_errors_name_where_and_key(mapping, match):
    with pytest.raises(ValueError, match=match):
        ControlPreprocess.from_dict(mapping, "job.control")


def test_direct_construction_is_validated_too():
    with pytest.raises(ValueError, match=r"ControlPreprocess\.high"):
        ControlPreprocess(high=-2)
