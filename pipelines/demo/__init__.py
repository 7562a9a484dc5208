"""The CPU demo and the embedded defaults: everything that exists for the demo, tests and
benchmarks rather than for users' models.

- :mod:`pipelines.demo.run`: ``difforge demo`` (assets, the demo chain, the colour check);
- :mod:`pipelines.demo.assets`: the shapes dataset, the demo's tiny Wan pipeline, the prompts;
- :mod:`pipelines.demo.tiny`: random-init tiny pipelines written in diffusers' format;
- :mod:`pipelines.demo.tokenizers`: offline tiny tokenizers for them;
- :mod:`pipelines.demo.vae_fitting`: fitting the demo's tiny VAE;
- :mod:`pipelines.demo.shapes`: the synthetic coloured-shapes dataset;
- :mod:`pipelines.demo.embedded`: the ``tiny`` and ``synthetic:`` sources the CLI resolves
  before a stage runs (the stages themselves only see real paths).
"""
