"""Two gloo processes that check `--coat-optimizer` (coat_megatron.optimizer) under Megatron's real optimizers.

Run by tests/megatron/test_megatron_optimizer.py:  python tests/jobs/megatron_optimizer_job.py OUT_DIR PORT
Each rank writes OUT_DIR/rank{r}.json. A 2-layer GPT (local BF16 spec) is wrapped in Megatron's DDP, its
optimizer built by `get_megatron_optimizer` and its inner Adam swapped by `use_coat_optimizer`. Phases:
- distributed optimizer (DP=2): every inner step is replayed by a plain CoatFP8AdamW on copies of the same
  fp32 shards (segments on the parameter's grid), which must match bit for bit; the state is FP8 per shard;
  the run tracks the stock torch-AdamW run;
- checkpoints through dist_checkpointing in three sharding types (COAT -> COAT), and across optimizers
  (COAT -> torch AdamW, torch AdamW -> COAT); once more with TE FusedAdam's step convention;
- Float16OptimizerWithFloat16Params (no distributed optimizer): steps and a checkpoint round trip;
- the precision-aware optimizer (`--use-precision-aware-optimizer`, bf16 shards stepped with master remainders):
  with fp32 main grads it trains bit for bit like the fp32-master run whose bf16 copies round ties away from zero;
  with bf16 main grads every step equals a plain CoatFP8AdamW with master remainders on copies of the shards, and
  checkpoints round-trip exactly, resume bit for bit and interchange with fp32-master runs.

Test-only CPU shims (megatron-core's optimizers and buffers assume CUDA; applied in these worker processes only):
torch.cuda.current_device -> cpu, torch.cuda.synchronize -> no-op, torch.cuda.current_stream -> a stream whose
waits do nothing (megatron-core 0.19's grad sync), torch.tensor/zeros/empty/ones with
device="cuda" -> cpu, and Tensor.type() without arguments answers "torch.cuda.<T>" (Megatron checks the type
name of every parameter it wraps). For the precision-aware optimizer, which megatron-core builds from
TransformerEngine's FusedAdam (absent here), a stand-in module with FusedAdam's constructor signature while the
optimizer is built (`use_coat_optimizer` replaces the stand-in before any step).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import types

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


class StandInFusedAdam(torch.optim.AdamW):
    """TransformerEngine FusedAdam's constructor signature, as megatron-core checks and calls it; never stepped."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adam_w_mode=True,
                 master_weights=False, master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32,
                 exp_avg_sq_dtype=torch.float32, use_decoupled_grad=False, store_param_remainders=False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


@contextlib.contextmanager
def stand_in_transformer_engine():
    """megatron-core's precision-aware optimizer without TransformerEngine: a `transformer_engine` module of version
    2.9 whose FusedAdam is StandInFusedAdam, while the optimizer is built; everything restored afterwards."""
    import megatron.core.optimizer as megatron_optimizer
    import megatron.core.utils as megatron_utils

    te = types.ModuleType("transformer_engine")
    te.__version__ = "2.9.0"
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.optimizers = types.ModuleType("transformer_engine.pytorch.optimizers")
    te.pytorch.optimizers.FusedAdam = StandInFusedAdam
    modules = {"transformer_engine": te, "transformer_engine.pytorch": te.pytorch,
               "transformer_engine.pytorch.optimizers": te.pytorch.optimizers}
    saved = (megatron_optimizer.Adam, megatron_optimizer.USING_PYTORCH_OPTIMIZER, megatron_utils._te_version)
    sys.modules.update(modules)
    megatron_optimizer.Adam, megatron_optimizer.USING_PYTORCH_OPTIMIZER = StandInFusedAdam, False
    try:
        yield
    finally:
        for name in modules:
            sys.modules.pop(name, None)
        megatron_optimizer.Adam, megatron_optimizer.USING_PYTORCH_OPTIMIZER, megatron_utils._te_version = saved


