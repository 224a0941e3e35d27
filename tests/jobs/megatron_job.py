"""Two gloo processes that run every Megatron CPU check once and write the measurements to a JSON file.

Run by tests/megatron/test_megatron.py (imports of megatron-core cost ~20 s per process, so all checks share one job):
  python tests/jobs/megatron_job.py OUT_DIR PORT
Phases (both ranks): TP=1 (as DP=2) COAT vs local BF16 and saved-tensor dtypes; TP=2 COAT vs local; TP=2 + SP
vs TP=2; a TP=2 dist checkpoint loaded at TP=1 by the COAT and the local spec.

Test-only CPU shims (megatron-core allocates some buffers on `torch.cuda.current_device()`; the notes, section 4):
torch.cuda.current_device -> cpu and torch.cuda.synchronize -> no-op, applied only in these worker processes.
"""
from __future__ import annotations

import json
import os
import time

import torch
from rank_helpers import init_gloo_rank
import torch.distributed as dist
import torch.nn.functional as F

SEQ, BATCH, VOCAB, HIDDEN, HEADS, FFN, LAYERS = 32, 2, 128, 64, 4, 128, 2
DTYPE = torch.bfloat16


def apply_cpu_shims():
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")
        torch.cuda.synchronize = lambda *a, **k: None


def init_parallel(tp):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def make_config(tp, sp=False):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        tensor_model_parallel_size=tp, sequence_parallel=sp, use_cpu_initialization=True,
        params_dtype=DTYPE, pipeline_dtype=DTYPE, bf16=True, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, hidden_dropout=0.0, attention_dropout=0.0,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm")


def build(impl, config):
    """GPTModel with the COAT decoder-block spec or Megatron's local spec (SDPA core attention on CPU)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from coat_megatron import SDPACoreAttention, get_gpt_decoder_block_coat_spec

    torch.manual_seed(1234)
    if impl == "coat":
        spec = get_gpt_decoder_block_coat_spec(config, attention="sdpa")
    else:
        spec = get_gpt_layer_local_spec(normalization=config.normalization)
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope")


LOCAL_TO_TE_NAMES = (("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
                     ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"))


def copy_local_weights(local, coat):
    """Load the local model's weights into the COAT model (TE names for the fused norms)."""
    sd = {}
    for key, value in local.state_dict().items():
        for old, new in LOCAL_TO_TE_NAMES:
            key = key.replace(old, new)
        sd[key] = value
    result = coat.load_state_dict(sd, strict=False)
    bad = [k for k in result.missing_keys + result.unexpected_keys if not k.endswith("_extra_state")]
    assert not bad, f"weights did not map: {bad}"


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return tokens, position_ids, mask, labels


def allreduce_sequence_parallel_grads(model, config):
    """What finalize_model_grads does for SP-tagged parameters (the final norm) under Megatron's trainer."""
    from megatron.core import parallel_state

    if config.sequence_parallel:
        for p in model.parameters():
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())


def fwd_bwd(model, config, seed=0):
    model.zero_grad(set_to_none=True)
    out = model(*batch(seed)[:3], labels=batch(seed)[3])
    loss = out.float().mean()
    loss.backward()
    allreduce_sequence_parallel_grads(model, config)
    return loss.item()


