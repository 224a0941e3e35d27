"""Two gloo processes that check `--coat-optimizer` (coat_megatron.optimizer) under Megatron's real optimizers.

Run by tests/megatron/test_megatron_optimizer.py:  python tests/jobs/megatron_optimizer_job.py OUT_DIR PORT
Each rank writes OUT_DIR/rank{r}.json. A 2-layer GPT (local BF16 spec) is wrapped in Megatron's DDP, its
optimizer built by `get_megatron_optimizer` and its inner Adam swapped by `use_coat_optimizer`. Phases:
- distributed optimizer (DP=2): every inner step is replayed by a plain CoatFP8AdamW on copies of the same
  fp32 shards (segments on the parameter's grid), which must match bit for bit; the state is FP8 per shard;
  the run tracks the stock torch-AdamW run;
- checkpoints through dist_checkpointing in three sharding types (COAT -> COAT), and across optimizers
  (COAT -> torch AdamW, torch AdamW -> COAT); once more with TE FusedAdam's step convention;
- Float16OptimizerWithFloat16Params (no distributed optimizer): steps and a checkpoint round trip.

Test-only CPU shims (megatron-core's optimizers and buffers assume CUDA; applied in these worker processes only):
torch.cuda.current_device -> cpu, torch.cuda.synchronize -> no-op, torch.cuda.current_stream -> a stream whose
waits do nothing (megatron-core 0.19's grad sync), torch.tensor/zeros/empty/ones with
device="cuda" -> cpu, and Tensor.type() without arguments answers "torch.cuda.<T>" (Megatron checks the type
name of every parameter it wraps).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
from rank_helpers import init_gloo_rank
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STEPS = 3
LR, WEIGHT_DECAY, CLIP_GRAD = 1e-2, 0.1, 1.0


class _NoStream:
    def wait_event(self, *args):
        pass

    def wait_stream(self, *args):
        pass


def apply_cpu_shims():
    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    for name in ("tensor", "zeros", "empty", "ones"):
        def on_cpu(*args, _factory=getattr(torch, name), **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return _factory(*args, **kwargs)
        setattr(torch, name, on_cpu)
    tensor_type = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        if args or kwargs:
            return tensor_type(self, *args, **kwargs)
        return tensor_type(self).replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type_name


def build(distributed, coat, float16_module=True, **coat_options):
    """(DDP-wrapped tiny GPT, Megatron optimizer); same initial weights every time.

    float16_module: all parameters BF16, as megatron.training wraps them; else the norms stay fp32, whose
    distributed-optimizer shards are views of the model parameters."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron_job import build as build_gpt
    from megatron_job import make_config

    from coat_megatron.optimizer import use_coat_optimizer

    config = make_config(1)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed, grad_reduce_in_fp32=True)
    gpt = build_gpt("local", config)
    model = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt) if float16_module else gpt)
    model.gpt = gpt
    opt_config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WEIGHT_DECAY, bf16=True,
                                 params_dtype=torch.bfloat16, use_distributed_optimizer=distributed,
                                 clip_grad=CLIP_GRAD)
    optimizer = get_megatron_optimizer(opt_config, [model])
    if coat:
        optimizer = use_coat_optimizer(optimizer, **{"group_size": 128, **coat_options})
    return model, optimizer


def train_step(model, optimizer, it):
    from megatron_job import batch

    model.zero_grad_buffer()
    optimizer.zero_grad()
    tokens, position_ids, mask, labels = batch(100 + it)
    loss = model(tokens, position_ids, mask, labels=labels).float().mean()
    loss.backward()
    model.finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok
    return loss.item()


def wrapper_of(optimizer):
    return optimizer.chained_optimizers[0]


def main_params(optimizer):
    return [p for g in wrapper_of(optimizer).optimizer.param_groups for p in g["params"]]


def named_main_params(model, optimizer):
    """{model parameter name: copy of its fp32 main param (this rank's shard under the distributed optimizer)}."""
    wrapper = wrapper_of(optimizer)
    names = {p: n.replace("module.", "") for n, p in model.named_parameters()}
    if hasattr(wrapper, "model_param_group_index_map"):
        pairs = [(mp, wrapper.optimizer.param_groups[gi]["params"][go])
                 for mp, (gi, go) in wrapper.model_param_group_index_map.items()]
    else:
        pairs = [(mp, main) for mg, fg in zip(wrapper.float16_groups, wrapper.fp32_from_float16_groups)
                 for mp, main in zip(mg, fg)]
        pairs += [(p, p) for g in wrapper.fp32_from_fp32_groups for p in g]
    return {names[mp]: main.detach().clone() for mp, main in pairs}


