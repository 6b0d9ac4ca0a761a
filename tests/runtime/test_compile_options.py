"""Inductor settings for models with FP8 activations (lowprec/runtime/compile_options.py): given to torch.compile
through Accelerate's dynamo plugin while prepare() compiles, the plugin as it was afterwards."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowprec.runtime.compile_options import ACT8_OPTIONS, ENV, compile_options, compiling_with

THRESHOLD = "realize_opcount_threshold"


def test_a_mode_is_spelt_out_as_its_options_and_a_users_own_setting_is_kept():
    from torch._inductor import list_mode_options

    assert compile_options("default", None, ACT8_OPTIONS) == ACT8_OPTIONS
    assert compile_options(None, None, ACT8_OPTIONS) == ACT8_OPTIONS
    autotune = compile_options("max-autotune-no-cudagraphs", None, ACT8_OPTIONS)
    assert autotune == {**list_mode_options("max-autotune-no-cudagraphs"), **ACT8_OPTIONS}
    assert compile_options(None, {THRESHOLD: 8, "max_autotune": True}, ACT8_OPTIONS) == {THRESHOLD: 8,
                                                                                          "max_autotune": True}


@pytest.mark.parametrize("backend", ["inductor", "eager"])
def test_the_plugin_compiles_with_the_settings_inside_and_is_restored_after(backend):
    from accelerate.utils import TorchDynamoPlugin

    plugin = TorchDynamoPlugin(backend=backend, mode="max-autotune-no-cudagraphs")
    with compiling_with(plugin, ACT8_OPTIONS):
        kwargs = plugin.to_kwargs()
    if backend == "inductor":
        assert kwargs.get("mode", "default") is None and kwargs["options"][THRESHOLD] == 64
        assert kwargs["options"]["max_autotune"] is True  # the mode's own options, spelt out
    else:  # another dynamo backend takes no inductor options
        assert "options" not in kwargs
    assert (plugin.mode, plugin.options) == ("max-autotune-no-cudagraphs", None)


def _prepare(monkeypatch, activation_dtype, env=None):
    """prepare() a small model compiled block by block, with Accelerate's compile_regions recording its arguments
    instead of compiling: (those arguments, the plan, the plugin after prepare)."""
    import accelerate.accelerator
    from accelerate.utils import TorchDynamoPlugin

    from lowprec import Accelerator, FP8RecipeKwargs

    if env is not None:
        monkeypatch.setenv(ENV, env)
    seen = []

    def record(module, **kwargs):
        seen.append(kwargs)
        return module

    monkeypatch.setattr(accelerate.accelerator, "compile_regions", record)
    plugin = TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)
    accelerator = Accelerator(mixed_precision="fp8", dynamo_plugin=plugin, kwargs_handlers=[FP8RecipeKwargs(
        backend="torchao", activation_dtype=activation_dtype, skip_slow_shapes=False)])
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    accelerator.prepare(model)
    return seen, accelerator.precision_plan, accelerator.state.dynamo_plugin


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("activation_dtype, env, expected", [
    ("fp8", None, 64), ("fp8", "1", 64), ("fp8", "0", None), (None, None, None),
], ids=["fp8", "fp8_env1", "fp8_env0", "no_fp8_activations"])
def test_prepare_compiles_a_model_with_fp8_activations_with_the_threshold(monkeypatch, activation_dtype, env,
                                                                        expected):
    from lowprec.runtime.activations_in_graph import inlining_supported

    if activation_dtype == "fp8" and not inlining_supported():
        pytest.skip("this torch does not inline saved-tensor hooks into compiled graphs")
    seen, plan, plugin = _prepare(monkeypatch, activation_dtype, env)
    assert len(seen) == 1
    assert (seen[0].get("options") or {}).get(THRESHOLD) == expected
    note = [n for n in plan.notes if THRESHOLD in n]
    assert bool(note) is (expected is not None)
    assert (plugin.mode, plugin.options) == ("default", None)  # as the user left it


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_bad_switch_value_is_refused_naming_the_variable(monkeypatch):
    with pytest.raises(ValueError, match=f"{ENV}='yes' is not one of '0', '1'"):
        _prepare(monkeypatch, "fp8", "yes")


def test_the_threshold_is_inductors_setting():
    # a renamed or removed setting would be an error in torch.compile's options only on the GPU host
    assert hasattr(torch._inductor.config, THRESHOLD)
