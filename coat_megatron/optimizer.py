"""CoatFP8AdamW under Megatron-core's optimizers (`--coat-optimizer`), and Megatron's Muon with FP8 momentum.

Megatron builds its optimizer as a wrapper (DistributedOptimizer, Float16OptimizerWithFloat16Params or
FP32Optimizer, inside a ChainedOptimizer) around an inner torch-style Adam. `use_coat_optimizer` replaces that
inner optimizer, after Megatron has built the wrapper, with `MegatronCoatFP8AdamW` over the very same param-group
dicts (the fp32 main params; under the distributed optimizer, this rank's shard of each parameter). Nothing of
Megatron is copied: sharding, grad copies, clipping, the LR scheduler and zero_grad stay Megatron's.

- Under `--use-precision-aware-optimizer` (with `--main-grads-dtype bf16` for bf16 main gradients) Megatron keeps
  no fp32 main params: the inner optimizer steps the bf16 shards of the model parameters in place, reading
  gradients from `decoupled_grad` (the shard of Megatron's grad buffer, bf16 or fp32). MegatronCoatFP8AdamW then
  keeps each bf16 shard's fp32 master exactly as (the shard, a 16-bit remainder in its state: `master_remainders`,
  TransformerEngine FusedAdam's `store_param_remainders` split). Model state: 2 (bf16 params) + 2 (bf16 grads) +
  (2 remainders + ~2.19 FP8 moments) / DP bytes per parameter. TE FusedAdam's own state options are refused with
  it (`--exp-avg-dtype`, `--exp-avg-sq-dtype`, `--main-params-dtype` other than fp32).
- Quantization groups follow each parameter's own 128-grid: a shard main param that starts `param_range.start`
  elements into its parameter gets the segment (0, shard_numel, param_range.start).
- State is created eagerly (FP8 zeros) when the inner optimizer is swapped, so Megatron's checkpoint code, which
  reads `step` from every state entry before the first step, always finds it.
- Checkpoints stay in Megatron's formats with fp32 moments on disk (interchangeable with a torch-AdamW run):
  * distributed optimizer: its two state accessors (`_get/_set_main_param_and_optimizer_states`, through which
    every current sharding type reads and writes `param`/`exp_avg`/`exp_avg_sq`) are bound on the instance to
    dequantize on save and re-quantize on load; `param` is the fp32 master (joined from a bf16 shard and its
    remainder under the precision-aware optimizer), so checkpoints of both modes are interchangeable;
  * Float16/FP32 optimizers: the inner `state_dict()` returns torch AdamW's layout (fp32 moments shaped like the
    parameters), `load_state_dict` quantizes fp32 moments it is given.
  The fp32 moments are exported so that they quantize back to the saved codes and metadata (coat_kernels.optim.
  exact_export): a run resumed at the same DP size continues bit for bit.
- `--optimizer muon`: Megatron chains its TensorParallelMuon (2-D matrices, whole or tensor-parallel shards, in a
  Float16/FP32 optimizer wrapper; under LayerWiseDistributedOptimizer each DP rank steps whole matrices) with Adam for
  the rest. The Muon becomes CoatTensorParallelMuon (coat_megatron.muon: Megatron's own step, momentum in FP8), the
  Adam wrappers get MegatronCoatFP8AdamW as above.
"""
from __future__ import annotations

import torch

from coat_kernels.optim import CoatFP8AdamW, state_report
from coat_kernels.optim.config import GROUP_OPTION_NAMES
from coat_kernels.optim.validation import check_distinct_tensors


