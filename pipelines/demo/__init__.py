"""The CPU demo: ``difforge demo`` and what exists only for it.

- :mod:`pipelines.demo.run`: ``difforge demo`` (assets, the demo chain, the colour check);
- :mod:`pipelines.demo.assets`: the shapes dataset, the demo's tiny Wan pipeline, the prompts;
- :mod:`pipelines.demo.vae_fitting`: fitting the demo's tiny VAE;
- :mod:`pipelines.demo.grading`: the per-attribute grades of the renders.

It builds on the embedded default (:mod:`pipelines.embedded`); nothing in the product imports
it (the command table names it by import path).
"""
