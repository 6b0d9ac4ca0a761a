"""activation_dtype='fp8' on a CUDA GPU: the packing matches the CPU definition, and the memory a forward
pass leaves held for backward shrinks. Run on a GPU host with `pytest -m gpu`; skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowprec import Accelerator, FP8RecipeKwargs
from lowprec.kernels.activations import MIN_EXPONENT, _decode, _encode, pack_fp8, unpack_fp8
from lowprec.runtime.activations import activation_storage

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
        reason="needs a Hopper (sm_90) or newer GPU",
    ),
]
pytest.importorskip("torchao")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_cuda_packing_equals_the_cpu_definition(dtype, strided):
    g = torch.Generator().manual_seed(0)
    span = 6 if dtype == torch.float16 else 12
    x = (torch.randn(8, 1000, generator=g) * torch.exp2(torch.randint(-span, 8, (8, 1000), generator=g).float()))
    if dtype != torch.float16:
        x[5, :128] *= 2.0 ** -130  # amax under 448 * 2**-126: the scale is capped at 2**126, decoding to subnormals
        x[5, 128:256] = torch.linspace(-1, 1, 128) * 2.0 ** -129  # a subnormal amax (FP32 and BF16): the same cap
        x[4, :2] = torch.tensor([3.3e38, -3.1e38])  # above 448 * 2**119: the scale held at 2**MIN_EXPONENT
    x = x.to(dtype)
    x[3, 17] = float("nan")
    x[6, 300] = float("inf")
    x[7, 896:] = 0  # the last group all zeros (scale 1), padded
    gpu = x.cuda()
    if strided:  # a transpose's rows: the kernel reads them through their strides
        gpu = gpu.t().contiguous().t()
    on_cpu, on_gpu = pack_fp8(x), pack_fp8(gpu)  # on CUDA: the Triton kernel
    _, fused_exponent = _encode(gpu.reshape(-1, 1000), 128)  # and inductor's kernel
    assert torch.equal(on_cpu.exponent, on_gpu.exponent.cpu()) and torch.equal(on_cpu.exponent, fused_exponent.cpu())
    # the same bytes but for a NaN's sign bit (a kernel may give NaN the other sign)
    nan = on_cpu.data.isnan()
    assert torch.equal(nan, on_gpu.data.cpu().isnan())
    assert torch.equal(on_cpu.data.view(torch.uint8)[~nan], on_gpu.data.cpu().view(torch.uint8)[~nan])
    decoded = unpack_fp8(on_gpu)
    assert torch.allclose(unpack_fp8(on_cpu), decoded.cpu(), rtol=0, atol=0, equal_nan=True)
    fused = _decode(on_gpu.data, on_gpu.exponent, 1000, dtype).reshape(8, 1000)  # inductor's decode
    assert torch.allclose(decoded, fused, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(decoded[3, 17]) and torch.isnan(decoded[6, 300])
    if dtype != torch.float16:  # the exact comparisons above covered subnormal outputs
        tiny = decoded[5, :128].abs()
        assert ((tiny > 0) & (tiny < torch.finfo(dtype).tiny)).any()
        assert on_gpu.exponent[5, 1] == 126  # the subnormal amax's group
        assert on_gpu.exponent[4, 0] == MIN_EXPONENT and decoded[4, 0] == 448 * 2.0**-MIN_EXPONENT  # saturated there
    assert on_gpu.exponent[7, -1] == 0 and not decoded[7, 896:].any()


def _held_after_forward(activation_dtype):
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    recipe = FP8RecipeKwargs(backend="torchao", activation_dtype=activation_dtype)
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe])
    torch.manual_seed(0)
    width = 2048
    blocks = [nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
              for _ in range(4)]
    model = accelerator.prepare(nn.Sequential(*blocks))
    x = torch.randn(8192, width, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = model(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    out.float().square().mean().backward()
    return held, model


def test_fp8_activations_hold_less_memory_between_forward_and_backward():
    plain, _ = _held_after_forward(None)
    fp8, model = _held_after_forward("fp8")
    counts = activation_storage(model).counts
    assert counts.packed > 0
    # the packed share of what forward leaves held goes from 2 bytes (BF16) to 1 + 1/128 per element
    assert fp8 < 0.75 * plain, (fp8, plain, counts)


def _torchao_step(lowprec_converts: bool):
    """One forward under CUDA autocast with torchao tensorwise, eager layers: (memory the forward leaves held,
    input grad, weight grads); converted by lowprec (FP8 input kept for backward) or by torchao itself."""
    from lowprec.backends import RunContext, create_backend
    from lowprec.planning.hardware import device_info
    from lowprec.runtime.planner import build_plan

    torch.manual_seed(0)
    width = 2048
    model = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)).cuda()
    recipe = FP8RecipeKwargs(backend="torchao", skip_first_last=False, skip_slow_shapes=False, compile_fp8_layers=False)
    context = RunContext(device=device_info())
    backend = create_backend(recipe, context)
    if lowprec_converts:
        model = backend.convert(model, build_plan(model, recipe, context=context, backend=backend))
    else:
        from torchao.float8 import convert_to_float8_training

        model = convert_to_float8_training(model, config=backend.float8_config())
    x = torch.randn(8192, width, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).requires_grad_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    out.float().square().mean().backward()
    return held, x.grad, [p.grad for p in model.parameters()]


def test_torchao_tensorwise_eager_layers_keep_their_fp8_input_with_torchaos_gradients():
    ours_held, dx, dw = _torchao_step(True)
    theirs_held, ref_dx, ref_dw = _torchao_step(False)
    assert torch.equal(dx, ref_dx) and all(torch.equal(a, b) for a, b in zip(dw, ref_dw))
    # the two Linear inputs (2048 and 8192 wide, 8192 tokens) go from BF16 to FP8: 8192 * 10240 bytes fewer
    assert theirs_held - ours_held >= 0.9 * 8192 * 10240, (ours_held, theirs_held)


def test_views_of_one_cuda_tensor_decode_into_one_buffer_with_the_cpu_values():
    # q, k, v of a fused QKV output on the GPU: one decoded buffer of the output's size, each view at its offset
    # and strides, the values those of the CPU definition
    from lowprec.kernels.activations import SpanKey

    base = torch.randn(2, 128, 3, 4, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    key = SpanKey()
    views = base.cuda().unbind(2)
    out = [unpack_fp8(pack_fp8(v, key)) for v in views]
    assert len({o.untyped_storage().data_ptr() for o in out}) == 1
    for o, v, cpu in zip(out, views, base.unbind(2)):
        assert o.stride() == v.stride() and o.storage_offset() == v.storage_offset()
        assert torch.equal(o.cpu(), unpack_fp8(pack_fp8(cpu)))


@pytest.mark.parametrize("kernel", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
def test_attention_kernels_log_sum_exp_stays_fp32_and_gradients_stay_close(kernel):
    # Each CUDA attention kernel saves its softmax log-sum-exp (cuDNN as [B, H, T, 1]); packed in FP8 its error
    # multiplies the recomputed probabilities (tests/test_activation_storage.py has the CPU figures)
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lowprec.runtime.activations import FP8ActivationStorage

    def grads(storage):
        torch.manual_seed(0)
        q, k, v = (torch.randn(4, 8, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        with sdpa_kernel(getattr(SDPBackend, kernel)):
            if storage is None:
                out = F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0, is_causal=True)
            else:
                with storage.context():
                    out = F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0, is_causal=True)
            out.backward(torch.randn(out.shape, dtype=out.dtype, device="cuda",
                                     generator=torch.Generator("cuda").manual_seed(1)))
        return [t.grad.float() for t in (q, k, v)]

    try:
        reference = grads(None)
    except RuntimeError as error:  # a kernel this build or GPU does not offer
        pytest.skip(f"{kernel}: {error}")
    storage = FP8ActivationStorage(nn.Linear(2, 2))
    fp8 = grads(storage)
    assert storage.counts.logsumexp_kept == 1, storage.counts
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(fp8, reference)]
    assert max(errors) < 0.08, errors


def _compiled_proxy_blocks(mode: str):
    """Two d1024 proxy blocks, each compiled, on CUDA under BF16 autocast: the memory the forward leaves held, x's
    gradient and the storage ('none': no hooks; 'python': Python hooks; 'graph': encoded inside the graphs)."""
    import contextlib
    import os
    import sys

    from lowprec.runtime.activations import FP8ActivationStorage

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from headline import Block

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(Block(1024, 2816), Block(1024, 2816)).cuda()
    storage = FP8ActivationStorage(model, in_graph=mode == "graph") if mode != "none" else None
    if storage is not None:  # the graphs' FP32 tensors through the hooks too: the same definitions either way
        storage.keep_untracked_fp32 = False
    blocks = [torch.compile(b) for b in model]
    x = torch.randn(4, 2048, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).requires_grad_()
    for _ in range(2):  # the first call compiles; the second is measured
        x.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16), (storage.context() if storage else contextlib.nullcontext()):
            y = x
            for block in blocks:
                y = block(y)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        y.float().square().mean().backward()
    return held, x.grad.clone(), storage


def test_compiled_graphs_encode_inside_the_graph_with_the_python_hooks_bytes_and_memory():
    from lowprec.runtime.activations_in_graph import inlining_supported

    if not inlining_supported():
        pytest.skip("this torch does not inline GraphModule saved-tensor hooks")
    plain, reference, _ = _compiled_proxy_blocks("none")
    python, python_grad, _ = _compiled_proxy_blocks("python")
    graph, graph_grad, storage = _compiled_proxy_blocks("graph")
    assert storage.in_graph and storage.counts.packed == 0 and storage.counts.traced_packed > 0
    # the same definitions in one kernel with their producers: values within the encode's bound, mostly the same
    assert (graph_grad - reference).norm() / reference.norm() < 0.10
    assert (graph_grad - python_grad).norm() / python_grad.norm() < 0.02
    # the block's inputs are stored too (the Python hooks store them): no more held than with them, and far less
    # than without
    assert graph <= 1.05 * python and graph < 0.6 * plain, (graph, python, plain)


@pytest.mark.parametrize("fused", ["0", "1"], ids=["torch chunks", "fused"])
def test_the_chunked_loss_matches_the_upcasting_one_and_keeps_no_fp32_logits(fused, monkeypatch):
    """lowprec.kernels.cross_entropy at the proxy's loss shape (4 x 2048 tokens, 32000 classes, BF16 logits): the
    loss and gradient of `F.cross_entropy(logits.float())`, and the memory the loss and its backward add above the
    logits (3 FP32 tensors of their shape for the upcasting loss) under the BF16 gradient and three FP32 chunks;
    as torch ops and fused (LOWPREC_FUSED_CROSS_ENTROPY=1)."""
    import torch.nn.functional as F

    from lowprec.kernels.cross_entropy import CHUNK_ELEMENTS, FUSED_ENV, cross_entropy

    monkeypatch.setenv(FUSED_ENV, fused)

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(8192, 32000, device="cuda", generator=g) * 4).bfloat16()
    target = torch.randint(0, 32000, (8192,), device="cuda", generator=g)
    target[:100] = -100
    results = []
    for fn in (cross_entropy, lambda x, t: F.cross_entropy(x.float(), t)):
        x = logits.clone().requires_grad_()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = fn(x, target)
        loss.backward()
        torch.cuda.synchronize()
        results.append((loss.detach(), x.grad, torch.cuda.max_memory_allocated() - base))
        del x, loss
    (loss, grad, added), (ref_loss, ref_grad, ref_added) = results
    assert float((loss - ref_loss).abs() / ref_loss) <= 1e-6
    assert float((grad.double() - ref_grad.double()).norm() / ref_grad.double().norm()) <= 2**-8
    assert ref_added >= 3 * logits.numel() * 4
    assert added <= logits.numel() * 2 + 3 * CHUNK_ELEMENTS * 4 + 2**22, (added, ref_added)


def test_rotary_angles_a_compiled_graph_saves_stay_out_of_fp8(monkeypatch):
    """The CUDA graph of HF-style rotary attention at 2048 tokens: the angles (position x frequency, up to 2047
    radians) it saves and takes cos/sin of again in backward are kept, and the query projection's gradient is as
    close to the unencoded one as the other tensors allow; encoded (the rule turned off), it is far worse (on the
    d4096 proxy: held-out loss +10%, results/gpu/2026-11-28-h200-act8-bisect)."""
    import contextlib
    import os
    import sys

    import lowprec.runtime.activations as activations
    from lowprec.runtime.activations import FP8ActivationStorage
    from lowprec.runtime.activations_in_graph import inlining_supported

    if not inlining_supported():
        pytest.skip("this torch does not inline GraphModule saved-tensor hooks")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from test_activations_in_graph import RotaryAttention

    def query_grad(encode: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = RotaryAttention(1024, 8).cuda()
        tokens = 2048
        x = torch.randn(2, tokens, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        positions = torch.arange(tokens, device="cuda")[None].expand(2, tokens)
        storage = FP8ActivationStorage(model, in_graph=True) if encode else None
        with torch.autocast("cuda", dtype=torch.bfloat16), (storage.context() if storage else
                                                            contextlib.nullcontext()):
            y = torch.compile(model)(x.requires_grad_(), positions)
        y.float().square().mean().backward()
        return model.qkv.weight.grad[:1024].float()

    reference = query_grad(False)
    kept = float((query_grad(True) - reference).norm() / reference.norm())
    assert kept < 0.07, kept
    monkeypatch.setattr(activations, "is_angle", lambda node: False)
    encoded = float((query_grad(True) - reference).norm() / reference.norm())
    assert encoded > 1.5 * kept, (kept, encoded)
