"""Cut the bundle's nvidia-cudnn-frontend wheel to what TE's torch extension compiles against.

    python3 scripts/gpu/slim_bundle.py [BUNDLE]        (BUNDLE defaults to .gpubundle)

The device tool carries at most 64 MiB: the tracked tree (results/ grows each session) plus the bundle. The
cudnn-frontend wheel is 11.6 MB, nearly all of it its Python DSL and a compiled module that TE imports only inside
its MoE grouped-MLP fusion and its MLA attention (`from cudnn import ...` within those functions); TE's build needs
only the wheel's C++ headers (`include/cudnn_frontend.h`, found through the distribution's metadata). The wheel is
rewritten with `include/` and its `.dist-info/` alone, its RECORD listing only what stays, so pip installs it as
before. Running it again on a slim wheel changes nothing.
"""

from __future__ import annotations

import csv
import io
import sys
import zipfile
from pathlib import Path

HEADER = "include/cudnn_frontend.h"


def _kept(name: str) -> bool:
    return name.startswith("include/") or name.split("/", 1)[0].endswith(".dist-info")


def slim_wheel(wheel: Path) -> tuple[int, int]:
    """Rewrite `wheel` with its headers and metadata only; return its size before and after, in bytes."""
    before = wheel.stat().st_size
    with zipfile.ZipFile(wheel) as zin:
        names = zin.namelist()
        if HEADER not in names:
            raise SystemExit(f"slim_bundle: {wheel.name} has no {HEADER}: not a cudnn-frontend wheel TE builds "
                             "against; left as it is")
        if all(_kept(n) for n in names):
            return before, before
        kept = {n: zin.read(n) for n in names if _kept(n)}
    record = next(n for n in kept if n.endswith(".dist-info/RECORD"))
    rows = [r for r in csv.reader(io.StringIO(kept[record].decode())) if r and (r[0] in kept)]
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    kept[record] = out.getvalue().encode()
    tmp = wheel.with_suffix(".slim")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for name, data in kept.items():
            zout.writestr(name, data)
    tmp.replace(wheel)
    return before, wheel.stat().st_size


def main(argv: list[str]) -> int:
    bundle = Path(argv[1] if len(argv) > 1 else ".gpubundle")
    wheels = sorted(bundle.glob("nvidia_cudnn_frontend-*.whl"))
    if not wheels:
        print(f"slim_bundle: no nvidia_cudnn_frontend wheel in {bundle} (a bundle without TE): nothing to do")
        return 0
    for wheel in wheels:
        before, after = slim_wheel(wheel)
        print(f"slim_bundle: {wheel.name}: {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
