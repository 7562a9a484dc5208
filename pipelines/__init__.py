"""difforge pipelines: the CLI and the chaining of stages through artifacts."""
