"""The benchmark tables of docs/benchmarks.md, each from one results file of one run.

``python -m bench.readme [results.json]`` prints the Markdown table for that file (default:
``bench/results/latest.json``, one ``make bench`` run); ``--write`` puts it into
docs/benchmarks.md instead, between the markers named after the file's stem::

    <!-- bench table: latest -->
    ...
    <!-- end bench table: latest -->

(``maxdiffusion.json``, the run of ``bench/vs_maxdiffusion.py``, fills the ``maxdiffusion`` pair.)
So each table quotes exactly one run: every figure and ratio comes from that file (ratio =
reference median / difforge median; > 1: difforge is faster). Rows whose benchmark the run
skipped are left out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.run import RESULTS_DIR, _fmt_seconds

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def _find(results: list[dict], bench: str, case: str, impl: str) -> dict | None:
    return next(
        (r for r in results if r["bench"] == bench and r["case"] == case and r["impl"] == impl),
        None,
    )


def _time(record: dict | None) -> str:
    return _fmt_seconds(record["median_s"]) if record and "median_s" in record else "-"


def _ratio(ours: dict | None, theirs: dict | None) -> float | None:
    if not ours or not theirs or "median_s" not in ours or "median_s" not in theirs:
        return None
    return theirs["median_s"] / ours["median_s"]


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _verdict(ratio: float | None, goal: float) -> str:
    if ratio is None:
        return "-"
    return f"{ratio:.2f}x ({_met(ratio >= goal)})"


def _share_of_limit(record: dict, *, bf16: bool, word: str = "") -> str:
    """`` (N% of the fp32 limit)``, or of the bf16 one for a bf16 case; MFU for train steps."""
    key, name = ("frac_of_bf16_limit", "bf16") if bf16 else ("frac_of_limit", "fp32")
    if key not in record:
        return ""
    if word:
        return f" ({word} {100 * record[key]:.0f}% of the {name} limit)"
    return f" ({100 * record[key]:.0f}% of the {name} limit)"


def _forward_rows(
    results: list[dict], bench: str, label: str, cases=("S", "M", "S-bf16")
) -> list[str]:
    rows = []
    for case in cases:
        ours = _find(results, bench, case, "difforge")
        if ours is None:
            continue
        eager = _find(results, bench, case, "diffusers_eager")
        compiled = _find(results, bench, case, "diffusers_compile")
        dot = _find(results, bench, case, "difforge_dot_product")
        reference = f"diffusers eager {_time(eager)}"
        verdicts = [_verdict(_ratio(ours, eager), 1.0) + " eager"]
        if compiled:
            reference += f", `torch.compile` {_time(compiled)}"
            verdicts.append(_verdict(_ratio(ours, compiled), 1.0) + " compile")
        ours_text = _time(ours) + _share_of_limit(ours, bf16=case.endswith("bf16"))
        if dot:
            ours_text += f"; `dot_product` {_time(dot)}"
        diff = ours.get("max_abs_diff_vs_diffusers")
        if diff is not None:
            verdicts.append(f"outputs within {diff:.1e}")
        rows.append(f"| {label}, {case} | {ours_text} | {reference} | {'; '.join(verdicts)} |")
    return rows


def _train_rows(results: list[dict]) -> list[str]:
    rows = []
    for case in ("demo b32", "S", "M", "S-bf16-mixed", "M-bf16-mixed"):
        ours = _find(results, "train_step", case, "difforge")
        eager = _find(results, "train_step", case, "pytorch eager")
        compiled = _find(results, "train_step", case, "pytorch compile")
        if ours is None:
            continue
        mfu = _share_of_limit(ours, bf16="mixed" in case, word="MFU")
        reference = f"PyTorch eager {_time(eager)}"
        verdicts = [_verdict(_ratio(ours, eager), 1.0) + " eager"]
        if compiled:
            reference += f", `torch.compile` {_time(compiled)}"
            verdicts.append(_verdict(_ratio(ours, compiled), 1.0) + " compile")
        rows.append(
            f"| training step (fwd + bwd + AdamW), {case} | {_time(ours)}{mfu} | "
            f"{reference} (diffusers' model, torch AdamW"
            f"{', autocast bf16' if 'mixed' in case else ''}) | {'; '.join(verdicts)} |"
        )
    return rows


def _maxdiffusion_rows(results: list[dict]) -> list[str]:
    """difforge against MaxDiffusion's Wan transformer and VAE (bench/vs_maxdiffusion.py), where
    it ran; the VAE rows' goal is parity (the issue sets none against MaxDiffusion's VAE)."""
    vae_cases = ("wan-5x64x64", "wan-9x128x128")
    rows = []
    for bench, label, goal, cases, ours_what, theirs_what in (
        ("maxdiffusion_forward", "Wan DiT forward vs MaxDiffusion", 1.3, ("S", "M", "S-bf16"),
         " (flash)", " (`dot_product`)"),
        ("maxdiffusion_train", "training step vs MaxDiffusion's forward + backward", 1.2,
         ("S", "M", "S-bf16-mixed", "M-bf16-mixed"), " (fwd + bwd + AdamW)", " (fwd + bwd)"),
        ("maxdiffusion_vae_encode", "Wan VAE encode vs MaxDiffusion", 1.0, vae_cases, "", ""),
        ("maxdiffusion_vae_decode", "Wan VAE decode vs MaxDiffusion", 1.0, vae_cases, "", ""),
    ):  # fmt: skip
        for case in cases:
            ours = _find(results, bench, case, "difforge")
            theirs = _find(results, bench, case, "maxdiffusion")
            if ours is None or theirs is None:
                continue
            rows.append(
                f"| {label}, {case} | {_time(ours)}{ours_what} | MaxDiffusion (JAX) "
                f"{_time(theirs)}{theirs_what} | {_verdict(_ratio(ours, theirs), goal)} |"
            )
    return rows


def _vae_rows(results: list[dict]) -> list[str]:
    rows = []
    for case in ("wan-5x64x64", "wan-9x128x128"):
        cells = []
        for bench in ("vae_encode", "vae_decode"):
            ours = _find(results, bench, case, "difforge")
            theirs = _find(results, bench, case, "diffusers_eager")
            if ours:
                cells.append((bench.split("_")[1], ours, theirs))
        if cells:
            rows.append(
                f"| Wan VAE {case[4:]}: "
                + " / ".join(name for name, _, _ in cells)
                + " | "
                + " / ".join(_time(o) for _, o, _ in cells)
                + " | diffusers "
                + " / ".join(_time(t) for _, _, t in cells)
                + " | "
                + " / ".join(_verdict(_ratio(o, t), 1.0) for _, o, t in cells)
                + " |"
            )
    return rows


def _other_rows(results: list[dict]) -> list[str]:
    rows = []
    ours = _find(results, "generate", "S-256px-steady", "difforge")
    theirs = _find(results, "generate", "S-256px-steady", "diffusers_wanpipeline")
    if ours:
        rows.append(
            "| bulk generate, size S pipeline, 256², 4 steps, CFG: steady-state seconds per "
            f"prompt | {_time(ours)} (outside device compute "
            f"{100 * ours.get('outside_compute_share', 0):.0f}%) | diffusers `WanPipeline` "
            f"{_time(theirs)} | {_verdict(_ratio(ours, theirs), 1.0)} |"
        )
    tiny = _find(results, "generate", "tiny-32prompts", "difforge")
    if tiny:
        rows.append(
            f"| bulk generate, tiny model, 32 prompts | {tiny['items_per_s']:.0f} prompts/s, "
            f"{100 * tiny['outside_compute_share']:.0f}% outside device compute | | fixed host "
            "costs dominate at this size |"
        )
    dense = _find(results, "step_cache", "24prompts-30steps", "difforge")
    mag = _find(results, "step_cache", "24prompts-30steps", "cache_magcache")
    if dense and mag:
        rows.append(
            f"| step caching (demo DiT, 24 prompts, 30 steps) | MagCache {_time(mag)} "
            f"({mag['evaluation_ratio']:.2f}x fewer block-stack runs, PSNR "
            f"{mag['mean_psnr_db']:.1f} dB mean) | dense {_time(dense)} | "
            f"{_ratio(mag, dense):.2f}x wall |"
        )
    for mode, peer in (("int8_weights", "torchao_int8_weights"), ("int8", "torchao_int8_dynamic")):
        ours = _find(results, "quantization", "S", f"difforge_{mode}")
        theirs = _find(results, "quantization", "S", peer)
        if ours and theirs:
            close = ours["psnr_db"] >= theirs["psnr_db"] - 3
            rows.append(
                f"| Wan S forward, `quantization={mode}` (PSNR vs float32 diffusers) | "
                f"{_time(ours)}, {ours['psnr_db']:.1f} dB | `{peer}` {_time(theirs)}, "
                f"{theirs['psnr_db']:.1f} dB | {_ratio(ours, theirs):.2f}x; PSNR within 3 dB: "
                f"{_met(close)} |"
            )
    for case in ("tiny-1200items", "S-64items"):
        conv = _find(results, "convert", case, "difforge_beam")
        if conv:
            share = conv["vs_encoders"]
            rows.append(
                f"| convert (Beam DirectRunner), {case} | {conv['records_per_s']:.3g} records/s "
                f"(after its {conv['startup_s']:.1f} s start-up: "
                f"{conv['marginal_vs_encoders']:.2f}x) | bare encoders "
                f"{conv['encoder_items_per_s']:.3g} items/s | {share:.2f}x whole run "
                f"({_met(share >= 0.5)}, goal 0.5x) |"
            )
    load = _find(results, "memory_load", "274MiB", "difforge")
    if load:
        peer = _find(results, "memory_load", "274MiB", "diffusers")
        rows.append(
            f"| model load, 274 MiB of safetensors | peak RSS {load['value']:.2f}x the weight "
            f"bytes | diffusers {peer['value']:.2f}x | goal < 1.3x: "
            f"{_met(load['value'] < 1.3)} |"
        )
    cold = _find(results, "compile_cache", "S", "cold_cache")
    warm = _find(results, "compile_cache", "S", "warm_cache")
    if cold and warm:
        rows.append(
            f"| compilation cache, start-up | {_fmt_seconds(warm['value'])} warm | "
            f"{_fmt_seconds(cold['value'])} cold | {cold['value'] / warm['value']:.2f}x |"
        )
    scan = [_find(results, "compile_layers", f"S x{n} train step", "scan_layers") for n in (8, 40)]
    flat = [_find(results, "compile_layers", f"S x{n} train step", "unrolled") for n in (8, 40)]
    if all(scan) and all(flat):
        rows.append(
            "| compile seconds of the S train step, 8 -> 40 layers | `scan_layers` "
            f"{scan[0]['value']:.1f} -> {scan[1]['value']:.1f} s | unrolled "
            f"{flat[0]['value']:.1f} -> {flat[1]['value']:.1f} s | "
            f"{flat[1]['value'] / scan[1]['value']:.1f}x faster at 40 layers |"
        )
    return rows


def table(run: dict) -> str:
    results = run["results"]
    lines = ["| what | difforge | reference | ratio (goal) |", "|---|---|---|---|"]
    lines += _forward_rows(results, "transformer_forward", "Wan DiT forward")
    lines += _forward_rows(results, "flux_forward", "Flux DiT forward")
    lines += _forward_rows(results, "ltx_forward", "LTX-Video DiT forward", ("S",))
    lines += _forward_rows(results, "unet_forward", "SD UNet forward", ("SD2-half", "SDXL-half"))
    lines += _train_rows(results)
    lines += _maxdiffusion_rows(results)
    lines += _vae_rows(results)
    lines += _other_rows(results)
    return "\n".join(lines)


def markers(name: str) -> tuple[str, str]:
    """The comment lines that enclose the table of the results file called ``name``."""
    return f"<!-- bench table: {name} -->", f"<!-- end bench table: {name} -->"


def write_table(doc: Path, name: str, text: str) -> None:
    """Replace what lies between ``name``'s markers in ``doc`` with ``text``; the rest of the
    file is kept byte for byte. Missing or repeated markers are an error naming them."""
    start, end = markers(name)
    content = doc.read_text()
    if content.count(start) != 1 or content.count(end) != 1:
        raise ValueError(f"{doc}: needs exactly one {start!r} and one {end!r}")
    head, rest = content.split(start, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{start}\n{text}\n{end}{tail}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    write = "--write" in argv
    paths = [a for a in argv if a != "--write"]
    path = Path(paths[0]) if paths else RESULTS_DIR / "latest.json"
    text = table(json.loads(path.read_text()))
    if write:
        write_table(DOC, path.stem, text)
        print(f"wrote the {path.stem!r} table into {DOC}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
