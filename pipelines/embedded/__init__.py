"""The embedded default: what the stages run on when a user names no real data or model.

- :mod:`pipelines.embedded.sources`: the ``tiny`` and ``synthetic:`` sources the CLI resolves
  before a stage runs (the stages themselves only see real paths);
- :mod:`pipelines.embedded.tiny`: random-init tiny pipelines of each family, written in
  diffusers' format;
- :mod:`pipelines.embedded.tokenizers`: offline tiny tokenizers for them;
- :mod:`pipelines.embedded.shapes`: the synthetic coloured-shapes dataset.

The demo (:mod:`pipelines.demo`), the tests and the benchmarks build on these; the product
imports them here and never imports the demo.
"""
