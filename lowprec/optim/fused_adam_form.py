"""Adam checkpoints between TE's FusedAdam form and Adam's, so that a run resumes with or without te's `fp8_weights`.

Adam's form (torch's Adam/AdamW, LowBitAdamW) keeps a "step" in each parameter's state. TE's FusedAdam (what
`fp8_weights` steps with) keeps one "step" per parameter group and, with master weights, each parameter's FP32
"master_param"; its `load_state_dict` makes each saved state by name and has no state named "step" (a KeyError), and
torch's Adam finds no "step" in FusedAdam's. Converted instead: steps moved to the form the loading optimizer keeps,
and FusedAdam's masters, the weights the run was updating, written into the parameters of an optimizer without
masters (the model file holds the FP8 weights' rounding of them).
"""

from __future__ import annotations

from typing import Any

import torch

from ..utils.tensors import local_shard


def per_group_steps(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Adam's form in FusedAdam's: each group's "step" the largest of its parameters' (they step together), the
    parameters' dropped. A state dict without a parameter's "step" is returned as it is."""
    states = state_dict.get("state", {})
    if not any(isinstance(s, dict) and "step" in s for s in states.values()):
        return state_dict
    groups = []
    for group in state_dict["param_groups"]:
        steps = [float(states[i]["step"]) for i in group["params"] if "step" in states.get(i, {})]
        # an int: FusedAdam (capturable=False, as lowprec builds it) counts in Python
        groups.append({**group, "step": int(max(steps)) if steps else group.get("step", 0)})
    new_states = {pid: {k: v for k, v in s.items() if k != "step"} for pid, s in states.items()}
    return {**state_dict, "state": new_states, "param_groups": groups}


def _take_fused_adam_entries(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[Any, torch.Tensor], list]:
    """(`state_dict` without FusedAdam's own entries, its parameters' FP32 masters and its groups' steps; {saved
    parameter id: master}; each group's step, None where it has none)."""
    states = state_dict.get("state", {})
    groups = state_dict.get("param_groups", [])
    masters = {pid: s["master_param"] for pid, s in states.items() if isinstance(s, dict) and "master_param" in s}
    kept = {pid: {k: v for k, v in s.items() if k != "master_param"} if isinstance(s, dict) else s
            for pid, s in states.items()}
    stripped = {**state_dict, "state": kept, "param_groups": [{k: v for k, v in g.items() if k != "step"}
                                                               for g in groups]}
    return stripped, masters, [g.get("step") for g in groups]


def per_parameter_steps(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[Any, torch.Tensor]]:
    """FusedAdam's form in Adam's: each parameter's "step" its group's (a 0-dim FP32 tensor, as torch's Adam keeps it),
    the groups' dropped, and the FP32 masters taken out: (state dict, {saved parameter id: master}). A state dict in
    Adam's form is returned as it is, with no masters."""
    states = state_dict.get("state", {})
    # FusedAdam's: its groups count the steps and no parameter does (another optimizer's is left to be refused)
    if (not states or not any("step" in g for g in state_dict.get("param_groups", []))
            or any(isinstance(s, dict) and "step" in s for s in states.values())):
        return state_dict, {}
    stripped, masters, steps = _take_fused_adam_entries(state_dict)
    kept = stripped["state"]
    new_states = {pid: {"step": torch.tensor(float(step or 0)), **kept[pid]}
                  for group, step in zip(state_dict["param_groups"], steps) for pid in group["params"] if pid in kept}
    return {**stripped, "state": new_states}, {pid: m for pid, m in masters.items() if pid in new_states}


def write_masters(param_groups: list[dict], saved_groups: list[dict], masters: dict[Any, torch.Tensor]) -> int:
    """Copy each saved master into its parameter, matched as torch's load matches them (the groups' parameters in
    order); returns how many. Nothing is written unless every group and master fits: torch refuses other group sizes
    itself, after the hooks."""
    if not masters or [len(g["params"]) for g in param_groups] != [len(g["params"]) for g in saved_groups]:
        return 0
    params = {pid: p for saved, group in zip(saved_groups, param_groups) for pid, p in zip(saved["params"],
                                                                                         group["params"])}
    pairs = [(params[pid], master) for pid, master in masters.items() if pid in params]
    if any(tuple(p.shape) != tuple(m.shape) for p, m in pairs):
        return 0  # another model's checkpoint: torch's load refuses its moments by shape
    with torch.no_grad():
        for p, master in pairs:
            target = local_shard(p)
            target.copy_(local_shard(master).to(target.device))
    return len(pairs)


def keeps_group_steps(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` counts its steps per group, as TE's FusedAdam: by its type, the same on every rank."""
    return getattr(optimizer, "master_weights", None) is not None


# where a load's pre-hook keeps what rank 0 alone got of a FusedAdam checkpoint, for `spread_from_rank0`
STASH = "_lowprec_rank0_fused_adam_entries"


def stash_fused_adam_entries(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any] | None:
    """A load_state_dict pre-hook (first of them) for FSDP2's full-state loads on several processes: FusedAdam's own
    entries of the dict (its masters, its groups' steps) taken out and kept on the optimizer, by the position of
    their parameter, for `spread_from_rank0`; None (the dict as it is) where there are none or the optimizer keeps
    them itself."""
    if keeps_group_steps(optimizer):
        return None
    stripped, masters, steps = _take_fused_adam_entries(state_dict)
    ids = [pid for group in state_dict.get("param_groups", []) for pid in group["params"]]
    by_position = {i: masters[pid] for i, pid in enumerate(ids) if pid in masters}
    steps = [None if step is None else float(step) for step in steps]
    if not by_position and all(step is None for step in steps):
        return None
    optimizer.__dict__[STASH] = (by_position, steps)
    return stripped


def spread_from_rank0(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """After FSDP2's full-state load on several processes, FusedAdam's entries that reached rank 0 alone, made every
    rank's in Adam's form; returns (parameters whose step was set, masters written). A collective: every rank calls it.

    Rank 0 alone reads the file, and torch's `set_optimizer_state_dict` gives the others only the entries the
    optimizer's own state dict has (every rank's too where the file has them): a FusedAdam checkpoint's group steps and
    FP32 masters reached rank 0 alone, in full, and each parameter's step kept the fresh optimizer's. The load's
    pre-hook took them aside (`stash_fused_adam_entries`); here each parameter's step becomes its group's and each
    master is written into the parameter (its shard on each rank: the weights the run was updating, of which the
    model file holds the FP8 rounding). An optimizer that keeps group steps and masters itself (FusedAdam) is left
    as it is."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    if keeps_group_steps(optimizer):
        return 0, 0
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stash = optimizer.__dict__.pop(STASH, None)
    info: list = [None]
    if dist.get_rank() == 0:  # a master of another shape than its parameter's (another model) is not written
        fits = [i for i, m in (stash[0].items() if stash else []) if i < len(params)
                and tuple(m.shape) == tuple(params[i].shape)]
        info = [{"masters": sorted(fits), "steps": stash[1] if stash else []}]
    dist.broadcast_object_list(info, src=0)
    masters, group_steps = info[0]["masters"], info[0]["steps"]
    stepped = 0
    for group, step in zip(optimizer.param_groups, group_steps):
        for p in group["params"] if step is not None else []:
            old = (optimizer.state.get(p) or {}).get("step")
            if old is not None:  # a tensor (torch's Adam, LowBitAdamW), or a number
                optimizer.state[p]["step"] = (torch.full_like(old, step) if isinstance(old, torch.Tensor)
                                              else type(old)(step))
                stepped += 1
    with torch.no_grad():
        for i in masters:
            p = params[i]
            target = local_shard(p)
            full = (stash[0][i].to(target.device, torch.float32) if stash is not None
                    else torch.empty(p.shape, dtype=torch.float32, device=target.device))
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=0).to_local()
            else:
                dist.broadcast(full, src=0)
            target.copy_(full)
    return stepped, len(masters)