class MegatronCoatFP8AdamW(CoatFP8AdamW):
    """CoatFP8AdamW over the param groups of a Megatron optimizer wrapper.

    param_offsets: {main param: offset of its first element inside the model parameter} (shards of the
    distributed optimizer); absent params start at 0. torch_format_state_dict: `state_dict()` returns fp32
    moments shaped like the parameters (what Float16/FP32Optimizer checkpoints hold). decoupled_grads: gradients
    are read from `param.decoupled_grad` (Megatron's precision-aware optimizer) instead of `param.grad`.
    """

    def __init__(self, param_groups, *, param_offsets=None, torch_format_state_dict=False, decoupled_grads=False,
                 **coat_options):
        self._param_offsets = dict(param_offsets or {})
        self.saves_torch_format = torch_format_state_dict  # (the base class's torch_format_state_dict is a method)
        self.decoupled_grads = decoupled_grads
        first = param_groups[0]
        super().__init__(param_groups, lr=first["lr"], betas=first["betas"], eps=first["eps"],
                         weight_decay=first["weight_decay"], **coat_options)
        self._use_own_coat_options()
        self.initialize_state()

    def param_segments(self, param, group_index):
        """A shard main param of the distributed optimizer starts `param_offsets[param]` into its parameter."""
        return [(0, param.numel(), self._param_offsets.get(param, 0))] if param.numel() else []

    def param_gradient(self, param):
        return getattr(param, "decoupled_grad", None) if self.decoupled_grads else param.grad

    def add_param_group(self, param_group):
        # The distributed optimizer's shards of fp32 model params are views (non-leaf), which torch's leaf check
        # rejects; Megatron itself assigns them to the inner optimizer's param_groups directly.
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        check_distinct_tensors(params, self.param_groups)  # on the tensors themselves, not the detached views
        param_group["params"] = [p if p.is_leaf else p.detach() for p in params]
        super().add_param_group(param_group)
        self.param_groups[-1]["params"] = params

    def _use_own_coat_options(self):
        """This run's COAT options win over those of loaded param groups (the fp32 moments on disk have none)."""
        for group in self.param_groups:
            group.pop("step", None)  # TE FusedAdam keeps one; ours lives in the state
            group.update({k: self.defaults[k] for k in GROUP_OPTION_NAMES})

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def state_dict(self):
        sd = self.torch_format_state_dict() if self.saves_torch_format else super().state_dict()
        # One step per group, as TE FusedAdam has it: Megatron reads it there when TE or apex is installed.
        for saved, group in zip(sd["param_groups"], self.param_groups):
            steps = {float(self.state[p]["step"]) for p in group["params"] if "step" in self.state[p]}
            if len(steps) == 1:
                saved["step"] = int(steps.pop())
        return sd

    def load_state_dict(self, state_dict):
        group_steps = [g.get("step") for g in state_dict["param_groups"]]
        own = {k: self.defaults[k] for k in GROUP_OPTION_NAMES}
        # this run's options, also when the loaded entries are checked against their groups
        state_dict = {**state_dict, "param_groups": [{**g, **own} for g in state_dict["param_groups"]]}
        super().load_state_dict(state_dict)
        self._use_own_coat_options()
        for group, group_step in zip(self.param_groups, group_steps):
            for p in group["params"]:
                state = self.state[p]
                # Megatron hands every entry the same `step` tensor, which in-place increments would share.
                step = group_step if group_step is not None else state.get("step", 0.0)
                state["step"] = torch.tensor(float(step), dtype=torch.float32)
        self.initialize_state()  # quantizes the fp32 moments of torch-format entries


# ---- Megatron's optimizer wrappers ---------------------------------------------------------------------------------
def use_coat_optimizer(megatron_optimizer, **coat_options):
    """Replace the inner Adam of every (chained) Megatron optimizer by MegatronCoatFP8AdamW, and the inner Muon of
    Megatron's `--optimizer muon` by CoatTensorParallelMuon (coat_megatron.muon: FP8 momentum); returns the argument.

    coat_options: CoatFP8AdamW's COAT options (exp_avg_format, group_size, ...; Muon's momentum takes the exp_avg
    ones and group_size). Call right after `get_megatron_optimizer` (or megatron-core 0.16/0.17's
    `get_megatron_muon_optimizer`), before loading a checkpoint (a state already present is carried over).
    """
    for wrapper in megatron_wrappers(megatron_optimizer):
        _swap_inner_optimizer(wrapper, coat_options)
    return megatron_optimizer


