"""MS-AMP O3 under FSDP2: FP16 master weights sharded by FSDP2 and all-gathered as FP8.

O3 keeps the FP16 master copy of each converted weight, and its O2 optimizer states, sharded across
the data-parallel ranks, and the weight itself in E4M3 with one power-of-two scale. Under FSDP2 the
sharded parameter *is* the FP16 master: `FP8MasterWeight` wraps a converted layer's FP16 shard and,
through FSDP2's all-gather extension (`fsdp_pre_all_gather` / `fsdp_post_all_gather`), has FSDP2
send E4M3 bytes instead of FP16 ones, scaled from the weight's amax over all ranks (a MAX
all-reduce of one scalar). The all-gather yields an `FP8GatheredWeight` (the bytes and the scale,
freed again when FSDP2 reshards), which `FP8Linear` feeds to its GEMMs without casting again. The
weight gradient goes back to FSDP2 through autograd, is reduce-scattered (in block-scaled FP8 when
grad_comm_dtype is 'fp8', O3's default across hosts; in the policy's reduce dtype on one host) and lands on the
FP16 shard as its `.grad`, where
`LowBitAdamW` reads it.
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from ...kernels.fused import cuda_fused
from ...kernels.scaling import compute_scale, nan_to_inf, quantize, tensor_amax

E4M3 = torch.float8_e4m3fn
aten = torch.ops.aten

# Ops whose result is still the master shard (FSDP2 builds and pads the shard with them, moves it
# between devices); anything else (arithmetic, reductions, the optimizer's math) sees the plain FP16
# tensor and returns plain tensors.
_MASTER_OPS = {
    aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor, aten.copy_.default, aten.view.default,
    aten.as_strided.default, aten._to_copy.default, aten._pin_memory.default, aten.split.Tensor,
    aten.clone.default, aten.detach.default, aten.alias.default,
}
# Ops that keep the gathered weight in FP8: views of its bytes, which share its scale.
_GATHERED_VIEWS = {aten.detach.default, aten.alias.default, aten.as_strided.default, aten.view.default,
                   aten.t.default, aten._unsafe_view.default}


class FP8MasterWeight(torch.Tensor):
    """A converted layer's FP16 weight (FSDP2 shards it: the master copy) that FSDP2 all-gathers in FP8.

    `margin` is the layer's power-of-two headroom. The scale of the last gather stays on the shard
    (`_scale`): a gather whose amax is zero or not finite keeps it, so NaN never becomes a scale.
    After an optimizer step `precompute_weight_scales` sets the scales of all weights with one
    all-reduce (`_precomputed`); until then each gather all-reduces its own weight's amax.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, margin: int = 0, scale: torch.Tensor | None = None):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
            layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, margin: int = 0, scale: torch.Tensor | None = None):
        self._tensor = tensor
        self._margin = margin
        self._scale = scale if scale is not None else torch.ones((), device=tensor.device)
        self._precomputed = False

    def __repr__(self) -> str:
        return f"FP8MasterWeight({self._tensor!r}, margin={self._margin})"

    def __deepcopy__(self, memo):
        return FP8MasterWeight(copy.deepcopy(self._tensor, memo), self._margin, copy.deepcopy(self._scale, memo))

    def data_ptr(self) -> int:
        # The FP16 bytes' address: Accelerate's FSDP2 optimizer remap keys parameters by data_ptr(),
        # and a wrapper without storage would report 0 for all of them.
        return self._tensor.data_ptr()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        masters = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, FP8MasterWeight)]
        master = masters[0]
        if func._schema.is_mutable:  # new values (a checkpoint loaded, an update): the scale must be new too
            for m in masters:
                m._precomputed = False
        args, kwargs = pytree.tree_map_only(FP8MasterWeight, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _MASTER_OPS:
            return out

        def rewrap(t: torch.Tensor) -> FP8MasterWeight:
            # views and copies share the scale; a copy on another device (FSDP2 moving the shard to
            # its GPU) gets the scale there, so reading it never syncs with the host
            scale = master._scale if master._scale.device == t.device else master._scale.to(t.device)
            return FP8MasterWeight(t, master._margin, scale)

        return pytree.tree_map_only(torch.Tensor, rewrap, out)

    def __tensor_flatten__(self):
        return ["_tensor", "_scale"], {"margin": self._margin}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return FP8MasterWeight(inner["_tensor"], meta["margin"], inner["_scale"])

    # ----- FSDP2's all-gather extension ------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """E4M3 bytes of this shard (padded to FSDP2's shard length) scaled from the global amax: cast with the
        rest of its FSDP2 group's weights where `fully_shard_fp8_layers` made the group (`_GroupCast`)."""
        rows = _shard_rows(outer_size[0], mesh)
        group = getattr(module, GROUP_CAST_ATTR, None)
        cast = group.take(self, rows) if group is not None else None
        if cast is not None:
            return (cast[0],), (cast[1],)
        shard = self._tensor
        if self._precomputed:
            scale = self._scale
        else:
            amax = _global_amax([shard], mesh)[0]
            scale = compute_scale(amax, E4M3, self._margin, previous=self._scale)
            self._scale.copy_(scale)
        _record_weight_scales([module], [scale])
        return (_shard_bytes(shard, scale, rows),), (scale.clone(),)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,), (scale,) = outputs, metadata
        if out is not None:  # FSDP2 refilled the same bytes buffer: only the scale is new
            out._scale = scale
            return None
        return FP8GatheredWeight(data.view(E4M3), scale, param_dtype), (data,)


