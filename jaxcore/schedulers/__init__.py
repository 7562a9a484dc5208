"""Pure, jittable samplers/schedulers."""
