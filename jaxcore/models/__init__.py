"""One architecture per file."""