def build(distributed, coat, float16_module=True, precision_aware=False, main_grads_dtype=torch.float32,
          **coat_options):
    """(DDP-wrapped tiny GPT, Megatron optimizer); same initial weights every time.

    float16_module: all parameters BF16, as megatron.training wraps them; else the norms stay fp32, whose
    distributed-optimizer shards are views of the model parameters. precision_aware: `--use-precision-aware-optimizer
    --main-grads-dtype <main_grads_dtype>` (the grad buffer in that dtype, as megatron.training sets it)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron_job import build as build_gpt
    from megatron_job import make_config

    from coat_megatron.optimizer import use_coat_optimizer

    config = make_config(1)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed,
                                               grad_reduce_in_fp32=main_grads_dtype == torch.float32)
    gpt = build_gpt("local", config)
    model = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt) if float16_module else gpt)
    model.gpt = gpt
    with stand_in_transformer_engine() if precision_aware else contextlib.nullcontext():
        opt_config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WEIGHT_DECAY, bf16=True,
                                     params_dtype=torch.bfloat16, use_distributed_optimizer=distributed,
                                     clip_grad=CLIP_GRAD, use_precision_aware_optimizer=precision_aware,
                                     main_grads_dtype=main_grads_dtype)
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
        self.reference = CoatFP8AdamW(groups, lr=LR, master_remainders=coat.config.master_remainders,
                                      **{k: coat.defaults[k] for k in GROUP_OPTION_NAMES})
        for copy, p in zip(self.copies, self._params()):
            self.reference.state[copy]["segments"] = coat.state[p]["segments"].clone()
        real_step = coat.step

        def step(closure=None):
            grads = [coat.param_gradient(p).clone() for p in self._params()]
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
            keys = ("exp_avg_meta", "exp_avg_sq_meta", "step") + (("master_remainder",) if "master_remainder" in ref
                                                                  else ())
            if not (same and set(mine) == set(ref) and all(torch.equal(mine[k], ref[k]) for k in keys)):
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


# ---- steps -----------------------------------------------------------------------------------------------------------
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


# ---- checkpoints -----------------------------------------------------------------------------------------------------
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
    """[(fp32 master, exp_avg, exp_avg_sq, step)] in the inner optimizer's order; COAT's dequantized (its masters
    joined from bf16 shards and remainders under the precision-aware optimizer)."""
    inner = wrapper_of(optimizer).optimizer
    out = []
    for p in main_params(optimizer):
        s = inner.state[p]
        m = inner.fp32_moments(p) if "exp_avg_q" in s else {k: s[k].reshape(-1) for k in ("exp_avg", "exp_avg_sq")}
        master = inner.fp32_master(p) if hasattr(inner, "fp32_master") else p.detach()
        out.append((master.clone(), m["exp_avg"].clone(), m["exp_avg_sq"].clone(), float(s["step"])))
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


# ---- the precision-aware optimizer: bf16 shards with master remainders --------------------------------------------
def copy_masters_ties_away(optimizer):
    """Make a default (fp32 main params) distributed optimizer copy its masters into the bf16 model params the way
    master remainders round (nearest, ties away from zero) instead of torch's ties-to-even `copy_`."""
    from coat_kernels.optim.master_remainders import round_to_bf16

    dist_opt = wrapper_of(optimizer)
    original = dist_opt._copy_main_params_to_model_params

    def copy_main_params_to_model_params():
        original()
        for main_group, model_group in zip(dist_opt.shard_fp32_from_float16_groups, dist_opt.model_float16_groups):
            for main, model_param in zip(main_group, model_group):
                world_range = dist_opt._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
                gbuf_index, _, bucket_id = dist_opt.model_param_gbuf_map[model_param]
                buffer = dist_opt.buffers[gbuf_index].buckets[bucket_id].param_data
                buffer.view(-1)[world_range.start:world_range.end].copy_(round_to_bf16(main))

    dist_opt._copy_main_params_to_model_params = copy_main_params_to_model_params


def model_params(model):
    return {n: p.detach().clone() for n, p in model.gpt.named_parameters()}


def masters(model, optimizer):
    """{model parameter name: fp32 master of this rank's shard}."""
    dist_opt = wrapper_of(optimizer)
    names = {p: n.replace("module.", "") for n, p in model.named_parameters()}
    out = {}
    for model_param, (gi, go) in dist_opt.model_param_group_index_map.items():
        out[names[model_param]] = dist_opt.optimizer.fp32_master(
            dist_opt.optimizer.param_groups[gi]["params"][go]).clone()
    return out


def bitwise_equal(a, b):
    return all(torch.equal(a[n].view(torch.int16 if a[n].element_size() == 2 else torch.int32),
                           b[n].view(torch.int16 if b[n].element_size() == 2 else torch.int32)) for n in a)


