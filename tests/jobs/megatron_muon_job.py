"""Two gloo processes that check `--optimizer muon --coat-optimizer` (coat_megatron.muon) under Megatron's own Muon.

Run by tests/megatron/test_megatron_muon.py:  python tests/jobs/megatron_muon_job.py OUT_DIR PORT
Each rank writes OUT_DIR/rank{r}.json. A 3-layer GPT (local BF16 spec) is wrapped in Megatron's DDP and its optimizer
built by megatron-core's `get_megatron_muon_optimizer` (TensorParallelMuon for the 2-D matrices, Adam for the rest,
in Float16OptimizerWithFloat16Params wrappers). Needs NVIDIA's emerging_optimizers package. Phases:
- layer-wise (`dist_muon`: LayerWiseDistributedOptimizer, DP=2, each rank steps whole matrices):
  * the fp32-state arm (Megatron's Muon adopted as CoatTensorParallelMuon(state_dtype="fp32"), Adam untouched)
    against Megatron's own run: every parameter bit for bit after STEPS steps;
  * `use_coat_optimizer` (FP8 momentum, CoatFP8AdamW for the rest): every Muon step replayed by Megatron's own
    TensorParallelMuon object on copies of the matrices, with the dequantized momentum and the same gradients:
    parameters bit for bit, the new momentum quantizes to the stored codes and metadata; the run against Megatron's
    own (update of every parameter); state bytes;
  * checkpoints through dist_checkpointing (the layer-wise optimizer's sharded state dict) and torch's state dict:
    COAT -> COAT (FP8 state and parameters bit for bit, then two more steps bit for bit like the uninterrupted run),
    COAT -> Megatron's own Muon and back;
- TP=2 (`--muon-tp-mode duplicated`: Newton-Schulz on the matrix all-gathered over the tensor-parallel ranks, which
  must meet in the same collectives): the fp32-state arm against Megatron's run, and the FP8 lockstep replay.

Test-only CPU shims: those of megatron_optimizer_job (megatron-core's optimizers and buffers assume CUDA), and
`torch.distributed.all_gather` into tensors of different sizes (the layer-wise optimizer gathers every rank's updated
matrices so; NCCL takes that, gloo does not): padded to the largest, gathered, the slices copied out.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_optimizer_job import train_step  # noqa: E402 - the same training step as the Adam job's
from rank_helpers import init_gloo_rank  # noqa: E402

STEPS = 3
LR, WEIGHT_DECAY, CLIP_GRAD = 1e-2, 0.1, 1.0


def gather_uneven_sizes_on_gloo():
    all_gather = dist.all_gather

    def padded(tensor_list, tensor, group=None, async_op=False):
        sizes = [t.numel() for t in tensor_list]
        if len(set(sizes)) == 1 or async_op:
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(sizes)
        parts = [torch.zeros(longest, dtype=tensor.dtype) for _ in sizes]
        all_gather(parts, torch.cat([tensor.reshape(-1), tensor.new_zeros(longest - tensor.numel())]), group=group)
        for out, part, n in zip(tensor_list, parts, sizes):
            out.view(-1).copy_(part[:n])

    dist.all_gather = padded


# ---- building ------------------------------------------------------------------------------------------------------
def build(layer_wise, tp_mode="blockwise"):
    """(DDP-wrapped tiny GPT, Megatron's Muon optimizer, the Megatron TensorParallelMuon objects it holds); the same
    initial weights every time."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.muon import get_megatron_muon_optimizer
    from megatron.core.parallel_state import get_tensor_model_parallel_world_size
    from megatron.core.transformer.module import Float16Module
    from megatron_job import build as build_gpt
    from megatron_job import make_config

    from coat_megatron.optimizer import megatron_wrappers
    from coat_megatron.muon import TensorParallelMuon

    config = make_config(get_tensor_model_parallel_world_size())
    gpt = build_gpt("local", config)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                    Float16Module(config, gpt))
    model.gpt = gpt
    # "dist_muon" selects the layer-wise optimizer in megatron.training (0.16/0.17) and in 0.19's shim
    opt_config = OptimizerConfig(optimizer="dist_muon" if layer_wise else "muon", lr=LR, weight_decay=WEIGHT_DECAY,
                                 bf16=True, params_dtype=torch.bfloat16, clip_grad=CLIP_GRAD, muon_tp_mode=tp_mode)
    optimizer = get_megatron_muon_optimizer(opt_config, [model], layer_wise_distributed_optimizer=layer_wise)
    muons = [w.optimizer for w in megatron_wrappers(optimizer) if type(w.optimizer) is TensorParallelMuon]
    assert len(muons) == 1, [type(w.optimizer).__name__ for w in megatron_wrappers(optimizer)]
    return model, optimizer, muons[0]


