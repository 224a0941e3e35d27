"""`enable_coat()` end to end on the GPU with megatron-core 0.17+ (megatron.training): coat_megatron.pretrain_gpt
trains a small GPT on mock data with `--transformer-impl coat --coat-optimizer` under torchrun, the loss falls, and
the run reports CoatFP8AdamW's FP8 state (about 2.19 bytes per element)."""
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.training", reason="megatron.training ships in megatron-core 0.17+ (Python 3.12)")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pretrain_gpt_with_coat_layers_and_optimizer(tmp_path):
    args = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--ffn-hidden-size", "704",
            "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "30", "--lr", "1e-3", "--lr-warmup-iters", "2",
            "--bf16", "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
            "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--attention-dropout", "0",
            "--hidden-dropout", "0", "--use-distributed-optimizer", "--no-gradient-accumulation-fusion",
            "--no-rope-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
            "--no-persist-layer-norm", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
            "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1", "--seed", "1234",
            "--transformer-impl", "coat", "--coat-optimizer"]
    env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
                           str(_free_port()), "-m", "coat_megatron.pretrain_gpt", *args], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    losses = [float(v) for v in re.findall(r"lm loss: ([0-9.E+-]+)", out)]
    assert len(losses) >= 25 and all(map(torch.isfinite, torch.tensor(losses))), out[-3000:]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    state = re.search(r"optimizer state: (\S+) .*\(([0-9.]+) B/element\)", out)
    assert state and state.group(1).endswith("CoatFP8AdamW") and 2.1 < float(state.group(2)) < 2.3, out[-3000:]
