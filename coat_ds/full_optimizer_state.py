"""DeepSpeed's per-parameter optimizer-state API for the COAT optimizers (CoatFP8AdamW, CoatFP8Lion, and CoatFP8Muon's
AdamW groups; on ZeRO-0 DeepSpeed links no parameter to a partition: use `optimizer.fp32_moments(p)` there; under
ZeRO-1/2 a Muon group's state is the momentum of whole matrices (coat_ds.muon_zero), which these functions refuse
with ValueError on every rank): fp32 moments out, fp32 moments in.

`deepspeed.utils.safe_get_full_optimizer_state(param, key)` and its siblings look for fp32 state tensors shaped like
the flat partition; the COAT optimizers keep FP8 codes and per-group metadata instead. The keys are the optimizer's
moments: "exp_avg" and "exp_avg_sq" for CoatFP8AdamW, "exp_avg" (the momentum) for CoatFP8Lion. `install()` (run by
`register_with_deepspeed`) wraps the four functions in `deepspeed.utils` and `deepspeed.utils.tensor_fragment`
(coat_ds.patch_sites.GET_FULL_STATE, ...):

- `safe_get_full_optimizer_state(param, key)`: the parameter's fp32 moment, assembled from the
  ranks' partitions (a collective, as in DeepSpeed). The values quantize back to the codes they came from, so
  `safe_set_full_optimizer_state(param, safe_get_full_optimizer_state(param, key), key)` changes nothing.
- `safe_set_full_optimizer_state(param, value, key)`: each rank writes its fragment of `value` (fp32, finite, the
  parameter's numel) into its partition's fp32 moments and quantizes that partition again on its groups; groups the
  write does not touch keep their codes and metadata bit for bit.
- `safe_get_local_optimizer_state` / `safe_set_local_optimizer_state` (ZeRO-3): this rank's partition only.

ZeRO-1/2 (DeepSpeedZeroOptimizer; coat_ds.engine_hooks links each parameter to it) and ZeRO-3 are covered, with
and without CPU offload. Under ZeRO-1/2 a rank that
holds no fragment of a parameter cannot see which optimizer owns it, so the wrapped get runs one collective on every
rank for every optimizer: the flat fp32 parameter-sized buffer plus one error flag, summed over the data-parallel
group. A key the owning optimizer does not have then raises ValueError on every rank (DeepSpeed's own version raises
on the owning ranks only and leaves the others waiting). Other optimizers' values are DeepSpeed's, unchanged.
Not covered: BF16_Optimizer (ZeRO-1 with `grad_accum_dtype: fp32`), whose parameters carry no link to their optimizer:
its ranks raise DeepSpeed's "not found in optimizer state fragment" error; use `optimizer.fp32_moments(flat)` there.
"""
from __future__ import annotations

import functools

import torch

from coat_kernels.optim.base import CoatFP8Optimizer

from . import patch_sites

KEYS_HELP = "'exp_avg' and 'exp_avg_sq' (CoatFP8AdamW) or 'exp_avg' (CoatFP8Lion, CoatFP8Muon)"


def install() -> None:
    """Idempotent: wrap DeepSpeed's four per-parameter optimizer-state functions where DeepSpeed exports them."""
    for site, ours in ((patch_sites.GET_FULL_STATE, get_full), (patch_sites.SET_FULL_STATE, set_full),
                       (patch_sites.GET_LOCAL_STATE, get_local), (patch_sites.SET_LOCAL_STATE, set_local)):
        patch_sites.wrap(site, functools.partial(functools.partial, ours))


# ---- ZeRO-1/2: parameters with a fragment table (`_hp_mapping`) --------------------------------------------------
def _coat_zero12(param):
    """(DeepSpeedZeroOptimizer, COAT optimizer, flat fp32 partition) when this rank holds a fragment of `param`
    stepped by a COAT optimizer, else None."""
    mapping = getattr(param, "_hp_mapping", None)
    wrapper = getattr(param, "_zero_optimizer", None)
    if mapping is None or wrapper is None or not isinstance(wrapper.optimizer, CoatFP8Optimizer):
        return None
    return wrapper, wrapper.optimizer, wrapper.single_partition_of_fp32_groups[mapping.param_group_index]


def _get_full_zero12(param, key):
    """Every rank: the fp32 state `key` of `param`, one sum over the data-parallel group (fragment + error flag)."""
    from deepspeed import comm as dist

    numel = param.numel()
    buffer = torch.zeros(numel + 2, dtype=torch.float32, device=param.device)  # + flags: unknown key, Muon matrix
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is not None:
        try:
            fragment = _fragment_value(param, mapping, key)
        except ValueError:
            buffer[numel + (1 if _in_muon_group(param) else 0)] = 1.0
        else:
            lp = mapping.lp_fragment_address
            buffer.narrow(0, lp.start, lp.numel).copy_(fragment.reshape(-1))
    dist.all_reduce(buffer, group=param._dp_group)
    if buffer[numel + 1].item() > 0:
        raise ValueError("CoatFP8Muon under ZeRO-1/2 keeps a Muon matrix's momentum over whole matrices "
                         "(coat_ds.muon_zero), not per parameter fragment: it has no per-parameter optimizer state "
                         "here (its AdamW groups do)")
    if buffer[numel].item() > 0:
        raise ValueError(f"optimizer state {key!r} not found for this parameter; the COAT optimizers' per-parameter "
                         f"states are {KEYS_HELP}")
    return buffer[:numel].reshape_as(param)