def muon_wrapper(optimizer):
    from coat_megatron.optimizer import megatron_wrappers

    (wrapper,) = [w for w in megatron_wrappers(optimizer) if "Muon" in type(w.optimizer).__name__]
    return wrapper


def adopt_muon_only(optimizer, state_dtype):
    """Megatron's Muon as CoatTensorParallelMuon with this state dtype; Megatron's Adam left as it is."""
    from coat_megatron.muon import CoatTensorParallelMuon

    wrapper = muon_wrapper(optimizer)
    wrapper.optimizer = CoatTensorParallelMuon.adopt(wrapper.optimizer, state_dtype=state_dtype)


def use_coat(optimizer):
    from coat_megatron.optimizer import use_coat_optimizer

    return use_coat_optimizer(optimizer, group_size=128)


def model_params(model):
    return {n.replace("module.", ""): p.detach().float().clone() for n, p in model.named_parameters()}


def main_params(model, optimizer):
    """{model parameter name: copy of its fp32 main param} for the parameters this rank steps."""
    from coat_megatron.optimizer import megatron_wrappers

    names = {p: n.replace("module.", "") for n, p in model.named_parameters()}
    out = {}
    for w in megatron_wrappers(optimizer):
        for model_group, main_group in zip(w.float16_groups, w.fp32_from_float16_groups):
            out.update({names[mp]: main.detach().clone() for mp, main in zip(model_group, main_group)})
    return out


def rel_err(x, y):
    return ((x - y).norm() / y.norm().clamp(min=1e-30)).item()


def bitwise_equal(a, b):
    return sorted(n for n in b if not torch.equal(a[n], b[n]))