def rel_err(x, y):
    return ((x - y).norm() / y.norm().clamp(min=1e-30)).item()


class LockstepReference:
    """Replays every step of a MegatronCoatFP8AdamW with a plain CoatFP8AdamW on copies of its (shard) params,
    same gradients, segments and hyper-parameters, and compares params, FP8 codes and metadata bit for bit."""

    def __init__(self, coat):
        from coat_kernels.optim import CoatFP8AdamW
        from coat_kernels.optim.config import GROUP_OPTION_NAMES

        self.coat, self.mismatches, self.steps = coat, [], 0
        self.copies = [p.detach().clone() for p in self._params()]
        groups, i = [], 0
        for g in coat.param_groups:
            groups.append({"params": self.copies[i:i + len(g["params"])]})
            i += len(g["params"])
        self.reference = CoatFP8AdamW(groups, lr=LR, **{k: coat.defaults[k] for k in GROUP_OPTION_NAMES})
        for copy, p in zip(self.copies, self._params()):
            self.reference.state[copy]["segments"] = coat.state[p]["segments"].clone()
        real_step = coat.step

        def step(closure=None):
            grads = [p.grad.clone() for p in self._params()]
            real_step()
            for ref_group, group in zip(self.reference.param_groups, coat.param_groups):
                ref_group.update({k: group[k] for k in ("lr", "weight_decay", "betas", "eps")})
            for copy, grad in zip(self.copies, grads):
                copy.grad = grad
            self.reference.step()
            self._compare()
            self.steps += 1

        coat.step = step

    def result(self):
        return {"lockstep_mismatches": self.mismatches, "lockstep_steps": self.steps}

    def _params(self):
        return [p for g in self.coat.param_groups for p in g["params"]]

    def _compare(self):
        for copy, p in zip(self.copies, self._params()):
            mine, ref = self.coat.state[p], self.reference.state[copy]
            same = torch.equal(copy, p) and all(torch.equal(mine[k].view(torch.uint8), ref[k].view(torch.uint8))
                                                for k in ("exp_avg_q", "exp_avg_sq_q"))
            if not (same and all(torch.equal(mine[k], ref[k]) for k in ("exp_avg_meta", "exp_avg_sq_meta", "step"))):
                self.mismatches.append(tuple(p.shape))


def shard_report(model, optimizer):
    """Per shard main param: its range in the model parameter, segments and state dtypes; numel over all ranks."""
    from megatron.core import parallel_state

    dist_opt = wrapper_of(optimizer)
    coat = dist_opt.optimizer
    shards = []
    for model_param, (gi, go) in dist_opt.model_param_group_index_map.items():
        main = coat.param_groups[gi]["params"][go]
        state = coat.state[main]
        param_range = dist_opt._get_model_param_range_map(model_param)["param"]
        shards.append({"numel": main.numel(), "param_numel": model_param.numel(), "start": param_range.start,
                       "model_dtype": str(model_param.dtype), "segments": state["segments"].tolist(),
                       "codes": [str(state["exp_avg_q"].dtype), str(state["exp_avg_sq_q"].dtype)],
                       "codes_numel": state["exp_avg_q"].numel(), "step": float(state["step"])})
    numel = torch.tensor([sum(s["numel"] for s in shards)])
    dist.all_reduce(numel, group=parallel_state.get_data_parallel_group())
    return {"shards": shards, "stepped_numel_all_ranks": int(numel),
            "model_numel": sum(p.numel() for p in model.parameters()), "state_bytes": coat.state_bytes(),
            "local_numel": sum(s["numel"] for s in shards)}


# ---- steps -------------------------------------------------------------------------------------------------------------
def train_and_compare(distributed, float16_module=True, **coat_options):
    """STEPS steps with COAT (checked against the lockstep reference) and with Megatron's stock torch AdamW from
    the same start: relative error of each parameter's total update."""
    model, optimizer = build(distributed, True, float16_module, **coat_options)
    lockstep = LockstepReference(wrapper_of(optimizer).optimizer)
    init = named_main_params(model, optimizer)
    losses = [train_step(model, optimizer, it) for it in range(STEPS)]
    result = {"wrapper": type(wrapper_of(optimizer)).__name__, "inner": type(wrapper_of(optimizer).optimizer).__name__,
              "losses": losses, **lockstep.result()}
    if distributed:
        result.update(shard_report(model, optimizer))
    ref_model, ref_opt = build(distributed, False, float16_module)
    result["torch_inner"] = type(wrapper_of(ref_opt).optimizer).__name__
    result["torch_losses"] = [train_step(ref_model, ref_opt, it) for it in range(STEPS)]
    coat_after, torch_after = named_main_params(model, optimizer), named_main_params(ref_model, ref_opt)
    result["update_rel_err"] = {n: rel_err(coat_after[n] - init[n], torch_after[n] - init[n]) for n in init}
    return model, optimizer, result