def precision_aware_vs_fp32_masters():
    """fp32 main grads both ways: the precision-aware run (bf16 shards + remainders, decoupled grads) against the
    default run (fp32 main params) whose bf16 copies round ties away: losses, masters, bf16 params, FP8 states."""
    ref_model, ref_opt = build(True, True)
    copy_masters_ties_away(ref_opt)
    model, optimizer = build(True, True, precision_aware=True)
    coat = wrapper_of(optimizer).optimizer
    result = {"losses": [[train_step(ref_model, ref_opt, it) for it in range(STEPS)],
                         [train_step(model, optimizer, it) for it in range(STEPS)]],
              "masters_equal": bitwise_equal(masters(model, optimizer), masters(ref_model, ref_opt)),
              "params_equal": bitwise_equal(model_params(model), model_params(ref_model)),
              "remainders": all("master_remainder" in coat.state[p] for p in main_params(optimizer)),
              "decoupled": coat.decoupled_grads and coat.config.master_remainders}
    ref_state, state = fp32_state(ref_opt), fp32_state(optimizer)
    result["moments_equal"] = all(torch.equal(x[i], y[i]) for x, y in zip(ref_state, state) for i in (1, 2))
    return result


def precision_aware_bf16_grads(out_dir):
    """--main-grads-dtype bf16: lockstep against a plain CoatFP8AdamW, memory, checkpoints."""
    model, optimizer = build(True, True, precision_aware=True, main_grads_dtype=torch.bfloat16)
    coat = wrapper_of(optimizer).optimizer
    lockstep = LockstepReference(coat)
    losses = [train_step(model, optimizer, it) for it in range(STEPS)]
    shards = main_params(optimizer)
    result = {"losses": losses, **lockstep.result(),
              "grad_dtypes": sorted({str(p.decoupled_grad.dtype) for p in shards if p.decoupled_grad is not None}),
              "param_dtypes": sorted({str(p.dtype) for p in shards}),
              "state_bytes_per_element": coat.state_bytes() / sum(p.numel() for p in shards),
              "remainder_bytes": sum(coat.state[p]["master_remainder"].numel() * 2 for p in shards),
              "local_numel": sum(p.numel() for p in shards)}
    saved = fp32_state(optimizer)
    saved_masters = masters(model, optimizer)
    checkpoints, resumed = {}, None
    for sharding_type in ("dp_reshardable", "fully_reshardable", "torch"):
        ckpt = os.path.join(out_dir, f"ckpt_pa_{sharding_type}")
        save(model, optimizer, ckpt, sharding_type)
        fresh = build(True, True, precision_aware=True, main_grads_dtype=torch.bfloat16)
        load(*fresh, ckpt, sharding_type, saved_by=model)
        report = loaded_state_report(fresh[1], saved)
        report["masters_exact"] = bitwise_equal(masters(*fresh), saved_masters)
        checkpoints[sharding_type] = report
        resumed = resumed or fresh
    # interchangeable with fp32-master runs: the fp32 "param" on disk is the master either way (in the model-space
    # format: the others name tensors by the grad buffer's dtype, bf16 here and fp32 there)
    fp32_model, fp32_opt = build(True, True)
    load(fp32_model, fp32_opt, os.path.join(out_dir, "ckpt_pa_fully_reshardable"), "fully_reshardable")
    checkpoints["to_fp32_masters"] = {"masters_exact": bitwise_equal(masters(fp32_model, fp32_opt), saved_masters),
                                      **compare_states(fp32_state(fp32_opt), saved)}
    save(fp32_model, fp32_opt, os.path.join(out_dir, "ckpt_fp32_masters"), "fully_reshardable")
    back = build(True, True, precision_aware=True, main_grads_dtype=torch.bfloat16)
    load(*back, os.path.join(out_dir, "ckpt_fp32_masters"), "fully_reshardable")
    checkpoints["from_fp32_masters"] = {"masters_exact": bitwise_equal(masters(*back), saved_masters),
                                        **compare_states(fp32_state(back[1]), saved)}
    losses = [[train_step(*resumed, it) for it in (STEPS, STEPS + 1)],
              [train_step(model, optimizer, it) for it in (STEPS, STEPS + 1)]]
    checkpoints["resumed_vs_uninterrupted"] = {
        "losses": losses, "params_exact": bitwise_equal(model_params(resumed[0]), model_params(model)),
        "masters_exact": bitwise_equal(masters(*resumed), masters(model, optimizer)),
        "state": compare_states(fp32_state(resumed[1]), fp32_state(optimizer))}
    result["checkpoints"] = checkpoints
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
    res["precision_aware_fp32_grads"] = precision_aware_vs_fp32_masters()
    res["precision_aware_bf16_grads"] = precision_aware_bf16_grads(out_dir)
    res["seconds"] = time.time() - t0
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    from rank_helpers import spawn_ranks

    spawn_ranks(worker)
