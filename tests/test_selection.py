"""Module selection: which Linear layers become FP8, and the reason for every one that does not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowprec import FP8RecipeKwargs, RunContext
from lowprec.backends import create_backend
from lowprec.planning.hardware import assumed_device, device_info
from lowprec.planning.selection import select_modules

CPU = RunContext(device=device_info("cpu"))
# H100 and H200, the model compiled (torchao's thresholds; an eager model has its own, tested below)
HOPPER = RunContext(device=assumed_device("9.0"), compiled=True)


def decide(model: nn.Module, *, context: RunContext = CPU, **recipe_kwargs) -> dict:
    recipe = FP8RecipeKwargs(backend="torchao", **recipe_kwargs)
    return {d.fqn: d for d in select_modules(model, recipe, create_backend(recipe, context, require_package=False))}


def fp8(decisions: dict) -> list[str]:
    return [name for name, d in decisions.items() if d.convert]


class MLP(nn.Module):
    def __init__(self, d: int = 64, h: int = 128):
        super().__init__()
        self.up_proj = nn.Linear(d, h)
        self.act = nn.GELU()
        self.down_proj = nn.Linear(h, d)


class Attention(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.q_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)


class Block(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.attn = Attention(d)
        self.norm = nn.LayerNorm(d)
        self.mlp = MLP(d)


class Tiny(nn.Module):
    """embed, layers.{0,1}.{attn.q_proj, attn.o_proj, mlp.up_proj, mlp.down_proj}, norm, lm_head."""

    def __init__(self, d: int = 64, vocab: int = 96, n: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)


LINEARS = [f"layers.{i}.{name}" for i in (0, 1)
           for name in ("attn.q_proj", "attn.o_proj", "mlp.up_proj", "mlp.down_proj")]
LINEARS.append("lm_head")

FAST = dict(skip_slow_shapes=False)  # the shapes here are all small


def test_only_linears_are_candidates():
    assert list(decide(Tiny(), **FAST)) == LINEARS


def test_skip_first_last():
    d = decide(Tiny(), skip_first_last=True, **FAST)
    assert fp8(d) == LINEARS[1:-1]
    assert d["layers.0.attn.q_proj"].reason == "first Linear layer (skip_first_last=True)"
    assert d["lm_head"].reason == "last Linear layer (skip_first_last=True)"


def test_skip_first_last_off_converts_all():
    assert fp8(decide(Tiny(), skip_first_last=False, **FAST)) == LINEARS
    assert fp8(decide(Tiny(), **FAST)) == LINEARS  # the default: the output head in FP8 (docs/performance.md)


@pytest.mark.parametrize(
    "pattern,excluded",
    [
        ("lm_head", ["lm_head"]),
        ("up_proj", ["layers.0.mlp.up_proj", "layers.1.mlp.up_proj"]),  # a bare name matches anywhere
        ("layers.1.*", [n for n in LINEARS if n.startswith("layers.1.")]),
        ("*.mlp.*", [n for n in LINEARS if ".mlp." in n]),
        ("layers.*.attn.o_proj", ["layers.0.attn.o_proj", "layers.1.attn.o_proj"]),
        ("mlp.down_proj", ["layers.0.mlp.down_proj", "layers.1.mlp.down_proj"]),  # a name suffix
        ("*_proj", LINEARS[:-1]),
        ("embed", []),  # a module that is not a candidate: named, so accepted
    ],
)
def test_exclude_patterns(pattern, excluded):
    d = decide(Tiny(), exclude=[pattern], skip_first_last=False, **FAST)
    assert [n for n in LINEARS if not d[n].convert] == excluded
    for name in excluded:
        assert d[name].reason == f"excluded by pattern {pattern!r}"


@pytest.mark.parametrize(
    "pattern,closest",
    [
        ("lm_haed", "Closest module names: 'lm_head'"),  # a typo once left the head in FP8, silently
        ("proj", "Closest module names: 'q_proj', 'o_proj'"),  # no partial-word match
        ("layers.0.attn.q", "'layers.0.attn.q_proj'"),
        ("xyz", "No module name is close"),
    ],
)
def test_exclude_pattern_matching_no_module_is_an_error(pattern, closest):
    with pytest.raises(ValueError) as err:
        decide(Tiny(), exclude=["lm_head", pattern], **FAST)
    message = str(err.value)
    assert message.startswith(f"FP8RecipeKwargs.exclude has {pattern!r}, which matches no module of Tiny: ")
    assert "fnmatch-style module names" in message and closest in message


def test_exclude_comma_string_and_several_patterns():
    d = decide(Tiny(), exclude="lm_head, layers.0.*", skip_first_last=False, **FAST)
    assert fp8(d) == [n for n in LINEARS if n.startswith("layers.1.")]


@pytest.mark.parametrize(
    "patterns,included",
    [
        (["*.mlp.*"], [n for n in LINEARS if ".mlp." in n]),
        (["lm_head", "q_proj"], ["layers.0.attn.q_proj", "layers.1.attn.q_proj", "lm_head"]),
    ],
)
def test_include_patterns(patterns, included):
    d = decide(Tiny(), include=patterns, skip_first_last=False, **FAST)
    assert fp8(d) == included
    for name in set(LINEARS) - set(included):
        assert d[name].reason == "not matched by any include pattern"


@pytest.mark.parametrize("patterns", [["nothing"], ["q_proj", "lm_haed"]])
def test_an_include_pattern_that_matches_nothing_is_refused_like_an_exclude_one(patterns):
    # a typo beside good patterns was dropped without a word, while the same typo in exclude raised
    with pytest.raises(ValueError, match=f"include has {patterns[-1]!r}, which matches no module of Tiny"):
        decide(Tiny(), include=patterns, skip_first_last=False, **FAST)


def test_exclude_beats_include():
    d = decide(Tiny(), include=["*.mlp.*"], exclude=["down_proj"], skip_first_last=False, **FAST)
    assert fp8(d) == ["layers.0.mlp.up_proj", "layers.1.mlp.up_proj"]
    assert d["layers.0.mlp.down_proj"].reason == "excluded by pattern 'down_proj'"


def test_module_filter_fn_gets_module_and_fqn():
    model = Tiny()
    calls = []

    def keep(module, fqn):
        calls.append((module, fqn))
        return fqn != "layers.1.mlp.up_proj"

    d = decide(model, module_filter_fn=keep, skip_first_last=False, **FAST)
    modules = dict(model.named_modules())
    assert [fqn for _, fqn in calls] == LINEARS
    assert all(module is modules[fqn] for module, fqn in calls)
    assert fp8(d) == [n for n in LINEARS if n != "layers.1.mlp.up_proj"]
    assert d["layers.1.mlp.up_proj"].reason == "module_filter_fn returned False"


def test_module_filter_fn_not_called_for_excluded_modules():
    seen = []
    decide(Tiny(), exclude=["lm_head"], module_filter_fn=lambda m, fqn: seen.append(fqn) or True, **FAST)
    assert "lm_head" not in seen


# ---- shape constraints ----------------------------------------------------------------------------
def odd_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 10), nn.Linear(24, 64), nn.Linear(40, 72), nn.Linear(64, 64))


def test_dims_not_divisible_by_16_are_kept():
    d = decide(odd_model(), skip_first_last=False, **FAST)
    assert fp8(d) == ["0", "4"]
    assert d["1"].reason.startswith("out_features=10 not divisible by 16")
    assert d["2"].reason.startswith("in_features=24 not divisible by 16")
    assert d["3"].reason.startswith("in_features=40, out_features=72 not divisible by 16")
    assert "pad_inner_dim=True" in d["1"].reason


def test_pad_inner_dim_converts_them():
    assert fp8(decide(odd_model(), skip_first_last=False, pad_inner_dim=True, **FAST)) == ["0", "1", "2", "3", "4"]


class Siblings(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(64, 64)
        self.a = nn.Linear(64, 64)
        self.unfit = nn.Linear(64, 10)
        self.b = nn.Linear(64, 64)
        self.sub = MLP(64, 128)
        self.nested = nn.Sequential(nn.Linear(64, 10), MLP(64, 64))
        self.last = nn.Linear(64, 64)


def test_an_unfit_linear_does_not_stop_its_siblings():
    # Accelerate's TE conversion returns from the loop at the first unfit Linear, leaving every later
    # sibling (and their children) in high precision.
    d = decide(Siblings(), skip_first_last=True, **FAST)
    assert fp8(d) == ["a", "b", "sub.up_proj", "sub.down_proj", "nested.1.up_proj", "nested.1.down_proj"]
    assert not d["unfit"].convert and not d["nested.0"].convert


def test_mha_out_proj_is_never_a_candidate():
    model = nn.Sequential(nn.Linear(64, 64), nn.MultiheadAttention(64, 4), nn.Linear(64, 64), nn.Linear(64, 64))
    d = decide(model, skip_first_last=True, **FAST)
    assert list(d) == ["0", "2", "3"]  # no "1.out_proj"
    assert fp8(d) == ["2"]


def test_mha_out_proj_does_not_count_as_last_linear():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.MultiheadAttention(64, 4))
    d = decide(model, skip_first_last=True, **FAST)
    assert d["2"].reason == "last Linear layer (skip_first_last=True)" and fp8(d) == ["1"]


def test_a_plain_linear_named_out_proj_is_a_candidate():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.out_proj = nn.Linear(64, 64)

    d = decide(nn.Sequential(nn.Linear(64, 64), Attn(), nn.Linear(64, 64)), **FAST)
    assert d["1.out_proj"].convert


# ---- speed rule (on Hopper: thresholds of torchao's H100 auto filter; weight shape is (N=out, K=in)) -------
def meta_linear(n: int, k: int) -> nn.Linear:
    with torch.device("meta"):
        return nn.Linear(k, n)


def one(n: int, k: int, context: RunContext = HOPPER, **kwargs):
    """The decision for a single Linear(K -> N) between two fit ones (first/last rule out of the way)."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(k, n), nn.Linear(16, 16))
    return decide(model, context=context, **kwargs)["1"]


