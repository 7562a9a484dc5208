"""Stage convert: a Hugging Face dataset -> sharded TFRecords of VAE latents + text embeddings.

Modules: ``config`` (ConvertConfig), ``media`` (decode/sample/resize), ``split`` (train/eval and
eval timesteps), ``source`` (open the dataset), ``encode`` (JAX encoders + Beam ModelHandler),
``pipeline`` (the Beam graph), ``run`` (the ``difforge convert`` driver). Importing this package
imports nothing heavy.
"""
