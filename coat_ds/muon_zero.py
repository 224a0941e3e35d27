"""CoatFP8Muon under DeepSpeed ZeRO-1/2: DeepSpeed's own Muon path, with the momentum stored by CoatFP8Muon.

DeepSpeed 0.19.8's ZeRO-1/2 optimizer (DeepSpeedZeroOptimizer) runs Muon itself for a param group whose parameters
carry `use_muon` and whose optimizer's class name holds "muon": while reducing gradients it all-reduces each Muon
matrix cut by a partition edge to every rank holding a piece of it (`average_tensor`), then, while it cuts the
gradient partition (`get_flat_partition`), it runs its `muon_update` (momentum, Newton-Schulz by the group's
`ns_method`, "gram" by default, and its aspect-ratio scaling) on each whole gradient of the partition's matrices and
hands the optimizer the orthogonalised update as the partition's gradient. The optimizer then only applies it
(coat_ds.optimizer.CoatFP8Muon, as DeepSpeed's MuonWithAuxAdam does). DeepSpeed keeps the momentum of the
partition's whole matrices (laid end to end, in the partition's parameter order) in one flat buffer of the
gradient's dtype, plus a staging copy of it kept between steps.

`install(zero_optimizer)` puts the CoatFP8Muon on that path (`use_deepspeed_muon_path`: it applies the updates) and
its momentum in place of DeepSpeed's (four methods wrapped on the instance; entries of coat_ds.patch_sites):
- the committed momentum is the CoatFP8Muon state entry of the group's flat partition, over the partition's whole
  matrices: with state_dtype "fp8" one FP8 code per element and per quantization group its expansion metadata
  (coat_kernels.optim.state's entry: `step`, `segments` (one per matrix), `group_size`, `exp_avg_q`,
  `exp_avg_meta`), with "fp32" / "bf16" an `exp_avg` tensor of that dtype; and `whole_matrices`, the matrices'
  shapes (int64 [n, 2]), which a loaded entry must match (`check_entry`); `_muon_momentum_buffer` makes it (zero)
  in place of DeepSpeed's buffer;
- `_muon_staging_momentum` hands muon_update a transient copy in the gradient's dtype (dequantized in batches of at
  most coat_kernels.optim.moment_batch.MAX_BATCH_NUMEL elements), and `_commit_muon_momentum` stores it back
  (quantized) once DeepSpeed knows the step survived, and frees it; after a skipped step it is dropped at the next
  staging;
- `average_tensor` runs with the ZeRO optimizer's `optimizer` presented as a MuonWithAuxAdam, the test DeepSpeed
  makes (isinstance, its only use of the optimizer there) before it copies a cut matrix's whole gradient.

`tag_parameters(optimizer)` sets `use_muon` on the model's parameters from CoatFP8Muon's param groups, the tag
deepspeed.initialize sets itself only for "type": "Muon". DeepSpeed internals read or written here are entries of
coat_ds.patch_sites.INTERNALS.
"""
from __future__ import annotations

import torch

from coat_kernels.optim import backends
from coat_kernels.optim.grouping import concat_layouts
from coat_kernels.optim.moment_batch import MomentBatch, batches

from . import patch_sites
from .muon_momentum_entry import WHOLE_MATRICES, matrix_layouts, new_entry


def tag_parameters(optimizer) -> None:
    """`use_muon` on every parameter of `optimizer` (a CoatFP8Muon not yet wrapped by ZeRO): its group's."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.use_muon = group["use_muon"]


def install(zero_optimizer) -> "ZeroMuonMomentum":
    """Make the ZeRO-1/2 optimizer around a CoatFP8Muon keep its Muon momentum in CoatFP8Muon's state."""
    zero_optimizer.optimizer.use_deepspeed_muon_path()
    momentum = ZeroMuonMomentum(zero_optimizer)
    patch_sites.wrap_instance(patch_sites.MUON_MOMENTUM_BUFFER, zero_optimizer, _replaced_by(momentum.ensure_entry))
    patch_sites.wrap_instance(patch_sites.MUON_STAGING, zero_optimizer, _replaced_by(momentum.stage))
    patch_sites.wrap_instance(patch_sites.MUON_COMMIT, zero_optimizer, _replaced_by(momentum.commit))
    role = _muon_role()
    patch_sites.wrap_instance(patch_sites.AVERAGE_TENSOR, zero_optimizer,
                              lambda original: _as_deepspeed_muon(zero_optimizer, role, original))
    return momentum


def _replaced_by(method):
    """A wrapper maker whose wrapper calls `method` in place of DeepSpeed's original."""
    def make(_original):
        def replacement(*args, **kwargs):
            return method(*args, **kwargs)

        return replacement

    return make


