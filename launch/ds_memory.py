"""What launch/train_ds.py measures of memory: peaks, the model states a rank holds, and the breakdown of rank 0's
GPU memory into weights, optimizer state, buffers and what a step adds."""
from __future__ import annotations

import resource

import torch


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # CPU: peak resident set


def offloaded(config: dict) -> bool:
    """Whether ZeRO keeps the optimizer (master weights and states) in CPU memory or on NVMe."""
    return (config.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device", "none") != "none"


def model_state_bytes(engine, device: torch.device) -> dict:
    """Bytes of model states this rank holds on `device`, from the tensors themselves: the weights as DeepSpeed
    keeps them (bf16; this rank's partitions under ZeRO-3); the ZeRO master weights where they are tensors of their
    own (0 when offloaded, or when the optimizer steps the weights themselves: CoatFP8AdamW with master remainders);
    CoatFP8AdamW's master remainders (part of its optimizer state)."""
    def nbytes(t):
        return t.numel() * t.element_size()

    params = list(engine.module.parameters())
    shards = [p.ds_tensor if hasattr(p, "ds_tensor") else p for p in params]
    storages = {t.untyped_storage().data_ptr() for t in shards}
    wrapper = engine.optimizer
    masters = getattr(wrapper, "single_partition_of_fp32_groups", None) or \
        getattr(wrapper, "fp32_partitioned_groups_flat", None) or []
    remainders = [s["master_remainder"] for s in getattr(engine.basic_optimizer, "state", {}).values()
                  if "master_remainder" in s]
    return dict(weights=sum(nbytes(t) for t in shards if t.device == device),
                master_weights=sum(nbytes(m) for m in masters if m.device == device and m.numel()
                                   and m.untyped_storage().data_ptr() not in storages),
                master_remainders=sum(nbytes(r) for r in remainders if r.device == device))


def breakdown(memory: dict, model_states: dict, optimizer_state_bytes: int) -> dict:
    """Rank 0's GPU memory in GiB, measured before step 2's forward (what is held between steps) and at its peak:
    weights (model_state_bytes); optimizer state on the GPU (moments, metadata and master remainders; 0 when
    offloaded), of which master remainders; the other model states held between steps: master weights (a separate
    fp32 or bf16 partition, unless offloaded or stepped in place) and gradient and other buffers (the rest); what one
    step adds at its peak (activations saved for backward, gradients, logits, temporaries)."""
    if "before_forward" not in memory:
        return {}
    gib = 2.0 ** 30
    held = memory["before_forward"]
    rest = held - model_states["weights"] - optimizer_state_bytes
    return dict(weights=model_states["weights"] / gib, optimizer_state=optimizer_state_bytes / gib,
                master_remainders=model_states["master_remainders"] / gib, master_and_grad_buffers=rest / gib,
                master_weights=model_states["master_weights"] / gib,
                gradient_and_other_buffers=(rest - model_states["master_weights"]) / gib,
                step_transient=(memory["step_peak"] - held) / gib, step_peak=memory["step_peak"] / gib)
