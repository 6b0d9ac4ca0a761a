"""Averaging FP8 weight gradients across data-parallel ranks in FP8, with a shared scale.

The gradients are those kept outside `.grad`: msamp's `FP8Linear` writes them from its backward,
a `GradStore` (te, torchao) takes them from `.grad`. DDP cannot average them, so it is told to
ignore those weights and this reducer runs once per optimizer step, after the last backward of the
accumulation window. Each step:

1. one all-reduce (MAX) of every layer's gradient amax (with the validity flags and the local
   scales), so every rank picks the same per-tensor power-of-two scale (MS-AMP's `sync=True` cast);
2. each rank requantises its gradient to that shared scale (an exponent shift: the shared scale is
   never larger than the local one) and all gradients are packed into one FP8 byte buffer;
3. the buffer is averaged by one of two methods:
   - "all_to_all" (default): all_to_all of the FP8 bytes, each rank sums its shard across ranks in
     FP32, multiplies by 1/N and rounds once to FP8, then all_gather of the FP8 shards. Because every
     rank uses the same scale per tensor, the sum needs no per-element scale, and the mean of
     values bounded by 448 is bounded by 448: no pre-scaling, no overflow, one rounding.
   - "nccl_fp8": NCCL's native FP8 all_reduce(SUM) (NCCL >= 2.24; not gloo) of values pre-scaled
     by 1/N so the sum cannot saturate; NCCL rounds after every addition and the 1/N costs
     log2(N) bits at the bottom of the range.
   Both move 1 byte per gradient element per direction; `benchmarks/fp8_comm.py` measures both.

With `owners` (msamp O3 under DeepSpeed ZeRO, where one rank steps each layer's master), the buffer is packed
owner by owner and the all_to_all sends each owner the bytes of its layers only: each owner sums and rounds them
as above, and no all_gather follows. The owners' means are bitwise those of the "all_to_all" method; the other
ranks' copies of a layer are marked as holding no gradient (`fp8_grad_valid` 0), since nothing there reads them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels.fused import cuda_fused, sum_over_ranks
from ..kernels.scaling import compute_scale, nan_to_inf, quantize
from .comm_hooks import all_gather_flat

E4M3 = torch.float8_e4m3fn

METHODS = ("all_to_all", "nccl_fp8")


class FP8GradReducer:
    """Averages the FP8 weight gradients of `layers` across `group` (one call per optimizer step).

    `layers` hold the gradients as `fp8_grad_data` (E4M3), `fp8_grad_scale`, `fp8_grad_amax` and
    `fp8_grad_valid`: msamp `FP8Linear` modules or `lowprec.optim.grad_store.GradStore`s.
    """

    def __init__(self, layers, group=None, method: str = "all_to_all", owners: list[int] | None = None):
        if method not in METHODS:
            raise ValueError(f"FP8 gradient reduction method={method!r} is not one of {', '.join(map(repr, METHODS))}")
        if method == "nccl_fp8" and dist.get_backend(group) != "nccl":
            raise ValueError(
                f"FP8 gradient reduction method='nccl_fp8' needs the NCCL process-group backend (this group uses "
                f"{dist.get_backend(group)!r}); use method='all_to_all', which runs on any backend"
            )
        self.layers = list(layers)
        self.group = group
        self.method = method
        self.world_size = dist.get_world_size(group)
        if owners is not None:
            if method != "all_to_all":
                raise ValueError(f"FP8 gradient reduction to owners runs method='all_to_all', not {method!r}")
            if len(owners) != len(self.layers) or any(not 0 <= r < self.world_size for r in owners):
                raise ValueError(f"owners must name a rank in [0, {self.world_size}) for each of the "
                                 f"{len(self.layers)} layers, got {owners!r}")
        self.owners = None if owners is None else list(owners)
        # owner by owner: the layers each rank owns and the bytes every rank sends it (fixed shapes: once)
        self._by_rank = None if owners is None else [[i for i, r in enumerate(owners) if r == rank]
                                                     for rank in range(self.world_size)]
        self._sends = None if owners is None else [sum(self.layers[i].fp8_grad_data.numel() for i in owned)
                                                   for owned in self._by_rank]
        self.pending = True  # a backward may have produced gradients not reduced yet

    def mark_pending(self) -> None:
        self.pending = True

    def reduce_if_pending(self) -> None:
        if self.pending:
            self.reduce()

    @torch.no_grad()
    def reduce(self) -> None:
        """Average the gradients in place; afterwards every rank holds identical bytes and scales (with `owners`, each
        owner those of its layers, and the others' copies are flagged as holding none)."""
        self.pending = False
        if self.world_size == 1 or not self.layers:
            return
        n = self.world_size
        layers = self.layers
        # Layers without a gradient on this rank contribute zeros (other ranks may have one); their
        # amax may be stale, even NaN, so it is masked, not multiplied by the flag. NaN becomes inf
        # first: MAX over NaN depends on operand order. One MAX all-reduce carries the amaxes, the
        # flags and the negated local scales, whose max gives every rank the same fallback scale
        # (the smallest) when the global amax is not finite.
        valid = torch.stack([layer.fp8_grad_valid for layer in layers])
        amax = torch.stack([layer.fp8_grad_amax for layer in layers])
        amax = torch.where(valid > 0, nan_to_inf(amax), torch.zeros_like(amax))
        local_scale = torch.stack([layer.fp8_grad_scale for layer in layers])
        stats = torch.stack([amax, valid, -local_scale])
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=self.group)
        amax, valid, fallback = stats[0], stats[1], -stats[2]
        shared = compute_scale(amax, E4M3, previous=fallback)
        if self.method == "nccl_fp8":
            shared_send = shared / n
        else:
            shared_send = shared
        ratios = shared_send / local_scale
        if self.owners is not None:
            self._reduce_to_owners(shared, amax, valid, ratios)
            return
        every = range(len(layers))
        total = sum(layer.fp8_grad_data.numel() for layer in layers)
        padded = -(-total // n) * n
        flat = torch.empty(padded, dtype=E4M3, device=layers[0].fp8_grad_data.device)
        flat[total:].zero_()
        self._pack(every, ratios, flat)
        if self.method == "nccl_fp8":
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            reduced = flat
        else:
            reduced = all_to_all_mean(flat, n, self.group)
        self._unpack(every, reduced, shared, amax, valid)

    def _reduce_to_owners(self, shared: torch.Tensor, amax: torch.Tensor, valid: torch.Tensor,
                          ratios: torch.Tensor) -> None:
        """Each owner gets the mean of its layers (see the module doc): one all_to_all, no all_gather. Halves, on
        two ranks, the bytes each rank receives, and skips writing every other rank's layers back."""
        n, me, layers = self.world_size, dist.get_rank(self.group), self.layers
        sends = self._sends
        device = layers[0].fp8_grad_data.device
        flat = torch.empty(sum(sends), dtype=E4M3, device=device)
        self._pack([i for owned in self._by_rank for i in owned], ratios, flat)
        mine = sends[me]
        received = torch.empty(n * mine, dtype=torch.uint8, device=device)
        dist.all_to_all_single(received, flat.view(torch.uint8), output_split_sizes=[mine] * n,
                               input_split_sizes=sends, group=self.group)
        del flat
        owned = self._by_rank[me]
        if owned:
            self._unpack(owned, mean_over_ranks(received.view(n, mine), 1.0 / n), shared, amax, valid)
        others = [layers[i].fp8_grad_valid for i in range(len(layers)) if self.owners[i] != me]
        if others:
            torch._foreach_zero_(others)

    def _pack(self, order, ratios: torch.Tensor, flat: torch.Tensor) -> None:
        """The gradients of the layers in `order`, each requantised to its shared scale (`ratios`), one after
        another into `flat`."""
        offset = 0
        for i in order:
            layer = self.layers[i]
            size = layer.fp8_grad_data.numel()
            flat[offset:offset + size].copy_(requantize(layer.fp8_grad_data.reshape(-1), ratios[i],
                                                        layer.fp8_grad_valid))
            offset += size

    def _unpack(self, order, reduced: torch.Tensor, shared: torch.Tensor, amax: torch.Tensor,
                valid: torch.Tensor) -> None:
        """The layers in `order` take their means from `reduced` (laid out as `_pack` wrote them), the shared scale,
        the global amax (the bound the next reduction starts from: the mean's amax is at most it) and the flag."""
        offset = 0
        for i in order:
            data = self.layers[i].fp8_grad_data
            data.copy_(reduced[offset:offset + data.numel()].view_as(data))
            offset += data.numel()
        for name, values in (("fp8_grad_scale", shared), ("fp8_grad_amax", amax), ("fp8_grad_valid", valid)):
            torch._foreach_copy_([getattr(self.layers[i], name) for i in order], [values[i] for i in order])


# The two passes over every gradient byte, each one fused kernel on CUDA (kernels/fused.py): eager, the
# requantisation alone was eight kernels over FP32 temporaries, ~60 bytes of memory traffic per element;
# fused, its kernel and the copy into the send buffer move ~4 (on the d4096 proxy: 973 M FP8 weight
# gradients, every step, after the backward).
@cuda_fused
def requantize(data: torch.Tensor, ratio: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """E4M3 `data` (1-D) times `ratio` (the shared scale over the local one) in E4M3; zeros where `valid`
    is not > 0 (no gradient on this rank); inf becomes NaN."""
    mine = data.float() * ratio
    return quantize(torch.where(valid > 0, mine, torch.zeros_like(mine)), 1.0, E4M3)


@cuda_fused
def mean_over_ranks(received: torch.Tensor, inverse: float) -> torch.Tensor:
    """The mean over ranks of E4M3 `received` bytes ([n, chunk], one scale shared by all ranks), in E4M3:
    the FP32 sum times `inverse` (1/n). A product, not a quotient: inductor's CUDA code divides approximately
    (div.full.f32) where torch's eager kernel multiplies by the reciprocal, and the two forms would round a
    sum for n = 3 apart. Values bounded by 448 have a mean bounded by 448: no saturation; a NaN stays NaN."""
    return sum_over_ranks(received.view(E4M3)).mul(inverse).to(E4M3)


def all_to_all_mean(flat: torch.Tensor, world_size: int, group=None) -> torch.Tensor:
    """Mean across ranks of E4M3 `flat` (length a multiple of `world_size`, one scale shared by all
    ranks): all_to_all of the bytes, FP32 sum of this rank's shard, one rounding, all_gather. The mean is
    gathered into `flat` itself (its bytes were all sent by then), which is returned: one gradient-sized
    buffer less at the step's end."""
    n = world_size
    chunk = flat.numel() // n
    # Bytes travel as uint8: every backend (gloo included) moves them, whatever its FP8 support.
    received = torch.empty_like(flat.view(torch.uint8))
    dist.all_to_all_single(received, flat.view(torch.uint8), group=group)
    shard = mean_over_ranks(received.view(n, chunk), 1.0 / n)
    del received
    # Collectives of a group run in order on its stream: the all_to_all has read `flat` before this writes it.
    all_gather_flat(flat.view(torch.uint8), shard.view(torch.uint8), group=group)
    return flat
