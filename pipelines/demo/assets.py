"""Assets of the CPU demo: a restricted-palette shapes dataset, a tiny Wan pipeline whose VAE
really reconstructs those shapes, the prompts, and the programmatic colour check.

The demo trains a tiny Wan DiT from scratch on coloured shapes and then checks that generated
images show the colour each prompt asks for. Two things make that possible in minutes of CPU:

- a small, well-separated palette (:data:`DEMO_COLOURS` shapes on :data:`DEMO_BACKGROUNDS`,
  :data:`DEMO_SHAPES`), 32x32 images, and a dataset in which every prompt's combination occurs;
- a VAE fitted on the shapes (``configs/models/demo_vae``, made by ``fit-vae`` below with
  :mod:`pipelines.demo.vae_fitting`): 2x spatial compression, ``z_dim`` 4, so 32x32 images become
  16x16x4 latents, 64 transformer tokens with patch (1, 2, 2).

Command line::

    python -m pipelines.demo.assets fit-vae --out configs/models/demo_vae [--steps N]
    python -m pipelines.demo.assets build ROOT [--num-items N]

Public API: :func:`build_demo_assets`, :func:`check_colours`, :func:`demo_prompts`,
:func:`make_demo_items`, :func:`write_demo_dataset`, :func:`fit_demo_vae`, :func:`parse_prompt`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import itertools
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from pipelines.embedded import shapes as synthetic

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
DEMO_VAE_DIR = REPO / "configs/models/demo_vae"
DEMO_MODEL_YAML = REPO / "configs/models/wan_demo.yml"

# Well separated in RGB (see synthetic.COLOURS), so a blurry 32x32 sample still reads clearly.
DEMO_COLOURS: tuple[str, ...] = ("red", "green", "blue", "yellow")
DEMO_BACKGROUNDS: tuple[str, ...] = ("white", "black")
DEMO_SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
DEMO_IMAGE_SIZE = 32
# (colour, shape, background) combinations the demo's training data leaves out while its prompts
# still ask for them: 4 of the 24 (1/6), one per colour, two per background, every shape. Each
# one's pairs (colour-shape, colour-background, shape-background) all occur in training, so
# rendering them right takes composing what the model learnt, not recalling a training image.
DEMO_HELD_OUT: tuple[tuple[str, str, str], ...] = (
    ("red", "triangle", "white"),
    ("green", "square", "black"),
    ("blue", "circle", "white"),
    ("yellow", "triangle", "black"),
)

# The demo's random-init UMT5 with its residual branches' output projections scaled by this
# (pipelines.embedded.tiny.scale_residual_branches). At 1.0 its two blocks mix so much of the
# sentence into each word that a word's output embedding changes from prompt to prompt almost as
# much as between words (cosine of the colour word across the 24 prompts: mean 0.75, min 0.29),
# so every colour/shape/background combination reached the DiT as its own random code and a
# held-out one as a code never seen; a trained encoder keeps a word recognisable in any
# sentence. At 0.3: mean 0.97, min 0.92 (shape word 0.93, background 0.95), other words still
# far (max 0.25); context still enters. Measured by tests/pipelines/test_demo_assets.py.
DEMO_TEXT_ENCODER_BRANCH_SCALE = 0.3

# The demo VAE (its architecture; latents_mean/std are measured by fit-vae).
DEMO_VAE_ARCHITECTURE = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=(1, 2),
    num_res_blocks=1,
    attn_scales=(),
    temperal_downsample=(True,),
    dropout=0.0,
)

ASSETS_STAMP = ".demo_asset.json"


# ----------------------------------------------------------------------------------------------
# Dataset and prompts
# ----------------------------------------------------------------------------------------------


def demo_combinations() -> list[tuple[str, str, str]]:
    """Every (colour, shape, background) of the demo palette: 4 x 3 x 2 = 24, fixed order."""
    return list(itertools.product(DEMO_COLOURS, DEMO_SHAPES, DEMO_BACKGROUNDS))


def training_combinations(
    held_out: Sequence[tuple[str, str, str]] = DEMO_HELD_OUT,
) -> list[tuple[str, str, str]]:
    """:func:`demo_combinations` less ``held_out``, in the same order."""
    unknown = set(map(tuple, held_out)) - set(demo_combinations())
    if unknown:
        raise ValueError(f"held-out combinations {sorted(unknown)} are not demo combinations")
    held = set(map(tuple, held_out))
    return [c for c in demo_combinations() if c not in held]


def make_demo_items(
    num_items: int,
    image_size: int,
    seed: int,
    held_out: Sequence[tuple[str, str, str]] = DEMO_HELD_OUT,
) -> list[dict]:
    """Shape items of the demo palette, like :func:`pipelines.embedded.shapes.make_items` makes them.

    Combinations are dealt from a seeded shuffle of :func:`training_combinations` (every demo
    combination but ``held_out``; pass ``()`` for all 24), reshuffled each round, so with
    ``num_items`` >= their number every one is in the dataset and the classes stay balanced.
    Position and size come from :func:`pipelines.embedded.shapes.draw_shape`.
    """
    if num_items < 1:
        raise ValueError(f"num_items must be >= 1, got {num_items}")
    rng = np.random.default_rng(seed)
    combos = training_combinations(held_out)
    items = []
    for i in range(num_items):
        if i % len(combos) == 0:
            order = rng.permutation(len(combos))
        colour, shape, background = combos[order[i % len(combos)]]
        image = synthetic.draw_shape(shape, colour, background, image_size, image_size, rng)
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        items.append(
            {
                "id": f"demo-{seed}-{i:05d}",
                "image_bytes": buf.getvalue(),
                "text": synthetic.caption_for(colour, shape, background),
                "colour": colour,
                "shape": shape,
                "background": background,
            }
        )
    return items


def decode_items(items: Sequence[dict]) -> np.ndarray:
    """The items' PNGs as uint8 ``[N, H, W, 3]``."""
    from PIL import Image

    return np.stack(
        [np.asarray(Image.open(io.BytesIO(it["image_bytes"])).convert("RGB")) for it in items]
    )


