"""Diagnostic (not a benchmark): does msamp's FP8Linear run compiled inside a transformers Llama on this GPU?

    python benchmarks/diag_scaled_mm.py [--layers 1] [--vocab 256]
Prints one line per case; failures with the end of their traceback.
"""

from __future__ import annotations

import argparse
import traceback

import torch


def case(compiled: bool, through_accelerator: bool, layers: int, vocab: int, steps: int) -> str:
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import TorchDynamoPlugin

    from lowprec import Accelerator, FP8RecipeKwargs
    from lowprec.demo.model import PRESETS, ModelPreset, llama_config

    torch._dynamo.reset()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    base = PRESETS["proxy"]
    preset = ModelPreset(base.hidden, layers, base.heads, base.ffn, base.seq_len, base.batch, base.lr, "diag")
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(preset, vocab_size=vocab))
    recipe = FP8RecipeKwargs(backend="msamp", skip_first_last=False, skip_slow_shapes=False)
    extra = {"dynamo_plugin": TorchDynamoPlugin(backend="inductor")} if compiled and through_accelerator else {}
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe], **extra)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    if compiled and not through_accelerator:
        model = torch.compile(model)
    ids = torch.randint(0, vocab, (preset.batch, preset.seq_len), device="cuda")
    try:
        for _ in range(steps):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        torch.cuda.synchronize()
        return f"ok loss={loss.item():.3f}"
    except Exception:
        return "FAILED\n" + traceback.format_exc()[-2500:]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="past the 16-step warm-up by default")
    p.add_argument("--cases", default="eager,compiled", help="eager, compiled (via Accelerator), torch_compile")
    args = p.parse_args()
    table = {"eager": (False, True), "compiled": (True, True), "torch_compile": (True, False)}
    for name in args.cases.split(","):
        compiled, through = table[name]
        print(f"== {name} layers={args.layers} vocab={args.vocab} steps={args.steps}: "
              f"{case(compiled, through, args.layers, args.vocab, args.steps)}", flush=True)


if __name__ == "__main__":
    main()