@pytest.mark.parametrize(
    "n,k,why",
    [
        (1024, 4096, "K=4096 <= 4096 and N=1024 <= 1024"),
        (16, 16, "K=16 <= 4096 and N=16 <= 1024"),
        (1024, 16, "K=16 <= 4096 and N=1024 <= 1024"),
        (1040, 4096, None),
        (1024, 4112, None),
        # measured on whole compiled models: every d1024 layer (K=1024) lost, the 32000x1024 head included
        (8192, 64, "K=64 <= 1024"),
        (32000, 1024, "K=1024 <= 1024"),
        (32000, 1040, None),
        (64, 8192, None),
    ],
)
def test_tensorwise_slow_shapes(n, k, why):
    d = one(n, k)
    assert d.convert is (why is None)
    if why is not None:
        assert d.reason == f"FP8 slower than BF16 on Hopper (sm_90) for {why} (skip_slow_shapes=True)"
        assert d.rule == "skip_slow_shapes" and d.option.startswith("skip_slow_shapes=False")
    assert d.shape == (n, k)
    assert one(n, k, skip_slow_shapes=False).convert


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize(
    "n,k,why",
    [
        (2048, 8192, "N=2048 <= 2048"),
        (2064, 1024, "K=1024 <= 1024"),
        (8192, 1024, "K=1024 <= 1024"),
        (4096, 2048, "N=4096 <= 4096 and K=2048 <= 2048"),
        (2064, 1040, "N=2064 <= 4096 and K=1040 <= 2048"),
        (4112, 1040, None),
        (2064, 2064, None),
        (8192, 8192, None),
    ],
)
def test_rowwise_slow_shapes(recipe, n, k, why):
    d = one(n, k, recipe=recipe)
    assert d.convert is (why is None)
    if why is not None:
        assert d.reason == f"FP8 slower than BF16 on Hopper (sm_90) for {why} (skip_slow_shapes=True)"


