"""MS-AMP O3 under FSDP2: FP8 layers that stay eager when the model is compiled, the rest of each block compiled.

Where the layers are not compiled one by one (the default under O3 FSDP2, `compile_fp8_layers` not True), whether
the model is compiled through Accelerate (the plan knows) or by the user after `prepare()` (it does not).

Each O3 layer group is an FSDP2 module of its own (its FP16 master shards all-gathered as E4M3), so dynamo breaks
the block's graph around it whatever the layer does, and compiles the layer's forward as a frame of its own: the
layers compiled one by one, which under O3 FSDP2 measured slower than eager ones past the warm-up (d4096, two H200s:
0.99x BF16 FSDP2 against 1.17x, results/gpu/2026-11-27-h200x2-steady-e8bb2bd). On the GPU host's torch 2.11 that
frame did not even compile: dynamo's autograd.Function tracing asserted on the all-gathered E4M3 weight and ended the
run (the model compiled block by block through Accelerate, results/gpu/2026-11-28-h200-world1-6365b0b). The layers
here keep the eager path those measurements chose, and the compiled blocks the rest.
"""

from __future__ import annotations

import torch

from .linear import FP8Linear


class EagerFP8Linear(FP8Linear):
    """An `FP8Linear` whose forward dynamo does not trace (a graph break): eager O3 layers under FSDP2. In an eager
    model the only cost is the wrapper's (dynamo's frame callback set off and back on: 0.37 us a call more than a
    plain call, torch 2.13 on this project's CPU host)."""

    forward = torch.compiler.disable(FP8Linear.forward, recursive=True)
