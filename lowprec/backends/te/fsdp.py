"""`fp8_weights` under FSDP2: TE's FP8-only weights are FSDP2's sharded parameters, all-gathered as FP8 bytes.

TE's `Float8Tensor` (the weight `quantized_model_init` builds) carries FSDP2's all-gather extension:
`fsdp_pre_all_gather` hands FSDP2 the shard's uint8 data and keeps the per-tensor scale as metadata,
`fsdp_post_all_gather` rebuilds a `Float8Tensor` around the gathered bytes (TE 2.20.2,
pytorch/tensor/float8_tensor.py:943-1052). TE's `FusedAdam(master_weights=True)` steps DTensor parameters
with `Float8Tensor` shards: FP32 master shards and moment shards (optimizer.py), the shard requantised after each step
(pytorch/optimizers/fused_adam.py:397-450, 678-710, 894-897). That is Megatron-Bridge's `fp8_param_gather`.

Which recipes (`FSDP2_RECIPES`): per-tensor scaling only. The gathered tensor takes the scale of the rank
that gathers it, so every shard must be quantised with the same scale: current scaling all-reduces the
amax over the FSDP2 mesh before it requantises a shard (float8_tensor.py:966-968, 1183-1190); delayed
scaling gets one scale from the amaxes TE all-reduces across ranks (`reduce_amax`, which must stay on).
Block scaling and MXFP8 are refused: TE's own FSDP2 suite expects Float8BlockScaling with quantised
init to fail ("scale inverse padding is not handled correctly during FSDP2 all-gather slice ops",
tests/pytorch/distributed/fsdp2_tests/run_fsdp2_model.py), MXFP8 needs each rank's rows in whole
32-row blocks and runs on Blackwell only, where lowprec has no run of it.

Around Accelerate's FSDP2 preparation (`TECommunication`):
- the weights are built with nominal dtype FP32 (`FP8_WEIGHT_DTYPE`): Accelerate upcasts every trainable
  parameter that is not FP32 (`param.data = param.data.to(float32)`, which would dequantise a
  `Float8Tensor`), and FSDP2 needs one original dtype per group;
- they are taken out of the optimizer while Accelerate prepares and put back, sharded, afterwards:
  Accelerate maps optimizer parameters to the sharded ones by `data_ptr()`, which is 0 for every
  `Float8Tensor` (a wrapper subclass without storage of its own), so it would map them all to one;
- their FP32 masters are seeded after sharding, each rank with its shard of the weight as it was
  before quantisation (seeded before, FusedAdam's state would belong to the unsharded parameters).
"""

from __future__ import annotations

import logging
import warnings
from typing import Protocol

import torch
from torch import nn

from ..parts import GradientCommunication
from ..parts.owner import Owner

log = logging.getLogger(__name__)

FSDP2_RECIPES = ("delayed", "current")
FP8_WEIGHT_DTYPE = torch.float32  # nominal dtype of FP8-only weights under FSDP2 (module docstring)


def fp8_weights_problem(recipe_name: str, engine: str, reduce_amax: bool | None) -> str | None:
    """Why `fp8_weights=True` cannot run with `recipe_name` under `engine`, or None."""
    head = "FP8RecipeKwargs(backend='te', fp8_weights=True)"
    works = ("it runs on one process, under DDP, and under FSDP2 (fsdp_version: 2) with recipe='delayed' or "
             "'current', where FSDP2 all-gathers the FP8 weights")
    if engine in ("fsdp1", "deepspeed"):
        why = ("FSDP1 has no all-gather extension to send TE's FP8 weights" if engine == "fsdp1" else
               "DeepSpeed shards and gathers flat high-precision buffers, not TE's FP8 weight tensors")
        return f"{head} is not supported with {engine}: {why}; {works}. Or use fp8_weights=False there"
    if engine != "fsdp2":
        return None
    if recipe_name not in FSDP2_RECIPES:
        why = {"block": "TE 2.20's FSDP2 all-gather of Float8BlockScaling weights built FP8-only is expected to fail "
                        "in TE's own tests (scale-inverse padding in FSDP2's slice ops)",
               "mxfp8": "MXFP8 weights all-gather only where each rank's rows are whole 32-row blocks, and lowprec "
                        "has no run of them (Blackwell only)"}[recipe_name]
        return (f"{head} with recipe={recipe_name!r} is not supported under fsdp2: {why}. Use recipe='current' or "
                "'delayed' (per-tensor scaling: FSDP2 all-gathers the FP8 bytes), or fp8_weights=False")
    if recipe_name == "delayed" and reduce_amax is False:
        return (f"{head} with recipe='delayed' and reduce_amax=False is not supported under fsdp2: the gathered "
                "weight takes one rank's scale for every rank's shard, so all ranks must share it. Leave "
                "reduce_amax on (the default), or use recipe='current'")
    return None


def local_shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of `full` that `param` (a DTensor FSDP2 made of it, or a plain tensor) holds on this rank.

    FSDP2 shards dim 0 as `torch.chunk` does (the last ranks may hold fewer rows, or none); a mesh of
    several dimensions shards mesh dimension by mesh dimension."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return full
    out, mesh = full, param.device_mesh
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            chunks = torch.chunk(out, mesh.size(mesh_dim), dim=placement.dim)
            rank = mesh.get_local_rank(mesh_dim)
            out = chunks[rank] if rank < len(chunks) else out.narrow(placement.dim, 0, 0)
    return out


class FP8WeightsOwner(Owner, Protocol):
    """What `TECommunication` reads of the TE adapter besides a part's usual facts."""

    def take_hp_weight(self, weight: torch.Tensor) -> torch.Tensor | None: ...