def _in_muon_group(param) -> bool:
    """Whether this rank's fragment of `param` is in a Muon group of a COAT optimizer (DeepSpeed's Muon path)."""
    coat = _coat_zero12(param)
    return coat is not None and bool(coat[1].param_groups[param._hp_mapping.param_group_index].get("use_muon"))


def _fragment_value(param, mapping, key):
    """This rank's fragment of state `key` of `param` (ValueError if its optimizer has no such state)."""
    coat = _coat_zero12(param)
    if coat is None:
        return mapping.get_hp_fragment(key)  # DeepSpeed's own lookup (ValueError for an unknown key)
    _, optimizer, flat = coat
    hp = mapping.get_hp_fragment_address()
    return _moments(optimizer, flat, key)[key].narrow(0, hp.start, hp.numel)


def _set_full_zero12(param, value, key):
    _, optimizer, flat = _coat_zero12(param)
    mapping = param._hp_mapping
    hp, lp = mapping.get_hp_fragment_address(), mapping.lp_fragment_address
    moments = _moments(optimizer, flat, key)
    moments[key].narrow(0, hp.start, hp.numel).copy_(value.reshape(-1).narrow(0, lp.start, lp.numel))
    optimizer.set_fp32_moments(flat, **moments)


# ---- ZeRO-3: partitioned parameters (`ds_id`) ---------------------------------------------------------------------
def _coat_zero3(param):
    """The ZeRO-3 wrapper when `param` is stepped by a COAT optimizer under it, else None."""
    wrapper = getattr(param, "_z3_optimizer", None) if hasattr(param, "ds_id") else None
    return wrapper if wrapper is not None and isinstance(wrapper.optimizer, CoatFP8Optimizer) else None


def _zero3_partition(wrapper, param):
    """(flat fp32 sub-group tensor, offset of param's partition in it, its numel)."""
    group, offset, numel = wrapper.grad_position[wrapper.get_param_id(param)]
    return wrapper.fp32_partitioned_groups_flat[group], offset, numel


def _get_local_zero3(wrapper, param, key):
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().resolves_data_dependency():
        wrapper.reduce_and_partition_stream.synchronize()
    flat, offset, numel = _zero3_partition(wrapper, param)
    local = _moments(wrapper.optimizer, flat, key)[key].narrow(0, offset, numel)
    return local.to(get_accelerator().current_device_name())


def _set_local_zero3(wrapper, param, key, write):
    """Apply `write(fp32 partition view of the moment)` and quantize the sub-group's moments again."""
    flat, offset, numel = _zero3_partition(wrapper, param)
    moments = _moments(wrapper.optimizer, flat, key)
    write(moments[key].narrow(0, offset, numel))
    wrapper.optimizer.set_fp32_moments(flat, **moments)


# ---- the wrapped DeepSpeed functions (first argument: DeepSpeed's original) ----------------------------------------
def get_full(original, param, optim_state_key):
    wrapper = _coat_zero3(param)
    if wrapper is not None:
        if not param.requires_grad:
            return None
        return wrapper._fp32_state_allgather(param, _get_local_zero3(wrapper, param, optim_state_key))
    if hasattr(param, "_hp_mapping") and not hasattr(param, "ds_id"):
        return _get_full_zero12(param, optim_state_key)
    return original(param, optim_state_key)


def set_full(original, param, value, optim_state_key):
    wrapper = _coat_zero3(param)
    if wrapper is not None:
        if not param.requires_grad:
            return
        _check_value(value, param.ds_numel, "the parameter")
        rank = wrapper._get_param_partition_rank(param)

        def write(partition):  # this rank's slice of the full value; padding past the parameter's end is kept
            start = partition.numel() * rank
            count = max(0, min(partition.numel(), param.ds_numel - start))
            partition.narrow(0, 0, count).copy_(value.reshape(-1).narrow(0, start, count))

        _set_local_zero3(wrapper, param, optim_state_key, write)
    elif hasattr(param, "_hp_mapping") and not hasattr(param, "ds_id"):
        _check_value(value, param.numel(), "the parameter")  # on every rank, holding a fragment or not
        if _coat_zero12(param) is not None:
            _set_full_zero12(param, value, optim_state_key)
        else:
            original(param, value, optim_state_key)
    else:
        original(param, value, optim_state_key)


def get_local(original, param, optim_state_key):
    wrapper = _coat_zero3(param)
    if wrapper is None:
        return original(param, optim_state_key)
    return _get_local_zero3(wrapper, param, optim_state_key) if param.requires_grad else None


def set_local(original, param, value, optim_state_key):
    wrapper = _coat_zero3(param)
    if wrapper is None:
        return original(param, value, optim_state_key)
    if not param.requires_grad:
        return
    _check_value(value, param.ds_tensor.numel(), "this rank's partition")
    _set_local_zero3(wrapper, param, optim_state_key, lambda partition: partition.copy_(value.reshape(-1)))


def _moments(optimizer, flat, key) -> dict:
    """The fp32 moments of `flat` ({moment: flat fp32}); ValueError when `key` is not one of them."""
    moments = optimizer.fp32_moments(flat)
    if key not in moments:
        raise ValueError(f"{optimizer.NAME}'s per-parameter optimizer states are {list(moments)}, not {key!r}")
    return moments


def _check_value(value, numel, what):
    if not torch.is_tensor(value) or not value.is_floating_point():
        raise TypeError(f"a moment must be a floating-point tensor, got {type(value).__name__}"
                        f"{'' if not torch.is_tensor(value) else ' of ' + str(value.dtype)}")
    if value.numel() != numel:
        raise ValueError(f"a moment for {what} needs {numel} elements, got {value.numel()}")
