"""Config of the convert stage: ``difforge convert configs/stages/convert.yml key=value ...``.

Sections (each component receives only its own):

- ``dataset``: the Hugging Face source and its column names;
- ``media``: frames, frame rate and size of the clips fed to the VAE;
- ``encoder``: the diffusers-format pipeline directory whose VAE and text encoder encode;
- ``compute``: dtypes (and attention backend) of the encoders;
- ``split``: the deterministic train/eval split and the eval timesteps;
- ``shards``: TFRecord shard size (records or bytes);
- ``beam``: the runner and its options (DirectRunner, DataflowRunner, portable runners).

Bare keys resolve to their section when unique, so MaxDiffusion-style overrides such as
``source=...``, ``height=480``, ``runner=DataflowRunner`` work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from jaxcore.compute import ComputeConfig
from stages.common.records import DEFAULT_TIMESTEPS_LIST

# the item keys of a row's extra images (DatasetConfig.image_columns)
CONTROL_ITEM = "control"
REFERENCE_ITEM = "reference"
# the item key of a row's sound (DatasetConfig.audio_column)
SOUND_ITEM = "sound"

RUNNERS = (
    "DirectRunner",
    "DataflowRunner",
    "PortableRunner",
    "FlinkRunner",
    "SparkRunner",
    "PrismRunner",
)


@dataclass(frozen=True)
class DatasetConfig:
    """Where the rows come from.

    ``source``: a local folder (imagefolder/videofolder with metadata, parquet/JSON files, or a
    ``save_to_disk`` dataset), a parquet/JSON/CSV file or a hub id (when the network allows).
    A finished ``generate`` artifact is a source too: its renders, captioned with their prompts.
    The ``difforge`` command also accepts ``synthetic:shapes?num_items=N&seed=S&height=H&width=W``
    (the demo's shapes dataset, see ``pipelines.embedded.sources``).
    """

    source: str = ""
    revision: str | None = None
    dataset_split: str = "train"
    media_column: str = "image"
    caption_column: str = "text"
    # one caption for every row instead of the caption column (DreamBooth's instance prompt,
    # "a photo of sks dog"); None: the column's
    caption: str | None = None
    # "auto": the `id` column when there is one, else the media file's path relative to the
    # dataset folder, else a hash of the row's media bytes and caption (never the row index,
    # which changes when rows are added); a column name; or None: the row index.
    id_column: str | None = "auto"
    max_items: int | None = None
    # a column of ControlNet conditioning images (diffusers' --conditioning_image_column):
    # each row's is resized / centre-cropped as its image is and stored as pixels
    # (records.CONDITIONING_PIXELS); None: none
    conditioning_image_column: str | None = None
    # a column of reference images (the source image of an edit pair: diffusers' image
    # editing datasets' source / input image); one per row, resized / centre-cropped as its
    # image is, then encoded by the family as its pipelines encode a reference image (the
    # records' reference latents); refused for a family whose pipelines take none. None: none
    reference_image_column: str | None = None
    # a column of each clip's sound, for a family whose records hold it (LTX-2: video with
    # audio): a Hugging Face Audio feature ({"array", "sampling_rate"} or a file's bytes /
    # path: WAV, or anything ffmpeg decodes), or the media column itself (the videos' own sound
    # tracks). The clip's span (num_frames / fps seconds from its start) is kept, zero-padded
    # where the sound is shorter. Required by such a family, refused by the others. None: none
    audio_column: str | None = None

    def __post_init__(self):
        if not self.source:
            raise ValueError("source must name a dataset (a folder, a file or a hub id)")
        for key in ("media_column", "caption_column"):
            if not getattr(self, key):
                raise ValueError(f"{key} must be a column name")
        for key in ("conditioning_image_column", "reference_image_column", "audio_column"):
            if getattr(self, key) is not None and not getattr(self, key):
                raise ValueError(f"{key} must be a column name or null")
        if self.max_items is not None and self.max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {self.max_items}")

    @property
    def image_columns(self) -> dict[str, str]:
        """The extra image columns a row carries besides its media, by the item key they
        become (``control``: the ControlNet's image, ``reference``: an edit's source image)."""
        columns = {
            CONTROL_ITEM: self.conditioning_image_column,
            REFERENCE_ITEM: self.reference_image_column,
        }
        return {key: column for key, column in columns.items() if column}


@dataclass(frozen=True)
class MediaConfig:
    """Clip geometry: ``num_frames`` at ``fps``, resized and centre-cropped to height x width.

    Which sizes the model can encode (VAE compression, frame stride) is its family's rule,
    checked against the pipeline before the job starts.
    """

    height: int = 64
    width: int = 64
    num_frames: int = 1
    fps: float = 16.0

    def __post_init__(self):
        for key in ("height", "width", "num_frames"):
            value = getattr(self, key)
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if self.fps <= 0:
            raise ValueError(f"fps must be > 0, got {self.fps}")


@dataclass(frozen=True)
class EncoderConfig:
    """The diffusers-format pipeline whose VAE and text encoders encode (any supported family;
    ``model_index.json`` names it). How they compute is the ``compute`` section."""

    pretrained_model_name_or_path: str = ""
    max_sequence_length: int = 512
    batch_size: int = 4  # every encoder call is padded to this, so nothing recompiles
    large_model: bool = False  # share one model copy across the worker's processes
    # encoder calls in flight per worker process; null: 2 on CPU (one call of a small encoder
    # keeps only ~1.6 of two cores busy), 1 on an accelerator (a second call would hold a
    # second batch's activations)
    encode_threads: int | None = None

    def __post_init__(self):
        if not self.pretrained_model_name_or_path:
            raise ValueError("pretrained_model_name_or_path must name a pipeline directory")
        if self.max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {self.max_sequence_length}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.encode_threads is not None and self.encode_threads < 1:
            raise ValueError(f"encode_threads must be >= 1 or null, got {self.encode_threads}")


@dataclass(frozen=True)
class SplitConfig:
    """Train/eval split by source-id hash, and the eval timesteps (MaxDiffusion's list)."""

    eval_fraction: float = 0.1
    split_seed: int = 0
    timesteps_list: tuple[int, ...] = DEFAULT_TIMESTEPS_LIST

    def __post_init__(self):
        if not 0.0 <= self.eval_fraction <= 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1], got {self.eval_fraction}")
        if not self.timesteps_list:
            raise ValueError("timesteps_list must not be empty")
        bad = [t for t in self.timesteps_list if not 0 <= t <= 1000]
        if bad:
            raise ValueError(f"timesteps_list entries must be in [0, 1000], got {bad}")
        if len(set(self.timesteps_list)) != len(self.timesteps_list):
            raise ValueError(f"timesteps_list has duplicates: {list(self.timesteps_list)}")


@dataclass(frozen=True)
class ShardConfig:
    """Shard size: at most ``records_per_shard`` records and about ``max_shard_bytes`` bytes."""

    records_per_shard: int | None = 1000
    max_shard_bytes: int | None = None

    def __post_init__(self):
        if self.records_per_shard is None and self.max_shard_bytes is None:
            raise ValueError("set records_per_shard or max_shard_bytes (or both)")
        if self.records_per_shard is not None and self.records_per_shard < 1:
            raise ValueError(f"records_per_shard must be >= 1, got {self.records_per_shard}")
        if self.max_shard_bytes is not None and self.max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {self.max_shard_bytes}")


@dataclass(frozen=True)
class BeamConfig:
    """The Beam runner and its options; cloud fields are used by DataflowRunner only.

    ``DirectRunner`` runs the job in this machine's Beam FnApiRunner
    (:func:`stages.convert.pipeline.local_runner`), with ``direct_num_workers`` /
    ``direct_running_mode``; ``PrismRunner`` is Beam's Go runner (a binary Beam downloads).

    ``worker_accelerator`` is Dataflow's ``worker_accelerator`` service option, e.g.
    ``type:nvidia-l4;count:1;install-nvidia-driver``. ``extra_options`` are passed to Beam as
    they are (``--flink_master=...``, ``--environment_type=DOCKER``, ...).
    """

    runner: str = "DirectRunner"
    direct_num_workers: int = 1
    direct_running_mode: str = "in_memory"
    project: str | None = None
    region: str | None = None
    temp_location: str | None = None
    staging_location: str | None = None
    sdk_container_image: str | None = None
    setup_file: str | None = None
    machine_type: str | None = None
    max_num_workers: int | None = None
    worker_accelerator: str | None = None
    job_name: str | None = None
    dry_run: bool = False  # DataflowRunner: build and stage the job, submit nothing
    extra_options: tuple[str, ...] = ()

    def __post_init__(self):
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {list(RUNNERS)}, got {self.runner!r}")
        if self.direct_running_mode not in ("in_memory", "multi_threading", "multi_processing"):
            raise ValueError(
                "direct_running_mode must be in_memory, multi_threading or multi_processing, "
                f"got {self.direct_running_mode!r}"
            )
        if self.direct_num_workers < 1:
            raise ValueError(f"direct_num_workers must be >= 1, got {self.direct_num_workers}")
        if self.runner == "DataflowRunner":
            missing = [k for k in ("project", "region", "temp_location") if not getattr(self, k)]
            if missing:
                raise ValueError(f"DataflowRunner needs {', '.join(missing)}")
        bad = [o for o in self.extra_options if not o.startswith("--")]
        if bad:
            raise ValueError(f"extra_options must look like --name=value, got {bad}")


@dataclass(frozen=True)
class ConvertConfig:
    """The whole convert stage config (see the module docstring)."""

    output_dir: str = ""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    media: MediaConfig = field(default_factory=MediaConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    shards: ShardConfig = field(default_factory=ShardConfig)
    beam: BeamConfig = field(default_factory=BeamConfig)
    max_bad_fraction: float = 0.05
    run_name: str = "convert"
    # incremental convert (stages/convert/incremental.py): an earlier convert artifact, or a
    # pointer to one, whose rows are not encoded again; the pointer this run moves to its
    # artifact once committed (a scheduled job passes the same URI as both); whether rows the
    # source no longer has are left out of what train/evaluate read.
    base: str | None = None
    latest: str | None = None
    drop_removed: bool = False

    def __post_init__(self):
        if not self.output_dir:
            raise ValueError("output_dir must name the artifact folder (local path or gs://)")
        self.compute.check_unquantized("convert")
        if self.drop_removed and not self.base:
            raise ValueError("drop_removed needs base (rows are removed relative to a base)")
        if self.latest and self.latest.rstrip("/") == self.output_dir.rstrip("/"):
            raise ValueError("latest must be a pointer object outside output_dir")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ValueError(f"max_bad_fraction must be in [0, 1], got {self.max_bad_fraction}")

    def replace(self, **changes) -> ConvertConfig:
        return dataclasses.replace(self, **changes)
