"""CoatFP8AdamW as a DeepSpeed optimizer: `"optimizer": {"type": "CoatFP8AdamW", "params": {...}}` in ds_config (and
CoatFP8Lion, CoatFP8Muon the same way: `"type": "CoatFP8Lion"` on ZeRO-0/1/2/3; `"type": "CoatFP8Muon"` only where
DeepSpeed steps the model's own parameters, ZeRO-0 without a bf16 / fp16 wrapper, since Newton-Schulz needs whole
matrices and every other mode hands the optimizer flat partitions).

DeepSpeed 0.19.8 has no optimizer registry: for a `type` it does not know it builds `getattr(torch.optim, type)`
with the config params as keywords, and ZeRO accepts only optimizers listed in
`deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS` (else it asks for `zero_allow_untested_optimizer`).
`register_with_deepspeed()` adds CoatFP8AdamW to both, and makes the engine refuse, at `deepspeed.initialize`,
the modes that cannot carry FP8 states (elastic checkpoints, NVMe optimizer swap), and `"master_remainders": true`
where DeepSpeed does not hand the optimizer bf16 master partitions; DeepSpeed's per-parameter optimizer-state
functions (`safe_get_full_optimizer_state`, ...) answer in fp32 moments (coat_ds.full_optimizer_state). With master
remainders the ZeRO optimizer, once built, steps the model's bf16 partitions and loads universal checkpoints exactly
(coat_ds.master_partitions). Every DeepSpeed internal coat_ds changes or reads is listed in coat_ds.patch_sites.
"""
from __future__ import annotations

from coat_kernels.optim import state_report

from . import engine_hooks, full_optimizer_state, master_partitions, patch_sites
from .optimizer import COAT_OPTIMIZERS, CoatFP8AdamW, CoatFP8Lion, CoatFP8Muon


def register_with_deepspeed() -> None:
    """Idempotent. Needs deepspeed importable (it is imported here). Each change is a site of coat_ds.patch_sites."""
    patch_sites.set_value(patch_sites.TORCH_OPTIM_CLASS, CoatFP8AdamW)
    patch_sites.set_value(patch_sites.TORCH_OPTIM_LION, CoatFP8Lion)
    patch_sites.set_value(patch_sites.TORCH_OPTIM_MUON, CoatFP8Muon)
    for optimizer_class in COAT_OPTIMIZERS:
        patch_sites.append_member(patch_sites.ZERO_SUPPORTED, optimizer_class)
    patch_sites.wrap(patch_sites.SANITY_CHECK, _checking_engine_config)
    patch_sites.wrap(patch_sites.CONFIGURE_ZERO, _owning_bf16_masters)
    engine_hooks.install()
    full_optimizer_state.install()


def check_engine_config(engine, optimizer=None) -> None:
    """Raise ValueError for DeepSpeed modes that cannot hold CoatFP8AdamW's FP8 states, or (for `optimizer`, the
    CoatFP8AdamW DeepSpeed built) that give master remainders no bf16 masters to complete."""
    stage = engine.zero_optimization_stage()
    if isinstance(optimizer, CoatFP8Muon) and (stage != 0 or engine.bfloat16_enabled() or engine.fp16_enabled()):
        raise ValueError(
            f"CoatFP8Muon needs whole weight matrices (Newton-Schulz orthogonalises each one), and this config (ZeRO "
            f"stage {stage}{', bf16' if engine.bfloat16_enabled() else ''}{', fp16' if engine.fp16_enabled() else ''}"
            ") hands the optimizer flat partitions of them: ZeRO-1/2/3, BF16_Optimizer and FP16_Optimizer all "
            "flatten the parameters. DeepSpeed's own Muon orthogonalises the gathered gradient inside its ZeRO "
            "optimizer with momentum kept there in fp32, which an FP8 state cannot replace. Use ZeRO stage 0 "
            'without "bf16" / "fp16" (an fp32 or bf16 model stepped in place), or "type": "Muon" for ZeRO.')
    if stage in (1, 2) and engine.zero_elastic_checkpoint():
        raise ValueError(
            "CoatFP8AdamW does not support zero_optimization.elastic_checkpoint=true: elastic checkpoints slice every "
            "state tensor as if it were elementwise, which corrupts FP8 codes and per-group scales (and DeepSpeed "
            "0.19.8's elastic load is broken for every optimizer). Remove the option: same-DP-size checkpoints resume "
            "exactly, and `python -m coat_ds.to_universal` converts a checkpoint for a different DP size.")
    offload = engine.zero_offload_optimizer()
    if offload is not None and str(getattr(offload.device, "value", offload.device)) == "nvme":
        raise ValueError(
            "CoatFP8AdamW does not support zero_optimization.offload_optimizer.device=nvme: DeepSpeed's optimizer "
            "swapper assumes every state tensor has the parameter's numel and dtype. Use \"device\": \"cpu\" (the step "
            "then runs on the C++ CPU step) or no optimizer offload.")
    if optimizer is not None and optimizer.config.master_remainders and not (
            stage in (1, 2, 3) and engine.bfloat16_enabled() and engine.bf16_master_weights_and_gradients()):
        raise ValueError(
            'CoatFP8AdamW "master_remainders": true completes bf16 master weights to exact fp32 ones: it needs ZeRO '
            'stage 1, 2 or 3 with "bf16": {"enabled": true, "bf16_master_weights_and_grads": true, '
            '"bf16_optimizer_states": true} (DeepSpeed then hands the optimizer bf16 master partitions and bf16 '
            'gradients). Without those DeepSpeed keeps fp32 masters itself: drop "master_remainders".')


def _checking_engine_config(original):
    """DeepSpeedEngine._do_optimizer_sanity_check that runs check_engine_config when the engine picks the ZeRO/bf16
    wrapper for a CoatFP8AdamW (before it is built)."""

    def _do_optimizer_sanity_check(self, basic_optimizer):
        if isinstance(basic_optimizer, COAT_OPTIMIZERS):
            check_engine_config(self, basic_optimizer)
        return original(self, basic_optimizer)

    return _do_optimizer_sanity_check


def _owning_bf16_masters(original):
    """DeepSpeedEngine._configure_zero_optimizer after which the ZeRO optimizer around a CoatFP8AdamW with master
    remainders steps the model's bf16 partitions in place of DeepSpeed's master clones, and universal-checkpoint
    loads stay exact."""

    def _configure_zero_optimizer(self, optimizer):
        zero_optimizer = original(self, optimizer)
        if isinstance(optimizer, CoatFP8AdamW) and optimizer.config.master_remainders:
            stage = self.zero_optimization_stage()
            master_partitions.own_master_partitions(zero_optimizer, stage)
            master_partitions.exact_universal_load(zero_optimizer, stage)
        return zero_optimizer

    return _configure_zero_optimizer


def optimizer_state_report(engine) -> dict:
    """This rank's optimizer-state bytes (moments and their metadata) against the numel it steps, of the torch
    optimizer DeepSpeed built from the config (inside any ZeRO/bf16 wrapper)."""
    return state_report([engine.basic_optimizer])
