"""runtime/sharded_checkpoints.py: which folder a load reads, the saved sizes of `_extra_state` entries from a DCP
checkpoint's metadata, and the modules told them only for the load (the whole path, through Accelerate's FSDP2
save_state/load_state on two CPU processes: tests/test_accelerate_engines.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from torch import nn

from lowprec.runtime.sharded_checkpoints import checkpoint_dir, saved_extra_state_bytes, sized_extra_states


def _accelerator(project_dir, automatic: bool):
    return SimpleNamespace(project_dir=str(project_dir),
                           project_configuration=SimpleNamespace(automatic_checkpoint_naming=automatic))


def test_the_folder_is_the_one_given_else_the_last_automatic_checkpoint(tmp_path):
    assert checkpoint_dir(_accelerator(tmp_path, True), "~/ckpt") == os.path.expanduser("~/ckpt")
    assert checkpoint_dir(_accelerator(tmp_path, False), None) is None
    assert checkpoint_dir(_accelerator(tmp_path, True), None) is None  # no checkpoints folder yet
    for name in ("checkpoint_2", "checkpoint_10", "checkpoint_9"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    # by number, as Accelerate picks it: 10 after 9, not after 1
    assert checkpoint_dir(_accelerator(tmp_path, True), None) == str(tmp_path / "checkpoints" / "checkpoint_10")


class Sized(nn.Linear):
    loading_extra_state_bytes = None

    def get_extra_state(self):
        want = self.loading_extra_state_bytes
        return torch.zeros(0 if want is None else want, dtype=torch.uint8)

    def set_extra_state(self, state):
        self.loaded = state


def test_saved_sizes_are_read_from_dcp_metadata_and_told_only_during_the_load(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = nn.Sequential(Sized(4, 4), nn.Linear(4, 4))
    state = {"model": {"0.weight": torch.ones(4, 4), "0._extra_state": torch.arange(207, dtype=torch.uint8) % 7,
                       "1.weight": torch.ones(4, 4)}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "pytorch_model_fsdp_0")), no_dist=True)
    assert saved_extra_state_bytes(str(tmp_path / "pytorch_model_fsdp_0")) == {"0": 207}
    assert saved_extra_state_bytes(str(tmp_path / "nothing_here")) == {}
    with sized_extra_states([model], str(tmp_path)):
        assert model[0].loading_extra_state_bytes == 207
        assert model.state_dict()["0._extra_state"].numel() == 207  # the place DCP loads into
    assert model[0].loading_extra_state_bytes is None
    with sized_extra_states([model], None):  # no folder to read: nothing told
        assert model[0].loading_extra_state_bytes is None


def test_each_backend_completes_the_optimizers_state_before_save_state_and_load_state(
        fresh_accelerate_state, monkeypatch, tmp_path):
    # what a save or a load makes the optimizer's state dict from must hold every parameter's state (te's FusedAdam
    # holds its FP8 weights' alone before the first step: Backend.complete_optimizer_state); here, a lowprec
    # Accelerator on one CPU process records each call and what the optimizer's state dict held when Accelerate
    # wrote it
    from accelerate import Accelerator as PlainAccelerator

    from lowprec import Accelerator, FP8RecipeKwargs
    from lowprec.backends.base import Backend

    calls = []
    monkeypatch.setattr(Backend, "complete_optimizer_state",
                        lambda self, optimizer, loading=False: calls.append((optimizer, loading)))
    saved = []
    plain_save = PlainAccelerator.save_state
    monkeypatch.setattr(PlainAccelerator, "save_state",
                        lambda self, *a, **k: (saved.append(len(calls)), plain_save(self, *a, **k))[1])
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(
        backend="msamp", opt_level="O2", emulate=True, skip_slow_shapes=False, skip_first_last=False)], cpu=True)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    inner = optimizer.optimizer
    accelerator.save_state(str(tmp_path / "c"))
    assert calls == [(inner, False)] and saved == [1]  # before Accelerate's own save
    accelerator.load_state(str(tmp_path / "c"))
    assert calls == [(inner, False), (inner, True)]  # a load: what it must replace marked (te's masters)


def test_whole_state_dict_saves_make_backend_tensors_plain_and_loads_refresh_from_the_optimizers(
        fresh_accelerate_state, monkeypatch, tmp_path):
    # save_state writing a whole state dict (here one CPU process; FSDP2's FULL_STATE_DICT, DDP) asks each backend to
    # make its tensor types plain in it (te's FP8-only weights: a Float8Tensor torch.load brings back has no
    # quantizer, and FSDP2's full load could not shard it, one H200 at 4135470), only during the save; after
    # load_state each backend sees the optimizers (te requantises its FP8 weights from FusedAdam's masters)
    from lowprec import Accelerator, FP8RecipeKwargs
    from lowprec.backends.base import Backend

    made_plain, refreshed = [], []
    monkeypatch.setattr(Backend, "plain_checkpoint_entries",
                        lambda self, state_dict, prefix: made_plain.append((prefix, sorted(state_dict))))
    monkeypatch.setattr(Backend, "after_load_state",
                        lambda self, model, optimizers=(): refreshed.append((model, list(optimizers))))
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(
        backend="msamp", opt_level="O2", emulate=True, skip_slow_shapes=False, skip_first_last=False)], cpu=True)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    accelerator.save_state(str(tmp_path / "c"))
    assert len(made_plain) == 1 and made_plain[0][0] == "" and "0.weight" in made_plain[0][1]
    model.state_dict()
    assert len(made_plain) == 1  # the hook is gone after the save
    accelerator.load_state(str(tmp_path / "c"))
    assert refreshed == [(accelerator.unwrap_model(model), [optimizer.optimizer])]


def test_a_failed_load_still_makes_the_backends_whole_again(fresh_accelerate_state, monkeypatch, tmp_path):
    # before a load te marks its masters for the load to replace (NaN); a load that fails or is refused must not leave
    # them so: each backend's after_load_state runs then too, its notices silenced (nothing loaded)
    import warnings

    from accelerate import Accelerator as PlainAccelerator

    from lowprec import Accelerator, FP8RecipeKwargs
    from lowprec.backends.base import Backend

    refreshed = []

    def after(self, model, optimizers=()):
        refreshed.append(model)
        warnings.warn("lowprec: a notice of a load that happened", stacklevel=2)

    monkeypatch.setattr(Backend, "after_load_state", after)
    monkeypatch.setattr(PlainAccelerator, "load_state", lambda self, *a, **k: (_ for _ in ()).throw(OSError("disk")))
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(
        backend="msamp", opt_level="O2", emulate=True, skip_slow_shapes=False, skip_first_last=False)], cpu=True)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            accelerator.load_state(str(tmp_path / "c"))
        except OSError as exc:
            assert str(exc) == "disk"
        else:
            raise AssertionError("the load's error was swallowed")
    assert refreshed == [accelerator.unwrap_model(model)]
    assert not [w for w in caught if "a load that happened" in str(w.message)]
