"""difforge stages: convert, train, evaluate, generate."""
