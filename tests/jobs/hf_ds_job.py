"""One rank of a torchrun job that never imports coat_ds: a Hugging Face Llama under DeepSpeed ZeRO-2 and ZeRO-3
(2 gloo ranks), FP8 activations switched on by the ds_config "coat" section alone, CoatFP8AdamW by its "optimizer"
section. Against the same model and data without the section: the layers are converted, the losses agree within
FP8 tolerance, what the decoder layers save for backward is mostly FP8, and the weight clock ticks once per step.
Usage: torchrun --nproc_per_node 2 THIS
"""
import faulthandler
import importlib
import os
import sys

assert "coat_ds" not in sys.modules and "deepspeed" not in sys.modules
faulthandler.enable()
faulthandler.dump_traceback_later(400, exit=True)
os.environ["DS_ACCELERATOR"] = "cpu"

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

importlib.import_module("deepspeed.comm.torch")  # test harness: no shared-memory op build on CPU
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
import deepspeed  # noqa: E402
from rank_helpers import end_rank_process  # noqa: E402

torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
VOCAB, SEQ, BATCH, STEPS = 128, 32, 2, 4


def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                        use_cache=False))


def config(stage, coat):
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "CoatFP8AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}}
    if coat:
        cfg["coat"] = {"fp8_activations": True, "backend": "torch"}
    return cfg


def train(engine):
    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


for stage in (2, 3):
    base, *_ = deepspeed.initialize(model=model(), config=config(stage, coat=False))
    coat, *_ = deepspeed.initialize(model=model(), config=config(stage, coat=True))
    assert "coat_ds" in sys.modules
    names = {type(m).__name__ for m in coat.module.modules()}
    assert {"CoatLlamaDecoderLayer", "CoatLlamaForCausalLM"} <= names, names
    runtime = sys.modules["coat_ds"].coat_runtime(coat.module)
    a, b = train(base), train(coat)
    assert all(abs(x - y) < 0.02 * abs(x) for x, y in zip(a, b)), (stage, a, b)
    assert runtime.clock.count == STEPS, runtime.clock.count
    counts = {}

    def pack(t):
        counts[t.dtype] = counts.get(t.dtype, 0) + t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        coat.module.model.layers[0](torch.randn(BATCH, SEQ, 64, dtype=torch.bfloat16, requires_grad=True),
                                    position_embeddings=coat.module.model.rotary_emb(
                                        torch.zeros(1, dtype=torch.bfloat16), torch.arange(SEQ)[None]))
    assert counts.get(torch.float8_e4m3fn, 0) >= BATCH * SEQ * (64 * 2 + 2 * 96), counts
    del base, coat
    print(f"rank {rank}: ZeRO-{stage} coat section OK, losses {[round(x, 4) for x in b]} vs {[round(x, 4) for x in a]}",
          flush=True)
end_rank_process()
