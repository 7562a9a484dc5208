"""The encoders as a Beam ``ModelHandler``, for ``RunInference`` jobs with ``large_model``.

``large_model=true`` shares one copy of the encoders between a worker's processes (Beam's
``share_model_across_processes``), which only ``RunInference`` does. Importing this module
imports ``apache_beam.ml`` (and, through it, torch when installed): the default graph encodes
with :class:`stages.convert.pipeline.EncodeBatches` instead and never imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from apache_beam.ml.inference.base import ModelHandler

from jaxcore.families import Encoders
from stages.convert.encode import EncoderHandler


class EncoderModelHandler(ModelHandler[dict, dict, Encoders]):
    """Beam ``ModelHandler`` delegating to an :class:`~stages.convert.encode.EncoderHandler`."""

    def __init__(self, handler: EncoderHandler):
        super().__init__()
        self._handler = handler

    def load_model(self) -> Encoders:
        return self._handler.load_model()

    def run_inference(
        self, batch: Sequence[dict], model: Encoders, inference_args: dict | None = None
    ) -> Iterable[dict]:
        return self._handler.run_inference(batch, model, inference_args)

    def batch_elements_kwargs(self) -> dict[str, Any]:
        return self._handler.batch_elements_kwargs()

    def share_model_across_processes(self) -> bool:
        return self._handler.share_model_across_processes()

    def get_metrics_namespace(self) -> str:
        return self._handler.get_metrics_namespace()
