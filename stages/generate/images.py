"""Conditioning image files of prompt lines (image-to-video images, control images)."""

from __future__ import annotations

import io

from jaxcore import storage
from stages.common.errors import StageInputError


def read_image(uri: str, where: str):
    """A conditioning image file (local or gs://) as (PIL image, fully decoded; its bytes)."""
    from PIL import Image, UnidentifiedImageError

    try:
        data = storage.read_bytes(uri)
    except storage.StorageError:
        raise StageInputError(f"{where}: image {uri} does not exist") from None
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError) as err:
        raise StageInputError(f"{where}: {uri} is not a readable image: {err}") from None
    return image, data