def full_grads(model):
    """Gradients gathered over TP into full tensors, keyed by TE-style names (local norms renamed)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    out = {}
    for name, p in model.named_parameters():
        for old, new in LOCAL_TO_TE_NAMES:
            name = name.replace(old, new)
        g = p.grad.float()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g.contiguous(), group=group)
            if "linear_fc1.weight" in name:  # [gate_r; up_r] per rank -> [gate; up]
                halves = [x.chunk(2, dim=0) for x in parts]
                g = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
            else:
                g = torch.cat(parts, dim=p.partition_dim)
        out[name] = g
    return out


def grad_errors(ref, test):
    """Relative L2 error of every gradient (keys present in both)."""
    return {k: ((test[k] - ref[k]).norm() / ref[k].norm().clamp(min=1e-12)).item() for k in ref if k in test}


def compare(tp, sp=False):
    init_parallel(tp)
    local = build("local", make_config(tp))
    coat = build("coat", make_config(tp, sp))
    copy_local_weights(local, coat)
    loss_local = fwd_bwd(local, make_config(tp))
    loss_coat = fwd_bwd(coat, make_config(tp, sp))
    errors = grad_errors(full_grads(local), full_grads(coat))
    return coat, {"loss_local": loss_local, "loss_coat": loss_coat, "grad_rel_err": errors,
                  "grads_full": full_grads(coat)}


def weights_written_through_data(coat):
    """Megatron's optimizers write BF16 weights through `.data` (no `_version` bump): the next forward must use them.
    `coat` holds the weights of a fresh local model (compare() copied them and took no step)."""
    local = build("local", make_config(1))
    tokens, pos, mask, labels = batch(2)
    loss = lambda m: m(tokens, pos, mask, labels=labels).float().mean().item()  # noqa: E731
    with torch.no_grad():
        before = loss(coat)  # fills the FP8 weight caches
        for p in list(coat.parameters()) + list(local.parameters()):
            p.data.mul_(0.5)
        return {"before": before, "coat": loss(coat), "local": loss(local)}


def saved_tensor_census(model):
    """Tensors saved for backward by each COAT block of layer 0, by dtype (parameters excluded)."""
    layer = model.decoder.layers[0]
    params = {p.data_ptr() for p in model.parameters()}
    h = torch.randn(SEQ, BATCH, HIDDEN, dtype=DTYPE, requires_grad=True)
    census = {}

    def run(name, fn, *args):
        saved = []

        def pack(t):
            if t.data_ptr() not in params:
                saved.append((str(t.dtype), t.numel()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(*args)
        census[name] = saved

    tokens = SEQ * BATCH
    run("linear_qkv", layer.self_attention.linear_qkv, h)
    run("mlp", layer.mlp, h)
    inter = torch.randn(SEQ, BATCH, 2 * FFN, dtype=DTYPE, requires_grad=True)
    run("linear_fc2", layer.mlp.linear_fc2, inter)
    return {"census": census, "tokens": tokens}


def fused_attention_vs_megatron_path():
    """CoatSelfAttention's fused path (RoPE fused with the q/k/v split, SDPA on the [s, b] order) against Megatron's
    own forward of the same module, for MHA and grouped-query attention: relative error of the output and of dx."""
    init_parallel(1)
    out = {}
    for groups in (HEADS, 2, 1):
        config = make_config(1)
        config.num_query_groups = groups
        model = build("coat", config)
        attention = model.decoder.layers[0].self_attention
        emb = model.rotary_pos_emb(SEQ)
        g = torch.Generator().manual_seed(groups)
        h = torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(DTYPE)
        dy = torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(DTYPE)
        runs, fused_calls = {}, []
        fused_forward = attention._fused_forward
        attention._fused_forward = lambda *a: fused_calls.append(1) or fused_forward(*a)
        for fused in (True, False):
            attention.fused_path = fused
            x = h.clone().requires_grad_()
            y, _ = attention(x, None, rotary_pos_emb=emb)
            y.backward(dy)
            runs[fused] = (y.detach().float(), x.grad.float())
        rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
        out[groups] = {"out": rel(runs[True][0], runs[False][0]), "dx": rel(runs[True][1], runs[False][1]),
                       "fused_calls": len(fused_calls)}
    return out


def checkpoint_round_trip(ckpt_dir, rank):
    from megatron.core import dist_checkpointing

    init_parallel(2)
    coat = build("coat", make_config(2))
    opt = torch.optim.AdamW(coat.parameters(), lr=1e-2)
    fwd_bwd(coat, make_config(2))
    opt.step()
    with torch.no_grad():
        loss_tp2 = coat(*batch(1)[:3], labels=batch(1)[3]).float().mean().item()
    shard_weights = {k: v.float() for k, v in coat.state_dict().items() if not k.endswith("_extra_state")}
    os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(coat.sharded_state_dict(), ckpt_dir)
    dist.barrier()

    init_parallel(1)  # TP=1 (DP=2): both ranks load the whole model
    result = {"loss_tp2": loss_tp2}
    for impl in ("coat", "local"):
        model = build(impl, make_config(1))
        loaded = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
        missing = model.load_state_dict(loaded, strict=False)
        result[f"{impl}_missing"] = [k for k in missing.missing_keys + missing.unexpected_keys
                                     if not k.endswith("_extra_state")]
        with torch.no_grad():
            result[f"loss_tp1_{impl}"] = model(*batch(1)[:3], labels=batch(1)[3]).float().mean().item()
        if impl == "coat":
            full = {k: v.float() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    result["tp1_matches_tp2_shards"] = matches_shards(full, shard_weights, rank)
    return result


def matches_shards(full, shards, rank):
    """True when this TP=2 rank's shard of every parameter equals the slice of the TP=1 tensor it came from."""
    for key, shard in shards.items():
        whole = full[key]
        if whole.shape == shard.shape:
            ok = torch.equal(whole, shard)
        elif "linear_fc1.weight" in key:
            gate, up = whole.chunk(2, dim=0)
            n = shard.shape[0] // 2
            ok = torch.equal(torch.cat([gate[rank * n:(rank + 1) * n], up[rank * n:(rank + 1) * n]]), shard)
        else:
            dim = 0 if whole.shape[0] != shard.shape[0] else 1
            n = shard.shape[dim]
            ok = torch.equal(whole.narrow(dim, rank * n, n), shard)
        if not ok:
            return False
    return True


