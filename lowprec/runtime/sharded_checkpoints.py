"""`Accelerator.load_state` of a sharded (DCP) checkpoint under FSDP2: refused before anything loads where it does
not fit this run (another backend, level or optimizer_states: `sharded_load_problem`), and loaded into modules whose
saved entries vary in size (`sized_extra_states`); before a save or a load, each backend completes the optimizers'
state (`Backend.complete_optimizer_state`).

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
import warnings

from torch import nn

from ..optim.fused_adam_form import STASH, keeps_group_steps, spread_from_rank0, stash_fused_adam_entries
from .checkpoints import optimizer_load_problem
from .model_file_check import load_mapped, model_file, model_file_problem

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


def sharded_load_problem(accelerator, input_dir: str) -> str | None:
    """Why Accelerate's load of the sharded checkpoint in `input_dir` would fail, or None: DCP's own load planner run
    over each model's and optimizer's state dict against the checkpoint's metadata, which reads no tensor. DCP
    loads a model before its optimizer, so a checkpoint whose optimizer entries differ (saved with other Adam
    states: torch's AdamW against LowBitAdamW) loaded the weights and then failed: half-loaded."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    offload = getattr(accelerator.state.fsdp_plugin.state_dict_config, "offload_to_cpu", False)
    options = StateDictOptions(full_state_dict=False, cpu_offload=offload)  # Accelerate's, for sharded dicts
    models, optimizers = accelerator._models, accelerator._optimizers
    checks = [(FSDP_MODEL_DIR.format(index=i), "model", lambda m=m: get_model_state_dict(m, options=options))
              for i, m in enumerate(models)]
    checks += [(f"optimizer_{i}", "optimizer", lambda m=models[i], o=o: get_optimizer_state_dict(m, o, options=options))
               for i, o in enumerate(optimizers) if i < len(models)]
    for folder, key, state_dict in checks:
        path = os.path.join(input_dir, folder)
        if not os.path.isfile(os.path.join(path, ".metadata")):
            continue  # not a DCP folder: Accelerate's own load says what it misses
        planner = DefaultLoadPlanner()
        metadata = FileSystemReader(path).read_metadata()
        planner.set_up_planner({key: state_dict()}, metadata, False)
        try:
            planner.create_local_plan()
        except (RuntimeError, ValueError) as exc:
            return f"{folder}: {str(exc).rstrip('.')}"
        moved = _moments_of_another_dtype(planner.state_dict, metadata)
        if moved:
            return f"{folder}: {moved}"
    return None


def _moments_of_another_dtype(flat: dict, metadata) -> str | None:
    """Adam moments saved in another dtype than this run keeps them, or None. DCP casts a tensor into the one it
    loads into, by value; a low-bit moment is stored scaled (E4M3 and FP16 times their scale, BF16 and FP32 not), so
    a cast between them would change every moment by its scale without a word."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for name, value in flat.items():
        saved = metadata.state_dict_metadata.get(name)
        if not name.endswith((".exp_avg", ".exp_avg_sq")) or not isinstance(saved, TensorStorageMetadata):
            continue
        if saved.properties.dtype != value.dtype:
            return (f"{name} was saved as {saved.properties.dtype} and this run keeps it as {value.dtype} "
                    "(another optimizer_states or level)")
    return None


class CheckedCheckpoints:
    """`Accelerator.save_state` / `load_state` (a mixin of lowprec.Accelerator). Under FSDP2 with sharded state
    dicts a checkpoint that does not fit this run is refused before anything loads (`sharded_load_problem`), and each
    module that sizes its extra state is told its saved size for the load (`sized_extra_states`); after any load,
    each backend refreshes what it derived from the weights and the optimizers' state (`Backend.after_load_state`:
    te requantises its FP8-only weights from their FP32 masters). Where a save writes whole state dicts, each backend
    makes its tensor types in them plain (`Backend.plain_checkpoint_entries`: te's FP8-only weights). Before a save
    or a load each backend gives every parameter of the optimizers the state their first step would where it left
    some without (`Backend.complete_optimizer_state`: te's FusedAdam, its FP8 weights' masters seeded before any
    step), so that a checkpoint made before the first step holds every parameter's state and a load's template asks
    for all of it."""

    def _complete_optimizer_states(self, loading: bool = False) -> None:
        for _, backend, _ in getattr(self, "_lowprec", []):
            for optimizer in getattr(self, "_optimizers", []):
                backend.complete_optimizer_state(getattr(optimizer, "optimizer", optimizer), loading)

    def _sharded(self) -> bool:
        """Whether save_state / load_state go through DCP's shards (FSDP2 with SHARDED_STATE_DICT)."""
        from torch.distributed.fsdp import StateDictType

        return (getattr(self, "is_fsdp2", False)
                and self.state.fsdp_plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT)

    @contextlib.contextmanager
    def _plain_whole_state_dicts(self):
        """While save_state writes whole state dicts (not DCP's shards, which keep each backend's tensors as they
        are), each backend makes its tensor types plain in the models' state dicts (`plain_checkpoint_entries`)."""
        handles = [] if self._sharded() else [
            inner.register_state_dict_post_hook(
                lambda module, state_dict, prefix, metadata, backend=backend: backend.plain_checkpoint_entries(
                    state_dict, prefix))
            for inner, backend, _ in getattr(self, "_lowprec", [])]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs):
        self._complete_optimizer_states()
        with self._plain_whole_state_dicts():
            return super().save_state(output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs):
        self._refuse_files_that_do_not_load(input_dir, load_kwargs, load_model_func_kwargs.get("strict", True))
        self._complete_optimizer_states(loading=True)
        inners = [getattr(o, "optimizer", o) for o in getattr(self, "_optimizers", [])]
        for inner in inners:
            inner.__dict__.pop(STASH, None)  # none left by a load that failed
        stashing = [inner.register_load_state_dict_pre_hook(stash_fused_adam_entries, prepend=True)
                    for inner in inners] if self._full_state_on_several() else []
        try:
            result = self._load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        except BaseException:
            # a refused or failed load too: what the backends marked for the load to replace (te's masters) is made
            # whole again from the model as it is, without the notices of a load that happened
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._after_load_state()
            raise
        finally:
            for handle in stashing:
                handle.remove()
        self._spread_rank0_entries()
        self._agree_group_steps()
        self._after_load_state()
        return result

    def _refuse_files_that_do_not_load(self, input_dir: str | None, load_kwargs: dict | None, strict: bool) -> None:
        """Accelerate loads the models before the optimizers: an optimizer file its optimizer refused (another
        optimizer's, another model's) left the weights loaded while the refusal said nothing was, and a model file
        with keys the model lacks half-loaded (safetensors' load_model checks the keys after copying). Each file
        that Accelerate's own load reads (not under FSDP, DeepSpeed or Megatron-LM, which load theirs their own way)
        is checked first, memory-mapped: no tensor's bytes are read. A model file's keys only where the load is
        strict (`strict=False` passed to load_state loads what matches, as in torch)."""
        from accelerate.utils import DistributedType

        if self.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
            return
        folder = checkpoint_dir(self, input_dir)
        if folder is None or not os.path.isdir(folder):
            return  # Accelerate's load says what is missing
        for i, model in enumerate(getattr(self, "_models", []) if strict else []):
            path = model_file(folder, i)
            problem = model_file_problem(model, path) if path is not None else None
            if problem is not None:
                raise ValueError(f"lowprec: the checkpoint in {folder} does not load into model {i}, and nothing was "
                                 f"loaded: {problem}\n(load_state(..., strict=False) loads the entries that match)")
        for i, optimizer in enumerate(getattr(self, "_optimizers", [])):
            name = "optimizer.bin" if i == 0 else f"optimizer_{i}.bin"  # Accelerate's names
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                problem = f"there is no {name}"
            else:
                problem = optimizer_load_problem(optimizer, load_mapped(path, **(load_kwargs or {})))
            if problem is not None:
                inner = getattr(optimizer, "optimizer", optimizer)
                raise ValueError(f"lowprec: the checkpoint in {folder} does not load into optimizer {i} "
                                 f"({type(inner).__name__}), and nothing was loaded: {name}: {problem}")

    def _spread_rank0_entries(self) -> None:
        """After FSDP2's full-state load on several processes, what rank 0 alone got of a FusedAdam checkpoint
        loaded into Adam's form (its group steps, its masters) made every rank's (`fused_adam_form.spread_from_rank0`):
        left there, the step count restarted, the weights were the model file's FP8 rounding of the masters, and the
        ranks disagreed on which groups count steps (the group-step agreement below waited for ever)."""
        if self._full_state_on_several():
            for optimizer in getattr(self, "_optimizers", []):
                spread_from_rank0(getattr(optimizer, "optimizer", optimizer))

    def _full_state_on_several(self) -> bool:
        """Whether load_state reads whole state dicts on rank 0 and hands them out (FSDP2's full state dict on
        several processes)."""
        import torch

        return (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
                and getattr(self, "is_fsdp2", False) and not self._sharded())

    def _agree_group_steps(self) -> None:
        """Step counts kept per parameter group (TE's FusedAdam) the highest any rank loaded, on every rank. FSDP2's
        full-state load on several processes keeps only the entries the optimizer's own state dict has: a checkpoint
        of Adam's form (a step per parameter) gave rank 0, which read the file, its count and the others none.
        Which optimizers count per group is told by their type, the same on every rank, never by what a rank loaded."""
        import torch

        if not torch.distributed.is_initialized():
            return
        for optimizer in getattr(self, "_optimizers", []):
            inner = getattr(optimizer, "optimizer", optimizer)
            if not keeps_group_steps(inner):
                continue
            groups = inner.param_groups
            steps = torch.tensor([float(g.get("step", 0)) for g in groups], device=self.device)
            torch.distributed.all_reduce(steps, op=torch.distributed.ReduceOp.MAX)
            for group, step in zip(groups, steps.tolist()):
                if isinstance(group.get("step"), torch.Tensor):  # a capturable FusedAdam's, on the device
                    group["step"].fill_(step)
                else:  # lowprec builds FusedAdam with capturable=False: counted in Python
                    group["step"] = int(step)

    def _after_load_state(self) -> None:
        optimizers = [getattr(o, "optimizer", o) for o in getattr(self, "_optimizers", [])]
        for inner, backend, _ in getattr(self, "_lowprec", []):
            backend.after_load_state(inner, optimizers)

    def _load_state(self, input_dir: str | None, load_kwargs: dict | None, **load_model_func_kwargs):
        import torch

        sharded = self._sharded()
        folder = checkpoint_dir(self, input_dir) if sharded else None
        models = [self.unwrap_model(m, keep_torch_compile=False) for m in self._models] if folder else []
        with sized_extra_states(models, folder):
            if folder is not None and os.path.isdir(folder):
                problem = sharded_load_problem(self, folder)
                # every rank refuses together: one rank left inside the load's collectives would wait for ever
                refused = torch.tensor([0.0 if problem is None else 1.0], device=self.device)
                if torch.distributed.is_initialized():
                    torch.distributed.all_reduce(refused, op=torch.distributed.ReduceOp.MAX)
                if refused.item():
                    raise ValueError(
                        f"lowprec: the checkpoint in {folder} does not fit this run, and nothing was loaded: "
                        f"{problem or 'another rank found an entry that does not fit'}. Under FSDP2 Accelerate saves "
                        "sharded checkpoints (torch.distributed.checkpoint), which load only into the FP8 "
                        "configuration that saved them (backend, opt_level, optimizer_states): resume with that "
                        "configuration, or save with the FSDP plugin's state_dict_type FULL_STATE_DICT, which loads "
                        "through load_state_dict, where lowprec converts what it can (other optimizer_states)")
            return super().load_state(input_dir, load_kwargs=load_kwargs, **load_model_func_kwargs)
