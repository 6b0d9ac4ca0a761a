"""`lowprec bench --seeds N`: every configuration with N seeds, each FP8 run against BF16's run of its own seed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from lowprec.demo.bench import markdown, parse_args, summarise
from lowprec.demo.seeds import main as seeds_main
from lowprec.demo.seeds import seed_markdown, seed_summary


def run(config: str, seed: int | None, heldout: float) -> dict:
    return {"arch": "llama", "config": config, "seed": seed, "tokens_per_s": 100.0, "step_ms_median": 10.0,
            "peak_memory_bytes": 2**30, "model_state_bytes_per_param": {"all_params": {"total": 16.0}},
            "peak_memory_kind": "cuda max_memory_allocated", "peak_split": None, "heldout_loss": heldout,
            "emulated": False, "losses": [2.0, 1.0]}


def test_each_run_is_compared_with_the_bf16_run_of_its_seed():
    rows = summarise([run("bf16", 0, 2.0), run("bf16", 1, 2.2), run("msamp:delayed:O2", 0, 2.02),
                      run("msamp:delayed:O2", 1, 2.2)], speeds=False)
    deltas = {(r["config"], r["seed"]): r.get("heldout_delta") for r in rows}
    assert deltas["msamp:delayed:O2", 0] == pytest.approx(0.01)
    assert deltas["msamp:delayed:O2", 1] == pytest.approx(0.0)  # against seed 1's BF16 (2.2), not seed 0's
    table = markdown(rows, "header")
    assert "| llama | msamp:delayed:O2 (seed 1) |" in table and "| llama | bf16 (seed 0) |" in table


def test_the_summary_gives_the_paired_differences_and_bf16s_own_spread():
    bf16 = [2.0, 2.1, 1.9]
    fp8 = [2.02, 2.1, 1.919]  # +1%, 0%, +1%
    rows = summarise([run("bf16", s, v) for s, v in enumerate(bf16)]
                     + [run("torchao:tensorwise", s, v) for s, v in enumerate(fp8)]
                     + [{"arch": "llama", "config": "te:delayed", "seed": 0, "error": ["no te"]}], speeds=False)
    by = {s["config"]: s for s in seed_summary(rows)}
    assert "te:delayed" not in by  # a failed run has no loss to summarise
    assert by["bf16"]["seeds"] == 3 and by["bf16"]["heldout_loss_mean"] == pytest.approx(2.0)
    assert by["bf16"]["spread"] == pytest.approx(0.1 / 2.0)  # sample sd 0.1 over a mean of 2.0
    fp8_row = by["torchao:tensorwise"]
    expected = [0.01, 0.0, 0.01]
    mean = sum(expected) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in expected) / 2)
    assert fp8_row["delta_mean"] == pytest.approx(mean) and fp8_row["delta_sd"] == pytest.approx(sd)
    assert fp8_row["delta_sem"] == pytest.approx(sd / math.sqrt(3)) and fp8_row["paired"] == 3
    assert (fp8_row["delta_min"], fp8_row["delta_max"]) == (pytest.approx(0.0), pytest.approx(0.01))
    table = seed_markdown(seed_summary(rows))
    assert "| llama | torchao:tensorwise | 3 | 2.0130 | +0.67% | 0.58% | 0.33% | +0.00% .. +1.00% | +0.65% |" in table
    assert "| llama | bf16 | 3 | 2.0000 |  |  |  |  |  |  | 5.00% |" in table


def test_the_summary_compares_the_means_unpaired_with_welchs_standard_error():
    # same-seed reruns on a GPU differ as much as seeds do: the means are compared without pairing as well
    bf16, fp8 = [2.0, 2.1, 1.9, 2.0], [2.05, 1.95]
    rows = summarise([run("bf16", s, v) for s, v in enumerate(bf16)]
                     + [run("msamp:delayed:O2", s, v) for s, v in enumerate(fp8)], speeds=False)
    by = {s["config"]: s for s in seed_summary(rows)}
    fp8_row = by["msamp:delayed:O2"]
    assert fp8_row["vs_mean"] == pytest.approx(0.0)
    var_bf16 = sum((v - 2.0) ** 2 for v in bf16) / 3
    var_fp8 = sum((v - 2.0) ** 2 for v in fp8) / 1
    assert fp8_row["vs_mean_sem"] == pytest.approx(math.sqrt(var_bf16 / 4 + var_fp8 / 2) / 2.0)
    assert "vs_mean" not in by["bf16"]
    one = seed_summary(summarise([run("bf16", 0, 2.0), run("bf16", 1, 2.2), run("msamp:delayed:O2", 0, 2.31)],
                                 speeds=False))
    (single,) = [s for s in one if s["config"] != "bf16"]
    assert single["vs_mean"] == pytest.approx(0.1) and single["vs_mean_sem"] is None  # one run: no variance


def test_a_configuration_whose_bf16_failed_has_no_difference():
    rows = summarise([{"arch": "llama", "config": "bf16", "seed": 0, "error": ["out of memory"]},
                      run("msamp:delayed:O2", 0, 2.0)], speeds=False)
    (entry,) = seed_summary(rows)
    assert entry["seeds"] == 1 and "delta_mean" not in entry
    assert "| llama | msamp:delayed:O2 | 1 | 2.0000 |  |" in seed_markdown([entry])
    assert "vs_mean" not in entry


def write_results(path, rows, size="proxy", steps=300, environment=None):
    result = {"size": size, "steps": steps, "tokens": None, "rows": rows}
    if environment is not None:
        result["environment"] = environment
    path.write_text(json.dumps(result))
    return str(path)


def test_several_results_are_pooled_into_one_table(tmp_path, capsys):
    first = summarise([run("bf16", 0, 2.0), run("msamp:delayed:O2", 0, 2.02)], speeds=False)
    second = summarise([run("bf16", 0, 2.2), run("msamp:delayed:O2", 0, 2.2)], speeds=False)
    paths = [write_results(tmp_path / "a.json", first), write_results(tmp_path / "b.json", second)]
    assert seeds_main(paths) == 0
    out = capsys.readouterr().out
    # each file's runs paired with its own BF16 run (+1%, 0%); the means 2.11 against 2.10
    assert "Pooled over 2 results" in out
    assert "| llama | msamp:delayed:O2 | 2 | 2.1100 | +0.50% | 0.71% | 0.50% | +0.00% .. +1.00% | +0.48% |" in out
    assert "| llama | bf16 | 2 | 2.1000 |" in out


def test_pooling_refuses_results_of_other_runs_and_other_files(tmp_path, capsys):
    rows = summarise([run("bf16", 0, 2.0)], speeds=False)
    paths = [write_results(tmp_path / "a.json", rows), write_results(tmp_path / "b.json", rows, steps=100)]
    with pytest.raises(SystemExit):
        seeds_main(paths)
    assert "cannot be pooled: (size, steps, tokens, compiled)" in capsys.readouterr().err
    # a bench under LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=0 ran other forms under the same names
    paths = [write_results(tmp_path / "a.json", rows),
             write_results(tmp_path / "c.json", rows, environment={"LOWPREC_FP8_ACTIVATIONS_IN_GRAPH": "0"})]
    with pytest.raises(SystemExit):
        seeds_main(paths)
    assert "different LOWPREC_* variables cannot be pooled" in capsys.readouterr().err
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(SystemExit):
        seeds_main([str(tmp_path / "other.json")])
    assert "not a `lowprec bench` results.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        seeds_main([str(tmp_path / "missing.json")])
    assert "missing.json" in capsys.readouterr().err


def test_a_bench_records_the_lowprec_variables_it_ran_under(monkeypatch):
    from lowprec.demo.seeds import lowprec_environment

    for name in [k for k in os.environ if k.startswith("LOWPREC_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("LOWPREC_FP8_ACTIVATIONS_IN_GRAPH", "0")
    monkeypatch.setenv("LOWPREC_COMMIT", "abc")  # names the tree, not a form: pooling across commits is the point
    monkeypatch.setenv("LOWPREC_QUIET", "1")  # the console's messages only
    assert lowprec_environment() == {"LOWPREC_FP8_ACTIVATIONS_IN_GRAPH": "0"}


@pytest.mark.parametrize("seeds", ["0", "-2"])
def test_seeds_below_one_are_refused_by_name(seeds, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--seeds", seeds])
    assert f"--seeds {seeds}: give at least 1" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_trains_each_configuration_with_each_seed(tmp_path):
    pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "lowprec.cli", "bench", "--size", "tiny", "--steps", "3", "--no-progress", "--no-raw",
           "--configs", "msamp:delayed:O2", "--seeds", "2", "--jobs", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["seeds"] == 2 and len(result["runs"]) == 4
    assert sorted((r["config"], r["seed"]) for r in result["runs"]) == [
        ("bf16", 0), ("bf16", 1), ("msamp:delayed:O2", 0), ("msamp:delayed:O2", 1)]
    assert {f for f in os.listdir(tmp_path) if f.endswith(".json")} == {
        "results.json", "llama_bf16_seed0.json", "llama_bf16_seed1.json", "llama_msamp_delayed_O2_seed0.json",
        "llama_msamp_delayed_O2_seed1.json"}
    bf16 = {r["seed"]: r["losses"] for r in result["runs"] if r["config"] == "bf16"}
    assert bf16[0] != bf16[1]  # another seed: another initialisation and batch order
    (fp8,) = [s for s in result["seed_summary"] if s["config"] == "msamp:delayed:O2"]
    assert fp8["paired"] == 2 and fp8["delta_sd"] is not None
    assert "Over 2 seeds" in (tmp_path / "results.md").read_text()


def test_a_bench_can_start_at_a_later_seed_to_add_to_an_earlier_result(tmp_path, monkeypatch, capsys):
    # `--first-seed 4 --seeds 2`: seeds 4 and 5 of every configuration, BF16's among them, for pooling
    from lowprec.demo import bench

    seen = []

    def fake_run_one(config, arch, common, out, raw, gpu=None, seed=None):
        seen.append((config["name"], seed))
        return run(config["name"], seed, 2.0 + 0.01 * (seed or 0))

    monkeypatch.setattr(bench, "run_one", fake_run_one)
    monkeypatch.setattr(bench, "plot", lambda *a: [])
    argv = ["--size", "tiny", "--steps", "2", "--no-progress", "--no-raw", "--configs", "msamp:delayed:O2",
            "--seeds", "2", "--first-seed", "4", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    assert sorted(seen) == [("bf16", 4), ("bf16", 5), ("msamp:delayed:O2", 4), ("msamp:delayed:O2", 5)]
    assert "| llama | msamp:delayed:O2 (seed 5) |" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [(["--first-seed", "-1", "--seeds", "2"], "--first-seed -1: give 0"),
                                               (["--first-seed", "3"], "--first-seed needs --seeds 2 or more")])
def test_a_bad_first_seed_is_refused_by_name(argv, message, capsys):
    from lowprec.demo.bench import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
