"""Config of the ``evaluate`` stage (frozen dataclass; MaxDiffusion names where they exist)."""

from __future__ import annotations

import dataclasses

from jaxcore.compute import ComputeConfig
from jaxcore.sharding import MeshConfig


@dataclasses.dataclass(frozen=True)
class EvaluateConfig:
    """``difforge evaluate configs/stages/evaluate.yml checkpoints=<train> data=<convert>``.

    ``steps``: the checkpoint steps to score (None = every checkpoint the train artifact keeps).
    ``eval_seed``: the noise of each record is ``fold_in(key(eval_seed), hash(source_id))``.
    """

    checkpoints: str
    data: str
    output_dir: str
    steps: list[int] | None = None
    split: str = "eval"
    eval_batch_size: int = 8
    eval_seed: int = 0
    max_eval_records: int | None = None
    compute: ComputeConfig = dataclasses.field(default_factory=ComputeConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    def __post_init__(self):
        if self.eval_batch_size < 1:
            raise ValueError(f"eval_batch_size must be >= 1, got {self.eval_batch_size}")
        if self.max_eval_records is not None and self.max_eval_records < 1:
            raise ValueError(f"max_eval_records must be >= 1, got {self.max_eval_records}")
