"""One rank of a torchrun job: DeepSpeed ZeRO-2 bf16 with the optimizer offloaded to the CPU (CoatFP8AdamW's C++
step): 4 steps straight, and 2 steps + checkpoint + a fresh engine loading it + 2 steps, give bit-identical weights,
optimizer states and losses; DeepSpeed's safe_get/set_full_optimizer_state on the offloaded FP8 states.  Usage: torchrun
--nproc_per_node 2 THIS CKPT_DIR
"""
import faulthandler
import importlib
import os
import sys

faulthandler.dump_traceback_later(400, exit=True)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import ds_helpers as H  # noqa: E402

importlib.import_module("deepspeed.comm.torch")
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
import deepspeed  # noqa: E402

import coat_ds  # noqa: E402,F401

torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
rank = int(os.environ["RANK"])
config = H.ds_config(2, "bf16", zero_optimization={"offload_optimizer": {"device": "cpu"}})


def engine():
    e, *_ = deepspeed.initialize(model=H.make_model(), config=config)
    assert e.optimizer.cpu_offload and type(e.basic_optimizer).__name__ == "CoatFP8AdamW"
    return e


def steps(e, first, count):
    losses = []
    for step in range(first, first + count):
        x, y = H.batch(step, rank, torch.bfloat16)
        loss = e(x, y)
        e.backward(loss)
        e.step()
        losses.append(loss.item())
    return losses


def snapshot(e):
    flat = e.basic_optimizer.param_groups[0]["params"][0]
    state = e.basic_optimizer.state[flat]
    return [flat.detach().clone()] + [state[k].clone() for k in ("exp_avg_q", "exp_avg_meta", "exp_avg_sq_q",
                                                                    "exp_avg_sq_meta")]


straight = engine()
losses_straight = steps(straight, 0, 4)
final_straight = snapshot(straight)
first = engine()
steps(first, 0, 2)
first.save_checkpoint(sys.argv[1], tag="t2")
resumed = engine()
resumed.load_checkpoint(sys.argv[1], tag="t2")
losses_resumed = steps(resumed, 2, 2)
assert losses_resumed == losses_straight[2:], (losses_resumed, losses_straight)
for a, b in zip(snapshot(resumed), final_straight):
    assert torch.equal(H.fp8_bytes(a), H.fp8_bytes(b))
# DeepSpeed's per-parameter API on the offloaded states: fp32 moments, and set(get()) leaves the state bit for bit
before = snapshot(resumed)
for p in resumed.module.parameters():
    for key in ("exp_avg", "exp_avg_sq"):
        value = deepspeed.utils.safe_get_full_optimizer_state(p, key)
        assert value.dtype == torch.float32 and value.shape == p.shape and bool(torch.isfinite(value).all())
        deepspeed.utils.safe_set_full_optimizer_state(p, value, key)
assert any(deepspeed.utils.safe_get_full_optimizer_state(p, "exp_avg").any() for p in resumed.module.parameters())
for a, b in zip(snapshot(resumed), before):
    assert torch.equal(H.fp8_bytes(a), H.fp8_bytes(b))
print(f"rank {rank}: offload resume bit-exact, losses {losses_resumed}", flush=True)
H.end_rank_process()
