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


def per_parameter_steps(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[Any, torch.Tensor]]:
    """FusedAdam's form in Adam's: each parameter's "step" its group's (a 0-dim FP32 tensor, as torch's Adam keeps it),
    the groups' dropped, and the FP32 masters taken out: (state dict, {saved parameter id: master}). A state dict in
    Adam's form is returned as it is, with no masters."""
    states = state_dict.get("state", {})
    # FusedAdam's: its groups count the steps and no parameter does (another optimizer's is left to be refused)
    if (not states or not any("step" in g for g in state_dict.get("param_groups", []))
            or any(isinstance(s, dict) and "step" in s for s in states.values())):
        return state_dict, {}
    masters, new_states, groups = {}, {}, []
    for group in state_dict["param_groups"]:
        step = torch.tensor(float(group.get("step", 0)))
        for pid in group["params"]:
            if pid in states:
                entry = dict(states[pid])
                if "master_param" in entry:
                    masters[pid] = entry.pop("master_param")
                new_states[pid] = {"step": step.clone(), **entry}
        groups.append({k: v for k, v in group.items() if k != "step"})
    return {**state_dict, "state": new_states, "param_groups": groups}, masters


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
