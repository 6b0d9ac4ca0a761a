"""Which lowprec lines call a host-syncing tensor method in one training step: `python step_syncs.py CONFIG...`
prints {config: {"calls": {"method file:function": count}, "fused_launches": n}} as JSON.

On a GPU `.item()`, `.tolist()`, `.cpu()`, `bool()`, `float()`, `int()` and `.nonzero()` of a device tensor wait
for every kernel queued before them (the step then cannot run ahead of the GPU). Here, on the CPU, each such
call made by a line of lowprec's (the innermost frame outside torch) during the third step is recorded, whoever's
tensor it is. LowBitAdamW takes its
CUDA path (the fused Triton kernels, interpreted: run with TRITON_INTERPRET=1), since its CPU path reads the
FP8 gradients' presence flags on the host by design. A CONFIG is `backend[:opt_level][,activation_dtype]`.
"""

from __future__ import annotations

import collections
import json
import sys
import traceback
import warnings

import torch

METHODS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__", "nonzero")


def run(config: str) -> dict:
    from lowprec import Accelerator, FP8RecipeKwargs
    from lowprec.demo.model import PRESETS, VOCAB_SIZE, build_model
    from lowprec.kernels import adam

    spec, _, activation = config.partition(",")
    backend, _, level = spec.partition(":")
    recipe = FP8RecipeKwargs(backend=backend, opt_level=level or None, activation_dtype=activation or None)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(mixed_precision="fp8", cpu=True, kwargs_handlers=[recipe])
    torch.manual_seed(0)
    model = build_model(PRESETS["tiny"])
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    launches = [0]
    fused = adam.fused_low_bit_adam_step

    def counted(*args, **kwargs):
        launches[0] += 1
        return fused(*args, **kwargs)

    import lowprec.optim.low_bit_adam as low_bit_adam

    low_bit_adam.fused_low_bit_adam_step = counted
    calls: collections.Counter = collections.Counter()
    recording = [False]
    originals = {name: getattr(torch.Tensor, name) for name in METHODS}

    def spy(name):
        original = originals[name]

        def method(self, *args, **kwargs):
            if recording[0]:
                # whose line made the call: the innermost frame outside torch. A library's own (transformers'
                # packed-sequence check in a model without a KV cache) is not lowprec's, though lowprec called it
                for frame in reversed(traceback.extract_stack()[:-1]):
                    if "/torch/" in frame.filename:
                        continue
                    if "/lowprec/" in frame.filename:
                        calls[f"{name} lowprec/{frame.filename.split('/lowprec/')[-1]}:{frame.name}"] += 1
                    break
            return original(self, *args, **kwargs)

        return method

    for name in METHODS:
        setattr(torch.Tensor, name, spy(name))
    try:
        ids = torch.randint(0, VOCAB_SIZE, (2, 32), generator=torch.Generator().manual_seed(0))
        for step in range(3):
            recording[0] = step == 2
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    finally:
        recording[0] = False
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        low_bit_adam.fused_low_bit_adam_step = fused
    return {"calls": dict(calls), "fused_launches": launches[0]}


def main(configs: list[str]) -> None:
    from lowprec.optim import LowBitAdamW

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    LowBitAdamW._use_fused = lambda self, p, grad, group: group["fused"] is not False  # the CUDA path
    print(json.dumps({config: run(config) for config in configs}))


if __name__ == "__main__":
    main(sys.argv[1:])
