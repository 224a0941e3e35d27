"""CoatFP8Muon on DeepSpeed's ZeRO-1/2 Muon path, one rank's checks (`muon_zero_checks`, run inside
ds_lion_muon_job's worker: 2 gloo ranks on the CPU), on the MLP of ds_helpers: its three weights are the Muon
matrices, the middle one (40 x 40) cut by the ZeRO-2 partition edge; the biases are the AdamW group.

Oracles: DeepSpeed's own `"type": "Muon"` (with torch's AdamW for its AdamW half), and the gradient autograd gives
on the global batch in one process. Each rank writes muon_zero_rank{r}.json (what it measured) into the checkpoint
folder; asserts inside."""
import json
import os

import torch

import ds_helpers as H

MUON_LR, ADAM_LR, MOMENTUM, WD, BETAS, EPS = 0.02, 1e-3, 0.95, 0.1, [0.9, 0.95], 1e-8
STEPS, NEXT, SIZE, GROUP = 3, 2, 32, 128
MATRICES = {0: [[40, 24], [40, 40]], 1: [[40, 40], [8, 40]]}  # the Muon matrices of each rank's ZeRO partition
FP8_TOLERANCE = 0.1  # of the distance DeepSpeed's Muon moved the weights in 3 steps (measured 0.062)


def deepspeed_muon(stage, dtype, adam_lr=ADAM_LR):
    return H.ds_config(stage, dtype, optimizer={"type": "Muon", "params": {
        "lr": MUON_LR, "adam_lr": adam_lr, "momentum": MOMENTUM, "weight_decay": WD, "betas": BETAS, "eps": EPS,
        "torch_adam": True}})


def coat_muon(stage, dtype, state_dtype, ds=None, **params):
    return H.ds_config(stage, dtype, optimizer={"type": "CoatFP8Muon", "params": {
        "lr": ADAM_LR, "betas": BETAS, "weight_decay": WD, "adamw_eps": EPS, "state_dtype": state_dtype, **params}},
        **(ds or {}))


def build(config, seed=0):
    import deepspeed

    from coat_kernels.optim import muon_param_groups

    model = H.make_model(seed)
    coat = config["optimizer"]["type"] == "CoatFP8Muon"
    groups = muon_param_groups(model, lr=MUON_LR, momentum=MOMENTUM) if coat else model.parameters()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    return engine


def weights(engine):
    return [p.detach().float().clone() for p in engine.module.parameters()]


def muon_entry(engine):
    """This rank's state entry of the Muon group's flat partition."""
    opt = engine.basic_optimizer
    return opt.state[opt.param_groups[0]["params"][0]]


def whole_momenta(entry):
    """The fp32 momentum of each whole matrix of the entry (FP8 codes decoded on the matrix's groups)."""
    from coat_kernels.optim import dre_reference
    from coat_kernels.optim.grouping import build_layout

    shapes = entry["whole_matrices"].tolist()
    if "exp_avg" in entry:
        flat = entry["exp_avg"].float()
    else:
        layout = build_layout(entry["segments"], entry["exp_avg_q"].numel(), entry["group_size"])
        flat = dre_reference.dequantize(entry["exp_avg_q"], entry["exp_avg_meta"], layout)
    return [m.view(r, c) for m, (r, c) in zip(flat.split([r * c for r, c in shapes]), shapes)]


def first_gradient(world):
    """The averaged gradient of step 0 over every rank's micro-batch, by autograd in this process."""
    model = H.make_model()
    loss = sum(model(*H.batch(0, r, size=SIZE)) for r in range(world)) / world
    loss.backward()
    return [p.grad.float() for p in model.parameters()]


def gathered(t):
    parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, t.contiguous())
    return parts


def relative_distance(a, b, start):
    num = sum(float((x - y).norm() ** 2) for x, y in zip(a, b)) ** 0.5
    den = sum(float((y - s).norm() ** 2) for y, s in zip(b, start)) ** 0.5
    return num / den


