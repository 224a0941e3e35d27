"""CoatFP8Muon on DeepSpeed's ZeRO-2 Muon path on a GPU (one rank): the momentum staged and committed through the
Triton (de)quantization batches, DeepSpeed's compiled `muon_update` on whole matrices. Oracles: DeepSpeed's own
`"type": "Muon"` (fp32 state: equal bit for bit), and the same with its momentum rounded through FP8 after each step
by coat_kernels.optim's torch reference (FP8 state: equal bit for bit, the Triton kernels giving the reference's
bits). The CPU version with two ranks and a matrix cut by the partition edge: tests/jobs/ds_muon_zero_job.py."""
import pytest
import torch

import ds_muon_zero_job as J


@pytest.fixture
def single_rank(monkeypatch):
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29733")):
        monkeypatch.setenv(key, value)


def train(engine, steps, after_step=None):
    return J.train(engine, steps, 0, torch.bfloat16, after_step=after_step, device="cuda")


def test_muon_on_zero2_equals_deepspeeds_muon_on_a_gpu(single_rank):
    pytest.importorskip("deepspeed")
    theirs = J.build(J.deepspeed_muon(2, "bf16"))
    their_losses = train(theirs, J.STEPS)
    ours = J.build(J.coat_muon(2, "bf16", "fp32"))
    assert train(ours, J.STEPS) == their_losses
    assert all(torch.equal(p, q) for p, q in zip(J.weights(ours), J.weights(theirs)))

    rounded = J.build(J.deepspeed_muon(2, "bf16", adam_lr=0.0))
    rounded_losses = train(rounded, J.STEPS, after_step=J.fp8_round_trip)
    fp8 = J.build(J.coat_muon(2, "bf16", "fp8", group_size=J.GROUP, lr=0.0))
    assert train(fp8, J.STEPS) == rounded_losses
    assert all(torch.equal(p, q) for p, q in zip(J.weights(fp8), J.weights(rounded)))
    entry = J.muon_entry(fp8)
    assert entry["exp_avg_q"].is_cuda and entry["exp_avg_q"].dtype == torch.float8_e4m3fn
    assert "momentum_buffer" not in entry
