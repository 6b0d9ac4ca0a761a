"""Draw docs/img/performance.png from the committed H100 results (the plot of docs/performance.md).

    python scripts/plot_performance.py [--out docs/img/performance.png]

Left: compiled models (regional compilation), each configuration against compiled BF16
(results/gpu/2026-11-23-h100-widths/widths.json). Right: eager models against eager BF16, lowprec's
default (FP8 layers compiled one by one) and the same with compile_fp8_layers=False
(results/gpu/2026-11-23-h100-eager-layers/eager.json). Ratios are the JSONs' own, computed in the run.
"""

from __future__ import annotations

import argparse
import json
import os

ROOT = os.path.join(os.path.dirname(__file__), "..")
COMPILED = os.path.join(ROOT, "results", "gpu", "2026-11-23-h100-widths", "widths.json")
EAGER = os.path.join(ROOT, "results", "gpu", "2026-11-23-h100-eager-layers", "eager.json")


def ratios(path: str, configs: list[str]) -> tuple[list[str], dict[str, list[float]]]:
    with open(path) as fh:
        widths = json.load(fh)["widths"]
    names = list(widths)
    return names, {c: [widths[w]["runs"][c].get("speedup_vs_bf16") or 0.0 for w in names] for c in configs}


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "img", "performance.png"))
    args = p.parse_args()
    panels = [
        ("compiled (vs compiled BF16)", COMPILED, ["torchao default", "raw torchao", "torchao all", "msamp O2"]),
        ("eager (vs eager BF16)", EAGER, ["torchao default", "torchao eager layers"]),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, (title, path, configs) in zip(axes, panels):
        names, values = ratios(path, configs)
        width = 0.8 / len(configs)
        for i, config in enumerate(configs):
            label = {"torchao default": "lowprec torchao (defaults)" if "compiled" in title else
                     "lowprec torchao, FP8 layers compiled (compile_fp8_layers default)",
                     "torchao eager layers": "lowprec torchao, compile_fp8_layers=False"}.get(config, config)
            ax.bar([x + i * width for x in range(len(names))], values[config], width, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
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
