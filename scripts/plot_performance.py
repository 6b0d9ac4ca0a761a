"""Draw docs/img/performance.png from the committed H100 results (the plot of docs/performance.md).

    python scripts/plot_performance.py [--out docs/img/performance.png]

Left: compiled models (regional compilation), lowprec's defaults against compiled BF16 at d2048-d8192
(results/gpu/2026-11-23-h100-speed-head/widths_defaults.json; at d1024 the defaults keep every layer in
BF16, so there is nothing to plot), and the peer, raw torchao, from results/gpu/2026-11-23-h100-widths.
Right: eager models against eager BF16, torchao's FP8 layers compiled one by one (the default) and with
compile_fp8_layers=False (results/gpu/2026-11-23-h100-eager-layers/eager.json), and TransformerEngine
with lowprec's defaults (results/gpu/2026-11-24-h100-te-widths/te_eager.json). Ratios are the JSONs' own,
computed in the run; a run whose plan replaces no module trained the BF16 model and gets no bar.
"""

from __future__ import annotations

import argparse
import json
import os

ROOT = os.path.join(os.path.dirname(__file__), "..")
COMPILED = os.path.join(ROOT, "results", "gpu", "2026-11-23-h100-speed-head", "widths_defaults.json")
PEER = os.path.join(ROOT, "results", "gpu", "2026-11-23-h100-widths", "widths.json")
EAGER = os.path.join(ROOT, "results", "gpu", "2026-11-23-h100-eager-layers", "eager.json")
TE_EAGER = os.path.join(ROOT, "results", "gpu", "2026-11-24-h100-te-widths", "te_eager.json")


def ratios(path: str, configs: list[str], names: list[str] | None = None) -> tuple[list[str], dict[str, list[float]]]:
    with open(path) as fh:
        widths = json.load(fh)["widths"]
    names = names or list(widths)

    def ratio(run: dict) -> float:
        plan = run.get("plan", {})
        if plan.get("converted_modules", plan.get("converted")) == 0:  # the BF16 model itself: no bar
            return 0.0
        return run.get("speedup_vs_bf16") or 0.0

    return names, {c: [ratio(widths[w]["runs"][c]) for w in names] for c in configs}


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "img", "performance.png"))
    args = p.parse_args()
    compiled_widths = ["d2048", "d4096", "d8192"]
    panels = [
        ("compiled (vs compiled BF16)", [(COMPILED, ["torchao default", "msamp O2"]), (PEER, ["raw torchao"])],
         compiled_widths),
        ("eager (vs eager BF16)", [(EAGER, ["torchao default", "torchao eager layers"]), (TE_EAGER, ["te default"])],
         None),
    ]
    labels = {
        ("compiled", "torchao default"): "lowprec torchao (defaults)",
        ("compiled", "msamp O2"): "lowprec msamp O2 (defaults)",
        ("compiled", "raw torchao"): "raw torchao (peer)",
        # measured before the eager rule, which now keeps d1024 and d2048 in BF16 for these losses
        ("eager", "torchao default"): "lowprec torchao, FP8 layers compiled (d1024/d2048: now kept in BF16)",
        ("eager", "torchao eager layers"): "lowprec torchao, compile_fp8_layers=False",
        ("eager", "te default"): "lowprec TransformerEngine (defaults; d1024: Linears in BF16, TE's norms)",
    }
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, (title, sources, names) in zip(axes, panels):
        series = []
        for path, configs in sources:
            names, values = ratios(path, configs, names)
            series += [(c, values[c]) for c in configs]
        width = 0.8 / len(series)
        for i, (config, values) in enumerate(series):
            ax.bar([x + i * width for x in range(len(names))], values, width,
                   label=labels[(title.split()[0], config)])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylim(0, 1.9)  # room for the legend above the bars
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names)
        ax.set_title(title)
        ax.legend(fontsize=7, loc="upper left")
    axes[0].set_ylabel("training step speed vs BF16 (H100)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