# ---- the lockstep replay of the FP8 Muon by Megatron's own Muon ------------------------------------------------------
class MuonLockstep:
    """Replays every step of a CoatTensorParallelMuon with the TensorParallelMuon object Megatron built (same
    Newton-Schulz function, tensor-parallel and QKV settings) on copies of its matrices, starting from the dequantized
    FP8 momentum, with the same gradients and hyper-parameters: the parameters must match bit for bit, and the
    momentum Megatron computes must quantize to the codes and metadata stored."""

    def __init__(self, coat, megatron_muon):
        self.coat, self.oracle = coat, megatron_muon
        self.mismatches, self.momentum_rel_err, self.steps, self.stepped = [], 0.0, 0, 0
        real_step = coat.step

        def step(closure=None):
            self._replay(real_step)

        coat.step = step

    def _replay(self, real_step):
        from megatron.core import tensor_parallel

        from coat_kernels.optim import dre_reference, state as coat_state

        coat = self.coat
        params = [p for g in coat.param_groups for p in g["params"]]
        copies = {}
        for p in params:
            copies[p] = p.detach().clone()
            tensor_parallel.copy_tensor_model_parallel_attributes(copies[p], p)
            copies[p].grad = None if p.grad is None else p.grad.clone()
        # the momentum a step starts from: the FP8 codes decoded (fp32_momentum, made for checkpoints, gives values
        # that quantize back to the same codes, not the decoded ones)
        momenta = {p: dre_reference.dequantize(coat.state[p]["exp_avg_q"], coat.state[p]["exp_avg_meta"],
                                               coat._layout(p)).view(p.shape) for p in params}
        real_step()
        self.oracle.param_groups = [{**g, "params": [copies[p] for p in g["params"]]} for g in coat.param_groups]
        self.oracle.state = defaultdict(dict, {copies[p]: {"momentum_buffer": momenta[p].clone()} for p in params})
        self.oracle.step()
        for p in params:
            if p.grad is None:
                continue
            self.stepped += 1
            reference = self.oracle.state[copies[p]]["momentum_buffer"]
            entry = coat.state[p]
            codes, meta = coat_state.quantize_moment(reference, coat._layout(p), coat._momentum_config, False)
            same = (torch.equal(copies[p], p) and torch.equal(codes.view(torch.uint8), entry["exp_avg_q"].view(
                torch.uint8)) and torch.equal(meta, entry["exp_avg_meta"]))
            if not same:
                self.mismatches.append(tuple(p.shape))
            self.momentum_rel_err = max(self.momentum_rel_err, rel_err(coat.fp32_momentum(p), reference))
        self.steps += 1

    def result(self):
        return {"lockstep_steps": self.steps, "lockstep_mismatches": self.mismatches,
                "lockstep_matrices_stepped": self.stepped, "momentum_rel_err": self.momentum_rel_err}


# ---- phases -------------------------------------------------------------------------------------------------------
def arms_against_megatron(layer_wise, tp_mode="blockwise"):
    """Megatron's own run, the fp32-state arm (must equal it bit for bit) and the FP8-momentum arm with Megatron's
    Adam (the update of every parameter against Megatron's: what FP8 momentum alone changes)."""
    model, optimizer, _ = build(layer_wise, tp_mode)
    init = main_params(model, optimizer)
    losses = [train_step(model, optimizer, it) for it in range(STEPS)]
    result = {"losses": losses}
    for state_dtype in ("fp32", "fp8"):
        arm_model, arm_opt, _ = build(layer_wise, tp_mode)
        adopt_muon_only(arm_opt, state_dtype)
        arm = {"inner": type(muon_wrapper(arm_opt).optimizer).__name__,
               "losses": [train_step(arm_model, arm_opt, it) for it in range(STEPS)]}
        after, ref_after = main_params(arm_model, arm_opt), main_params(model, optimizer)
        if state_dtype == "fp32":
            arm["model_params_differing"] = bitwise_equal(model_params(arm_model), model_params(model))
            arm["main_params_differing"] = bitwise_equal(after, ref_after)
        else:
            arm.update(update_errors(init, after, ref_after))
        result[state_dtype] = arm
    return result


def update_errors(init, after, ref_after):
    """Relative L2 error of each parameter's update against the reference run's, and of all updates together."""
    delta = {n: after[n] - init[n] for n in init}
    ref_delta = {n: ref_after[n] - init[n] for n in init}
    joined = rel_err(torch.cat([delta[n].reshape(-1) for n in init]), torch.cat([ref_delta[n].reshape(-1)
                                                                                   for n in init]))
    return {"update_rel_err": {n: rel_err(delta[n], ref_delta[n]) for n in init}, "update_rel_err_all": joined}


