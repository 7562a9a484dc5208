"""difforge benchmarks: ``python -m bench.run`` (``make bench``).

Each module measures one thing against a reference in the same process and returns result
records (plain dicts, see :mod:`bench.common`); ``bench.run`` adds the machine's matmul limit,
ratios and fractions, and writes ``bench/results/latest.json`` and ``latest.md``.
"""