def write_demo_dataset(
    directory: str | os.PathLike,
    num_items: int,
    image_size: int,
    seed: int,
    held_out: Sequence[tuple[str, str, str]] = DEMO_HELD_OUT,
):
    """The demo dataset in the ``imagefolder`` layout of :mod:`pipelines.embedded.shapes` (PNGs plus
    ``metadata.jsonl`` with ``file_name``, ``id``, ``text``, ``colour``, ``shape``,
    ``background``), readable with ``datasets.load_dataset(directory)``; without ``held_out``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for item in make_demo_items(num_items, image_size, seed, held_out):
        name = f"{item['id']}.png"
        (directory / name).write_bytes(item["image_bytes"])
        meta = {k: v for k, v in item.items() if k != "image_bytes"}
        lines.append(json.dumps({"file_name": name, **meta}))
    (directory / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def demo_prompts(seed: int = 0, renders: int = 1) -> list[dict]:
    """The demo prompts ``{id, prompt, seed}``: ``renders`` per :func:`demo_combinations` entry
    (held-out combinations included: the check grades them apart), each with its own seed, so
    a grade is a share of ``24 x renders`` images rather than of one draw per prompt. Render
    ``r`` of a combination is ``<colour>-<shape>-on-<background>`` plus ``-r<r>`` from the
    second on; the first render of each keeps the seed it had with ``renders=1``."""
    if renders < 1:
        raise ValueError(f"renders must be >= 1, got {renders}")
    combos = demo_combinations()
    return [
        {
            "id": f"{colour}-{shape}-on-{background}" + (f"-r{r}" if r else ""),
            "prompt": synthetic.caption_for(colour, shape, background),
            "seed": seed * 1000 + r * len(combos) + i,
        }
        for r in range(renders)
        for i, (colour, shape, background) in enumerate(combos)
    ]


# ----------------------------------------------------------------------------------------------
# The colour check
# ----------------------------------------------------------------------------------------------

_PROMPT = re.compile(r"^\s*an?\s+(\w+)\s+(\w+)\s+on\s+an?\s+(\w+)\s+background\b", re.IGNORECASE)


class PromptParts(NamedTuple):
    colour: str
    shape: str
    background: str


def parse_prompt(prompt: str) -> PromptParts:
    """'a red circle on a white background' -> (red, circle, white); ValueError otherwise."""
    match = _PROMPT.match(prompt)
    if not match:
        raise ValueError(
            f"prompt {prompt!r} does not read 'a <colour> <shape> on a <colour> background'"
        )
    colour, shape, background = (word.lower() for word in match.groups())
    for role, word in (("colour", colour), ("background", background)):
        if word not in synthetic.COLOURS:
            raise ValueError(
                f"prompt {prompt!r}: {role} {word!r} is not one of {list(synthetic.COLOURS)}"
            )
    return PromptParts(colour, shape, background)


@dataclasses.dataclass(frozen=True)
class ColourCheck:
    """The verdict on one image: the colour asked for, the colour found, and why."""

    prompt: str
    expected: str
    found: str | None
    passed: bool
    background_expected: str
    background_found: str | None
    shape_fraction: float  # share of pixels far from the background colour
    colour_share: float  # share of those pixels whose nearest palette colour is `found`


@dataclasses.dataclass(frozen=True)
class ColourReport:
    checks: tuple[ColourCheck, ...]

    @property
    def pass_fraction(self) -> float:
        return sum(c.passed for c in self.checks) / len(self.checks) if self.checks else 0.0

    def passed(self, threshold: float = 0.8) -> bool:
        return bool(self.checks) and self.pass_fraction >= threshold

    def to_dict(self) -> dict:
        return {
            "pass_fraction": self.pass_fraction,
            "checks": [dataclasses.asdict(c) for c in self.checks],
        }


@dataclasses.dataclass(frozen=True)
class ColourCheckOptions:
    """Thresholds of :func:`check_colours` (RGB distances on 0..255, fractions of pixels).

    ``foreground_distance``: a pixel belongs to the shape if it is this far from the
    background estimate. ``palette_distance``: a shape pixel votes for its nearest palette
    colour only when that colour is this close (noise votes for nothing). The shape must
    cover ``min_shape_fraction`` .. ``max_shape_fraction`` of the image (the demo draws radii
    of 0.2-0.35 of the side: ~6-40%), and the winning colour must hold ``min_colour_share``
    of the shape's pixels.
    """

    foreground_distance: float = 80.0
    palette_distance: float = 70.0
    min_shape_fraction: float = 0.02
    max_shape_fraction: float = 0.7
    min_colour_share: float = 0.5
    border: int = 2


def _nearest_palette(pixels_n3: np.ndarray, palette: dict[str, tuple[int, int, int]]):
    """(index of the nearest palette colour, its distance) per pixel."""
    colours = np.asarray(list(palette.values()), np.float64)
    distances = np.linalg.norm(pixels_n3[:, None, :] - colours[None], axis=-1)
    return distances.argmin(-1), distances.min(-1)


def _border_pixels(image: np.ndarray, width: int) -> np.ndarray:
    mask = np.zeros(image.shape[:2], bool)
    mask[:width], mask[-width:], mask[:, :width], mask[:, -width:] = True, True, True, True
    return image[mask]


def check_image(
    image: np.ndarray, prompt: str, options: ColourCheckOptions = ColourCheckOptions()
) -> ColourCheck:
    """Does ``image`` (uint8 HxWx3) show a shape of the colour ``prompt`` asks for?

    Background = per-channel median of the border pixels; shape = pixels far from it; the
    shape's colour = the palette colour (:data:`pipelines.embedded.shapes.COLOURS`) with most votes
    among shape pixels close to some palette colour. Blank images have no shape; noise has
    no shape colour with a majority; both fail.
    """
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(
            f"image for {prompt!r} must be uint8 HxWx3, got {image.dtype} {image.shape}"
        )
    expected = parse_prompt(prompt)
    palette = synthetic.COLOURS
    names = list(palette)
    pixels = image.reshape(-1, 3).astype(np.float64)
    background = np.median(_border_pixels(image, options.border).astype(np.float64), axis=0)
    bg_index, bg_distance = _nearest_palette(background[None], palette)
    background_found = names[bg_index[0]] if bg_distance[0] <= options.palette_distance else None
    foreground = np.linalg.norm(pixels - background, axis=-1) > options.foreground_distance
    shape_fraction = float(foreground.mean())
    found, share = None, 0.0
    if options.min_shape_fraction <= shape_fraction <= options.max_shape_fraction:
        index, distance = _nearest_palette(pixels[foreground], palette)
        votes = np.bincount(index[distance <= options.palette_distance], minlength=len(names))
        winner = int(votes.argmax())
        share = float(votes[winner] / foreground.sum())
        if share >= options.min_colour_share:
            found = names[winner]
    return ColourCheck(
        prompt=prompt,
        expected=expected.colour,
        found=found,
        passed=found == expected.colour,
        background_expected=expected.background,
        background_found=background_found,
        shape_fraction=shape_fraction,
        colour_share=share,
    )


def check_colours(
    images: Sequence[np.ndarray],
    prompts: Sequence[str],
    options: ColourCheckOptions = ColourCheckOptions(),
) -> ColourReport:
    """Check each image against its prompt (see :func:`check_image`); report per prompt."""
    if len(images) != len(prompts):
        raise ValueError(f"check_colours: {len(images)} images but {len(prompts)} prompts")
    return ColourReport(
        tuple(check_image(im, p, options) for im, p in zip(images, prompts, strict=True))
    )


# ----------------------------------------------------------------------------------------------
# Fitting and shipping the demo VAE
# ----------------------------------------------------------------------------------------------


def demo_vae_config():
    """The demo VAE's WanVAEConfig with neutral latent statistics (before fitting)."""
    from jaxcore.models.wan_vae import WanVAEConfig

    z_dim = DEMO_VAE_ARCHITECTURE["z_dim"]
    return WanVAEConfig(
        **DEMO_VAE_ARCHITECTURE, latents_mean=(0.0,) * z_dim, latents_std=(1.0,) * z_dim
    )