def fp8_run(layer_wise, tp_mode="blockwise"):
    """The COAT run with its lockstep replay, against Megatron's own run from the same start."""
    from coat_megatron.optimizer import megatron_wrappers, optimizer_state_report

    model, optimizer, megatron_muon = build(layer_wise, tp_mode)
    use_coat(optimizer)
    coat = muon_wrapper(optimizer).optimizer
    lockstep = MuonLockstep(coat, megatron_muon)
    init = main_params(model, optimizer)
    losses = [train_step(model, optimizer, it) for it in range(STEPS)]
    ref_model, ref_opt, _ = build(layer_wise, tp_mode)
    ref_losses = [train_step(ref_model, ref_opt, it) for it in range(STEPS)]
    muon_params = [p for g in coat.param_groups for p in g["params"]]
    numel = torch.tensor([sum(p.numel() for p in muon_params)])
    dist.all_reduce(numel)
    result = {"inners": sorted({type(w.optimizer).__name__ for w in megatron_wrappers(optimizer)}),
              "losses": losses, "ref_losses": ref_losses, **lockstep.result(),
              **update_errors(init, main_params(model, optimizer), main_params(ref_model, ref_opt)),
              "muon_state_bytes": coat.state_bytes(), "muon_numel": sum(p.numel() for p in muon_params),
              "muon_matrices": len(muon_params), "muon_matrix_numels": [p.numel() for p in muon_params],
              "muon_numel_all_ranks": int(numel), "model_matrix_numel": sum(
                  p.numel() for p in model.parameters() if p.dim() == 2
                  and not getattr(p, "is_embedding_or_output_parameter", False)),
              "state_report": optimizer_state_report(optimizer), "skipped_matrices": coat.skipped_matrices,
              "codes": sorted({str(coat.state[p]["exp_avg_q"].dtype) for p in muon_params}),
              "entry_keys": sorted({k for p in muon_params for k in coat.state[p]})}
    return model, optimizer, result


# ---- checkpoints -----------------------------------------------------------------------------------------------------
def save(model, optimizer, ckpt):
    from megatron.core import dist_checkpointing

    model_sd = model.gpt.sharded_state_dict()
    sd = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd)}
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sd, ckpt)
    dist.barrier()


def load(model, optimizer, ckpt):
    from megatron.core import dist_checkpointing

    model_sd = model.gpt.sharded_state_dict()
    sd = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True)}
    loaded = dist_checkpointing.load(sd, ckpt)
    model.gpt.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])


def muon_state(optimizer):
    """{shape and position: (fp32 main param, fp32 momentum)} of the Muon matrices this rank steps."""
    inner = muon_wrapper(optimizer).optimizer
    out = {}
    for i, p in enumerate(p for g in inner.param_groups for p in g["params"]):
        momentum = inner.fp32_momentum(p) if hasattr(inner, "fp32_momentum") else inner.state[p]["momentum_buffer"]
        out[i] = (p.detach().clone(), momentum.detach().float().clone())
    return out


def fp8_entries(optimizer):
    inner = muon_wrapper(optimizer).optimizer
    return [(inner.state[p]["exp_avg_q"].view(torch.uint8).clone(), inner.state[p]["exp_avg_meta"].clone())
            for g in inner.param_groups for p in g["params"]]


def same_entries(a, b):
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def compare_muon_states(a, b):
    return {"params_exact": all(torch.equal(a[k][0], b[k][0]) for k in b),
            "momentum_exact": all(torch.equal(a[k][1], b[k][1]) for k in b),
            "momentum_rel_err": max((rel_err(a[k][1], b[k][1]) for k in b), default=0.0)}


def adam_state(optimizer):
    from coat_megatron.optimizer import megatron_wrappers

    out = []
    for w in megatron_wrappers(optimizer):
        inner = w.optimizer
        if "Muon" in type(inner).__name__:
            continue
        for p in (p for g in inner.param_groups for p in g["params"]):
            m = inner.fp32_moments(p) if hasattr(inner, "fp32_moments") else inner.state[p]
            out.append((p.detach().clone(), m["exp_avg"].reshape(-1).clone(), m["exp_avg_sq"].reshape(-1).clone()))
    return out


