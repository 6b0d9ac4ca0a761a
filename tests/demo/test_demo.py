"""The main job (`lowprec demo`): BF16 then FP8 on the standard-library corpus, and its table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lowprec.demo.data import Windows, stdlib_corpus

pytest.importorskip("transformers")
pytest.importorskip("torchao")


def test_corpus_split_is_deterministic_and_disjoint():
    a, b = stdlib_corpus(max_bytes=2**20), stdlib_corpus(max_bytes=2**20)
    assert a.train.equal(b.train) and a.heldout.equal(b.heldout)
    assert a.heldout.numel() > 10_000 and a.train.numel() > 10 * a.heldout.numel() // 2
    windows = Windows(a.train, 64, 10, seed=3)
    assert windows[0].shape == (64,) and int(windows[0].max()) < 256
    assert Windows(a.train, 64, 10, seed=3)[7].equal(windows[7])


def test_demo_end_to_end(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env["TORCHAO_FORCE_SKIP_LOADING_SO_FILES"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "lowprec.cli", "demo", "--steps", "12", "--out", str(tmp_path), "--no-progress"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "lowprec precision plan: backend torchao" in out
    assert "| BF16 autocast" in out and "| FP8 torchao:tensorwise (emulated)" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    bf16, fp8 = summary["bf16"], summary["fp8"]
    for run in (bf16, fp8):
        assert run["steps"] == 12 and run["final_loss"] < run["first_loss"] - 0.5
    assert fp8["emulated"] and summary["speedup"] is None
    assert len([m for m in fp8["plan"]["modules"] if m["convert"]]) == 13  # 15 Linears minus first and last
    assert abs(summary["heldout_delta"]) < 0.05


def test_demo_run_with_gradient_accumulation(tmp_path):
    from lowprec.demo.run import parse_args, run

    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    result = run(parse_args(["--variant", "fp8", "--steps", "4", "--grad-accum", "2", "--batch", "4",
                             "--no-progress", "--json", str(tmp_path / "r.json")]))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    assert result["steps"] == 4 and result["tokens_per_step"] == 2 * 4 * 128
    assert json.loads((tmp_path / "r.json").read_text())["grad_accum"] == 2
