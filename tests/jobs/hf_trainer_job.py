"""The Hugging Face Trainer with `--deepspeed`, as a user runs it: a script that never imports coat_ds, with the
optimizer chosen only by ds_config. transformers and accelerate probe `importlib.util.find_spec("deepspeed")`
before they import it; the probe is repeated here before anything else touches deepspeed.

    python hf_trainer_job.py OUT_DIR MAX_STEPS [RESUME_CHECKPOINT] [--coat]   -> prints one JSON line (losses per step)
--coat adds "coat": {"fp8_activations": true} to the ds_config: FP8 activations by configuration alone.
"""
import faulthandler
import importlib.util
import json
import os
import sys

faulthandler.dump_traceback_later(240, exit=True)
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
os.environ.setdefault("MASTER_PORT", "29611")
assert importlib.util.find_spec("deepspeed") is not None
assert "coat_ds" not in sys.modules and "deepspeed" not in sys.modules

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

# Test harness only: deepspeed.init_distributed JIT-builds a shared-memory op that gloo on one rank does not need.
importlib.import_module("deepspeed.comm.torch")
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
torch.set_num_threads(1)

VOCAB, SEQ = 128, 32


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def main(out_dir, max_steps, resume=None, coat=False):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=SEQ))
    auto = "auto"
    ds_config = {"train_micro_batch_size_per_gpu": auto, "gradient_accumulation_steps": auto,
                 "gradient_clipping": auto, "bf16": {"enabled": auto}, "zero_optimization": {"stage": 2},
                 "optimizer": {"type": "CoatFP8AdamW",
                               "params": {"lr": auto, "betas": auto, "eps": auto, "weight_decay": auto}}}
    if coat:
        ds_config["coat"] = {"fp8_activations": True, "backend": "torch"}
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4, max_steps=max_steps, save_steps=3,
                             logging_steps=1, learning_rate=1e-3, deepspeed=ds_config, report_to=[], use_cpu=True,
                             bf16=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=resume)
    losses = {int(h["step"]): h["loss"] for h in trainer.state.log_history if "loss" in h}
    converted = sum(type(m).__name__.startswith("Coat") and "DecoderLayer" in type(m).__name__
                    for m in trainer.model.modules())
    print(json.dumps({"optimizer": type(trainer.deepspeed.basic_optimizer).__name__, "converted_layers": converted,
                      "registered": getattr(torch.optim, "CoatFP8AdamW", None) is sys.modules["coat_ds"].CoatFP8AdamW,
                      "losses": losses}), flush=True)


if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if a != "--coat"]
    main(argv[0], int(argv[1]), argv[2] if len(argv) > 2 else None, coat="--coat" in sys.argv)
    from rank_helpers import end_rank_process

    end_rank_process()  # not interpreter finalization: gloo's threads abort it now and then (see rank_helpers)
