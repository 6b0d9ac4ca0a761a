"""MS-AMP O3 under DeepSpeed ZeRO-1/2: FP8 weights kept beside DeepSpeed's ZeRO optimizer.

DeepSpeed's ZeRO optimizer flattens the parameters it is given into BF16 groups with FP32 master
partitions; it cannot hold E4M3 weights or FP16 masters. MS-AMP replaced it with a modified copy
(`FP8DeepSpeedZeroOptimizer`, pinned to DeepSpeed 0.13.1). lowprec leaves DeepSpeed's optimizer as
it is and keeps the converted Linear weights out of it, partitioned the way MS-AMP's was:

| tensor           | where                                   | bytes per parameter |
|------------------|-----------------------------------------|---------------------|
| weight           | E4M3 + one power-of-2 scale, every rank | 1                   |
| weight gradient  | E4M3 on the layer (`FP8Linear`), averaged in FP8 once per step on its master's rank | 1 |
| master weight    | FP16, on one rank: whole tensors assigned greedily by size (MS-AMP's rule) | 2/N |
| optimizer states | LowBitAdamW E4M3 + FP16, with the master | 3/N |

The FP8 gradients are averaged for the owners only (`FP8GradReducer(owners=...)`: one all_to_all sends each owner
its layers' bytes, no all_gather, as no other rank reads them), and the clipping norm sums the owners' norms.
After DeepSpeed's step the owners step their masters with the hyper-parameters (learning rate
included, so schedulers apply) of the optimizer group each weight came from, requantise them and
broadcast the bytes and scales. Everything else (embeddings, norms, biases, BF16 layers) stays
DeepSpeed's. Gradient clipping: lowprec clips the FP8 weights by the norm over all gradients
(DeepSpeed's pre-clip norm and theirs); DeepSpeed clips its own parameters by their own norm, as it
has no public way to count gradients it does not hold.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...optim.grad_reduce import FP8GradReducer
from ...optim.grad_store import fp8_grad_norms
from ...optim.low_bit_adam import LowBitAdamW
from .fsdp import FP8GatheredWeight

E4M3 = torch.float8_e4m3fn
# Hyper-parameters copied from the source optimizer group before every step (schedulers change them).
HYPER = ("lr", "betas", "eps", "weight_decay", "maximize")


def assign_owners(numels: list[int], world_size: int) -> list[int]:
    """The rank that holds each tensor's master: largest first, each to the least-loaded rank
    (ties: the tensor's index modulo the world size), as MS-AMP's ZeRO optimizer assigns them."""
    load = [0] * world_size
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        start = i % world_size
        rank = min(range(world_size), key=lambda r: (load[r], (r - start) % world_size))
        owners[i] = rank
        load[rank] += numels[i]
    return owners


def _restore_buffer_dtypes(layer: nn.Module) -> None:
    """Undo DeepSpeed's `module.bfloat16()` on a layer's FP8 state: the gradient buffer back to E4M3,
    scales and amax histories back to FP32 (their values, zeros and powers of two, survive BF16)."""
    for name, buf in list(layer.named_buffers(recurse=False)):
        want = E4M3 if name == "fp8_grad_data" else torch.float32 if buf.is_floating_point() else buf.dtype
        if buf.dtype != want:
            setattr(layer, name, buf.to(want))


class _MasterSlot:
    """What LowBitAdamW reads for one owned layer: the FP16 master as `weight`, the gradient from
    the layer's FP8 buffer."""

    def __init__(self, master: torch.Tensor, layer: nn.Module):
        self.weight, self.layer = master, layer

    def __getattr__(self, name: str):
        if name.startswith("fp8_grad_"):
            return getattr(self.layer, name)
        raise AttributeError(name)


class ZeroFP8Weights:
    """The converted Linears' weights, masters and states under DeepSpeed ZeRO-1/2 (see module doc).

    Built before DeepSpeed initialises (`detach_from`), installed after it (`install`), stepped after
    each DeepSpeed step (`step`). `state_dict` / `load_state_dict` carry the masters and their
    optimizer states whole, so `Accelerator.save_state` / `load_state` resume exactly; both are
    collectives (every rank calls them, as Accelerate's save_state does for custom objects).
    """

    def __init__(self, layers: list[nn.Module], names: list[str], group=None):
        self.layers, self.names, self.group = layers, names, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.owners = assign_owners([layer.weight.numel() for layer in layers], self.world_size)
        self.source_groups: list[dict] = [{}] * len(layers)  # each weight's optimizer group (the dict itself)
        self._source_optimizer: torch.optim.Optimizer | None = None  # DeepSpeed's basic optimizer
        self._group_indices: list[int | None] = []  # each source group's index in its groups, once installed
        self.optimizer: LowBitAdamW | None = None
        self.masters: dict[int, torch.Tensor] = {}  # layer index -> FP16 master (owned layers only)
        self._stash: list[torch.Tensor] | None = None
        self._trainable: list[bool] = []
        self.reducer: FP8GradReducer | None = None
        self.blockwise = None  # or block by block during the backward (grad_overlap.BlockwiseReduction)
        self.engine = None

    # ----- before / after DeepSpeed initialises -------------------------------------------------------
    def detach_from(self, optimizer: torch.optim.Optimizer) -> None:
        """Take the layers' weights out of `optimizer` (DeepSpeed's future basic optimizer) and freeze
        them while DeepSpeed initialises: it then neither flattens them into its BF16 groups nor
        registers gradient hooks on them. Their FP16 values are kept aside, as DeepSpeed's
        `module.bfloat16()` casts every floating-point parameter."""
        self._source_optimizer = optimizer
        where = {id(layer.weight): i for i, layer in enumerate(self.layers)}
        found = set()
        emptied = []
        for g, group in enumerate(optimizer.param_groups):
            kept = []
            for p in group["params"]:
                i = where.get(id(p))
                if i is None:
                    kept.append(p)
                else:
                    self.source_groups[i] = group
                    found.add(i)
            if group["params"] and not kept:
                emptied.append(g)
            group["params"] = kept
        if emptied:
            raise ValueError(
                "FP8RecipeKwargs(backend='msamp', opt_level='O3') under DeepSpeed takes the converted Linear weights "
                f"out of DeepSpeed's optimizer, which would leave optimizer param group(s) {emptied} empty; DeepSpeed "
                "drops empty groups, which shifts the groups an LR scheduler updates. Put each group's Linear weights "
                "together with other parameters (e.g. norms or embeddings), or use FSDP2 (fsdp_version: 2)"
            )
        missing = [self.names[i] for i in range(len(self.layers)) if i not in found]
        if missing:
            raise ValueError(
                "FP8RecipeKwargs(backend='msamp', opt_level='O3') under DeepSpeed: the optimizer passed to prepare() "
                f"does not update {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; O3 keeps those "
                "weights' masters itself and needs every converted Linear weight in the optimizer (or leave the "
                "layer out of FP8 with module_filter_func)"
            )
        self._stash = [layer.weight.detach().clone() for layer in self.layers]
        self._trainable = [layer.weight.requires_grad for layer in self.layers]
        for layer in self.layers:
            layer.weight.requires_grad_(False)

    @torch.no_grad()
    def install(self, engine=None, overlap: bool = False) -> None:
        """After DeepSpeed initialised: each weight becomes E4M3 bytes with its scale (the
        `FP8GatheredWeight` the layer's GEMMs read), owners keep FP16 masters, and LowBitAdamW
        with O2 states steps them."""
        if self._stash is None:
            raise RuntimeError("ZeroFP8Weights.install() before detach_from()")
        self.engine = engine
        slots, groups = [], {}
        for layer in self.layers:
            _restore_buffer_dtypes(layer)
        for i, (layer, value) in enumerate(zip(self.layers, self._stash)):
            device = layer.fp8_grad_data.device
            value = value.to(device)
            weight = FP8GatheredWeight(torch.empty(value.shape, dtype=E4M3, device=device),
                                       torch.ones((), device=device), torch.float16)
            weight.requantize_(value, layer.margin, keep_scale=False)
            layer.weight = nn.Parameter(weight, requires_grad=self._trainable[i])
            if self.owners[i] == self.rank:
                master = value.to(torch.float16).clone()
                self.masters[i] = master
                slots.append(_MasterSlot(master, layer))
                groups.setdefault(id(self.source_groups[i]), (self.source_groups[i], []))[1].append(master)
        self._stash = None
        # the source groups as dicts, not indices: DeepSpeed re-lists its optimizer's groups
        self._group_sources = [source for source, _ in groups.values()]
        # ... and their places among the optimizer's groups once DeepSpeed has initialised: a checkpoint's
        # load_state_dict gives the optimizer new group dicts, where an LR scheduler then sets the rate
        live = self._source_optimizer.param_groups if self._source_optimizer is not None else []
        self._group_indices = [next((k for k, g in enumerate(live) if g is source), None)
                               for source in self._group_sources]
        param_groups = [{"params": masters, **{k: source[k] for k in HYPER if k in source}}
                        for source, masters in groups.values()]
        self.optimizer = LowBitAdamW(param_groups or [{"params": []}], exp_avg_dtype=E4M3,
                                     exp_avg_sq_dtype=torch.float16)
        self.optimizer.attach_fp8_grads(slots)
        # each layer's mean goes to its owner only: the other ranks' copies are never read
        self.reducer = FP8GradReducer(self.layers, self.group, owners=self.owners)
        self.blockwise = self._blockwise(engine, overlap)

    def _blockwise(self, engine, overlap: bool):
        """`BlockwiseReduction` of the layers (`LOWPREC_FP8_GRAD_OVERLAP=1`, docs/communication.md) where the
        model has a block list and runs eager; None otherwise (one reduction at the step)."""
        from ...optim.grad_overlap import BlockwiseReduction
        from ...planning.selection import find_blocks

        if not overlap or engine is None or self.world_size == 1:
            return None
        model = getattr(engine, "module", engine)
        found = find_blocks(model)
        if found is None:
            return None
        from accelerate.state import GradientState

        # Accelerate's accumulate() sets sync_gradients before the forward: the backward that steps is hooked
        return BlockwiseReduction(self.layers, list(found[1]), will_sync=lambda: GradientState().sync_gradients,
                                  group=self.group, model=model)

    # ----- each step -------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, max_norm: float | None = None, engine_norm: float | torch.Tensor | None = None) -> None:
        """Average the FP8 gradients, clip them by the norm over every gradient (with `engine_norm`,
        DeepSpeed's pre-clip norm of the rest), step the masters, broadcast the new FP8 weights."""
        if self.blockwise is None or not self.blockwise.finish():  # else the hooked backward averaged them
            self.reducer.reduce()
        if max_norm:
            self._clip(max_norm, 0.0 if engine_norm is None else engine_norm)
        for group, source in zip(self.optimizer.param_groups, self._current_sources()):
            group.update({k: source[k] for k in HYPER if k in source})
        self.optimizer.step()
        self._requantize_and_broadcast()
        for layer in self.layers:
            layer.fp8_grad_valid.zero_()

    def _current_sources(self) -> list[dict]:
        """The groups the masters take their hyper-parameters from, as the optimizer holds them now (after a
        checkpoint load too; until 2026-11-29 the dicts from before it, whose learning rate no scheduler moved)."""
        if self._source_optimizer is None or None in self._group_indices:
            return self._group_sources
        groups = self._source_optimizer.param_groups
        return [groups[k] if k < len(groups) else source for k, source in zip(self._group_indices, self._group_sources)]

    def _clip(self, max_norm: float, engine_norm: float | torch.Tensor) -> None:
        """Divide every FP8 gradient's scale by the clip coefficient, on the device: no host sync in the step
        (the coefficient is 1 where the total norm is under `max_norm` or not finite). The norm over the FP8
        gradients is the owners' norms summed over the ranks (one scalar all-reduce): each layer's mean is on its
        owner only, and with the blockwise reduction each layer is counted once all the same."""
        if not self.layers:
            return
        owned = [layer for i, layer in enumerate(self.layers) if self.owners[i] == self.rank]
        norms = fp8_grad_norms(owned, 2.0)  # a layer without a gradient counts 0
        device = self.layers[0].fp8_grad_scale.device
        # FP32 on every rank, also one owning nothing (the collective's dtype must match across ranks)
        squares = (norms.float().square().sum() if norms is not None
                   else torch.zeros((), dtype=torch.float32, device=device))
        if self.world_size > 1:
            dist.all_reduce(squares, group=self.group)
        engine = torch.as_tensor(engine_norm, dtype=torch.float32, device=device)
        total = (squares + engine.square()).sqrt()
        coef = max_norm / (total + 1e-6)
        coef = torch.where(torch.isfinite(total) & (coef < 1), coef, torch.ones_like(coef))
        # value = data / scale: a larger scale is a smaller gradient
        torch._foreach_div_([layer.fp8_grad_scale for layer in self.layers], coef)

    def _requantize_and_broadcast(self) -> None:
        for i, master in self.masters.items():
            self.layers[i].weight.requantize_(master, self.layers[i].margin)
        # One broadcast per owner: its layers' bytes, then their scales' bytes.
        for rank in range(self.world_size):
            owned = [self.layers[i].weight for i in range(len(self.layers)) if self.owners[i] == rank]
            if not owned:
                continue
            sizes = [w._data.numel() for w in owned]
            if rank == self.rank:
                flat = torch.cat([w._data.view(torch.uint8).flatten() for w in owned]
                                 + [torch.stack([w._scale.float() for w in owned]).view(torch.uint8)])
            else:  # only received into: no need to pack this rank's stale copies first
                flat = torch.empty(sum(sizes) + 4 * len(owned), dtype=torch.uint8, device=owned[0]._data.device)
            dist.broadcast(flat, src=self._global(rank), group=self.group)
            if rank == self.rank:
                continue
            parts = flat.split(sizes + [4 * len(owned)])
            torch._foreach_copy_([w._data.view(torch.uint8) for w in owned],
                                 [part.view(w._data.shape) for part, w in zip(parts, owned)])
            # a copy: the scales' offset is the weights' byte count, which need not be a multiple of 4
            scales = parts[-1].clone().view(torch.float32)
            torch._foreach_copy_([w._scale for w in owned], list(scales.unbind(0)))

    # ----- what the model's weights are ----------------------------------------------------------------
    @torch.no_grad()
    def full_masters(self) -> dict[str, torch.Tensor]:
        """Every layer's FP16 master (name -> tensor on this rank's device), broadcast from its owner.
        A collective: every rank calls it."""
        return {self.names[i]: self._broadcast_master(i) for i in range(len(self.layers))}

    def _broadcast_master(self, i: int) -> torch.Tensor:
        """Layer `i`'s FP16 master on every rank, sent by its owner (a collective)."""
        master = self.masters.get(i)
        if master is None:
            w = self.layers[i].weight
            master = torch.empty(w.shape, dtype=torch.float16, device=w._data.device)
        dist.broadcast(master, src=self._global(self.owners[i]), group=self.group)
        return master

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    @torch.no_grad()
    def state_dict(self) -> dict:
        """Masters and their optimizer states, whole (broadcast from their owners): a collective. Only
        a node's main process keeps them (Accelerate writes custom checkpoints from there); the other
        ranks return an empty entry instead of a CPU copy of every master and state."""
        from accelerate import PartialState

        keep = PartialState().is_local_main_process
        masters, states = {}, {}
        for i, layer in enumerate(self.layers):
            master = self._broadcast_master(i)
            if keep:
                masters[self.names[i]] = master.cpu()
            w, src = layer.weight, self._global(self.owners[i])
            own = self.optimizer.state.get(self.masters[i], {}) if i in self.masters else {}
            # O3's states have one layout (E4M3 + FP16 moments, FP32 scalars): sent as tensors, as
            # pickled FP8 tensors do not survive broadcast_object_list
            scalars = torch.tensor([float(bool(own))] + [float(own[k]) if own else 0.0
                                                         for k in ("step", "exp_avg_scale", "exp_avg_sq_scale")],
                                   device=w._data.device)
            dist.broadcast(scalars, src=src, group=self.group)
            if not scalars[0]:
                if keep:
                    states[self.names[i]] = {}
                continue
            exp_avg = own["exp_avg"] if own else torch.empty(w.shape, dtype=E4M3, device=w._data.device)
            exp_avg_sq = own["exp_avg_sq"] if own else torch.empty(w.shape, dtype=torch.float16, device=w._data.device)
            dist.broadcast(exp_avg.view(torch.uint8), src=src, group=self.group)
            dist.broadcast(exp_avg_sq, src=src, group=self.group)
            if not keep:
                continue
            step, s1, s2 = scalars[1:].cpu().unbind(0)
            states[self.names[i]] = {"step": step.clone(), "exp_avg": exp_avg.cpu(), "exp_avg_scale": s1.clone(),
                                     "exp_avg_sq": exp_avg_sq.cpu(), "exp_avg_sq_scale": s2.clone()}
        return {"masters": masters, "states": states, "world_size": self.world_size}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Masters and states from `state_dict()` (any world size: owners take theirs), then the FP8
        weights requantised from them on every rank."""
        by_name = dict(zip(self.names, range(len(self.layers))))
        unknown = sorted(set(state["masters"]) - set(by_name))
        if unknown or len(state["masters"]) != len(self.layers):
            raise ValueError(f"O3 checkpoint does not match this model's FP8 layers (unexpected: {unknown[:3]}, "
                             f"{len(state['masters'])} saved vs {len(self.layers)} here)")
        for name, value in state["masters"].items():
            i = by_name[name]
            layer = self.layers[i]
            device = layer.weight._data.device
            value = value.to(device=device, dtype=torch.float16)
            layer.weight.requantize_(value, layer.margin, keep_scale=False)
            if i in self.masters:
                self.masters[i].copy_(value)
                saved = state["states"].get(name) or {}
                if saved:
                    self.optimizer.state[self.masters[i]] = {
                        k: v.to("cpu" if k == "step" else device) if isinstance(v, torch.Tensor) else v
                        for k, v in saved.items()}

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the converted weights: FP8 weights, FP8 gradients, masters, states."""
        weight = sum(layer.weight._data.numel() for layer in self.layers)
        return {"weight": weight, "grad": sum(layer.fp8_grad_data.numel() for layer in self.layers),
                "master": sum(m.numel() * m.element_size() for m in self.masters.values()),
                "optimizer_states": self.optimizer.state_bytes() if self.optimizer is not None else 0}
