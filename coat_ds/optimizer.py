"""The COAT FP8 optimizers as DeepSpeed builds them from `"optimizer": {"type": "CoatFP8AdamW"}` (or "CoatFP8Lion",
"CoatFP8Muon").

DeepSpeed constructs the optimizer over the model's parameters, then its ZeRO / bf16 wrappers replace each param
group's parameters with flat fp32 partitions (ZeRO-1/2, BF16_Optimizer) or flat sub-group shards (ZeRO-3). Each class
here remembers the model parameters of every param group, in group order, and answers `param_segments` for a flat
tensor from DeepSpeed's own fragment tables (coat_ds.zero_segments), so quantization groups follow each parameter's
grid. Group order survives `load_state_dict` (which replaces the group dicts) and universal-checkpoint loads; the
segments are taken when a tensor's state is first created and then travel with the state (DeepSpeed's ZeRO-1/2 step
hands the optimizer one param group at a time, so a tensor's parameters are looked up in every group).

CoatFP8Muon under ZeRO-1/2 rides on DeepSpeed's own Muon path (coat_ds.muon_zero): DeepSpeed writes Muon's update
(its muon_update on each whole matrix, with the group's `ns_method`) into the gradient of a Muon group's flat
partition, and CoatFP8Muon applies it as DeepSpeed's MuonWithAuxAdam does, p = p (1 - lr wd) - lr update; that
partition's state entry is the momentum of its whole matrices (coat_ds.muon_zero), which the per-tensor functions
(fp32_moments, set_fp32_moments) do not cover. Its AdamW groups are stepped as everywhere else. Where DeepSpeed would
hand CoatFP8Muon partitions without running Muon itself (ZeRO-3, BF16_Optimizer, ...), coat_ds.deepspeed_plugin
refuses the config.
"""
from __future__ import annotations

import torch

from coat_kernels.optim import CoatFP8AdamW as _CoatFP8AdamW
from coat_kernels.optim import CoatFP8Lion as _CoatFP8Lion
from coat_kernels.optim import CoatFP8Muon as _CoatFP8Muon

from . import muon_momentum_entry, zero_segments

OPTIMIZER_NAME = "CoatFP8AdamW"  # the ds_config "optimizer" "type", and the class's name in torch.optim
LION_NAME, MUON_NAME = "CoatFP8Lion", "CoatFP8Muon"


class PartitionSegments:
    """The DeepSpeed half of a COAT optimizer: model parameters per param group, and `param_segments` from them."""

    def add_param_group(self, param_group):
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        super().add_param_group({**param_group, "params": params})  # may refuse the group: remember it after
        self.__dict__.setdefault("_model_params", []).append(params)

    def param_segments(self, param, group_index):
        model_params = [q for params in self._model_params for q in params]
        if any(param is q for q in model_params):
            return None  # not replaced by a wrapper: one whole parameter
        return zero_segments.fragment_segments(param, model_params)


class CoatFP8AdamW(PartitionSegments, _CoatFP8AdamW):
    __doc__ = _CoatFP8AdamW.__doc__


class CoatFP8Lion(PartitionSegments, _CoatFP8Lion):
    __doc__ = _CoatFP8Lion.__doc__


NS_METHODS = (None, "gram", "standard")  # DeepSpeed's Newton-Schulz methods (None: its default, "gram")


