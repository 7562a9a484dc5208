"""Stage ``train``: sharded flow-matching training of any model family on converted TFRecords.

Light on purpose: importing this package does not import JAX or TensorFlow.
"""
