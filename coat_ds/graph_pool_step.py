"""A ZeRO-1/2 optimizer step that borrows the memory of the model's CUDA-graph pool (coat_kernels.act.
graph_pool_loans).

With `"cuda_graphs": true` the decoder layers' activation memory stays in the graphs' pool through the optimizer step,
where eager training has freed it by then. DeepSpeedZeroOptimizer.step flattens each param group's gradient partition
into one new tensor (`self.flatten`, directly or through `flatten_dense_tensors_aligned`) and converts that to the
master weights' dtype: with fp32 masters both copies (6 bytes per partition element) would come on top of the pool.
During the step, `flatten` instead writes one tensor of the master dtype into the pool's free memory (DeepSpeed's
`.to(master dtype)` then returns it as it is): the same values bit for bit (bf16 to fp32 is exact), and no step memory
beyond the pool for those copies. Before the first capture, on CPU tensors and with a replay pending the step is
DeepSpeed's own.
"""
from __future__ import annotations

from coat_kernels.act.graph_pool_loans import lend
from coat_kernels.act.graph_pool import GraphPool

from . import patch_sites


def lend_graph_pool_to_steps(zero_optimizer, pool: GraphPool) -> None:
    """Wrap this DeepSpeedZeroOptimizer's `step` and `flatten` so that each step's gradient partitions live in
    `pool`'s memory."""
    borrowing = _StepBorrowing(zero_optimizer, pool)
    patch_sites.wrap_instance(patch_sites.ZERO_STEP, zero_optimizer, borrowing.step)
    patch_sites.wrap_instance(patch_sites.ZERO_FLATTEN, zero_optimizer, borrowing.flatten)


class _StepBorrowing:
    """The loan of the step in progress (None outside a step, or when the pool has nothing to lend)."""

    def __init__(self, zero_optimizer, pool: GraphPool):
        self.zero_optimizer = zero_optimizer
        self.pool = pool
        self.loan = None

    def step(self, original):
        def step(*args, **kwargs):
            with lend(self.pool) as loan:
                self.loan = loan
                try:
                    return original(*args, **kwargs)
                finally:
                    self.loan = None
        return step

    def flatten(self, original):
        def flatten(tensors):
            tensors = list(tensors)
            if self.loan is None or not tensors or not tensors[0].is_cuda:
                return original(tensors)
            master_dtype = self.zero_optimizer.single_partition_of_fp32_groups[0].dtype
            return self.loan.flatten(tensors, master_dtype)
        return flatten
