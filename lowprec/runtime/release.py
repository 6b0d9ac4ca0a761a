"""`Accelerator.free_memory` (a mixin of lowprec.Accelerator): what lowprec keeps per prepared model goes too.

Accelerate tells users to call `free_memory()` between two trainings with one Accelerator (a sweep, a notebook);
it drops Accelerate's own references to the models and optimizers. lowprec's Accelerator also keeps each prepared
model with its backend and plan, its health monitors, and the parameters conversion replaced: without this, every
model trained before stayed allocated for as long as the Accelerator lived.
"""

from __future__ import annotations

from accelerate.utils import release_memory

from .params import ReplacedParams


class ReleasedOnFree:
    def free_memory(self, *objects):
        """Accelerate's `free_memory`, after dropping lowprec's own references to the models prepared so far (their
        backends, plans and health monitors): `precision_plan` is None until the next `prepare()`."""
        self._lowprec = []
        self._health = []
        self._replaced_params = ReplacedParams()
        objects = super().free_memory(*objects)
        # Accelerate collects garbage and empties the device's cache before it drops its own lists of models and
        # optimizers: what those held in reference cycles (a model and its optimizer do) would stay allocated until
        # some later collection
        release_memory()
        return objects
