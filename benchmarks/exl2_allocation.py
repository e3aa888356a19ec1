"""EXL2's two allocations against each other, from two report directories of the same settings:
every linear at the target's two nearest widths (the default) and widths per attention and MLP
block from a measurement (quantkit report --exl2-measured). Prints each target's KLD and perplexity
as ratios to the default's, and plots KLD against bits per weight and the bits the measurement gave
each block at each target.

    python benchmarks/exl2_allocation.py benchmarks/report-exl2 benchmarks/report-exl2-measured
"""
import argparse
import json
from pathlib import Path

import matplotlib

from quantkit import measurement
from quantkit.quantizers import exl2

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def block_bits(path: Path, target: float) -> dict[str, float]:
    """Bits per weight of each block in the allocation the measurement at path gives the target."""
    body = json.loads(path.read_text())
    blocks = {name: [tuple(s) for s in entry["linears"].values()] for name, entry in body["units"].items()}
    chosen = measurement.allocate(blocks, {name: entry["errors"] for name, entry in body["units"].items()}, target,
                                  exl2.CANDIDATES)
    return {name: sum(chosen[name].total_bits(*s) for s in shapes) / sum(n * k for n, k in shapes)
            for name, shapes in blocks.items()}


def exl2_points(directory: Path) -> dict[float, dict]:
    report = json.loads((directory / "report.json").read_text())
    past = ("perplexity", "ppl_ratio", "kld_mean", "kld_p99")  # null there: past float's range
    return {p["exl2"]: p | {k: float("inf") for k in past if p.get(k, 0) is None}
            for p in report["points"] if p["format"] == "exl2" and p["status"] == "ok"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("default", type=Path, help="report directory of the default allocation")
    parser.add_argument("measured", type=Path, help="report directory of the measured allocation")
    parser.add_argument("--plot", type=Path, help="where the plot goes [MEASURED/allocation.png]")
    args = parser.parse_args()
    default, measured = exl2_points(args.default), exl2_points(args.measured)
    print("| target | default bpw | default KLD | measured bpw | measured KLD | KLD ratio | PPL ratio |")
    print("|---|---|---|---|---|---|---|")
    for t in sorted(default.keys() & measured.keys()):
        d, m = default[t], measured[t]
        print(f"| {t:g} | {d['bpw_linear']:.3f} | {d['kld_mean']:.4f} | {m['bpw_linear']:.3f} | {m['kld_mean']:.4f} "
              f"| {m['kld_mean'] / d['kld_mean']:.2f} | {m['perplexity'] / d['perplexity']:.3f} |")
    measurement_file = args.measured / "exl2-measurement.json"
    if not measurement_file.is_file():  # the report keeps it only where it was measured into that directory
        print(f"{measurement_file}: none, so the plot leaves out the widths the measurement gives each block")
    panels = 2 if measurement_file.is_file() else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
    ax = axes[0, 0]
    for label, points in (("same widths in every linear (default)", default), ("widths per block from a measurement", measured)):
        xs = sorted(points)
        ax.plot([points[t]["bpw_linear"] for t in xs], [points[t]["kld_mean"] for t in xs], "o-", label=label)
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight of the decoder linears (from the file)")
    ax.set_ylabel("mean KL divergence from the base")
    ax.set_title("EXL2 on the embedded model: two ways to spend a target")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if measurement_file.is_file():
        block_plot(axes[0, 1], measurement_file, sorted(measured))
    fig.tight_layout()
    out = args.plot or args.measured / "allocation.png"
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


def block_plot(right, measurement_file: Path, targets: list[float]) -> None:
    """Each block's bits per weight at each target, from the measurement."""
    for i, t in enumerate(targets):
        bits = block_bits(measurement_file, t)
        for kind, style in (("self_attn", "-"), ("mlp", "--")):
            layers = [b for b in bits if b.endswith(kind)]
            right.plot(range(len(layers)), [bits[b] for b in layers], style, color=f"C{i}",
                       label=f"{t:g}: {kind}")
    right.set_xlabel("decoder layer")
    right.set_ylabel("bits per weight of the block")
    right.set_title("what the measurement gives each block, per target")
    right.grid(True, alpha=0.3)
    right.legend(ncol=2, fontsize=7)


if __name__ == "__main__":
    main()