def test_thresholds_match_torchao_auto_filter():
    pytest.importorskip("torchao")
    # A plain import: if torchao renames or drops its filter, our copied thresholds lose their reference and
    # this must fail (a skip would go unnoticed), so that they are checked again against torchao's source.
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe as auto

    dims = [16, 1024, 1040, 2048, 2064, 4096, 4112, 8192]
    for recipe in ("tensorwise", "rowwise"):
        keep = auto(recipe, filter_fqns=[])
        for n in dims:
            for k in dims:
                # tensorwise adds one region measured on whole compiled models (K <= 1024 lost at d1024)
                expected = keep(meta_linear(n, k), "x") and not (recipe == "tensorwise" and k <= 1024)
                assert one(n, k, recipe=recipe).convert == expected, (recipe, n, k)


@pytest.mark.parametrize("n, k, slow", [(4096, 4096, None), (14336, 4096, None), (4096, 14336, None),
                                         (8192, 2048, "K=2048 <= 2048"), (2048, 5632, "N=2048 <= 2048"),
                                         (2816, 1024, "K=1024 <= 2048")])
def test_eager_models_keep_layers_with_a_dimension_up_to_2048(n, k, slow):
    # measured on whole models: d1024/d2048 layers lost even compiled one by one, d4096/d8192 ones won
    d = one(n, k, context=RunContext(device=assumed_device("9.0")))
    assert d.convert is (slow is None)
    if slow:
        assert d.reason == ("FP8 slower than BF16 on Hopper (sm_90) in an eager model (FP8 layers compiled one by "
                            f"one) for {slow} (skip_slow_shapes=True)")


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
def test_sharded_engines_use_the_eager_rule(engine):
    # measured on two H200s: eager FP8 layers 0.60-0.67x BF16 under FSDP2 / ZeRO, compiled ones 1.19x
    d = one(8192, 2048, context=RunContext(device=assumed_device("9.0"), engine=engine, world_size=2))
    assert not d.convert  # eager rule with compiled layers: K=2048 <= 2048 stays in BF16
    d = one(8192, 4096, context=RunContext(device=assumed_device("9.0"), engine=engine, world_size=2))
    assert d.convert


