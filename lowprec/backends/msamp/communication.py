"""msamp's communication: where each level runs, its gradient-communication row, O3's engines, and the
delayed scales' amaxes all-reduced across ranks (`reduce_amax`).

At O1/O2 under DDP the layers' FP8 weight gradients are averaged in FP8 with a shared scale by the
storage part's `FP8GradReducer`, the rest by DDP. O3 runs under FSDP2 and DeepSpeed ZeRO-1/2:

- FSDP2: the converted layers of each transformer block are one FSDP2 group (a layer outside the blocks
  one of its own), sharded with the plugin's settings before Accelerate shards the rest around them
  (FSDP2 needs one parameter dtype per group); their FP16 masters
  are all-gathered in E4M3 (`fsdp.FP8MasterWeight`) and their gradients reduce-scattered in FP8 across hosts,
  in the engine's reduce dtype (BF16) on one host (`choice`), unless the recipe names a `grad_comm_dtype`.
- DeepSpeed: the converted weights are kept out of DeepSpeed's ZeRO optimizer: E4M3 on every rank, FP16
  masters and O2 states on one rank each (`zero.ZeroFP8Weights`), stepped right after DeepSpeed's step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ...planning.engines import grad_comm_problem
from ..parts import GradientCommunication
from .linear import update_delayed_scales

_WRAP_NAMES_ATTR = "_lowprec_transformer_cls_names_to_wrap"  # the user's list while lowprec has emptied it

if TYPE_CHECKING:
    from ...planning.plan import PrecisionPlan, TensorPrecision
    from .linear import FP8Linear
    from .owner import LevelOwner

# Where each level runs: O1/O2 keep whole FP8 gradients on every rank, O3 needs an engine that shards.
LEVEL_ENGINES: dict[str, tuple[str, ...]] = {"O1": ("single", "ddp"), "O2": ("single", "ddp"),
                                             "O3": ("fsdp2", "deepspeed")}
ZERO_STAGES = (1, 2)  # DeepSpeed stages O3 runs under: ZeRO-3 would partition the FP8 weights' modules


def engine_problem(level: str, engine: str) -> str | None:
    """Why `level` cannot run under `engine`, or None."""
    if engine in LEVEL_ENGINES[level]:
        return None
    if level == "O3":
        if engine == "fsdp1":
            where = "FSDP1 has no all-gather extension to send FP8 weights; use FSDP2 (fsdp_version: 2)"
        else:
            where = ("with nothing to shard across, use opt_level='O2' (FP16 weights, FP8 gradients, FP8+FP16 states: "
                     "6 bytes per parameter), or run under FSDP2")
        return (f"FP8RecipeKwargs(backend='msamp', opt_level='O3') shards FP16 master weights and the O2 optimizer "
                f"states across ranks and all-gathers the weights in FP8: it runs under FSDP2 and DeepSpeed ZeRO-1/2; "
                f"under {engine!r} "
                f"{where}")
    return (f"backend 'msamp' at level {level} (FP8 weight gradients kept whole on its layers) runs on one process or "
            f"under DDP; engine {engine!r} is not supported at this level. Use opt_level='O3' under FSDP2 or DeepSpeed "
            "ZeRO-1/2 (FP8 weights, FP16 masters and FP8+FP16 states sharded across ranks), or backend='te' / "
            "'torchao' with FSDP2 / DeepSpeed")


# Codes of a step's amax in `all_reduce_amaxes` (0: finite): their MAX over ranks is NaN over inf over finite.
_INF, _NAN = 1.0, 2.0


@torch.no_grad()
def all_reduce_amaxes(layers: list[FP8Linear], group=None) -> None:
    """Make the step's input and output-gradient amaxes (column 0 of every layer's window) their maximum
    over the ranks of `group` (None: the world group), in place, with one all-reduce (MAX) for all layers.

    Data-parallel ranks see different data, so their local amaxes, and the delayed scales computed from
    them, differ; after this every rank's window holds the same values and `update_delayed_scales` gives
    every rank the same scales (TE's `reduce_amax`). Earlier columns need nothing: each was column 0 of
    an earlier step and was reduced then.

    A non-finite amax on any rank stays non-finite on every rank, so `update_delayed_scales` drops it
    everywhere alike and no rank turns it into a scale. All-reduce MAX alone cannot promise that: over
    NaN it depends on operand order (gloo's std::max keeps or loses a NaN by position). So the amaxes
    travel with NaN and inf zeroed, beside a code per amax (0 finite, 1 inf, 2 NaN) in the same tensor,
    whose MAX puts NaN back over inf over the finite maximum.

    A no-op without an initialised default process group or on one rank (single-process results are
    bitwise unchanged). Every rank of `group` must call it, with the same layers in the same order (the
    converted layers of one model: they are); the backend calls it only under a data-parallel engine.
    """
    if not layers or not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    device = layers[0].amax_history.device
    current = torch.stack([layer.amax_history[:, 0].to(device) for layer in layers])  # (n, 2): input, grad
    code = torch.isnan(current).float() * _NAN + torch.isinf(current).float() * _INF
    stats = torch.stack([torch.where(code > 0, torch.zeros_like(current), current), code])
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    amax, code = stats.unbind(0)
    amax = torch.where(code == _NAN, float("nan"), torch.where(code == _INF, float("inf"), amax))
    torch._foreach_copy_([layer.amax_history[:, 0] for layer in layers], list(amax.unbind(0)))


class MSAMPCommunication(GradientCommunication):
    owner: LevelOwner

    def __init__(self, owner: LevelOwner):
        super().__init__(owner)
        self.zero = None  # zero.ZeroFP8Weights under DeepSpeed O3, from before_engine_prepare
        self.frozen: list[nn.Parameter] = []  # O3's layer parameters under FSDP2 while Accelerate prepares
        self.wrap_plugin = None  # the FSDP plugin whose block classes lowprec emptied while Accelerate prepares

    @property
    def choice(self) -> str | None:
        """O3 under FSDP2 reduce-scatters its gradients as the recipe names, else in FP8 across hosts (MS-AMP's
        choice: half BF16's bytes on the slow link) and on one host in the engine's reduce dtype (BF16 where the
        plugin names none): there the FP8 reduce-scatter measured slower (O3_FSDP2_COMM_NOTE). Under DeepSpeed the
        FP8 layers' gradients go in FP8 on their own; the rest as DeepSpeed sends them."""
        named = self.owner.recipe.grad_comm_dtype
        if named is not None or not self.owner.sharded:
            return named
        context = self.owner.context
        if context.hosts > 1 and grad_comm_problem("fp8", context.engine) is None:  # torch >= 2.8
            return "fp8"
        return None if context.engine_precision.grad_reduce else "bf16"

    def rows(self, plan: PrecisionPlan) -> list[TensorPrecision]:
        """The engine's rows, with the gradient-communication row saying how the FP8 weight gradients of
        converted layers are averaged under DDP and DeepSpeed (the storage part writes the other rows)."""
        from ...optim.grad_overlap import overlap_requested, reduction_timing
        from ...planning.plan import TensorPrecision

        comm, *rest = super().rows(plan)
        if plan.converted and self.owner.context.engine == "ddp":
            comm = TensorPrecision("grad_comm", f"FP8 E4M3, shared scale (Linear), {comm.dtype} (rest)",
                                   "weight grads: amax all-reduced (MAX), FP8 all_to_all, FP32 sum, FP8 all_gather, "
                                   + reduction_timing())
        elif plan.converted and self.owner.zero_o3:
            # the single pass sends each layer's bytes to the rank that steps its master only; block by block,
            # every rank gets every block's mean
            how = ("FP8 all_to_all, FP32 sum, FP8 all_gather" if overlap_requested("deepspeed")
                   else "FP8 all_to_all to each layer's owner, FP32 sum there")
            comm = TensorPrecision("grad_comm", f"FP8 E4M3, shared scale (Linear), {comm.dtype} (rest)",
                                   f"weight grads averaged by lowprec once per step (amax all-reduced, {how}), "
                                   f"{reduction_timing('deepspeed')}; the rest by DeepSpeed")
        return [comm, *rest]

    def update_delayed_scales(self) -> None:
        """After each optimizer step: the layers' delayed scales from their amax windows, the step's amaxes
        first all-reduced across the ranks where the backend reduces them (`amax_reduction`)."""
        layers = self.owner.layers
        if self.owner.amax_reduction:
            all_reduce_amaxes(layers)
        update_delayed_scales(layers)

    # ----- O3's engines --------------------------------------------------------------------------------
    def engine_config_problem(self, config: dict) -> str | None:
        if not self.owner.zero_o3:
            return None
        stage = (config.get("zero_optimization") or {}).get("stage", 0)
        stage = int(stage) if str(stage).isdigit() else stage  # a config file may give "2"
        if stage not in ZERO_STAGES:
            return (
                f"FP8RecipeKwargs(backend='msamp', opt_level='O3') runs under DeepSpeed ZeRO stage 1 or 2 (as MS-AMP's "
                f"O3 did), not zero_stage={stage}: "
                + ("ZeRO-3 partitions the modules' parameters itself and cannot hold E4M3 weights. Use zero_stage 1 "
                   "or 2, or FSDP2 (fsdp_version: 2), where O3 also shards the FP8 weights" if stage == 3 else
                   "without ZeRO there is nothing to shard the masters with. Use zero_stage 1 or 2, or DDP with "
                   "opt_level='O2'")
            )
        if (config.get("fp16") or {}).get("enabled") in (True, "true"):
            return ("FP8RecipeKwargs(backend='msamp', opt_level='O3') under DeepSpeed runs with bf16 (or no) mixed "
                    "precision, not fp16: DeepSpeed's fp16 loss scaling would scale gradients lowprec keeps outside "
                    "DeepSpeed. Set mixed_precision='fp8' (lowprec runs the rest in bf16) and remove the fp16 section")
        return None

    def before_engine_prepare(self, objects: list, accelerator=None) -> None:
        """O3 under DeepSpeed: take the converted weights out of the optimizer DeepSpeed will wrap
        (`_detach_for_deepspeed`). O3 under Accelerate's FSDP2 plugin: shard the converted layers, one FSDP2
        group per transformer block, with the plugin's settings, before Accelerate shards the rest around them
        (FSDP2 needs one parameter dtype per group), and point the optimizer at the sharded parameters.

        While Accelerate prepares, the layers' parameters are frozen: under mixed precision it upcasts
        every trainable parameter that is not FP32, which would make FP32 masters of the FP16 ones.
        `install` thaws them once Accelerate is done."""
        if self.owner.zero_o3 and accelerator is not None:
            self._detach_for_deepspeed(objects, accelerator)
        if not self.owner.sharded or accelerator is None:
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from .fsdp_groups import fully_shard_fp8_layers

        plugin = accelerator.state.fsdp_plugin
        if plugin.cpu_ram_efficient_loading:
            raise ValueError(
                "FP8RecipeKwargs(backend='msamp', opt_level='O3') cannot be used with the FSDP plugin's "
                "cpu_ram_efficient_loading=True in this version of lowprec (that path rebuilds the model on the meta "
                "device and reloads a full state dict around lowprec's FP8 layers); set "
                "fsdp_cpu_ram_efficient_loading: false"
            )
        mesh = getattr(accelerator, "torch_device_mesh", None)
        if mesh is not None:
            mesh = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]
        kwargs = dict(mesh=mesh, reshard_after_forward=plugin.reshard_after_forward, offload_policy=plugin.cpu_offload,
                      mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy())
        layers = self.owner.layers
        before = {id(p): (layer, name) for layer in layers for name, p in layer.named_parameters(recurse=False)}
        blocks = tuple(plugin.transformer_cls_names_to_wrap or ())
        models = [o for o in objects if isinstance(o, nn.Module)]
        for model in models:
            fully_shard_fp8_layers(model, blocks, **kwargs)
        self._leave_blocks_to_the_root(models, plugin)
        for opt in (o for o in objects if isinstance(o, torch.optim.Optimizer)):
            for group in opt.param_groups:
                group["params"] = [getattr(*before[id(p)]) if id(p) in before else p for p in group["params"]]
        self.frozen = [p for layer in layers for p in layer.parameters(recurse=False) if p.requires_grad]
        for p in self.frozen:
            p.requires_grad_(False)

    def _leave_blocks_to_the_root(self, models: list[nn.Module], plugin) -> None:
        """Have Accelerate shard each block's parameters outside its FP8 group (its norms) with the root, not as a
        group of their own, where that is all the blocks of every model prepared hold beside their FP8 layers (the
        plugin's wrap list serves them all). Such a group cost its block an FSDP2 pre-forward, all-gather,
        pre-backward and reduce-scatter for a few thousand elements: about a fifth of O3's host time per step on two
        CPU ranks, where on two H200s the step is bound by the host. Not under activation checkpointing: Accelerate
        checkpoints the blocks its wrap policy names."""
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        from .fsdp_groups import blocks_rest_is_small

        policy = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy)
        if policy is not transformer_auto_wrap_policy or getattr(plugin, "activation_checkpointing", False):
            return
        names = getattr(plugin, _WRAP_NAMES_ATTR, plugin.transformer_cls_names_to_wrap)  # the user's, if emptied

        def block_names(model: nn.Module) -> tuple[str, ...]:
            return tuple(names if names is not None else getattr(model, "_no_split_modules", None) or ())

        if not models or not all(blocks_rest_is_small(model, block_names(model)) for model in models):
            return
        # kept on the plugin itself: another backend's prepare must not take the emptied list for the user's
        if not hasattr(plugin, _WRAP_NAMES_ATTR):
            setattr(plugin, _WRAP_NAMES_ATTR, names)
        self.wrap_plugin = plugin
        plugin.transformer_cls_names_to_wrap = []  # no block matches: Accelerate wraps none

    def after_engine_prepare(self) -> None:
        """The plugin's block classes as the user set them, once Accelerate's prepare() returned or raised."""
        plugin, self.wrap_plugin = self.wrap_plugin, None
        if plugin is not None and hasattr(plugin, _WRAP_NAMES_ATTR):
            plugin.transformer_cls_names_to_wrap = getattr(plugin, _WRAP_NAMES_ATTR)
            delattr(plugin, _WRAP_NAMES_ATTR)

    def _detach_for_deepspeed(self, objects: list, accelerator) -> None:
        """O3 under DeepSpeed: check the ZeRO stage and precision, take the converted weights out of
        the optimizer DeepSpeed will wrap, and register their masters for save_state/load_state."""
        from .zero import ZeroFP8Weights

        problem = self.engine_config_problem(accelerator.state.deepspeed_plugin.deepspeed_config)
        if problem is not None:
            raise ValueError(problem)
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        if len(optimizers) != 1:
            raise ValueError(
                "FP8RecipeKwargs(backend='msamp', opt_level='O3') under DeepSpeed keeps the converted Linears' "
                f"masters itself and takes their hyper-parameters from the optimizer: pass exactly one optimizer to "
                f"prepare() together with the model (got {len(optimizers)})"
            )
        self.zero = ZeroFP8Weights(self.owner.layers, self.owner.layer_names)
        self.zero.detach_from(optimizers[0])
        accelerator.register_for_checkpointing(self.zero)

    def install(self, model: nn.Module) -> None:
        """Thaw O3's FSDP2 layers and hand DeepSpeed's engine to `ZeroFP8Weights` before the shared part's
        hooks (FP8 reduce-scatters under FSDP2) go in."""
        for p in self.frozen:
            p.requires_grad_(True)
        self.frozen = []
        if self.zero is not None:
            from ...optim.grad_overlap import overlap_requested

            # a model compiled whole would run the blocks' hooks inside its graph: one reduction at the step
            self.zero.install(engine=model, overlap=overlap_requested("deepspeed") and not self.owner.context.compiled)
        super().install(model)

    def after_backward(self, sync_gradients: bool) -> None:
        if self.zero is None or not sync_gradients:
            return
        # Accelerate has run DeepSpeed's step by now (its backward steps at the boundary): the rest of
        # the model is updated and DeepSpeed's pre-clip norm of its own gradients is known.
        engine = self.zero.engine
        max_norm = engine.gradient_clipping() if engine is not None else None
        norm = engine.get_global_grad_norm() if max_norm else None
        self.zero.step(max_norm=max_norm, engine_norm=norm)  # a tensor stays on its device: no host sync
        self.update_delayed_scales()
