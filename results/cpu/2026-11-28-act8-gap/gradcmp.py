import os, sys, torch
mode = sys.argv[1]  # bf16 | graph | hooks
if mode == "hooks":
    os.environ["LOWPREC_FP8_ACTIVATIONS_IN_GRAPH"] = "0"
from accelerate.utils import TorchDynamoPlugin
from lowprec import Accelerator, FP8RecipeKwargs
from lowprec.demo.model import ModelPreset, build_model
from lowprec.demo.data import TOKENIZATIONS
preset = ModelPreset(256, 2, 2, 768, 512, 4, 1.5e-3, "exp")
torch.manual_seed(0)
model = build_model(preset, "llama", TOKENIZATIONS["bytes"])
kw = dict(dynamo_plugin=TorchDynamoPlugin(backend="inductor"))
if mode == "bf16":
    acc = Accelerator(mixed_precision="bf16", **kw)
else:
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(backend="torchao", activation_dtype=None if mode == "fp8" else "fp8")], **kw)
model = acc.prepare(model)
ids = torch.randint(0, 256, (4, 512), generator=torch.Generator().manual_seed(1))
for i in range(2):
    loss = model(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    if i == 0:
        for p in model.parameters():
            p.grad = None
grads = {n: p.grad.detach().float().clone() for n, p in acc.unwrap_model(model).named_parameters() if p.grad is not None}
torch.save(grads, f"/tmp/grads_{mode}.pt")
print(mode, float(loss))
