"""Stage ``evaluate``: eval-timestep loss of training checkpoints (SD3 / MaxDiffusion / MLPerf).

Light on purpose: importing this package does not import JAX or TensorFlow.
"""
