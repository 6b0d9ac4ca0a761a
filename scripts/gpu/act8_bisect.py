"""One `lowprec.demo.run` training with the FP8 activation storage told to leave alone what the named kinds of
module save (`--keep attention mlp norm`), to find which saved tensors cost `activation_dtype="fp8"` its
convergence (results/gpu/2026-11-28-h200x2-convergence-d103418: +12-14% held-out loss on the d4096 proxy; found
and fixed with it: results/gpu/2026-11-28-h200-act8-bisect).

    python3 scripts/gpu/act8_bisect.py --keep attention -- --variant fp8 --backend msamp --opt-level O2 \
        --activation-dtype fp8 --size proxy --steps 300 --no-compile --json OUT.json

The kinds are told by class name, as Hugging Face's decoders name them (LlamaAttention, LlamaMLP, LlamaRMSNorm):
`FP8ActivationStorage.leave_alone` on each, which acts where the Python hooks see the module's forward, so eager
(`--no-compile`, or LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=0 with no compiled region around the module). A diagnostic:
the library itself has no such option until a measurement says which default is right.
"""

from __future__ import annotations

import argparse
import sys

SUFFIXES = {"attention": ("Attention",), "mlp": ("MLP",), "norm": ("RMSNorm", "LayerNorm")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keep", nargs="*", choices=sorted(SUFFIXES), default=[],
                   help="kinds of module whose saved tensors stay as autograd saves them")
    p.add_argument("--keep-traced-fp32", action="store_true",
                   help="inside compiled graphs, leave FP32 saved tensors (the residual stream the norms save) as "
                        "they are: on two CPU cores this closed the in-graph form's gap "
                        "(results/cpu/2026-11-28-act8-gap)")
    p.add_argument("--keep-fp32", action="store_true",
                   help="the Python hooks too (eager, or a compiled graph's saves handed to them) leave FP32 tensors")
    p.add_argument("--trace", action="store_true",
                   help="print each pack decision (form, shape, dtype, node or grad_fn, packed or kept)")
    p.add_argument("run_args", nargs=argparse.REMAINDER, help="-- then lowprec.demo.run's arguments")
    args = p.parse_args(argv)
    run_args = args.run_args[1:] if args.run_args[:1] == ["--"] else args.run_args
    suffixes = tuple(s for kind in args.keep for s in SUFFIXES[kind])

    from lowprec.demo import run as demo
    from lowprec.runtime.activations import FP8ActivationStorage

    if suffixes:
        init = FP8ActivationStorage.__init__

        def leaving_alone(self, model, *a, **k):
            init(self, model, *a, **k)
            for module in model.modules():
                if type(module).__name__.endswith(suffixes):
                    self.leave_alone(module)

        FP8ActivationStorage.__init__ = leaving_alone
    if args.keep_traced_fp32:
        import torch

        pack_traced = FP8ActivationStorage.pack_traced

        def keeping_fp32(self, tensor):
            return tensor if tensor.dtype == torch.float32 else pack_traced(self, tensor)

        FP8ActivationStorage.pack_traced = keeping_fp32
    if args.keep_fp32:
        import torch

        pack = FP8ActivationStorage.pack

        def keeping_fp32_eager(self, tensor):
            return tensor if tensor.dtype == torch.float32 else pack(self, tensor)

        FP8ActivationStorage.pack = keeping_fp32_eager
    if args.trace:
        _trace(FP8ActivationStorage)
    result = demo.run(demo.parse_args(run_args))
    kept = ",".join(args.keep + (["traced-fp32"] if args.keep_traced_fp32 else [])
                    + (["fp32"] if args.keep_fp32 else [])) or "-"
    print(f"act8_bisect keep={kept} heldout_loss={result['heldout_loss']:.4f}")
    return 0


def _trace(storage_class) -> None:
    """Print what the storage does with each tensor it is handed, traced (in-graph) or real (the Python hooks)."""
    from lowprec.runtime import activations_in_graph

    def describe_node(node) -> str:
        if node is None:
            return "node=None"
        text = f"node={node.name} target={node.target}"
        if node.args and hasattr(node.args[0], "target"):
            text += f" arg0={node.args[0].target}"
        return text

    for name in ("pack_traced", "pack"):
        original = getattr(storage_class, name)

        def traced(self, tensor, _original=original, _name=name):
            result = _original(self, tensor)
            where = (describe_node(activations_in_graph.traced_node()) if _name == "pack_traced"
                     else f"grad_fn={type(tensor.grad_fn).__name__} requires_grad={tensor.requires_grad}")
            print(f"act8_trace {_name} {'packed' if result is not tensor else 'kept'} {tuple(tensor.shape)} "
                  f"{tensor.dtype} stride={tensor.stride()} {where}", flush=True)
            return result

        setattr(storage_class, name, traced)


if __name__ == "__main__":
    sys.exit(main())