def _muon_role():
    """An object that is a MuonWithAuxAdam for isinstance and nothing else (never built, never stepped)."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    class MuonRole(MuonWithAuxAdam):
        def __init__(self):  # no state: it only answers isinstance
            pass

        def __getattr__(self, name):
            raise AttributeError(f"average_tensor read optimizer.{name}: DeepSpeed uses the optimizer there for more "
                                 "than isinstance(optimizer, MuonWithAuxAdam) now (see coat_ds.patch_sites)")

    return MuonRole()


def _as_deepspeed_muon(zero_optimizer, role, original):
    def average_tensor(tensor, communication_data_type):
        optimizer = zero_optimizer.optimizer
        zero_optimizer.optimizer = role
        try:
            return original(tensor, communication_data_type)
        finally:
            zero_optimizer.optimizer = optimizer

    return average_tensor


class ZeroMuonMomentum:
    """The Muon momentum of one ZeRO-1/2 optimizer around a CoatFP8Muon: committed in the CoatFP8Muon's state entry of
    each Muon group's flat partition, staged for DeepSpeed's muon_update in a buffer of the gradient's dtype that
    lives from the gradient partition's making to the commit."""

    def __init__(self, zero_optimizer):
        self.zero_optimizer = zero_optimizer
        self.staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # param group -> (flat partition, momentum)
        self.staging_dtypes: dict[int, torch.dtype] = {}
        self.moment_batches: dict[int, list] = {}  # param group -> its runs of matrices (see _batches)

    def ensure_entry(self, tensor_list, param_group_idx, dtype, device):
        """DeepSpeed's `_muon_momentum_buffer`: the group's momentum entry (zero on first use; one that covers other
        matrices is an error), and the staging dtype DeepSpeed would give its buffer: the gradients'."""
        optimizer = self.zero_optimizer.optimizer
        group = optimizer.param_groups[param_group_idx]
        flat = group["params"][0]
        shapes = torch.tensor([tuple(t.shape) for t in tensor_list], dtype=torch.int64).reshape(-1, 2)
        entry = optimizer.state[flat]
        if not entry:
            entry.update(new_entry(optimizer, group, shapes, device))
        elif not torch.equal(entry[WHOLE_MATRICES].cpu(), shapes):
            raise RuntimeError(f"CoatFP8Muon: the Muon momentum of param group {param_group_idx} covers matrices "
                               f"{entry[WHOLE_MATRICES].tolist()}, the ZeRO partition holds {shapes.tolist()}")
        grads = self.zero_optimizer.all_grad_tensors.get(param_group_idx)
        self.staging_dtypes[param_group_idx] = grads[0].dtype if grads else dtype

    def stage(self, flatten_copy, param_group_idx):
        """DeepSpeed's `_muon_staging_momentum`: the committed momentum, in the gradients' dtype, for muon_update to
        update in place."""
        optimizer = self.zero_optimizer.optimizer
        entry = optimizer.state[flatten_copy]
        dtype = self.staging_dtypes[param_group_idx]
        self.staged.pop(param_group_idx, None)  # a step skipped after staging leaves one behind
        if "exp_avg" in entry:
            staged = entry["exp_avg"].to(dtype, copy=True)
        else:
            codes, meta = entry["exp_avg_q"], entry["exp_avg_meta"]
            staged = torch.empty(codes.numel(), dtype=dtype, device=codes.device)
            for start, numel, first, groups, batch in self._batches(param_group_idx, entry):
                values, = batch.dequantize([codes.narrow(0, start, numel)], [meta.narrow(1, first, groups)])
                staged.narrow(0, start, numel).copy_(values)
        self.staged[param_group_idx] = (flatten_copy, staged)
        return staged

    def commit(self):
        """DeepSpeed's `_commit_muon_momentum` (the step survived): the staged momenta stored, then freed."""
        optimizer = self.zero_optimizer.optimizer
        for param_group_idx, (flat, staged) in self.staged.items():
            entry = optimizer.state[flat]
            if "exp_avg" in entry:
                entry["exp_avg"].copy_(staged)
            else:
                m_cfg = optimizer.group_config(optimizer.param_groups[param_group_idx]).moment_configs()[0]
                for start, numel, first, groups, batch in self._batches(param_group_idx, entry):
                    (codes,), (meta,) = batch.quantize([staged.narrow(0, start, numel).float()], m_cfg)
                    entry["exp_avg_q"].narrow(0, start, numel).view(torch.uint8).copy_(codes.view(torch.uint8))
                    entry["exp_avg_meta"].narrow(1, first, groups).copy_(meta)
            entry["step"] += 1
        self.staged.clear()

    def _batches(self, param_group_idx, entry) -> list:
        """(first element, elements, first group, groups, MomentBatch) of each run of whole matrices holding at most
        moment_batch.MAX_BATCH_NUMEL elements (a larger matrix alone), made once per param group: one
        (de)quantization call per run, on the run's groups, which are the matrices' own (concat_layouts)."""
        made = self.moment_batches.get(param_group_idx)
        if made is None:
            layouts = matrix_layouts(entry[WHOLE_MATRICES].cpu(), int(entry["group_size"]))
            codes = entry["exp_avg_q"]
            use_triton = backends.use_triton(self.zero_optimizer.optimizer.config.backend, codes,
                                             layouts[0].group_size)
            made, start, first = [], 0, 0
            for run in batches(layouts):
                layout = concat_layouts([layouts[i] for i in run])
                made.append((start, layout.numel, first, layout.num_groups,
                             MomentBatch([layout], codes.device, use_triton)))
                start, first = start + layout.numel, first + layout.num_groups
            self.moment_batches[param_group_idx] = made
        return made
