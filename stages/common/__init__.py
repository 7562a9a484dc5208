"""What the stages share, so that no stage imports another: the record format, reading a
convert artifact, checkpoints named through train/evaluate artifacts, the training objective,
eval-timestep scoring and the user-error type. Stages meet only through artifacts."""
