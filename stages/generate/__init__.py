"""The ``generate`` stage: bulk rendering of a prompt file to images and videos.

Light on purpose (no JAX import): ``config`` holds the dataclasses, ``prompts`` parses prompt
files, ``render`` drives the JAX pipeline, ``outputs`` writes files/records/gallery, ``run`` is
the thin entry point.
"""