class CoatFP8Muon(PartitionSegments, _CoatFP8Muon):
    """CoatFP8Muon (coat_kernels.optim.muon) for DeepSpeed. Under ZeRO-1/2 (coat_ds.muon_zero) the Muon step is
    DeepSpeed's: `ns_method` ("gram", its default, or "standard") picks its Newton-Schulz iteration (a group may set
    its own), and torch.optim.Muon's nesterov, ns_coefficients, ns_steps, eps and adjust_lr_fn must stay at their
    defaults (coat_ds.deepspeed_plugin refuses others)."""

    ns_method: str | None = None
    on_deepspeed_muon_path = False  # set by use_deepspeed_muon_path

    def __init__(self, params, *args, ns_method: str | None = None, **kwargs):
        if ns_method not in NS_METHODS:
            raise ValueError(f"CoatFP8Muon: ns_method must be one of {NS_METHODS}, got {ns_method!r}")
        self.ns_method = ns_method
        super().__init__(params, *args, **kwargs)

    def use_deepspeed_muon_path(self) -> None:
        """From now on DeepSpeed's ZeRO-1/2 optimizer runs Muon for this optimizer (coat_ds.muon_zero.install): a
        Muon group of flat partitions holds DeepSpeed's updates in its gradients. Without this call a flat tensor in
        a Muon group stays an error at the step (Newton-Schulz needs whole matrices)."""
        self.on_deepspeed_muon_path = True

    def holds_deepspeed_updates(self, group: dict) -> bool:
        """A Muon group whose tensors are ZeRO-1/2 flat partitions, on DeepSpeed's Muon path."""
        return (self.on_deepspeed_muon_path and group["use_muon"] and bool(group["params"])
                and all(p.dim() == 1 for p in group["params"]))

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["use_muon"] and self.ns_method is not None:
            group.setdefault("ns_method", self.ns_method)
        if group.get("ns_method") not in NS_METHODS:
            raise ValueError(f"CoatFP8Muon: ns_method must be one of {NS_METHODS}, got {group['ns_method']!r}")

    def step(self, closure=None):
        """CoatFP8Muon's step (which leaves groups holding DeepSpeed's Muon updates alone); then those updates
        applied: p = p (1 - lr wd) - lr update (MuonWithAuxAdam's operations)."""
        loss = super().step(closure)
        with torch.no_grad():
            for group in self.param_groups:
                if self.holds_deepspeed_updates(group):
                    self._check_group(group)
                    for p in group["params"]:
                        if p.grad is not None:
                            p.mul_(1 - group["lr"] * group["weight_decay"])
                            p.add_(p.grad.reshape(p.shape), alpha=-group["lr"])
        return loss

    def _prepare_group(self, index, group):
        return None if self.holds_deepspeed_updates(group) else super()._prepare_group(index, group)

    def _unquantized_step(self, group, p, grad, entry):
        if not self.holds_deepspeed_updates(group):
            super()._unquantized_step(group, p, grad, entry)

    def _holds_whole_matrix_momentum(self, p) -> bool:
        try:
            return self.holds_deepspeed_updates(self._group_of(p)[1])
        except KeyError:
            return False

    def _needs_new_entry(self, p, state) -> bool:
        return not self._holds_whole_matrix_momentum(p) and super()._needs_new_entry(p, state)

    def fp32_moments(self, p):
        self._refuse_whole_matrix_momentum(p)
        return super().fp32_moments(p)

    def set_fp32_moments(self, p, exp_avg, exp_avg_sq=None, step=None):
        self._refuse_whole_matrix_momentum(p)
        return super().set_fp32_moments(p, exp_avg, exp_avg_sq, step)

    def _refuse_whole_matrix_momentum(self, p):
        if self._holds_whole_matrix_momentum(p):
            raise ValueError("CoatFP8Muon under ZeRO-1/2: the state of a Muon group's flat partition is the momentum "
                             "of the partition's whole matrices (coat_ds.muon_zero, key exp_avg), not moments of the "
                             "partition's elements")

    def load_state_dict(self, state_dict):
        """CoatFP8Muon's load_state_dict, with the whole-matrix momenta's shape tables kept int64 on the CPU, as made
        (torch casts every state tensor to its parameter's dtype and device)."""
        tables = {pid: entry[muon_momentum_entry.WHOLE_MATRICES] for pid, entry in state_dict.get("state", {}).items()
                  if isinstance(entry, dict) and muon_momentum_entry.WHOLE_MATRICES in entry}
        super().load_state_dict(state_dict)
        params = {pid: p for saved, group in zip(state_dict["param_groups"], self.param_groups)
                  for pid, p in zip(saved["params"], group["params"])}
        for pid, table in tables.items():
            self.state[params[pid]][muon_momentum_entry.WHOLE_MATRICES] = table.to("cpu", copy=True)

    def _check_entry(self, entry, p, group_index, position, cfg, own_segments=True):
        if not self.holds_deepspeed_updates(self.param_groups[group_index]):
            return super()._check_entry(entry, p, group_index, position, cfg, own_segments)
        shapes = muon_momentum_entry.partition_shapes(p, self._model_params[group_index]) if own_segments else None
        muon_momentum_entry.check_entry(entry, shapes, cfg, self.state_dtype, self._where(p, group_index, position))


OPTIMIZERS = {OPTIMIZER_NAME: CoatFP8AdamW, LION_NAME: CoatFP8Lion, MUON_NAME: CoatFP8Muon}
COAT_OPTIMIZERS = tuple(OPTIMIZERS.values())