def test_an_engine_without_eager_measurements_keeps_the_gemm_rule():
    d = one(8192, 2048, context=RunContext(device=assumed_device("9.0"), engine="fsdp1", world_size=2))
    assert d.convert  # FSDP1: nothing eager measured; the GEMM (compiled) rule converts it


def test_eager_layers_without_compilation_lose_at_every_shape():
    d = one(8192, 8192, context=RunContext(device=assumed_device("9.0")), compile_fp8_layers=False)
    assert not d.convert
    assert d.reason == ("FP8 slower than BF16 on Hopper (sm_90) in an eager model with eager FP8 layers "
                        "(compile_fp8_layers=False) for every shape (N=8192, K=8192) (skip_slow_shapes=True)")
    assert one(8192, 8192, context=RunContext(device=assumed_device("9.0")), compile_fp8_layers=False,
               skip_slow_shapes=False).convert


@pytest.mark.parametrize("capability", ["cpu", "8.9", "10.0", "12.0"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_no_slow_shapes_where_nothing_was_measured(capability, recipe):
    # H100's thresholds are not assumed to hold elsewhere: the small shape Hopper skips converts.
    context = RunContext(device=assumed_device(capability))
    assert not one(16, 16, recipe="tensorwise", context=HOPPER).convert
    d = one(16, 16, recipe=recipe, context=context)
    assert d.convert and d.reason == "FP8"


# ---- reasons ---------------------------------------------------------------------------------------------
def test_every_decision_has_a_reason():
    for decision in decide(Siblings(), exclude=["b"], include=["*"]).values():
        assert decision.reason
        assert (decision.reason == "FP8") is decision.convert


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        (dict(exclude=["1"]), "excluded by pattern '1'"),
        (dict(include=["0"]), "not matched by any include pattern"),
        (dict(module_filter_fn=lambda m, fqn: fqn != "1"), "module_filter_fn returned False"),
        (dict(), "out_features=10 not divisible by 16"),
    ],
)
def test_first_failing_check_is_the_reason(kwargs, reason):
    # "1" is unfit and, on Hopper, slow; the earlier checks win.
    d = decide(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 10), nn.Linear(16, 16)), context=HOPPER, **kwargs)
    assert d["1"].reason.startswith(reason)


@pytest.mark.parametrize(
    "kwargs,rule,option",
    [
        (dict(exclude=["2", "1"]), "exclude", "remove '1' from exclude"),
        (dict(include=["0"]), "include", "add a pattern naming them to include (include=None considers every module)"),
        (dict(module_filter_fn=lambda m, fqn: fqn != "1"), "module_filter_fn",
         "let module_filter_fn return True for them (or module_filter_fn=None)"),
        (dict(), "constraint", "pad_inner_dim=True pads them to what the FP8 GEMMs need"),
        (dict(pad_inner_dim=True), "skip_slow_shapes",
         "skip_slow_shapes=False converts them anyway (FP8, though slower at these shapes)"),
    ],
)
def test_each_kept_module_names_the_option_that_converts_it(kwargs, rule, option):
    d = decide(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 10), nn.Linear(16, 16)), context=HOPPER,
               skip_first_last=True, **kwargs)
    assert (d["1"].rule, d["1"].option) == (rule, option)
    assert (d["0"].rule, d["0"].option) == ("skip_first_last", "skip_first_last=False converts them")
    converted = decide(Tiny(), **FAST)["layers.0.mlp.up_proj"]
    assert converted.convert and (converted.rule, converted.option) == ("", "")


