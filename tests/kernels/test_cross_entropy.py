"""lowprec.kernels.cross_entropy against `F.cross_entropy(logits.float())`, the expression it replaces: the loss and
the gradient in every logits dtype and chunking, ignored rows, non-finite logits, its bad inputs, what it keeps for
backward, and Hugging Face's causal-LM loss it stands in for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowprec.kernels import cross_entropy as ce

VOCAB = 101
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
# the relative error of the gradient against the upcasting expression's: FP32 summation order, then the cast to the
# logits' dtype (at most one unit in its last place)
GRAD_BOUND = {torch.bfloat16: 2**-8, torch.float16: 2**-10, torch.float32: 1e-6, torch.float64: 1e-13}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def reference(logits: torch.Tensor, target: torch.Tensor, grad_loss: torch.Tensor, **kwargs):
    x = logits.detach().clone().requires_grad_()
    compute = torch.promote_types(x.dtype, torch.float32)
    loss = F.cross_entropy(x.to(compute).reshape(-1, x.shape[-1]), target.reshape(-1), **kwargs)
    loss.backward(grad_loss)
    return loss.detach(), x.grad


def ours(logits: torch.Tensor, target: torch.Tensor, grad_loss: torch.Tensor, **kwargs):
    x = logits.detach().clone().requires_grad_()
    loss = ce.cross_entropy(x, target, **kwargs)
    loss.backward(grad_loss)
    return loss.detach(), x.grad


def sample(dtype, shape=(3, 37), seed=0, ignored=5):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, VOCAB, generator=g) * 3).to(dtype)
    target = torch.randint(0, VOCAB, shape, generator=g)
    target.view(-1)[:ignored] = -100
    return logits, target


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [ce.CHUNK_ELEMENTS, 1, VOCAB * 5 + 3], ids=["one chunk", "row by row", "5 rows"])
def test_loss_and_gradient_match_the_upcasting_expression(dtype, reduction, chunk, monkeypatch):
    monkeypatch.setattr(ce, "CHUNK_ELEMENTS", chunk)
    logits, target = sample(dtype)
    grad_loss = torch.tensor(0.37, dtype=torch.promote_types(dtype, torch.float32))
    loss, grad = ours(logits, target, grad_loss, reduction=reduction)
    ref_loss, ref_grad = reference(logits, target, grad_loss, reduction=reduction)
    assert loss.dtype == ref_loss.dtype and grad.dtype == dtype
    assert relative_error(loss, ref_loss) <= (1e-6 if dtype != torch.float64 else 1e-13)
    assert relative_error(grad, ref_grad) <= GRAD_BOUND[dtype]
    assert torch.all(grad.view(-1, VOCAB)[:5] == 0)  # ignored rows


def test_strided_logits_and_a_custom_ignore_index():
    logits, target = sample(torch.bfloat16, shape=(4, 9))
    strided = logits.transpose(0, 1)  # (9, 4, V), not contiguous
    target = target.transpose(0, 1).clamp(min=0)
    target[0] = 7
    one = torch.tensor(1.0)
    loss, grad = ours(strided, target, one, ignore_index=7)
    ref_loss, ref_grad = reference(strided, target, one, ignore_index=7)
    assert relative_error(loss, ref_loss) <= 1e-6 and relative_error(grad, ref_grad) <= GRAD_BOUND[torch.bfloat16]


def test_every_row_ignored_gives_torchs_nan_loss_and_zero_gradient():
    logits, target = sample(torch.float32, ignored=3 * 37)
    loss, grad = ours(logits, target, torch.tensor(1.0))
    ref_loss, ref_grad = reference(logits, target, torch.tensor(1.0))
    assert torch.isnan(loss) and torch.isnan(ref_loss)
    assert torch.equal(grad, ref_grad) and not grad.any()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_logit_never_comes_out_finite(bad):
    logits, target = sample(torch.bfloat16)
    row = 10  # a labelled row: its loss and the mean become non-finite, as torch's do
    logits.view(-1, VOCAB)[row, 3] = bad
    loss, grad = ours(logits, target, torch.tensor(1.0))
    ref_loss, _ = reference(logits, target, torch.tensor(1.0))
    assert not torch.isfinite(loss) and not torch.isfinite(ref_loss)
    assert not torch.isfinite(grad.view(-1, VOCAB)[row, 3])


@pytest.mark.parametrize("at_target", [False, True])
def test_minus_inf_is_a_masked_logit_as_for_torch(at_target):
    logits, target = sample(torch.float32)
    row = 10
    column = int(target.view(-1)[row]) if at_target else (int(target.view(-1)[row]) + 1) % VOCAB
    logits.view(-1, VOCAB)[row, column] = -float("inf")
    loss, grad = ours(logits, target, torch.tensor(1.0))
    ref_loss, ref_grad = reference(logits, target, torch.tensor(1.0))
    if at_target:  # the label has probability 0: an infinite loss, as torch's
        assert loss == ref_loss == float("inf")
    else:
        assert relative_error(loss, ref_loss) <= 1e-6 and relative_error(grad, ref_grad) <= 1e-6


def test_an_ignored_rows_non_finite_logits_stay_out_of_the_loss_but_not_out_of_its_gradient():
    logits, target = sample(torch.float32)
    logits.view(-1, VOCAB)[0, 3] = float("inf")  # row 0 is ignored
    loss, grad = ours(logits, target, torch.tensor(1.0))
    ref_loss, _ = reference(logits, target, torch.tensor(1.0))
    assert torch.isfinite(loss) and relative_error(loss, ref_loss) <= 1e-6
    assert torch.isnan(grad.view(-1, VOCAB)[0, 3])


def test_the_fp8_activation_hooks_keep_what_it_saves_as_it_is():
    # the logits in FP8 would spoil the probabilities its backward recomputes from them
    from torch import nn

    from lowprec.runtime.activations import FP8ActivationStorage

    logits, target = sample(torch.bfloat16, shape=(64,), ignored=0)
    logits = logits.repeat(1, 200)  # 20200 classes: over the hooks' MIN_ELEMENTS
    one = torch.tensor(1.0)
    storage = FP8ActivationStorage(nn.Linear(2, 2))
    x = logits.clone().requires_grad_()
    with storage.context():
        loss = ce.cross_entropy(x * 1.0, target)
    loss.backward(one)
    assert storage.counts.packed == 0 and storage.counts.log_probabilities_kept >= 1
    assert torch.equal(x.grad, ours(logits, target, one)[1])
    assert not ce.saving_for_backward()  # only while its own forward saves


def test_logits_modified_in_place_before_backward_are_refused():
    logits, target = sample(torch.float32)
    x = logits.clone().requires_grad_()
    y = x * 1.0
    loss = ce.cross_entropy(y, target)
    with torch.no_grad():
        y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_second_backward_with_retain_graph_gives_the_same_gradient():
    logits, target = sample(torch.float32)
    x = logits.requires_grad_()
    loss = ce.cross_entropy(x, target)
    first, = torch.autograd.grad(loss, x, retain_graph=True)
    second, = torch.autograd.grad(loss, x)
    assert torch.equal(first, second)


@pytest.mark.parametrize("call, error, match", [
    (lambda x, t: ce.cross_entropy(x, t, reduction="none"), ValueError, "reduction='none' is not one of mean, sum"),
    (lambda x, t: ce.cross_entropy(x, t.float()), TypeError, "target must be an integer tensor"),
    (lambda x, t: ce.cross_entropy(x, t > 0), TypeError, "target must be an integer tensor"),
    (lambda x, t: ce.cross_entropy(x, t[:, :-1]), ValueError, r"target of shape \(3, 36\) does not match"),
    (lambda x, t: ce.cross_entropy(x.long(), t), TypeError, "logits must be a floating tensor"),
], ids=["reduction", "float target", "bool target", "shape", "integer logits"])
def test_bad_input_is_refused_by_name(call, error, match):
    logits, target = sample(torch.float32)
    with pytest.raises(error, match=match):
        call(logits, target)


def test_a_target_out_of_range_raises():
    logits, target = sample(torch.float32)
    target[1, 1] = VOCAB
    with pytest.raises(RuntimeError, match="out of bounds"):
        ce.cross_entropy(logits, target)


def test_a_double_backward_is_refused():
    logits, target = sample(torch.float32)
    x = logits.requires_grad_()
    with pytest.raises(RuntimeError, match="cross_entropy has no double backward"):
        torch.autograd.grad(ce.cross_entropy(x, target), x, create_graph=True)


def test_inside_a_compiled_graph_it_is_the_upcasting_expression(monkeypatch):
    monkeypatch.setattr(ce._LogitsCrossEntropy, "apply", lambda *a: pytest.fail("the Function ran in the graph"))
    logits, target = sample(torch.bfloat16)
    one = torch.tensor(1.0)
    compiled = torch.compile(lambda x, t: ce.cross_entropy(x, t), backend="aot_eager", fullgraph=True)
    x = logits.detach().clone().requires_grad_()
    loss = compiled(x, target)
    loss.backward()
    ref_loss, ref_grad = reference(logits, target, one)
    assert relative_error(loss.detach(), ref_loss) <= 1e-6 and relative_error(x.grad, ref_grad) <= 2**-8


@pytest.mark.parametrize("items", [None, 50, "tensor"])
@pytest.mark.parametrize("shifted", [False, True])
def test_causal_lm_loss_matches_hugging_faces(items, shifted):
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    logits, labels = sample(torch.bfloat16, shape=(2, 40), ignored=3)
    num = torch.tensor(50) if items == "tensor" else items
    kwargs = {"num_items_in_batch": num, "unused_by_the_loss": 1}
    if shifted:
        kwargs["shift_labels"] = torch.roll(labels, -1, dims=1)
    results = []
    for fn in (ce.causal_lm_loss, loss_utils.ForCausalLMLoss):
        x = logits.detach().clone().requires_grad_()
        loss = fn(x, labels, vocab_size=VOCAB, **kwargs)
        loss.backward()
        results.append((loss.detach(), x.grad))
    (loss, grad), (ref_loss, ref_grad) = results
    assert loss.dtype == ref_loss.dtype == torch.float32
    assert relative_error(loss, ref_loss) <= 1e-6 and relative_error(grad, ref_grad) <= 2**-8


@pytest.fixture
def fused_loss(fused_on_cpu, monkeypatch):
    """LOWPREC_FUSED_CROSS_ENTROPY=1 with `cuda_fused` compiling on CPU too (inductor's CPU code for the CUDA
    kernels); counts the calls of the fused forms."""
    monkeypatch.setenv(ce.FUSED_ENV, "1")
    calls = {"lse": 0, "grad": 0}
    for name, key in (("_fused_lse", "lse"), ("_fused_grad", "grad")):
        fn = getattr(ce, name)
        monkeypatch.setattr(ce, name, lambda *a, _fn=fn, _key=key: calls.__setitem__(_key, calls[_key] + 1) or _fn(*a))
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_fused_form_matches_the_upcasting_expression(fused_loss, dtype, reduction):
    logits, target = sample(dtype)
    logits.view(-1, VOCAB)[0, 3] = float("nan")  # an ignored row's NaN: out of the loss, in its gradient
    grad_loss = torch.tensor(0.37)
    loss, grad = ours(logits, target, grad_loss, reduction=reduction)
    ref_loss, ref_grad = reference(logits, target, grad_loss, reduction=reduction)
    assert fused_loss == {"lse": 1, "grad": 1}
    assert grad.dtype == dtype and torch.isnan(grad.view(-1, VOCAB)[0, 3])
    finite = torch.isfinite(ref_grad)
    assert relative_error(loss, ref_loss) <= 1e-6
    assert relative_error(grad[finite], ref_grad[finite]) <= GRAD_BOUND[dtype]


def test_the_fused_form_keeps_a_labelled_rows_nan(fused_loss):
    logits, target = sample(torch.bfloat16)
    logits.view(-1, VOCAB)[10, 3] = float("nan")
    loss, grad = ours(logits, target, torch.tensor(1.0))
    assert torch.isnan(loss) and torch.isnan(grad.view(-1, VOCAB)[10]).all()


def test_without_the_variable_the_fused_form_runs_where_it_compiles(fused_loss, monkeypatch):
    monkeypatch.delenv(ce.FUSED_ENV, raising=False)
    logits, target = sample(torch.bfloat16)
    ours(logits, target, torch.tensor(1.0))
    assert fused_loss == {"lse": 1, "grad": 1}


@pytest.mark.parametrize("variable, compiles", [("0", True), (None, False)],
                         ids=["LOWPREC_FUSED_CROSS_ENTROPY=0", "default where nothing compiles"])
def test_the_torch_chunks_run_when_asked_or_where_the_fused_form_would_not_compile(variable, compiles, request,
                                                                                    monkeypatch):
    # where nothing compiles, the fused form run as plain torch would hold FP32 copies of every row's logits at once
    if compiles:
        request.getfixturevalue("fused_on_cpu")
    if variable is None:
        monkeypatch.delenv(ce.FUSED_ENV, raising=False)
    else:
        monkeypatch.setenv(ce.FUSED_ENV, variable)
    monkeypatch.setattr(ce, "_fused_grad", lambda *a: pytest.fail("the fused form ran"))
    monkeypatch.setattr(ce, "_fused_lse", lambda *a: pytest.fail("the fused form ran"))
    logits, target = sample(torch.bfloat16)
    loss, grad = ours(logits, target, torch.tensor(1.0))
    ref_loss, ref_grad = reference(logits, target, torch.tensor(1.0))
    assert relative_error(loss, ref_loss) <= 1e-6 and relative_error(grad, ref_grad) <= GRAD_BOUND[torch.bfloat16]


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_a_bad_fused_variable_is_refused_naming_it(value, monkeypatch):
    monkeypatch.setenv(ce.FUSED_ENV, value)
    logits, target = sample(torch.float32)
    with pytest.raises(ValueError, match=f"LOWPREC_FUSED_CROSS_ENTROPY='{value}' is not one of '0', '1'"):
        ce.cross_entropy(logits, target)
