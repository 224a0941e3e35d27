"""One rank of the CoatFP8Lion / CoatFP8Muon DeepSpeed job (2 gloo ranks on the CPU): Lion from the ds_config on
ZeRO-1 and ZeRO-2, a ZeRO-2 checkpoint resumed bit for bit, Lion's ZeRO-2 state through DeepSpeed's per-parameter
state functions and a universal checkpoint (ds_lion_universal_job); Muon on ZeRO-0 with its param groups, and refused
on ZeRO-0 with bf16 (BF16_Optimizer's flat copies) with the reason; Muon on ZeRO-1/2 (ds_muon_zero_job)."""
import torch

import ds_helpers as H
import ds_job
import ds_lion_universal_job
import ds_muon_zero_job


def lion_muon_worker(rank, world, rendezvous, ck_dir):
    H.start_rank(rank, world, rendezvous)
    ds_lion_universal_job.save_convert_load(rank, world, ck_dir)
    import deepspeed

    import coat_ds  # noqa: F401
    from coat_kernels.optim import muon_param_groups

    lion = {"type": "CoatFP8Lion", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.1}}
    engines = {}
    for stage in (1, 2):
        engine, *_ = deepspeed.initialize(model=H.make_model(), config=H.ds_config(stage, "fp32", optimizer=lion))
        assert type(engine.basic_optimizer).__name__ == "CoatFP8Lion"
        losses = ds_job.train(engine, 3, rank, torch.float32)
        assert all(torch.isfinite(torch.tensor(losses))), losses
        engines[stage] = engine
    engine = engines[2]
    engine.save_checkpoint(ck_dir, tag="lion")
    straight = ds_job.train(engine, 3, rank, torch.float32, first=3)
    resumed, *_ = deepspeed.initialize(model=H.make_model(seed=1), config=H.ds_config(2, "fp32", optimizer=lion))
    resumed.load_checkpoint(ck_dir, tag="lion")
    assert ds_job.train(resumed, 3, rank, torch.float32, first=3) == straight
    for p, q in zip(engine.module.parameters(), resumed.module.parameters()):
        assert torch.equal(p, q)
    entry = next(iter(resumed.basic_optimizer.state.values()))
    assert "exp_avg_q" in entry and "exp_avg_sq_q" not in entry

    muon = {"type": "CoatFP8Muon", "params": {"lr": 0.02, "momentum": 0.95}}
    model = H.make_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=muon_param_groups(model),
                                      config=H.ds_config(0, "fp32", optimizer=muon))
    assert [g["use_muon"] for g in engine.basic_optimizer.param_groups] == [True, False]
    losses = ds_job.train(engine, 4, rank, torch.float32)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    initial = H.make_model()
    for p, q in zip(engine.module.parameters(), initial.parameters()):  # stepped, and alike on both ranks
        assert not torch.equal(p, q)
        gathered = [torch.empty_like(p) for _ in range(world)]
        torch.distributed.all_gather(gathered, p.detach().contiguous())
        assert all(torch.equal(g, gathered[0]) for g in gathered)
    model = H.make_model()
    H.assert_refused(lambda: deepspeed.initialize(model=model, model_parameters=muon_param_groups(model),
                                                  config=H.ds_config(0, "bf16", optimizer=muon)),
                     "whole weight matrices", "BF16_Optimizer", what="CoatFP8Muon on ZeRO-0 with bf16")
    ds_muon_zero_job.muon_zero_checks(rank, world, ck_dir)
    print(f"rank {rank}: Lion ZeRO-1/2 + resume, Muon ZeRO-0, Muon ZeRO-0 bf16 refused, Muon ZeRO-1/2 OK", flush=True)
    H.end_rank_process()