class TECommunication(GradientCommunication):
    """The shared part, plus `fp8_weights` around Accelerate's FSDP2 preparation (module docstring)."""

    owner: FP8WeightsOwner

    def __init__(self, owner: FP8WeightsOwner):
        super().__init__(owner)
        # FP8 weights out of the optimizer while Accelerate prepares: (optimizer, its group's index, the weight's
        # index in the group, module). Indices, not the group dict: AcceleratedOptimizer's device placement
        # (`load_state_dict(state_dict())`) gives the optimizer new group dicts, and Accelerate's FSDP2 remap new
        # lists in them; a weight put back into the old dict's list was in no group the optimizer steps or zeroes.
        self.held: list[tuple[torch.optim.Optimizer, int, int, nn.Module]] = []
        self.masters: dict[nn.Module, torch.Tensor] = {}  # module -> its weight before quantisation

    @property
    def active(self) -> bool:
        return self.owner.gathers_fp8_weights

    def before_engine_prepare(self, objects: list, accelerator=None) -> None:
        if not self.active:
            return
        plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
        if plugin is not None:
            self._check_plugin(plugin)
        modules = {id(m.weight): m for model in objects if isinstance(model, nn.Module)
                   for m in model.modules() if self.owner.converted_kind(m) == "linear"}
        for opt in (o for o in objects if isinstance(o, torch.optim.Optimizer)):
            base = getattr(opt, "optimizer", opt)
            for g, group in enumerate(base.param_groups):
                kept = []
                for i, p in enumerate(group["params"]):
                    module = modules.get(id(p))
                    if module is None:
                        kept.append(p)
                    else:
                        self.held.append((base, g, i, module))
                group["params"] = kept
        for module in modules.values():
            hp = self.owner.take_hp_weight(module.weight)
            if hp is not None:
                self.masters[module] = hp

    @staticmethod
    def _check_plugin(plugin) -> None:
        head = "FP8RecipeKwargs(backend='te', fp8_weights=True) under FSDP2"
        if plugin.cpu_ram_efficient_loading:
            raise ValueError(
                f"{head} cannot be used with the FSDP plugin's cpu_ram_efficient_loading=True in this version of "
                "lowprec (that path moves the model to the meta device and reloads a full high-precision state "
                "dict into TE's FP8 weights); set fsdp_cpu_ram_efficient_loading: false"
            )
        from torch.distributed.fsdp import CPUOffloadPolicy

        if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
            raise ValueError(
                f"{head} cannot offload parameters to the CPU: TE's FusedAdam steps the FP8 weight shards and "
                "their FP32 masters on the GPU only; set fsdp_offload_params: false, or use fp8_weights=False"
            )

    def install(self, model: nn.Module) -> None:
        """After Accelerate's preparation: the sharded FP8 weights back in their optimizer groups, at their
        places, and their FP32 master shards seeded, before the shared part's hooks go in."""
        held, self.held = sorted(self.held, key=lambda h: (h[1], h[2])), []
        for opt, g, i, module in held:
            opt.param_groups[g]["params"].insert(i, module.weight)
        seeded, skipped = 0, []
        for opt, _, _, module in held:
            hp = self.masters.pop(module, None)
            if hp is None:
                continue
            weight = module.weight
            shard = local_shard(hp, weight)
            local = getattr(weight, "_local_tensor", weight)
            if tuple(shard.shape) != tuple(local.shape):
                skipped.append(f"{tuple(shard.shape)} vs {tuple(local.shape)}")
                continue
            opt.initialize_state(weight, store_param_remainders=False)
            opt.set_scaled_state(weight, "master_param", shard.to(local.device, torch.float32))
            seeded += 1
        log.info("lowprec: %d FP32 master shards of FP8-only weights seeded after FSDP2 sharding", seeded)
        for opt in {id(o): o for o, *_ in held}.values():
            problem = empty_shard_problem(opt)
            if problem is not None:
                raise ValueError(problem)
        if skipped or (held and self.masters):
            warnings.warn(
                "lowprec: some FP8-only weights' FP32 masters start from their FP8 values: "
                + (f"their shard did not match FSDP2's ({', '.join(skipped)})" if skipped else
                   "they were not in the optimizer passed to prepare()"), stacklevel=3,
            )
        self.masters.clear()
        super().install(model)


def empty_shard_problem(optimizer) -> str | None:
    """Why TE's FusedAdam cannot step `optimizer`'s parameters, or None: FP16 and FP8 moments are rescaled from their
    `torch.aminmax` after each step, which fails on a rank whose FSDP2 shard of a parameter is empty (dim 0 smaller
    than the world: a Linear(h, 1)'s bias). Decided from the global shapes, so that every rank refuses alike."""
    scaled = {torch.float16, torch.uint8} & {getattr(optimizer, "exp_avg_dtype", None),
                                             getattr(optimizer, "exp_avg_sq_dtype", None)}
    if not scaled:
        return None
    empty = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if _empty_on_a_rank(p)]
    if not empty:
        return None
    return (f"FP8RecipeKwargs(fp8_weights=True, optimizer_states=...) under FSDP2: {len(empty)} parameter(s) of shapes "
            f"{', '.join(map(str, empty[:4]))} have no elements on some rank (dim 0 below the world size), and TE's "
            "FusedAdam rescales FP16 and FP8 moments from their aminmax, which an empty shard has not; use "
            "optimizer_states 'fp32', 'bf16' (recipe='current') or 'bf16+fp32'")


def _empty_on_a_rank(param) -> bool:
    """Whether FSDP2's dim-0 shard of `param` is empty on some rank (each rank holds ceil(rows / n) rows, the last
    ones fewer or none)."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return param.numel() == 0
    rows, n = (param.shape[0] if param.dim() else 1), mesh.size(mesh.ndim - 1)
    return param.numel() == 0 or -(-rows // n) * (n - 1) >= rows