# FSDP2 reads the extension's signature at every gather of every weight (inspect.signature, to tell its one-argument
# form from the five-argument one): about half of the host time of making a group's all-gather inputs, on two CPU
# ranks. A precomputed signature is returned as it is.
FP8MasterWeight.fsdp_pre_all_gather.__signature__ = inspect.signature(FP8MasterWeight.fsdp_pre_all_gather)


def _shard_rows(length: int, mesh) -> int:
    """Rows of FSDP2's padded shard of a weight `length` rows long: its dim-0 split over the mesh's last (shard)
    dimension."""
    return -(-length // mesh.size(mesh.ndim - 1))


@cuda_fused
def _shard_bytes(shard: torch.Tensor, scale: torch.Tensor, rows: int) -> torch.Tensor:
    """E4M3 bytes of a master shard, zero-padded to FSDP2's shard length `rows` (the last ranks' shards
    are shorter or empty), as uint8: FSDP2 gathers a group of one dtype in that dtype, and gloo has no
    FP8 type. One fused kernel on CUDA."""
    data = quantize(shard, scale, E4M3)
    if data.shape[0] < rows:
        data = torch.cat([data, data.new_zeros((rows - data.shape[0], *data.shape[1:]))])
    return data.view(torch.uint8)


@cuda_fused
def _group_bytes(scales: torch.Tensor, shards: list[torch.Tensor], rows: list[int]) -> list[torch.Tensor]:
    """`_shard_bytes` of each shard with its scale (`scales[i]`): on CUDA one compiled call for a group's weights,
    where each weight's own call cost a dynamo guard check, the call and a copy of its scale."""
    return [_shard_bytes(shard, scales[i], r) for i, (shard, r) in enumerate(zip(shards, rows))]


GROUP_CAST_ATTR = "_lowprec_group_cast"


class _GroupCast:
    """The E4M3 shards of one FSDP2 group's O3 weights, cast together when FSDP2 asks for the first of them.

    FSDP2 calls `fsdp_pre_all_gather` weight by weight. One compiled call per weight was ~0.65 ms of host time
    each on the d4096 proxy (seven per block, twice a step), and O3 under FSDP2 is bound by the host
    (results/gpu/2026-11-27-h200x2-o3fsdp2-765a23c). A cast is kept only for the master values and scale it was
    made from: the master's and the scale's version counters and the scales' epoch, which every setting of the scales
    moves (the fused LowBitAdamW writes the masters by pointer, which moves no version counter, and the scales are
    set after every step). Anything else casts again."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = layers
        self.ready: dict[int, tuple[tuple[int, int, int], torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def _version(master: FP8MasterWeight) -> tuple[int, int, int]:
        return master._tensor._version, master._scale._version, _SCALE_EPOCH[0]

    def take(self, master: FP8MasterWeight, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(bytes, scale) of `master`'s shard, or None where its layer is not one of the group's."""
        entry = self.ready.pop(id(master), None)
        if entry is not None and entry[0] == self._version(master) and entry[1].shape[0] == rows:
            return entry[1], entry[2]
        from torch.distributed.tensor import DTensor

        weights = [layer.weight for layer in self.layers]
        if not all(isinstance(w, DTensor) and isinstance(w._local_tensor, FP8MasterWeight) for w in weights):
            return None  # a layer gathered or swapped: each weight on its own
        masters = [w._local_tensor for w in weights]
        if not any(m is master for m in masters):
            return None
        mesh = weights[0].device_mesh
        if not all(m._precomputed for m in masters):
            _set_scales(masters, mesh)  # one all-reduce for the group, on every rank alike
        counts = [_shard_rows(w.shape[0], mesh) for w in weights]
        scales = torch.stack([m._scale.reshape(()) for m in masters])  # a copy: the next step's scales go elsewhere
        data = _group_bytes(scales, [m._tensor for m in masters], counts)
        each = list(scales.unbind(0))
        _record_weight_scales(self.layers, each)
        self.ready = {id(m): (self._version(m), d, s) for m, d, s in zip(masters, data, each)}
        entry = self.ready.pop(id(master))
        return (entry[1], entry[2]) if entry[1].shape[0] == rows else None


def _record_weight_scales(layers: list[nn.Module], scales: list[torch.Tensor]) -> None:
    """Each training layer's weight scale buffer (`FP8Linear.scales`, for inspection) set to its gather's, in one
    launch: the layers' forwards no longer copy it one by one. On FSDP2's all-gather stream, which the forward waits
    for: a read of `scales` outside the forward may see the last gather's."""
    pairs = [(getattr(layer, "fp8_meta_scale_weight", None), scale) for layer, scale in zip(layers, scales)
             if layer.training]
    if pairs and all(b is not None for b, _ in pairs):
        torch._foreach_copy_([b for b, _ in pairs], [s for _, s in pairs])


def _shard_amaxes(shards: list[torch.Tensor]) -> torch.Tensor:
    """amax of each shard, NaN as +inf, as one FP32 vector. Eager (an abs and a max per shard, once per
    step): `cuda_fused` looks for its tensor among the arguments, not inside a list."""
    return nan_to_inf(torch.stack([tensor_amax(s) for s in shards]))


@cuda_fused
def _scaled_cast(value: torch.Tensor, previous: torch.Tensor | None, margin: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(power-of-2 scale from `value`'s amax, or `previous` when that is zero or not finite (1 without one),
    `value` in E4M3 with it): on CUDA one compiled function, a reduction over `value`'s rows, one over theirs, the
    cast. Its last reduction stays compiled: split into a compiled row pass, aten's amax and a compiled cast (as
    the grad store's `accumulated`), a 14336x4096 weight took 2.61 ms against this form's 0.26 ms
    (results/gpu/2026-11-28-h200-act8-steady-2a04d10, fused_reductions.json)."""
    scale = compute_scale(tensor_amax(value), E4M3, margin, previous=previous)
    return scale, quantize(value, scale, E4M3)


class FP8GatheredWeight(torch.Tensor):
    """A whole weight in E4M3: `_data` with `_scale` (value = _data / _scale), reporting the dtype it
    stands for; as FSDP2 gathered it (O3 under FSDP2), or as stored on every rank (O3 under DeepSpeed,
    `zero`). `FP8Linear` reads the bytes directly; copying into it requantises; any other use sees
    the dequantised tensor."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=dtype,
            layout=data.layout, device=data.device, requires_grad=False,
        )

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self._data = data
        self._scale = scale

    def __repr__(self) -> str:
        return f"FP8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, scale={self._scale})"

    def dequantize(self) -> torch.Tensor:
        return (self._data.float() / self._scale).to(self.dtype)

    @torch.no_grad()
    def requantize_(self, value: torch.Tensor, margin: int = 0, keep_scale: bool = True) -> None:
        """Store `value` in place: a power-of-2 scale from its amax, then its E4M3 bytes. A zero or
        non-finite amax keeps the scale in use (`keep_scale`) or falls back to 1, never a NaN scale."""
        scale, data = _scaled_cast(value.to(self._data.device), self._scale if keep_scale else None, margin)
        self._scale.copy_(scale)
        self._data.copy_(data)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.copy_.default and isinstance(args[0], FP8GatheredWeight):
            # new values into a stored FP8 weight (O3 under DeepSpeed: load_state_dict)
            weight, src = args
            weight.requantize_(src.dequantize() if isinstance(src, FP8GatheredWeight) else src)
            return weight
        if func in _GATHERED_VIEWS and isinstance(args[0], FP8GatheredWeight):
            weight = args[0]
            data = func(weight._data, *args[1:], **(kwargs or {}))
            return FP8GatheredWeight(data, weight._scale, weight.dtype)
        args, kwargs = pytree.tree_map_only(FP8GatheredWeight, lambda t: t.dequantize(), (args, kwargs or {}))
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        return ["_data", "_scale"], {"dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return FP8GatheredWeight(inner["_data"], inner["_scale"], meta["dtype"])


torch.serialization.add_safe_globals([FP8MasterWeight, FP8GatheredWeight])


def _global_amax(shards: list[torch.Tensor], mesh) -> torch.Tensor:
    """The amax of each whole weight from its shards: one MAX all-reduce over the mesh (replicas hold
    equal weights, so MAX over every mesh dimension is the global amax). NaN travels as +inf: MAX over
    NaN depends on operand order."""
    amax = _shard_amaxes(shards)
    for dim in range(mesh.ndim):
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    return amax


_SCALE_EPOCH = [0]  # how many times `_set_scales` ran: a `_GroupCast` keeps no cast across it


def _set_scales(masters: list[FP8MasterWeight], mesh) -> None:
    """Each master's all-gather scale from the global amax of its weight, with one all-reduce over `mesh`; marks
    them precomputed (valid until the master changes)."""
    _SCALE_EPOCH[0] += 1
    amax = _global_amax([m._tensor for m in masters], mesh)
    # One vector of scales, not a compute_scale (~25 kernels) per weight: weight by weight this was 841 of
    # O3's ~2200 ops a step under FSDP2 (counted on two CPU ranks), whose step was host-bound on two H200s.
    # Layers take the recipe's one margin; another margin costs another vector, not an index copied from the host.
    previous = torch.stack([m._scale for m in masters]).reshape(-1)
    for margin in dict.fromkeys(m._margin for m in masters):
        new = compute_scale(amax, E4M3, margin, previous=previous).unbind(0)
        mine = [(m._scale, v.reshape(m._scale.shape)) for m, v in zip(masters, new) if m._margin == margin]
        torch._foreach_copy_([s for s, _ in mine], [v for _, v in mine])
    for master in masters:
        master._precomputed = True


@torch.no_grad()
def precompute_weight_scales(weights: list[torch.Tensor]) -> int:
    """Set the all-gather scale of every O3 master weight (DTensors of `FP8MasterWeight`) with one
    all-reduce per device mesh, after an optimizer step changed them, so FSDP2's gathers need none
    of their own. Returns how many weights got a scale."""
    from torch.distributed.tensor import DTensor

    # keyed by the mesh itself (equal ranks and layout), not its id: FSDP2 groups sharded in separate calls may
    # hold equal meshes of their own, and one all-reduce serves them all
    by_mesh: dict[object, tuple[object, list[FP8MasterWeight]]] = {}
    for w in weights:
        if isinstance(w, DTensor) and isinstance(w._local_tensor, FP8MasterWeight):
            by_mesh.setdefault(w.device_mesh, (w.device_mesh, []))[1].append(w._local_tensor)
    for mesh, masters in by_mesh.values():
        _set_scales(masters, mesh)
    return sum(len(masters) for _, masters in by_mesh.values())


def master_view(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (an `FP8MasterWeight`, or a DTensor of one) as a plain FP16 tensor on the same memory."""
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor) and isinstance(weight._local_tensor, FP8MasterWeight):
        local = weight._local_tensor._tensor
        plain = DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False,
                                   shape=weight.shape, stride=weight.stride())
        return plain.requires_grad_(weight.requires_grad) if weight.requires_grad else plain
    if isinstance(weight, FP8MasterWeight):
        return weight._tensor
    return weight