# ---- checkpoints -------------------------------------------------------------------------------------------------------
def sharding_metadata(sharding_type):
    # fully_reshardable: the gloo variant (the default one gathers through NCCL with .cuda() tensors).
    return {"distrib_optim_sharding_type": sharding_type, "chained_optim_avoid_prefix": True,
            "distrib_optim_fully_reshardable_mem_efficient": True}


def save(model, optimizer, ckpt, sharding_type):
    """dist_checkpointing (`--ckpt-format torch_dist`; megatron.training's sharding types), or sharding_type
    "torch": the distributed optimizer's own file (`--ckpt-format torch`: save_parameter_state, gathered on DP
    rank 0 through gloo; the rest of the state dict is kept in memory here)."""
    from megatron.core import dist_checkpointing

    if sharding_type == "torch":
        model.saved = {"model": model.gpt.state_dict(), "optimizer": optimizer.state_dict()}
        optimizer.save_parameter_state(ckpt + ".pt")
        dist.barrier()
        return
    model_sd = model.gpt.sharded_state_dict()
    sd = {"model": model_sd,
          "optimizer": optimizer.sharded_state_dict(model_sd, metadata=sharding_metadata(sharding_type))}
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sd, ckpt)
    dist.barrier()


def load(model, optimizer, ckpt, sharding_type, saved_by=None):
    from megatron.core import dist_checkpointing

    if sharding_type == "torch":
        model.gpt.load_state_dict(saved_by.saved["model"])
        optimizer.load_state_dict(saved_by.saved["optimizer"])
        optimizer.load_parameter_state(ckpt + ".pt")
        return
    model_sd = model.gpt.sharded_state_dict()
    sd = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True,
                                                                      metadata=sharding_metadata(sharding_type))}
    loaded = dist_checkpointing.load(sd, ckpt)
    model.gpt.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])


def fp32_state(optimizer):
    """[(main param, exp_avg, exp_avg_sq, step)] in the inner optimizer's order; COAT's dequantized."""
    inner = wrapper_of(optimizer).optimizer
    out = []
    for p in main_params(optimizer):
        s = inner.state[p]
        m = inner.fp32_moments(p) if "exp_avg_q" in s else {k: s[k].reshape(-1) for k in ("exp_avg", "exp_avg_sq")}
        out.append((p.detach().clone(), m["exp_avg"].clone(), m["exp_avg_sq"].clone(), float(s["step"])))
    return out


def compare_states(a, b):
    """Worst relative L2 differences of two fp32_state lists, whether they are equal, and their steps."""
    return {"param": max(rel_err(x[0], y[0]) for x, y in zip(a, b)),
            "exp_avg": max(rel_err(x[1], y[1]) for x, y in zip(a, b)),
            "exp_avg_sq": max(rel_err(x[2], y[2]) for x, y in zip(a, b)),
            "exact": all(all(torch.equal(u, v) for u, v in zip(x[:3], y[:3])) for x, y in zip(a, b)),
            "steps": sorted({x[3] for x in a}), "expected_steps": sorted({y[3] for y in b})}


def loaded_state_report(optimizer, saved):
    r = compare_states(fp32_state(optimizer), saved)
    inner = wrapper_of(optimizer).optimizer
    r["fp8"] = all("exp_avg_q" in s and "exp_avg" not in s for s in inner.state.values())
    return r