def worker(rank, world, out_dir, port):
    apply_cpu_shims()
    init_gloo_rank(rank, world, port)
    t0 = time.time()
    res = {}
    coat_tp1, res["tp1"] = compare(1)
    res["tp1"].pop("grads_full")
    res["spec"] = {name: type(m).__name__ for name, m in coat_tp1.named_modules()
                   if name.startswith("decoder.layers.0.") and name.count(".") in (3, 4)
                   or name == "decoder.final_layernorm"}
    res["param_names"] = sorted(n for n, _ in coat_tp1.named_parameters() if n.startswith("decoder.layers.0."))
    res["runtimes"] = len({id(m.coat_runtime) for m in coat_tp1.modules() if hasattr(m, "coat_runtime")})
    res["data_update"] = weights_written_through_data(coat_tp1)
    res["saved"] = saved_tensor_census(coat_tp1)
    res["saved_local"] = saved_tensor_census_local()
    res["fused_attention"] = fused_attention_vs_megatron_path()
    _, res["tp2"] = compare(2)
    grads_tp2 = res["tp2"].pop("grads_full")
    _, res["tp2_sp"] = compare(2, sp=True)
    grads_sp = res["tp2_sp"].pop("grads_full")
    res["sp_vs_tp2_grad_rel_err"] = grad_errors(grads_tp2, grads_sp)
    res["ckpt"] = checkpoint_round_trip(os.path.join(out_dir, "ckpt_tp2"), rank)
    res["seconds"] = time.time() - t0
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)


def saved_tensor_census_local():
    """The local BF16 MLP's saved tensors, for contrast (same shapes as the COAT census)."""
    local = build("local", make_config(1))
    layer = local.decoder.layers[0]
    params = {p.data_ptr() for p in local.parameters()}
    saved = []
    h = torch.randn(SEQ, BATCH, HIDDEN, dtype=DTYPE, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append((str(t.dtype), t.numel())) or t if t.data_ptr() not in params else t,
            lambda t: t):
        layer.mlp(layer.pre_mlp_layernorm(h))
    return saved


if __name__ == "__main__":
    from rank_helpers import spawn_ranks

    spawn_ranks(worker)