def megatron_wrappers(megatron_optimizer) -> list:
    """The Megatron optimizer wrappers (each around one inner torch optimizer) of a Megatron optimizer: itself, or
    those of its chain, nested chains included (megatron-core 0.19 chains a LayerWiseDistributedOptimizer, itself a
    chain, with distributed optimizers)."""
    chained = getattr(megatron_optimizer, "chained_optimizers", None)
    if chained is None:
        return [megatron_optimizer]
    return [wrapper for optimizer in chained for wrapper in megatron_wrappers(optimizer)]


def _swap_inner_optimizer(wrapper, coat_options):
    from megatron.core.optimizer import Adam, DistributedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer

    inner = wrapper.optimizer
    if inner is None or getattr(wrapper, "is_stub_optimizer", False):
        return  # no trainable parameters on this rank
    if isinstance(inner, MegatronCoatFP8AdamW):
        return
    if _is_megatron_muon(inner):
        return _swap_inner_muon(wrapper, coat_options)
    _check_config(wrapper.config, inner, Adam)
    distributed = isinstance(wrapper, DistributedOptimizer)
    # Megatron hands the inner optimizer the bf16 shards and decoupled gradients (it keeps no fp32 main params)
    model_params_stepped = bool(getattr(wrapper.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))
    if distributed:
        if wrapper.ddp_config.use_megatron_fsdp:
            raise ValueError("--coat-optimizer does not support Megatron FSDP (--use-megatron-fsdp)")
        offsets = _shard_offsets(wrapper)
    elif isinstance(wrapper, (Float16OptimizerWithFloat16Params, FP32Optimizer)):
        offsets = {}
    else:
        raise TypeError(f"--coat-optimizer: unsupported Megatron optimizer {type(wrapper).__name__}")
    previous = {p: dict(s) for p, s in inner.state.items()}
    if model_params_stepped:
        coat_options = {**coat_options, "master_remainders": True}
    coat = MegatronCoatFP8AdamW(inner.param_groups, param_offsets=offsets, torch_format_state_dict=not distributed,
                                decoupled_grads=model_params_stepped, **coat_options)
    for p, state in previous.items():  # an optimizer swapped after a checkpoint load keeps its moments
        if "exp_avg" in state and p in coat.state:
            coat.set_fp32_moments(p, state["exp_avg"], state["exp_avg_sq"], step=float(state.get("step", 0.0)))
    wrapper.optimizer = coat
    wrapper.init_state_fn = lambda opt, config=None: opt.initialize_state()
    if distributed:
        _bind_fp32_state_accessors(wrapper)


def _is_megatron_muon(inner) -> bool:
    """Megatron's TensorParallelMuon or a subclass of it (which `_swap_inner_muon` checks)."""
    from .muon import TensorParallelMuon, have_megatron_muon

    return have_megatron_muon() and isinstance(inner, TensorParallelMuon)


def _swap_inner_muon(wrapper, coat_options):
    """Megatron's Muon (inside a Float16OptimizerWithFloat16Params or FP32Optimizer: whole matrices, or their
    tensor-parallel shards) -> CoatTensorParallelMuon, the same optimizer with its momentum in FP8."""
    from megatron.core.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    from coat_kernels.optim import OptimizerConfig

    from .muon import CoatTensorParallelMuon, TensorParallelMuon

    inner = wrapper.optimizer
    if isinstance(inner, CoatTensorParallelMuon):
        return
    problems = []
    if type(inner) is not TensorParallelMuon:
        problems.append(f"{type(inner).__name__} (COAT stores the momentum of Megatron's plain Muon, "
                        "TensorParallelMuon; this one keeps more state)")
    if not isinstance(wrapper, (Float16OptimizerWithFloat16Params, FP32Optimizer)):
        problems.append(f"Muon inside {type(wrapper).__name__}")
    if getattr(wrapper.config, "use_precision_aware_optimizer", False):
        problems.append("--use-precision-aware-optimizer with --optimizer muon")
    if problems:
        raise ValueError("--coat-optimizer cannot be used with: " + "; ".join(problems))
    options = {k: v for k, v in coat_options.items() if k != "master_remainders"}
    wrapper.optimizer = CoatTensorParallelMuon.adopt(inner, OptimizerConfig(**options))
    wrapper.init_state_fn = lambda opt, config=None: opt.initialize_state()


