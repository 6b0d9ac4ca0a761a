"""The jobs an adapter composes besides its own, one file each (issue 28).

An adapter (a `Backend` subclass) does layer replacement itself: which modules, how to convert them,
which modules are its own, what its checkpoints hold, the GEMM row of the plan. The other two jobs of
the precision table, and the level machinery under them, are parts it composes:

- `storage.WeightStorage`: the storage knobs `weight_dtype` / `weight_grad_dtype` (the MS-AMP levels'
  weight and gradient columns for backends without layers of their own for them): converted weights
  cast in place, their gradients kept in `GradStore`s, averaged under DDP, clipped, checked, and the
  plan rows and bytes they change.
- `optimizer.OptimizerPrecision`: the optimizer-state column: which states are in force, refusing an
  optimizer before anything is converted, swapping in lowprec's low-bit Adam, the plan row and bytes.
- `communication.GradientCommunication`: the gradient-communication column and what the engine does
  to weights and masters: DDP hooks and FSDP2 FP8 reduce-scatters, the engine's plan rows and bytes,
  and the engine hooks around Accelerate's `prepare()` and each backward.

An adapter names its parts in the class attributes `storage_part`, `optimizer_part` and
`communication_part`, which `Backend.__init__` instantiates with the backend as their `owner`. Most
adapters keep these shared parts; one whose layers or levels decide a job their own way names a
subclass: msamp brings all three (`lowprec.backends.msamp`: its FP8Linear holds the level's storage,
O3 counts optimizer states per rank, and its communication part runs O3 under FSDP2 and DeepSpeed),
TE a storage part and a communication part for `fp8_weights` (`lowprec.backends.te.fsdp`: under
FSDP2). Each part reads its backend (`owner.Owner`) for the facts a
backend decides (the storage knobs and level in force, which modules are its own); the backend keeps
one-line methods of the old names that hand over to its parts, so the Accelerator calls what it always
called.
"""

from .communication import GradientCommunication
from .optimizer import OptimizerPrecision
from .storage import WeightStorage

__all__ = ["GradientCommunication", "OptimizerPrecision", "WeightStorage"]
