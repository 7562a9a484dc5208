"""Two ``make bench`` runs side by side: ``python -m bench.compare A.json B.json [--labels a b]``.

For every (bench, case) both runs measured, difforge's median in each, the ratio of the two
(A / B: > 1 means B is faster) and, where the run timed a reference in the same script
(diffusers or PyTorch eager, diffusers' WanPipeline), difforge's ratio to it in each run
(reference / difforge), which does not drift with the machine between the runs. Used for the
platform comparison (``bench/results/platform/``: jax 0.10.2 against 0.12.0.1 and 0.12.1) and
for switching one mechanism off (``python -m bench.ablate``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.run import _fmt_seconds

OURS = ("difforge", "difforge_beam")
REFERENCES = ("diffusers_eager", "pytorch eager", "diffusers_wanpipeline")


def _timed(results: list[dict]) -> dict[tuple[str, str, str], dict]:
    return {(r["bench"], r["case"], r["impl"]): r for r in results if r.get("median_s")}


def _reference_ratio(timed: dict, bench: str, case: str, ours: dict) -> float | None:
    for impl in REFERENCES:
        theirs = timed.get((bench, case, impl))
        if theirs:
            return theirs["median_s"] / ours["median_s"]
    return None


def rows(a: list[dict], b: list[dict]) -> list[dict]:
    """One row per (bench, case) with difforge timed in both runs, in ``a``'s order."""
    timed_a, timed_b = _timed(a), _timed(b)
    out = []
    for (bench, case, impl), ours_a in timed_a.items():
        ours_b = timed_b.get((bench, case, impl))
        if impl not in OURS or ours_b is None or ours_a.get("unit", "s") != "s":
            continue
        out.append(
            {
                "bench": bench,
                "case": case,
                "a_s": ours_a["median_s"],
                "b_s": ours_b["median_s"],
                "a_over_b": ours_a["median_s"] / ours_b["median_s"],
                "a_vs_reference": _reference_ratio(timed_a, bench, case, ours_a),
                "b_vs_reference": _reference_ratio(timed_b, bench, case, ours_b),
            }
        )
    return out


def markdown(table: list[dict], labels: tuple[str, str]) -> str:
    a, b = labels
    lines = [
        f"| bench | case | {a} | {b} | {a} / {b} | vs reference, {a} | vs reference, {b} |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in table:
        ref_a, ref_b = row["a_vs_reference"], row["b_vs_reference"]
        lines.append(
            f"| {row['bench']} | {row['case']} | {_fmt_seconds(row['a_s'])} | "
            f"{_fmt_seconds(row['b_s'])} | {row['a_over_b']:.2f}x | "
            f"{'-' if ref_a is None else f'{ref_a:.2f}x'} | "
            f"{'-' if ref_b is None else f'{ref_b:.2f}x'} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__)
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--labels", nargs=2, default=None)
    args = parser.parse_args(argv)
    runs = [json.loads(path.read_text()) for path in (args.a, args.b)]
    labels = tuple(args.labels or (f"jax {run['machine']['jax']}" for run in runs))
    print(markdown(rows(runs[0]["results"], runs[1]["results"]), labels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