def checkpoints(model, optimizer, out_dir, float16_module=True):
    """COAT -> COAT in each format; Megatron's format both ways with a stock torch-AdamW run; TE FusedAdam's step
    convention; one step after the reload against one step of the uninterrupted run."""
    from megatron.core.optimizer import distrib_optimizer

    saved = fp32_state(optimizer)
    result, resumed = {}, None
    for sharding_type in ("dp_reshardable", "fully_reshardable", "torch"):
        ckpt = os.path.join(out_dir, f"ckpt_{sharding_type}")
        save(model, optimizer, ckpt, sharding_type)
        fresh = build(True, True, float16_module)
        load(*fresh, ckpt, sharding_type, saved_by=model)
        result[sharding_type] = loaded_state_report(fresh[1], saved)
        resumed = resumed or fresh

    # fp32 moments on disk, as a torch-AdamW run writes them. (Megatron's torch-AdamW path needs a state with a
    # `step` before it can load, and then restores its own step: compare tensors only.)
    torch_model, torch_opt = build(True, False, float16_module)
    train_step(torch_model, torch_opt, 0)
    load(torch_model, torch_opt, os.path.join(out_dir, "ckpt_dp_reshardable"), "dp_reshardable")
    result["coat_to_torch"] = compare_states(fp32_state(torch_opt), saved)
    torch_model, torch_opt = build(True, False, float16_module)
    for it in range(STEPS):
        train_step(torch_model, torch_opt, it)
    save(torch_model, torch_opt, os.path.join(out_dir, "ckpt_torch_adamw"), "dp_reshardable")
    coat_model, coat_opt = build(True, True, float16_module)
    load(coat_model, coat_opt, os.path.join(out_dir, "ckpt_torch_adamw"), "dp_reshardable")
    result["torch_to_coat"] = loaded_state_report(coat_opt, fp32_state(torch_opt))

    # With TE or apex installed Megatron keeps `step` in the param groups (TE FusedAdam's convention).
    flags = (distrib_optimizer.HAVE_APEX_OR_TE, distrib_optimizer.USING_TE_OPTIMIZER)
    distrib_optimizer.HAVE_APEX_OR_TE, distrib_optimizer.USING_TE_OPTIMIZER = True, True
    try:
        ckpt = os.path.join(out_dir, "ckpt_te_convention")
        save(model, optimizer, ckpt, "dp_reshardable")
        fresh = build(True, True, float16_module)
        load(*fresh, ckpt, "dp_reshardable")
        result["te_step_convention"] = loaded_state_report(fresh[1], saved)
    finally:
        distrib_optimizer.HAVE_APEX_OR_TE, distrib_optimizer.USING_TE_OPTIMIZER = flags

    losses = [[train_step(*resumed, it) for it in (STEPS, STEPS + 1)],
              [train_step(model, optimizer, it) for it in (STEPS, STEPS + 1)]]
    after_resume, uninterrupted = named_main_params(*resumed), named_main_params(model, optimizer)
    result["resumed_vs_uninterrupted"] = {
        "losses": losses, "param_rel_err": max(rel_err(after_resume[n], uninterrupted[n]) for n in uninterrupted),
        "exact": all(torch.equal(after_resume[n], uninterrupted[n]) for n in uninterrupted),
        "state": compare_states(fp32_state(resumed[1]), fp32_state(optimizer))}
    return result


def float16_optimizer(out_dir):
    """Float16OptimizerWithFloat16Params: steps, torch AdamW's checkpoint layout, round trips both ways."""
    model, optimizer, result = train_and_compare(distributed=False)
    saved = fp32_state(optimizer)
    ckpt = os.path.join(out_dir, "ckpt_float16")
    save(model, optimizer, ckpt, None)
    on_disk = wrapper_of(optimizer).state_dict()["optimizer"]["state"]
    result["checkpoint_torch_layout"] = all(e["exp_avg"].shape == p.shape and e["exp_avg"].dtype == torch.float32
                                            for e, p in zip(on_disk.values(), main_params(optimizer)))
    fresh = build(False, True)
    load(*fresh, ckpt, None)
    result["round_trip"] = loaded_state_report(fresh[1], saved)
    torch_model, torch_opt = build(False, False)
    load(torch_model, torch_opt, ckpt, None)
    result["coat_to_torch"] = compare_states(fp32_state(torch_opt), saved)
    return result


def worker(rank, world, out_dir, port):
    apply_cpu_shims()
    init_gloo_rank(rank, world, port)
    import megatron_job

    # 3 layers and 129 tokens: the two DP shards split linear_fc1 of layer 1 at 12352, inside a 128-group.
    megatron_job.LAYERS, megatron_job.VOCAB = 3, 129
    t0 = time.time()
    megatron_job.init_parallel(1)
    res = {"mixed": train_and_compare(distributed=True, float16_module=False)[2]}
    model, optimizer, res["bf16"] = train_and_compare(distributed=True)
    res["bf16_e5m2"] = train_and_compare(distributed=True, exp_avg_sq_format="e5m2")[2]
    res["checkpoints"] = checkpoints(model, optimizer, out_dir)
    res["float16"] = float16_optimizer(out_dir)
    res["seconds"] = time.time() - t0
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    from rank_helpers import spawn_ranks

    spawn_ranks(worker)