def train(engine, steps, rank, tdt, first=0, after_step=None, device="cpu"):
    """ds_job.train on micro-batches of SIZE samples (gradients of rank >= the matrices' widths: Newton-Schulz then
    acts on a well-conditioned momentum) on `device`, `after_step(engine)` after each step."""
    losses = []
    for step in range(first, first + steps):
        loss = engine(*(t.to(device) for t in H.batch(step, rank, tdt, size=SIZE)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(engine)
    return losses


def fp8_round_trip(engine):
    """The oracle of FP8 momentum: DeepSpeed's Muon whose momentum buffer (the partition's whole matrices, end to
    end) goes through E4M3 with Dynamic Range Expansion after each step, in groups of GROUP along each matrix (the
    quantizer is coat_kernels.optim's reference, tested against its formulas in tests/kernels/optim)."""
    from coat_kernels.optim import dre_reference
    from coat_kernels.optim.config import OptimizerConfig
    from coat_kernels.optim.grouping import build_layout

    opt = engine.basic_optimizer
    buffer = opt.state[opt.param_groups[0]["params"][0]]["momentum_buffer"]
    numels = [p.numel() for p in engine.optimizer.params_in_partition[0]]  # MuonWithAuxAdam sorts them by size
    starts = [sum(numels[:i]) for i in range(len(numels))]
    layout = build_layout([(s, n, 0) for s, n in zip(starts, numels)], buffer.numel(), GROUP)
    m_cfg = OptimizerConfig().moment_configs()[0]
    codes, meta = dre_reference.quantize(buffer.float(), layout, m_cfg)
    buffer.copy_(dre_reference.dequantize(codes, meta, layout))


def muon_zero_checks(rank, world, ck_dir):
    """After H.start_rank: the checks of the module docstring."""
    torch._dynamo.config.disable = True  # DeepSpeed's muon_update is torch.compile'd: eager on these tiny CPU runs
    import deepspeed  # noqa: F401

    import coat_ds  # noqa: F401

    report = {}
    start = [p.detach().clone() for p in H.make_model().parameters()]

    # DeepSpeed's own Muon against the fp32 reference arm, bit for bit: ZeRO-2 with an fp32 model, ZeRO-1 with bf16
    theirs = build(deepspeed_muon(2, "fp32"))
    assert type(theirs.basic_optimizer).__name__ == "MuonWithAuxAdam"
    their_losses = train(theirs, STEPS, rank, torch.float32)
    ours = build(coat_muon(2, "fp32", "fp32"))
    our_losses = train(ours, 1, rank, torch.float32)
    entry = muon_entry(ours)
    assert entry["whole_matrices"].tolist() == MATRICES[rank], entry["whole_matrices"]
    # after one step every rank holding a piece of a matrix (the cut one: both) holds (1 - momentum) x its whole
    # averaged gradient
    grads = dict(zip(("w0", "b0", "w1", "b1", "w2", "b2"), first_gradient(world)))
    for name, m in zip({0: ["w0", "w1"], 1: ["w1", "w2"]}[rank], whole_momenta(entry)):
        expected = (1 - MOMENTUM) * grads[name]
        err = float((m - expected).abs().max() / expected.abs().max())
        assert err < 1e-6, (name, err)
    both = gathered(whole_momenta(entry)[1 if rank == 0 else 0])
    assert torch.equal(both[0], both[1]), "the cut matrix's momentum differs between the ranks"
    our_losses += train(ours, STEPS - 1, rank, torch.float32, first=1)
    assert our_losses == their_losses, (our_losses, their_losses)
    for p, q in zip(weights(ours), weights(theirs)):
        assert torch.equal(p, q), float((p - q).abs().max())
    theirs_bf16, ours_bf16 = build(deepspeed_muon(1, "bf16")), build(coat_muon(1, "bf16", "fp32"))  # ZeRO-1
    assert train(ours_bf16, STEPS, rank, torch.bfloat16) == train(theirs_bf16, STEPS, rank, torch.bfloat16)
    for p, q in zip(weights(ours_bf16), weights(theirs_bf16)):
        assert torch.equal(p, q), float((p - q).abs().max())

    # FP8 momentum: bit for bit DeepSpeed's Muon with its momentum rounded through FP8 after each step (ZeRO-2 fp32
    # model and ZeRO-1 bf16 model; the AdamW half at lr 0, its weights fixed, as its moments are FP8 on one side
    # only); its distance from DeepSpeed's plain Muon; bytes; the AdamW group's segments
    for stage, dtype in ((2, "fp32"), (1, "bf16")):
        tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
        rounded = build(deepspeed_muon(stage, dtype, adam_lr=0.0))
        rounded_losses = train(rounded, STEPS, rank, tdt, after_step=fp8_round_trip)
        fp8 = build(coat_muon(stage, dtype, "fp8", group_size=GROUP, lr=0.0))
        assert train(fp8, STEPS, rank, tdt) == rounded_losses
        for p, q in zip(weights(fp8), weights(rounded)):
            assert torch.equal(p, q), (stage, dtype, float((p - q).abs().max()))
    fp8 = build(coat_muon(2, "fp32", "fp8"))
    train(fp8, STEPS, rank, torch.float32)
    distance = relative_distance(weights(fp8), weights(theirs), start)
    assert distance < FP8_TOLERANCE, distance
    entry = muon_entry(fp8)
    assert entry["exp_avg_q"].dtype == torch.float8_e4m3fn and "momentum_buffer" not in entry
    numel = sum(r * c for r, c in MATRICES[rank])
    assert entry["exp_avg_q"].numel() == numel
    H.assert_refused(lambda: fp8.basic_optimizer.fp32_moments(fp8.basic_optimizer.param_groups[0]["params"][0]),
                     "whole matrices", what="fp32_moments of a Muon partition under ZeRO-2")
    from deepspeed.utils import safe_get_full_optimizer_state
    for p in fp8.module.parameters():  # every rank, the cut matrix included: a ValueError naming why, no hang
        if p.use_muon:
            H.assert_refused(lambda: safe_get_full_optimizer_state(p, "exp_avg"), "whole matrices",
                             what="safe_get_full_optimizer_state of a Muon matrix under ZeRO-2")
    adamw_flat = fp8.basic_optimizer.param_groups[1]["params"][0]
    segments = fp8.basic_optimizer.state[adamw_flat]["segments"].tolist()
    assert segments == [list(s) for s in H.expected_segments([40, 40, 8], 2, rank, world)], segments
    report.update(fp8_distance=distance, momentum_bytes=entry["exp_avg_q"].numel() + 4 * entry["exp_avg_meta"].numel(),
                  momentum_numel=numel, partition_numel=fp8.basic_optimizer.param_groups[0]["params"][0].numel())

    # the ZeRO-2 checkpoint of the FP8 run resumes bit for bit
    fp8.save_checkpoint(ck_dir, tag="muon_z2")
    saved = {k: v.clone() if torch.is_tensor(v) else v for k, v in muon_entry(fp8).items()}
    straight = train(fp8, NEXT, rank, torch.float32, first=STEPS)
    resumed = build(coat_muon(2, "fp32", "fp8"), seed=1)
    resumed.load_checkpoint(ck_dir, tag="muon_z2")
    assert not H.states_equal(muon_entry(resumed), saved), H.states_equal(muon_entry(resumed), saved)
    assert train(resumed, NEXT, rank, torch.float32, first=STEPS) == straight
    for p, q in zip(weights(fp8), weights(resumed)):
        assert torch.equal(p, q)
    assert not H.states_equal(muon_entry(resumed), muon_entry(fp8))
    # another rank's momentum (other whole matrices) does not load
    state_dict = resumed.basic_optimizer.state_dict()
    state_dict["state"][0]["whole_matrices"] = torch.tensor(MATRICES[1 - rank])
    H.assert_refused(lambda: resumed.basic_optimizer.load_state_dict(state_dict), "whole_matrices", "another rank",
                     what="a momentum over another rank's matrices")

    # refused at deepspeed.initialize, with the reason
    for config, words in ((coat_muon(3, "fp32", "fp8"), "ZeRO-3 runs Muon only for DeepSpeed's own"),
                          (coat_muon(0, "fp32", "fp8", ns_method="gram"), "ZeRO stage 0 steps torch.optim.Muon's"),
                          (coat_muon(1, "bf16", "fp8", ds={"data_types": {"grad_accum_dtype": "fp32"}}),
                           "BF16_Optimizer"),
                          (coat_muon(2, "fp32", "fp8", ns_steps=3), "takes none of torch.optim.Muon's options"),
                          (coat_muon(2, "fp32", "fp8", ds={"checkpoint": {"load_universal": True}}),
                           "universal checkpoints"),
                          (coat_muon(2, "fp32", "fp8", ds={"zero_optimization": {"offload_optimizer": {
                              "device": "cpu"}}}), "optimizer offload")):
        H.assert_refused(lambda: build(config), words, what=words)
    with open(os.path.join(ck_dir, f"muon_zero_rank{rank}.json"), "w") as f:
        json.dump(report, f)