def test_first_linear_reason_beats_shape_reason():
    d = decide(nn.Sequential(nn.Linear(16, 10), nn.Linear(16, 16)), skip_first_last=True)
    assert d["0"].reason == "first Linear layer (skip_first_last=True)"


def test_decision_fields():
    d = decide(Tiny(), **FAST)
    up = d["layers.0.mlp.up_proj"]
    assert (up.kind, up.shape, up.params, up.convert) == ("linear", (128, 64), 128 * 64 + 128, True)
    assert d["layers.0.attn.q_proj"].params == 64 * 64  # no bias


def test_root_linear():
    d = decide(nn.Linear(64, 64), skip_first_last=False, **FAST)
    assert list(d) == ["<root>"] and d["<root>"].convert


# ---- whole blocks in high precision: skip_first_blocks / skip_last_blocks (issue 30) ---------------------------
def llama(layers: int = 4) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


# (builder, the block list's name): a transformers decoder and a hand-made model, four blocks each
BLOCK_MODELS = {"llama": (llama, "model.layers"), "hand-made": (lambda: Tiny(n=4), "layers")}


def linears_of(model: nn.Module) -> list[str]:
    return [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("which", list(BLOCK_MODELS))
@pytest.mark.parametrize(
    "first,last,kept",
    [(1, 1, {0, 3}), (2, 0, {0, 1}), (0, 2, {2, 3}), (1, 0, {0}), (3, 1, {0, 1, 2, 3}), (0, 4, {0, 1, 2, 3})],
)
def test_kept_blocks_hold_exactly_their_linears(which, first, last, kept):
    build, blocks = BLOCK_MODELS[which]
    model = build()
    d = decide(model, skip_first_blocks=first, skip_last_blocks=last, **FAST)
    # Written out from the model's own names, not from the selection code: every Linear inside a kept block
    # and nothing else (lm_head and the blocks in between convert).
    inside = [n for n in linears_of(model) if any(n.startswith(f"{blocks}.{i}.") for i in kept)]
    assert len(inside) == (7 if which == "llama" else 4) * len(kept)
    assert [n for n, x in d.items() if not x.convert] == inside
    assert fp8(d) == [n for n in linears_of(model) if n not in inside]
    for name in inside:
        index = int(name[len(blocks) + 1:].split(".")[0])
        rule, n = ("skip_first_blocks", first) if index < first else ("skip_last_blocks", last)
        assert d[name].reason == f"in block {index} of {blocks} ({rule}={n})"
        assert (d[name].rule, d[name].option) == (rule, f"{rule}=0 converts them")


@pytest.mark.parametrize("which", list(BLOCK_MODELS))
def test_no_blocks_asked_changes_nothing(which):
    build, _ = BLOCK_MODELS[which]
    model = build()
    for kwargs in (dict(skip_first_last=True), dict(exclude=["lm_head"]), {}):
        assert decide(model, skip_first_blocks=0, skip_last_blocks=None, **kwargs, **FAST) == decide(model, **kwargs,
                                                                                                      **FAST)


def test_earlier_rules_name_their_reason_inside_a_kept_block():
    d = decide(Tiny(n=4), exclude=["layers.0.mlp.up_proj"], skip_first_last=True, skip_first_blocks=1, **FAST)
    assert d["layers.0.attn.q_proj"].rule == "skip_first_last"  # the first Linear
    assert d["layers.0.mlp.up_proj"].rule == "exclude"
    assert [d[f"layers.0.{n}"].rule for n in ("attn.o_proj", "mlp.down_proj")] == ["skip_first_blocks"] * 2
    assert d["lm_head"].rule == "skip_first_last" and d["layers.1.attn.q_proj"].convert


def test_norms_inside_a_kept_block_stay_too():
    # TransformerEngine replaces norms as well: every candidate of a kept block stays, not only its Linears.
    recipe = FP8RecipeKwargs(backend="te", skip_last_blocks=1, **FAST)
    backend = create_backend(recipe, RunContext(device=assumed_device("9.0")), require_package=False)
    d = {x.fqn: x for x in select_modules(Tiny(n=3), recipe, backend)}
    assert {n for n, x in d.items() if not x.convert} == {
        "layers.2.attn.q_proj", "layers.2.attn.o_proj", "layers.2.norm", "layers.2.mlp.up_proj",
        "layers.2.mlp.down_proj"}
    assert d["layers.2.norm"].reason == "in block 2 of layers (skip_last_blocks=1)" and d["norm"].convert


def test_blocks_from_the_environment(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_SKIP_FIRST_BLOCKS", "1")
    monkeypatch.setenv("ACCELERATE_FP8_LOWPREC_SKIP_LAST_BLOCKS", "1")
    d = decide(Tiny(n=3), **FAST)
    assert fp8(d) == [n for n in LINEARS if n.startswith("layers.1.")] + ["lm_head"]
    assert d["layers.2.mlp.up_proj"].reason == "in block 2 of layers (skip_last_blocks=1)"


class Heads(nn.Module):
    """A small stack of blocks beside a larger list of heads of different classes."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block(16) for _ in range(3))
        self.heads = nn.ModuleList([nn.Linear(16, 512), MLP(16, 512), nn.Sequential(nn.Linear(16, 512))])


class Experts(nn.Module):
    """A block whose MoE experts are a list of one class, with more children than the blocks."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.router = nn.Linear(d, 8)
        self.experts = nn.ModuleList(MLP(d, 64) for _ in range(8))


@pytest.mark.parametrize(
    "model,name,length",
    [
        (Tiny(n=4), "layers", 4),
        (Heads(), "layers", 3),  # the heads hold more parameters but are not of one class
        (nn.Sequential(nn.Linear(32, 32), nn.ModuleList(Experts() for _ in range(2))), "1", 2),  # not the experts
        # one parameter-free list of one class (a list of activations) holds no layer to keep
        (nn.ModuleDict({"acts": nn.ModuleList(nn.GELU() for _ in range(6)),
                        "body": nn.ModuleList(nn.Linear(8, 8) for _ in range(2))}), "body", 2),
        # equal parameters: the list with more children
        (nn.ModuleDict({"two": nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(2)),
                        "four": nn.ModuleList(nn.Linear(32, 64, bias=False) for _ in range(4))}), "four", 4),
        (nn.ModuleList(Block(16) for _ in range(2)), "", 2),  # the model itself
    ],
    ids=["tiny", "heads", "experts", "parameter-free", "tie", "root"],
)
def test_the_block_list_found(model, name, length):
    from lowprec.planning.selection import find_blocks

    found, blocks = find_blocks(model)
    assert (found, len(blocks)) == (name, length)


def test_the_llama_block_list_is_model_layers():
    from lowprec.planning.selection import find_blocks

    name, blocks = find_blocks(llama(2))
    assert name == "model.layers" and type(blocks[0]).__name__ == "LlamaDecoderLayer"


def test_a_list_of_different_heads_is_never_the_block_list():
    d = decide(Heads(), skip_first_blocks=1, **FAST)
    assert [n for n, x in d.items() if not x.convert] == ["layers.0.attn.q_proj", "layers.0.attn.o_proj",
                                                          "layers.0.mlp.up_proj", "layers.0.mlp.down_proj"]


@pytest.mark.parametrize("first,last,asked", [(1, 0, "skip_first_blocks=1 keeps"), (0, 2, "skip_last_blocks=2 keeps"),
                                              (1, 1, "skip_first_blocks=1 and skip_last_blocks=1 keep")])
@pytest.mark.parametrize("model", [nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), Heads().heads,
                                   nn.ModuleDict({"acts": nn.ModuleList(nn.GELU() for _ in range(2))})],
                         ids=["no-list", "mixed-classes", "parameter-free"])
def test_no_block_list_is_an_error_naming_the_option(model, first, last, asked):
    with pytest.raises(ValueError) as err:
        decide(model, skip_first_blocks=first, skip_last_blocks=last, **FAST)
    message = str(err.value)
    assert message.startswith(f"FP8RecipeKwargs.{asked} whole transformer blocks in high precision, but "
                              f"{type(model).__name__} has no block list")
    assert "an nn.ModuleList of two or more modules of one class" in message and "exclude" in message


@pytest.mark.parametrize("first,last", [(3, 2), (5, 0), (0, 5), (4, 1)])
@pytest.mark.parametrize("which", list(BLOCK_MODELS))
def test_more_blocks_than_the_model_has_is_an_error(which, first, last):
    build, blocks = BLOCK_MODELS[which]
    model = build()
    with pytest.raises(ValueError) as err:
        decide(model, skip_first_blocks=first, skip_last_blocks=last, **FAST)
    block = "LlamaDecoderLayer" if which == "llama" else "Block"
    assert str(err.value) == (
        f"FP8RecipeKwargs.skip_first_blocks={first} and skip_last_blocks={last} keep {first + last} blocks in high "
        f"precision, but {type(model).__name__} has 4 ({block} in {blocks}): together they can keep at most 4")
