"""The plan's note on a compiled Hugging Face model that builds a KV cache in training."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from lowprec.demo.model import PRESETS, build_model
from lowprec.runtime.planner import kv_cache_note


@pytest.mark.parametrize(("use_cache", "compiled", "noted"), [(True, True, True), (False, True, False),
                                                             (True, False, False)])
def test_a_compiled_model_that_builds_a_kv_cache_in_training_is_told(use_cache, compiled, noted):
    pytest.importorskip("transformers")
    model = build_model(PRESETS["tiny"])
    model.config.use_cache = use_cache
    note = kv_cache_note(model, compiled)
    assert (note is not None) is noted
    if noted:
        assert "model.config.use_cache = False" in note
    assert kv_cache_note(torch.nn.Linear(2, 2), compiled) is None  # no config: nothing to say


def _recompiles_of_a_ten_block_llama(use_cache: bool, capfd) -> int:
    """Prepare a 10-block Llama compiled block by block (torchao) and train two steps: how often dynamo recompiled
    (TORCH_LOGS=recompiles on), after checking that prepare() warned of the cache where there was one."""
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import TorchDynamoPlugin

    from lowprec import Accelerator, FP8RecipeKwargs

    torch._dynamo.reset()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    model = build_model(dataclasses.replace(PRESETS["tiny"], layers=10))
    model.config.use_cache = use_cache
    plugin = TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)
    accelerator = Accelerator(mixed_precision="fp8", dynamo_plugin=plugin,
                              kwargs_handlers=[FP8RecipeKwargs(backend="torchao", skip_slow_shapes=False)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = accelerator.prepare(model)
    assert bool([w for w in caught if "use_cache" in str(w.message)]) is use_cache
    ids = torch.randint(0, 100, (2, 32))
    capfd.readouterr()
    for _ in range(2):
        accelerator.backward(model(ids, labels=ids).loss)
    return capfd.readouterr().err.count("Recompiling function")


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_the_cache_recompiles_each_block_under_regional_compilation_and_prepare_warns(monkeypatch, capfd):
    # the reason for the note: with the cache each of a 10-block Llama's blocks compiles a graph of its own
    pytest.importorskip("transformers")
    monkeypatch.setenv("TORCH_LOGS", "recompiles")
    torch._logging._internal._init_logs()
    counts = {}
    try:
        for use_cache in (True, False):
            counts[use_cache] = _recompiles_of_a_ten_block_llama(use_cache, capfd)
    finally:  # torch's logging back to what the environment says without TORCH_LOGS
        monkeypatch.delenv("TORCH_LOGS")
        torch._logging._internal._init_logs()
    assert counts[True] >= 8 and counts[False] <= 2, counts
