"""`--coat-optimizer --use-precision-aware-optimizer --main-grads-dtype bf16` on the GPU with TransformerEngine's
FusedAdam (what megatron-core builds there, then swapped for COAT): the inner optimizer steps the bf16 shards with
master remainders from bf16 decoupled gradients, each step (Triton kernel) equals a plain CoatFP8AdamW with master
remainders on copies of the shards, and the state is ~4.19 bytes per element against TE FusedAdam's FP8 moments +
remainders (~4) in the same setup."""
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")
pytest.importorskip("transformer_engine.pytorch")

VOCAB, SEQ, BATCH = 1024, 256, 4


@pytest.fixture(scope="module")
def parallel():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29549")
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()


def build(coat: bool, exp_avg_dtype=torch.float32):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from coat_megatron.optimizer import use_coat_optimizer

    config = TransformerConfig(num_layers=2, hidden_size=512, num_attention_heads=8, ffn_hidden_size=1408,
                               params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, bf16=True,
                               gradient_accumulation_fusion=False, masked_softmax_fusion=False,
                               bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                               persist_layer_norm=False, hidden_dropout=0.0, attention_dropout=0.0,
                               gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)
    torch.manual_seed(0)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                   max_sequence_length=SEQ, position_embedding_type="rope").cuda()
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=False)
    model = DistributedDataParallel(config, ddp, Float16Module(config, gpt))
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, bf16=True, params_dtype=torch.bfloat16,
                                 use_distributed_optimizer=True, clip_grad=1.0, use_precision_aware_optimizer=True,
                                 main_grads_dtype=torch.bfloat16, exp_avg_dtype=exp_avg_dtype,
                                 exp_avg_sq_dtype=exp_avg_dtype)
    optimizer = get_megatron_optimizer(opt_config, [model])
    if coat:
        optimizer = use_coat_optimizer(optimizer)
    return model, optimizer


def train_step(model, optimizer, it):
    g = torch.Generator(device="cuda").manual_seed(it)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    position_ids = torch.arange(SEQ, device="cuda")[None].expand(BATCH, SEQ)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = model(tokens, position_ids, None, labels=torch.roll(tokens, -1, 1)).float().mean()
    loss.backward()
    model.finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok
    return loss.item()


def test_coat_replaces_te_fused_adam_with_remainders_and_bf16_grads(parallel):
    from megatron_optimizer_job import LockstepReference

    from coat_megatron.optimizer import optimizer_state_report

    model, optimizer = build(coat=True)
    inner = optimizer.chained_optimizers[0].optimizer
    assert type(inner).__name__ == "MegatronCoatFP8AdamW" and inner.config.master_remainders and inner.decoupled_grads
    lockstep = LockstepReference(inner)
    losses = [train_step(model, optimizer, it) for it in range(3)]
    assert lockstep.result() == {"lockstep_mismatches": [], "lockstep_steps": 3}
    shards = [p for g in inner.param_groups for p in g["params"]]
    assert {p.dtype for p in shards} == {torch.bfloat16} and {p.decoupled_grad.dtype for p in shards} == {
        torch.bfloat16}
    coat_report = optimizer_state_report(optimizer)
    assert 4.1 < coat_report["bytes_per_element"] < 4.3
    te_model, te_optimizer = build(coat=False, exp_avg_dtype=torch.uint8)
    te_losses = [train_step(te_model, te_optimizer, it) for it in range(3)]
    te_report = optimizer_state_report(te_optimizer)
    print(f"COAT {coat_report}, losses {losses}; TE FusedAdam FP8 {te_report}, losses {te_losses}")
    assert 3.9 < te_report["bytes_per_element"] < 4.2  # FP8 moments + int16 remainders (+ steps)
    assert abs(losses[-1] - te_losses[-1]) < 0.05 * abs(te_losses[-1])
