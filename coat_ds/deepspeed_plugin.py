"""CoatFP8AdamW as a DeepSpeed optimizer: `"optimizer": {"type": "CoatFP8AdamW", "params": {...}}` in ds_config (and
CoatFP8Lion, CoatFP8Muon the same way: `"type": "CoatFP8Lion"` on ZeRO-0/1/2/3; `"type": "CoatFP8Muon"` where it
gets whole matrices: ZeRO-0 without a bf16 / fp16 wrapper (torch.optim.Muon's step on the model's parameters) and
ZeRO-1/2 without fp16 or optimizer offload (DeepSpeed's own Muon path, coat_ds.muon_zero); `check_muon_config` says
why the other modes are refused).

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

import torch

from coat_kernels.optim import state_report
from coat_kernels.optim.muon import NS_COEFFICIENTS

from . import engine_hooks, full_optimizer_state, master_partitions, muon_zero, patch_sites
from .optimizer import COAT_OPTIMIZERS, CoatFP8AdamW, CoatFP8Lion, CoatFP8Muon


def register_with_deepspeed() -> None:
    """Idempotent. Needs deepspeed importable (it is imported here). Each change is a site of coat_ds.patch_sites."""
    patch_sites.set_value(patch_sites.TORCH_OPTIM_CLASS, CoatFP8AdamW)
    patch_sites.set_value(patch_sites.TORCH_OPTIM_LION, CoatFP8Lion)
    patch_sites.set_value(patch_sites.TORCH_OPTIM_MUON, CoatFP8Muon)
    for optimizer_class in COAT_OPTIMIZERS:
        patch_sites.append_member(patch_sites.ZERO_SUPPORTED, optimizer_class)
    patch_sites.wrap(patch_sites.SANITY_CHECK, _checking_engine_config)
    patch_sites.wrap(patch_sites.CONFIGURE_ZERO, _configuring_coat_zero)
    engine_hooks.install()
    full_optimizer_state.install()


def check_engine_config(engine, optimizer=None) -> None:
    """Raise ValueError for DeepSpeed modes that cannot hold CoatFP8AdamW's FP8 states, or (for `optimizer`, the
    CoatFP8AdamW DeepSpeed built) that give master remainders no bf16 masters to complete."""
    stage = engine.zero_optimization_stage()
    if isinstance(optimizer, CoatFP8Muon):
        check_muon_config(engine, optimizer)
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


def check_muon_config(engine, optimizer) -> None:
    """ValueError for the configs CoatFP8Muon cannot run under, naming why: it needs whole weight matrices, which
    ZeRO-0 without a bf16 / fp16 wrapper hands it (torch.optim.Muon's step), and which DeepSpeed's own ZeRO-1/2 Muon
    path gathers for it (DeepSpeed's step, coat_ds.muon_zero); every other mode hands it flat partitions."""
    stage = engine.zero_optimization_stage()
    muon_groups = [group for group in optimizer.param_groups if group["use_muon"]]
    if stage == 0:
        if engine.bfloat16_enabled() or engine.fp16_enabled():
            raise ValueError(
                "CoatFP8Muon needs whole weight matrices (Newton-Schulz orthogonalises each one), and ZeRO stage 0 "
                f"with {'bf16' if engine.bfloat16_enabled() else 'fp16'} hands the optimizer flat copies of them "
                "(BF16_Optimizer / FP16_Optimizer). Use ZeRO stage 0 without \"bf16\" / \"fp16\" (an fp32 model "
                "stepped in place), or ZeRO stage 1 or 2, where DeepSpeed's Muon path gathers whole matrices.")
        if any("ns_method" in group for group in muon_groups):
            raise ValueError(
                'CoatFP8Muon "ns_method" is DeepSpeed\'s Newton-Schulz choice under ZeRO-1/2; ZeRO stage 0 steps '
                "torch.optim.Muon's iteration (ns_coefficients, ns_steps): drop ns_method or use ZeRO stage 1 or 2.")
        return
    model_dtype, grad_accum_dtype = engine.get_data_types()
    offload = engine.zero_offload_optimizer()
    reason = None
    if stage == 3:
        reason = ("ZeRO-3 runs Muon only for DeepSpeed's own MuonWithAuxAdam (it checks the optimizer's class), "
                  "with the momentum in fp32 sub-group buffers that coat_ds does not replace, and would hand "
                  "CoatFP8Muon flat shards")
    elif engine.fp16_enabled():
        reason = ("with fp16 DeepSpeed folds loss-scaled gradients into the Muon momentum, whose scale then moves "
                  "with the dynamic loss scale; coat_ds does not cover it (no fp16 ZeRO on the CPU tests)")
    elif offload is not None and str(getattr(offload.device, "value", offload.device)) != "none":
        reason = ("with optimizer offload DeepSpeed runs Muon (_apply_muon_updates_cpu_offload) only for its own "
                  "MuonWithAuxAdam, so CoatFP8Muon would be handed raw gradients of flat partitions")
    elif stage == 1 and model_dtype == torch.bfloat16 and grad_accum_dtype == torch.float32:
        reason = ("ZeRO-1 with bf16 and grad_accum_dtype fp32 is DeepSpeed's BF16_Optimizer, whose Muon path keeps "
                  "its own momentum (coat_ds rides on the ZeRO-1/2 optimizer's only)")
    elif engine.load_universal_checkpoint():
        reason = ("universal checkpoints hold elementwise moments per parameter fragment (DeepSpeed's converter "
                  "knows exp_avg / exp_avg_sq); the Muon momentum under ZeRO-1/2 covers each partition's whole "
                  "matrices on every rank that shares one (as DeepSpeed's own Muon momentum_buffer, which its "
                  "converter does not take either). Resume at the same data-parallel size from the ZeRO checkpoint")
    if reason is not None:
        raise ValueError(f"CoatFP8Muon is not supported with this config (ZeRO stage {stage}): {reason}. It runs on "
                         'ZeRO stage 1 or 2 (fp32 or "bf16" model, no optimizer offload) and on ZeRO stage 0 '
                         "(fp32 model).")
    fixed = {"nesterov": True, "ns_coefficients": NS_COEFFICIENTS, "ns_steps": 5, "eps": 1e-7}
    for group in muon_groups:
        changed = {k: group[k] for k, v in fixed.items()
                   if (tuple(group[k]) if k == "ns_coefficients" else group[k]) != v}
        if group["adjust_lr_fn"] not in (None, "original"):
            changed["adjust_lr_fn"] = group["adjust_lr_fn"]
        if changed:
            raise ValueError(
                f"CoatFP8Muon under ZeRO stage {stage} runs DeepSpeed's muon_update (Nesterov momentum, 5 "
                "Newton-Schulz steps with Keller Jordan's coefficients, \"gram\" or \"standard\" by ns_method, the "
                "update scaled by sqrt(max(1, rows / cols))), which takes none of torch.optim.Muon's options; this "
                f"Muon group sets {changed}: leave them at their defaults, or use ZeRO stage 0 (torch.optim.Muon's "
                "step).")


def _checking_engine_config(original):
    """DeepSpeedEngine._do_optimizer_sanity_check that runs check_engine_config when the engine picks the ZeRO/bf16
    wrapper for a CoatFP8AdamW (before it is built)."""

    def _do_optimizer_sanity_check(self, basic_optimizer):
        if isinstance(basic_optimizer, COAT_OPTIMIZERS):
            check_engine_config(self, basic_optimizer)
        return original(self, basic_optimizer)

    return _do_optimizer_sanity_check


def _configuring_coat_zero(original):
    """DeepSpeedEngine._configure_zero_optimizer after which the ZeRO optimizer around a CoatFP8AdamW with master
    remainders steps the model's bf16 partitions in place of DeepSpeed's master clones, and universal-checkpoint
    loads stay exact; and the ZeRO-1/2 optimizer around a CoatFP8Muon runs DeepSpeed's Muon path with CoatFP8Muon's
    momentum (coat_ds.muon_zero)."""

    def _configure_zero_optimizer(self, optimizer):
        muon = isinstance(optimizer, CoatFP8Muon) and self.zero_optimization_stage() in (1, 2)
        if muon:
            muon_zero.tag_parameters(optimizer)
        zero_optimizer = original(self, optimizer)
        if muon:
            muon_zero.install(zero_optimizer)
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
