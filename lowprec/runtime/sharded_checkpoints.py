"""Loading a sharded (DCP) checkpoint under FSDP2 into modules whose saved entries vary in size.

Accelerate's `load_state` under FSDP2 with `SHARDED_STATE_DICT` (its default there) loads through
`torch.distributed.checkpoint`, in place: into the tensors of the model's current state dict, refusing any whose size
differs from the saved one. TE's `_extra_state` is a byte tensor whose size follows the module's FP8 state, empty
before its first FP8 step, so a run resumed into a fresh model failed ("Size mismatch between saved
torch.Size([207]) and current: torch.Size([0])"; TransformerEngine issue #1860, open upstream). Before the load,
each module that can (`loading_extra_state_bytes`: lowprec's TE modules) is told the size of its saved entry, read
from the checkpoint's DCP metadata, and hands DCP a place of that size; the load fills it and `set_extra_state`
reads it as always.
"""

from __future__ import annotations

import contextlib
import os
import re

from torch import nn

EXTRA_STATE = "_extra_state"
FSDP_MODEL_DIR = "pytorch_model_fsdp_{index}"  # Accelerate's FSDP_MODEL_NAME with the model's index


def checkpoint_dir(accelerator, input_dir: str | None) -> str | None:
    """The folder `Accelerator.load_state(input_dir)` will read: `input_dir`, or with automatic checkpoint naming
    the last of the project's checkpoints (Accelerate's choice); None where there is none."""
    if input_dir is not None:
        return os.path.expanduser(input_dir)
    config = accelerator.project_configuration
    root = os.path.join(accelerator.project_dir or "", "checkpoints")
    if not config.automatic_checkpoint_naming or not os.path.isdir(root):
        return None
    numbered = [(int(m.group(1)), f) for f in os.listdir(root) if (m := re.search(r"([0-9]+)[^/]*$", f))]
    return os.path.join(root, max(numbered)[1]) if numbered else None


def saved_extra_state_bytes(model_dir: str) -> dict[str, int]:
    """{module name: bytes of its saved `_extra_state`} from a DCP checkpoint folder's metadata (empty if there is
    no DCP checkpoint there)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not os.path.isfile(os.path.join(model_dir, ".metadata")):
        return {}
    sizes = {}
    for key, meta in FileSystemReader(model_dir).read_metadata().state_dict_metadata.items():
        # Accelerate saves {"model": state_dict}: "model.<module name>._extra_state"
        if key.endswith("." + EXTRA_STATE) and isinstance(meta, TensorStorageMetadata) and len(meta.size) == 1:
            sizes[key.removeprefix("model.")[: -len(EXTRA_STATE) - 1]] = int(meta.size[0])
    return sizes


@contextlib.contextmanager
def sized_extra_states(models: list[nn.Module], input_dir: str | None):
    """While Accelerate loads a sharded checkpoint from `input_dir`: every module of `models` (their model index
    in the checkpoint is their place in the list) that sizes its own extra state told the size of its saved
    entry."""
    sized = []
    try:
        for index, model in enumerate(models if input_dir is not None else []):
            sizes = saved_extra_state_bytes(os.path.join(input_dir, FSDP_MODEL_DIR.format(index=index)))
            for name, module in model.named_modules() if sizes else ():
                if name in sizes and hasattr(module, "loading_extra_state_bytes"):
                    module.loading_extra_state_bytes = sizes[name]
                    sized.append(module)
        yield
    finally:
        for module in sized:
            module.loading_extra_state_bytes = None


class LoadsShardedExtraStates:
    """`Accelerator.load_state` with `sized_extra_states` around Accelerate's, under FSDP2 with sharded state
    dicts (a mixin of lowprec.Accelerator)."""

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs):
        from torch.distributed.fsdp import StateDictType

        sharded = (getattr(self, "is_fsdp2", False)
                   and self.state.fsdp_plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT)
        models = [self.unwrap_model(m, keep_torch_compile=False) for m in self._models] if sharded else []
        with sized_extra_states(models, checkpoint_dir(self, input_dir) if models else None):
            return super().load_state(input_dir, load_kwargs=load_kwargs, **load_model_func_kwargs)
