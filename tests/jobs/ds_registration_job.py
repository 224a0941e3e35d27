"""One rank of a torchrun job that never imports coat_ds: `import deepspeed` alone must register CoatFP8AdamW
(the coat_fp8_autoregister.pth start-up hook). Then: ZeRO-2 with optimizer offload to CPU, and a universal
checkpoint saved on one rank loaded on two (DP 1 -> 2).  Usage: torchrun --nproc_per_node 2 THIS CKPT_DIR
"""
import faulthandler
import os
import sys

assert "coat_ds" not in sys.modules and "deepspeed" not in sys.modules and "torch" not in sys.modules
faulthandler.dump_traceback_later(300, exit=True)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import ds_helpers as H  # noqa: E402  (torch only)
import ds_job  # noqa: E402  (torch only)

torch.set_num_threads(1)
H.init_deepspeed_distributed()  # imports deepspeed
import deepspeed  # noqa: E402

assert "coat_ds" in sys.modules, "importing deepspeed did not load coat_ds"
assert getattr(torch.optim, "CoatFP8AdamW", None) is sys.modules["coat_ds"].CoatFP8AdamW
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

# No zero_allow_untested_optimizer: the ZeRO list knows the class.
offloaded, *_ = deepspeed.initialize(model=H.make_model(), config=H.ds_config(
    2, "fp32", zero_optimization={"offload_optimizer": {"device": "cpu"}}))
on_device, *_ = deepspeed.initialize(model=H.make_model(), config=H.ds_config(2, "fp32"))
assert type(offloaded.basic_optimizer).__name__ == "CoatFP8AdamW" and offloaded.optimizer.cpu_offload
losses = [ds_job.train(e, 3, rank, torch.float32) for e in (offloaded, on_device)]
assert losses[0] == losses[1], losses
assert torch.equal(ds_job.flat_state(offloaded)[0], ds_job.flat_state(on_device)[0])
del offloaded, on_device

numels = [p.numel() for p in H.make_model().parameters()]
ds_job.load_universal_and_check(sys.argv[1], "dp1_universal", "dp1_expected.pt", numels, rank, world, next_step=4)
print(f"rank {rank}: registration, offload and DP 1 -> 2 OK", flush=True)
H.end_rank_process()