# --optimizer values whose Adam COAT replaces: Adam's, and Muon's (megatron-core builds Muon's Adam part with the
# Muon run's config; 0.16/0.17 rename it "adam" on the way, 0.18 on keep "muon", and "dist_muon" is the layer-wise
# distributed spelling).
ADAM_OPTIMIZER_NAMES = ("adam", "muon", "dist_muon")


def _check_config(config, inner, megatron_adam):
    problems = []
    if getattr(config, "optimizer", "adam") not in ADAM_OPTIMIZER_NAMES:
        problems.append(f"--optimizer {config.optimizer}: COAT replaces Adam and Megatron's Muon only")
    if not getattr(config, "decoupled_weight_decay", True):
        problems.append("Adam with L2 weight decay (decoupled_weight_decay=False): CoatFP8AdamW is AdamW")
    if getattr(config, "use_precision_aware_optimizer", False):
        for flag, name in (("--exp-avg-dtype", "exp_avg_dtype"), ("--exp-avg-sq-dtype", "exp_avg_sq_dtype"),
                           ("--main-params-dtype", "main_params_dtype")):
            value = getattr(config, name, torch.float32)
            if value != torch.float32:
                problems.append(f"{flag} {_dtype_name(value)} (TE FusedAdam's low-precision states; COAT keeps FP8 "
                                "moments (--coat-exp-avg-format, ...) and exact fp32 masters: leave it fp32)")
    if getattr(config, "optimizer_cpu_offload", False):
        problems.append("--optimizer-cpu-offload")
    if not problems and not isinstance(inner, (torch.optim.AdamW, megatron_adam)):
        problems.append(f"inner optimizer {type(inner).__name__} is not Megatron's Adam")
    if problems:
        raise ValueError("--coat-optimizer cannot be used with: " + "; ".join(problems))


def _dtype_name(dtype) -> str:
    """Megatron's name of a state dtype ('fp8' is torch.uint8 there)."""
    return {torch.uint8: "fp8", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def _shard_offsets(dist_opt) -> dict:
    """{shard main param: start of the shard inside its model parameter}."""
    offsets = {}
    for model_param, (group_index, group_order) in dist_opt.model_param_group_index_map.items():
        main_param = dist_opt.optimizer.param_groups[group_index]["params"][group_order]
        offsets[main_param] = dist_opt._get_model_param_range_map(model_param)["param"].start
    return offsets


def _bind_fp32_state_accessors(dist_opt):
    """Dequantize-on-save / quantize-on-load for every sharding type of the distributed optimizer."""

    def main_param(model_param):
        group_index, group_order = dist_opt.model_param_group_index_map[model_param]
        return dist_opt.optimizer.param_groups[group_index]["params"][group_order]

    def get_main_param_and_optimizer_states(model_param):
        param = main_param(model_param)
        return {"param": dist_opt.optimizer.fp32_master(param), **dist_opt.optimizer.fp32_moments(param)}

    def set_main_param_and_optimizer_states(model_param, tensors):
        param = main_param(model_param)
        dist_opt.optimizer.set_fp32_master(param, tensors["param"])
        dist_opt.optimizer.set_fp32_moments(param, tensors["exp_avg"], tensors["exp_avg_sq"])

    def load_parameter_state_from_dp_zero_legacy(state_dict):
        raise NotImplementedError("--coat-optimizer: converting a pre-2024 legacy distributed-optimizer "
                                  "checkpoint is not supported; convert it with a torch-AdamW run first")

    dist_opt._get_main_param_and_optimizer_states = get_main_param_and_optimizer_states
    dist_opt._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states
    dist_opt.load_parameter_state_from_dp_zero_legacy = load_parameter_state_from_dp_zero_legacy


def optimizer_state_report(megatron_optimizer) -> dict:
    """This rank's inner optimizer state: bytes of all state tensors, elements stepped, bytes per element."""
    wrappers = megatron_wrappers(megatron_optimizer)
    return state_report(w.optimizer for w in wrappers if getattr(w, "optimizer", None) is not None)