def checkpoints(model, optimizer, out_dir):
    result = {}
    saved_muon, saved_fp8, saved_adam = muon_state(optimizer), fp8_entries(optimizer), adam_state(optimizer)

    ckpt = os.path.join(out_dir, "ckpt_coat")
    save(model, optimizer, ckpt)
    resumed_model, resumed_opt, _ = build(True)
    use_coat(resumed_opt)
    load(resumed_model, resumed_opt, ckpt)
    result["coat_to_coat"] = {**compare_muon_states(muon_state(resumed_opt), saved_muon),
                              "fp8_exact": same_entries(fp8_entries(resumed_opt), saved_fp8),
                              "adam_exact": all(all(torch.equal(u, v) for u, v in zip(x, y))
                                                for x, y in zip(adam_state(resumed_opt), saved_adam))}

    # the torch-format state dict (`--ckpt-format torch`): Megatron's Muon layout, fp32 momentum_buffer per matrix
    state_dict = muon_wrapper(optimizer).state_dict()
    on_disk = state_dict["optimizer"]["state"]
    coat = muon_wrapper(optimizer).optimizer
    result["torch_format"] = {"keys": sorted({k for e in on_disk.values() for k in e}), "layout_matches": all(
        e["momentum_buffer"].dtype == torch.float32 and e["momentum_buffer"].shape == p.shape
        for e, p in zip(on_disk.values(), (p for g in coat.param_groups for p in g["params"])))}
    fresh_model, fresh_opt, _ = build(True)
    use_coat(fresh_opt)
    muon_wrapper(fresh_opt).load_state_dict(state_dict)
    result["torch_format"]["fp8_exact"] = same_entries(fp8_entries(fresh_opt), saved_fp8)

    # COAT -> Megatron's own Muon: the fp32 momentum it reads is the one COAT exports
    megatron_model, megatron_opt, _ = build(True)
    load(megatron_model, megatron_opt, ckpt)
    result["coat_to_megatron"] = compare_muon_states(muon_state(megatron_opt), saved_muon)
    # Megatron's own Muon -> COAT: quantized on load
    for it in range(STEPS):
        train_step(megatron_model, megatron_opt, it)
    save(megatron_model, megatron_opt, os.path.join(out_dir, "ckpt_megatron"))
    coat_model, coat_opt, _ = build(True)
    use_coat(coat_opt)
    load(coat_model, coat_opt, os.path.join(out_dir, "ckpt_megatron"))
    result["megatron_to_coat"] = {**compare_muon_states(muon_state(coat_opt), muon_state(megatron_opt)),
                                  "fp8": all(len(e[0]) for e in fp8_entries(coat_opt))}

    losses = [[train_step(resumed_model, resumed_opt, it) for it in (STEPS, STEPS + 1)],
              [train_step(model, optimizer, it) for it in (STEPS, STEPS + 1)]]
    result["resumed_vs_uninterrupted"] = {
        "losses": losses, "params_differing": bitwise_equal(model_params(resumed_model), model_params(model)),
        "fp8_exact": same_entries(fp8_entries(resumed_opt), fp8_entries(optimizer))}
    return result


def worker(rank, world, out_dir, port):
    from megatron_optimizer_job import apply_cpu_shims

    apply_cpu_shims()
    gather_uneven_sizes_on_gloo()
    init_gloo_rank(rank, world, port)
    import megatron_job

    megatron_job.LAYERS = 3
    t0 = time.time()
    res = {}
    megatron_job.init_parallel(1)
    res["layer_wise_arms"] = arms_against_megatron(layer_wise=True)
    model, optimizer, res["layer_wise_fp8"] = fp8_run(layer_wise=True)
    res["checkpoints"] = checkpoints(model, optimizer, out_dir)
    megatron_job.init_parallel(2)
    res["tp2_arms"] = arms_against_megatron(layer_wise=False, tp_mode="duplicated")
    res["tp2_fp8"] = fp8_run(layer_wise=False, tp_mode="duplicated")[2]
    res["seconds"] = time.time() - t0
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    from rank_helpers import spawn_ranks

    spawn_ranks(worker)
