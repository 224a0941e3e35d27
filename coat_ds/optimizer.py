"""The COAT FP8 optimizers as DeepSpeed builds them from `"optimizer": {"type": "CoatFP8AdamW"}` (or "CoatFP8Lion",
"CoatFP8Muon").

DeepSpeed constructs the optimizer over the model's parameters, then its ZeRO / bf16 wrappers replace each param
group's parameters with flat fp32 partitions (ZeRO-1/2, BF16_Optimizer) or flat sub-group shards (ZeRO-3). Each class
here remembers the model parameters of every param group, in group order, and answers `param_segments` for a flat
tensor from DeepSpeed's own fragment tables (coat_ds.zero_segments), so quantization groups follow each parameter's
grid. Group order survives `load_state_dict` (which replaces the group dicts) and universal-checkpoint loads; the
segments are taken when a tensor's state is first created and then travel with the state. CoatFP8Muon needs whole
matrices: coat_ds.deepspeed_plugin refuses it where DeepSpeed would hand it partitions.
"""
from __future__ import annotations

import torch

from coat_kernels.optim import CoatFP8AdamW as _CoatFP8AdamW
from coat_kernels.optim import CoatFP8Lion as _CoatFP8Lion
from coat_kernels.optim import CoatFP8Muon as _CoatFP8Muon

from . import zero_segments

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
        model_params = self._model_params[group_index] if group_index < len(self._model_params) else []
        if any(param is q for q in model_params):
            return None  # not replaced by a wrapper: one whole parameter
        return zero_segments.fragment_segments(param, model_params)


class CoatFP8AdamW(PartitionSegments, _CoatFP8AdamW):
    __doc__ = _CoatFP8AdamW.__doc__


class CoatFP8Lion(PartitionSegments, _CoatFP8Lion):
    __doc__ = _CoatFP8Lion.__doc__


class CoatFP8Muon(PartitionSegments, _CoatFP8Muon):
    __doc__ = _CoatFP8Muon.__doc__


OPTIMIZERS = {OPTIMIZER_NAME: CoatFP8AdamW, LION_NAME: CoatFP8Lion, MUON_NAME: CoatFP8Muon}
COAT_OPTIMIZERS = tuple(OPTIMIZERS.values())
