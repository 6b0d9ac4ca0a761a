"""The jobs an adapter shares with every other, one file each (issue 28).

An adapter (a `Backend` subclass) does layer replacement itself: which modules, how to convert them,
which modules are its own, what its checkpoints hold. The other two jobs of the precision table, and
the level machinery under them, are the same code for every backend, composed here:

- `storage.WeightStorage`: the storage knobs `weight_dtype` / `weight_grad_dtype` (the MS-AMP levels'
  weight and gradient columns for backends without layers of their own for them): converted weights
  cast in place, their gradients kept in `GradStore`s, averaged under DDP, clipped, checked, and the
  plan rows and bytes they change.
- `optimizer.OptimizerPrecision`: the optimizer-state column: which states are in force, refusing an
  optimizer before anything is converted, swapping in lowprec's low-bit Adam, the plan row.
- `communication.GradientCommunication`: the gradient-communication column and what the engine does
  to weights and masters: DDP hooks and FSDP2 FP8 reduce-scatters, the engine's plan rows and bytes.

Each part reads its backend (`owner`) for the facts a backend may decide differently (the level in
force, the communication dtype its level implies); the backend keeps one-line methods of the old names
that hand over to its parts, so the Accelerator and existing adapters call what they always called.
"""

from .communication import GradientCommunication
from .optimizer import OptimizerPrecision
from .storage import WeightStorage

__all__ = ["GradientCommunication", "OptimizerPrecision", "WeightStorage"]