def fit_demo_vae(
    out: str | os.PathLike,
    *,
    steps: int = 4000,
    num_images: int = 2048,
    batch_size: int = 16,
    crop_size: int | None = None,
    learning_rate: float = 4e-3,
    kl_weight: float = 1e-3,
    image_size: int = DEMO_IMAGE_SIZE,
    seed: int = 0,
) -> dict:
    """Fit the demo VAE on synthetic shapes, save it to ``out``, return held-out metrics.

    Training images: :func:`pipelines.embedded.shapes.make_items` (all 8 colours, 5 shapes) plus as
    many demo-palette items, so the VAE covers the demo and more. Held-out images use other
    seeds. ``latents_mean/std`` are measured on the training images.

    The defaults made the shipped VAE (about 7 minutes on 2 cores): held out 34.4 dB on the demo
    palette, 31.3 dB on all colours. Fidelity matters downstream: the VAE fitted before (1,500
    steps on 16-pixel crops, 29 dB) rounded triangles off, and the demo's shape grade was 43-69%
    with it against 81-91% with this one (same three seeds), the DiT and its training unchanged
    (docs/demo.md).
    """
    from jaxcore.models.wan_vae import WanVAE
    from pipelines.demo import vae_fitting

    half = num_images // 2
    train = np.concatenate(
        [
            decode_items(synthetic.make_items(num_images - half, image_size, image_size, seed)),
            decode_items(make_demo_items(half, image_size, seed, held_out=())),
        ]
    )
    config = demo_vae_config()
    params, history = vae_fitting.fit_wan_vae(
        config,
        train,
        steps=steps,
        batch_size=batch_size,
        learning_rate=learning_rate,
        kl_weight=kl_weight,
        seed=seed,
        crop_size=crop_size,
        log_every=max(1, steps // 20),
    )
    module = WanVAE(config)
    mean, std = vae_fitting.latent_stats(module, params, train)
    config = vae_fitting.with_latent_stats(config, mean, std)
    vae_fitting.save_wan_vae(out, config, params)
    metrics = evaluate_vae(module, params, image_size, seed=seed + 1)
    metrics["final_train"] = history[-1]
    metrics["latents_mean"], metrics["latents_std"] = (
        list(config.latents_mean),
        list(config.latents_std),
    )
    return metrics


def evaluate_vae(module, params, image_size: int = DEMO_IMAGE_SIZE, *, seed: int = 1) -> dict:
    """Held-out PSNR (all-palette and demo-palette shapes) and the colour check on the
    reconstructions of the 24 demo combinations."""
    from pipelines.demo import vae_fitting

    general = decode_items(synthetic.make_items(128, image_size, image_size, seed))
    demo_items = make_demo_items(48, image_size, seed, held_out=())
    demo = decode_items(demo_items)
    demo_rec = vae_fitting.reconstruct(module, params, demo)
    report = check_colours(list(demo_rec), [it["text"] for it in demo_items])
    return {
        "psnr_all_palette": vae_fitting.psnr(
            general, vae_fitting.reconstruct(module, params, general)
        ),
        "psnr_demo_palette": vae_fitting.psnr(demo, demo_rec),
        "colour_check_pass_fraction": report.pass_fraction,
    }


# ----------------------------------------------------------------------------------------------
# Building the demo's assets
# ----------------------------------------------------------------------------------------------


class DemoAssets(NamedTuple):
    dataset: Path  # imagefolder shapes dataset
    pipeline: Path  # diffusers-format WanPipeline directory
    prompts: Path  # prompts.jsonl


def _stamp_file(path: Path) -> Path:
    """Where an asset's stamp lives: inside a folder asset, beside a file asset."""
    return path / ASSETS_STAMP if path.is_dir() else path.with_name(path.name + ASSETS_STAMP)


def _is_complete(path: Path, stamp: dict) -> bool:
    marker = _stamp_file(path)
    return path.exists() and marker.exists() and json.loads(marker.read_text()) == stamp


def _build_dir(final: Path, stamp: dict, build) -> Path:
    """Run ``build(tmp_dir)`` unless ``final`` is complete with the same stamp, then move the
    finished folder into place, so an interrupted build never looks complete."""
    if _is_complete(final, stamp):
        log.info("demo asset %s is complete; skipping", final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        _stamp_file(tmp).write_text(json.dumps(stamp, sort_keys=True))
        if final.exists():
            log.info("demo asset %s is stale or incomplete; replacing it", final)
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_prompts(path: Path, seed: int, renders: int) -> Path:
    stamp = {"asset": "prompts", "seed": seed, "renders": renders}
    if _is_complete(path, stamp):
        return path
    text = "".join(json.dumps(p) + "\n" for p in demo_prompts(seed, renders))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    _stamp_file(path).write_text(json.dumps(stamp, sort_keys=True))
    return path


def assets_digest(assets: DemoAssets) -> str:
    """One digest of what the demo's assets were built from (their stamps): it changes whenever
    an asset is rebuilt differently (another VAE, encoder scale, data seed, prompt count)."""
    stamps = [json.loads(_stamp_file(path).read_text()) for path in assets]
    return hashlib.sha256(json.dumps(stamps, sort_keys=True).encode()).hexdigest()[:20]


def _check_vae_dir(vae_dir: Path) -> None:
    for name in ("config.json", "diffusion_pytorch_model.safetensors"):
        if not (vae_dir / name).is_file():
            raise FileNotFoundError(
                f"demo VAE {vae_dir} lacks {name}; run `python -m pipelines.demo.assets fit-vae "
                f"--out {vae_dir}`"
            )


def build_demo_assets(
    root: str | os.PathLike,
    *,
    num_items: int = 480,
    seed: int = 0,
    image_size: int = DEMO_IMAGE_SIZE,
    model_yaml: str | os.PathLike = DEMO_MODEL_YAML,
    vae_dir: str | os.PathLike = DEMO_VAE_DIR,
    held_out: Sequence[tuple[str, str, str]] = (),
    renders_per_prompt: int = 1,
) -> DemoAssets:
    """Write ``root/assets/{shapes, tiny_wan, prompts.jsonl}``; skip each one already complete.

    ``held_out``: combinations left out of the dataset (the demo's ``hold_out=true`` passes
    :data:`DEMO_HELD_OUT`); the prompts always cover all 24, ``renders_per_prompt`` times each
    (:func:`demo_prompts`).

    ``shapes``: :func:`write_demo_dataset`; ``tiny_wan``: a random-init diffusers WanPipeline
    from ``model_yaml`` (:func:`pipelines.embedded.tiny.build_tiny_wan_pipeline`) whose ``vae/``
    is the fitted ``vae_dir``; ``prompts.jsonl``: :func:`demo_prompts`. Each folder is built
    aside and moved into place when finished; a stamp of its parameters marks it complete,
    so a rerun with other parameters rebuilds it.
    """
    from pipelines.embedded.tiny import build_tiny_wan_pipeline

    vae_dir = Path(vae_dir)
    _check_vae_dir(vae_dir)
    assets = Path(root) / "assets"
    assets.mkdir(parents=True, exist_ok=True)
    dataset_stamp = {
        "asset": "shapes",
        "num_items": num_items,
        "seed": seed,
        "image_size": image_size,
        "held_out": [list(c) for c in held_out],
    }
    dataset = _build_dir(
        assets / "shapes",
        dataset_stamp,
        lambda tmp: write_demo_dataset(tmp, num_items, image_size, seed, tuple(held_out)),
    )

    def build_pipeline(tmp: Path) -> None:
        build_tiny_wan_pipeline(
            tmp,
            seed=seed,
            model_config=model_yaml,
            text_encoder_branch_scale=DEMO_TEXT_ENCODER_BRANCH_SCALE,
        )
        shutil.rmtree(tmp / "vae")
        shutil.copytree(vae_dir, tmp / "vae")

    vae_bytes = (vae_dir / "diffusion_pytorch_model.safetensors").read_bytes()
    pipeline_stamp = {
        "asset": "tiny_wan",
        "seed": seed,
        "model_yaml": Path(model_yaml).read_text(),
        "text_encoder_branch_scale": DEMO_TEXT_ENCODER_BRANCH_SCALE,
        "vae_config": json.loads((vae_dir / "config.json").read_text()),
        "vae_weights_sha256": hashlib.sha256(vae_bytes).hexdigest(),
    }
    pipeline = _build_dir(assets / "tiny_wan", pipeline_stamp, build_pipeline)
    prompts = _write_prompts(assets / "prompts.jsonl", seed, renders_per_prompt)
    return DemoAssets(dataset, pipeline, prompts)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipelines.demo.assets", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    fit = commands.add_parser("fit-vae", help="fit the demo VAE and write it in diffusers format")
    fit.add_argument("--out", default=str(DEMO_VAE_DIR))
    fit.add_argument("--steps", type=int, default=4000)
    fit.add_argument("--num-images", type=int, default=2048)
    fit.add_argument("--batch-size", type=int, default=16)
    fit.add_argument(
        "--crop-size",
        type=int,
        default=0,
        help="train on random crops of this size (0: whole images, as the shipped VAE was: "
        "16-pixel crops for 1,500 steps gave 29 dB and a demo whose shapes came out rounded)",
    )
    fit.add_argument("--learning-rate", type=float, default=4e-3)
    fit.add_argument("--kl-weight", type=float, default=1e-3)
    fit.add_argument("--seed", type=int, default=0)
    build = commands.add_parser("build", help="write ROOT/assets (dataset, pipeline, prompts)")
    build.add_argument("root")
    build.add_argument("--num-items", type=int, default=480)
    build.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "fit-vae":
        metrics = fit_demo_vae(
            args.out,
            steps=args.steps,
            num_images=args.num_images,
            batch_size=args.batch_size,
            crop_size=args.crop_size or None,
            learning_rate=args.learning_rate,
            kl_weight=args.kl_weight,
            seed=args.seed,
        )
        print(json.dumps(metrics, indent=2))
        print(
            f"held-out reconstruction PSNR: {metrics['psnr_all_palette']:.2f} dB (all colours), "
            f"{metrics['psnr_demo_palette']:.2f} dB (demo palette); wrote {args.out}"
        )
    else:
        print(
            json.dumps(
                build_demo_assets(args.root, num_items=args.num_items, seed=args.seed)._asdict(),
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
