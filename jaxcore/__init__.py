"""jaxcore: the shared JAX library every difforge stage calls (models, kernels, sharding, weights)."""
