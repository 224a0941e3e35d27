"""coat_megatron on CPU (megatron-core 0.16.x, gloo): spec, TP=1/TP=2/SP numerics against the local BF16 spec,
FP8 saved-for-backward tensors, a TP=2 -> TP=1 distributed checkpoint, and the `--transformer-impl coat` flag.

All multi-process checks run once, in one spawned two-process job (tests/jobs/megatron_job.py).
"""
import argparse
import os
import subprocess
import sys

import pytest
from rank_helpers import run_job


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# FP8 (E4M3 activations/weights, E5M2 gradients) against BF16 on a tiny 2-layer GPT.
LOSS_REL_TOL = 0.01
GRAD_REL_TOL = 0.15



@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_job("megatron_job.py", tmp_path_factory.mktemp("megatron_job"), timeout=420)


def test_spec_builds_te_shaped_modules(job):
    spec = job[0]["spec"]
    prefix = "decoder.layers.0."
    assert spec[prefix + "self_attention"] == "CoatSelfAttention"
    assert spec[prefix + "self_attention.linear_qkv"] == "CoatLayerNormColumnParallelLinear"
    assert spec[prefix + "self_attention.linear_proj"] == "CoatRowParallelLinear"
    assert spec[prefix + "mlp.linear_fc1"] == "CoatLayerNormColumnParallelLinear"
    assert spec[prefix + "mlp.linear_fc2"] == "CoatRowParallelLinear"
    assert spec["decoder.final_layernorm"] == "CoatNorm"
    # TE parameter names: a checkpoint moves between TE and COAT runs.
    assert job[0]["runtimes"] == 1  # every COAT layer of the model shares one CoatRuntime
    assert job[0]["param_names"] == sorted(prefix + n for n in (
        "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
        "self_attention.linear_proj.weight", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight"))


@pytest.mark.parametrize("phase", ["tp1", "tp2", "tp2_sp"])
def test_forward_backward_matches_local_bf16(job, phase):
    for rank in job:
        r = rank[phase]
        assert abs(r["loss_coat"] - r["loss_local"]) <= LOSS_REL_TOL * abs(r["loss_local"]), r
        worst = max(r["grad_rel_err"], key=r["grad_rel_err"].get)
        assert r["grad_rel_err"][worst] < GRAD_REL_TOL, (worst, r["grad_rel_err"][worst])
        assert len(r["grad_rel_err"]) == 2 + 6 * 2 + 1  # embedding, output layer, 2 layers x 6, final norm


def test_forward_sees_weights_written_through_data(job):
    r = job[0]["data_update"]
    # Stale cached FP8 weights would leave the COAT loss at `before`.
    assert abs(r["coat"] - r["local"]) < 0.1 * abs(r["local"] - r["before"]), r


def test_sequence_parallel_matches_tensor_parallel(job):
    # Same FP8 scales (SP gathers the full input before quantizing): only reduction order differs.
    for rank in job:
        assert abs(rank["tp2_sp"]["loss_coat"] - rank["tp2"]["loss_coat"]) < 1e-3
        assert max(rank["sp_vs_tp2_grad_rel_err"].values()) < 0.02


def test_saved_for_backward_is_fp8(job):
    census, tokens = job[0]["saved"]["census"], job[0]["saved"]["tokens"]
    hidden = 64
    for block, saved in census.items():
        activations = [(dtype, n) for dtype, n in saved if n >= tokens * hidden // 2]
        assert activations, block
        not_fp8 = [(dtype, n) for dtype, n in activations if "float8" not in dtype]
        assert not not_fp8, (block, not_fp8)
    coat_mlp_bytes = sum(n * (1 if "float8" in d else 2 if "bfloat16" in d else 4) for d, n in census["mlp"])
    local_mlp_bytes = sum(n * (2 if "bfloat16" in d else 4) for d, n in job[0]["saved_local"])
    assert coat_mlp_bytes < 0.6 * local_mlp_bytes, (coat_mlp_bytes, local_mlp_bytes)


def test_fused_attention_path_matches_megatron_forward(job):
    """The COAT layer's fused attention (RoPE + q/k/v split in one kernel, SDPA on the [s, b] token order) computes
    what Megatron's SelfAttention forward computes around the same core (MHA, 2 and 1 key/value groups)."""
    for groups, r in job[0]["fused_attention"].items():
        assert r["fused_calls"] == 1, (groups, r)  # the fused run took the fused path, the other did not
        assert r["out"] < 0.02 and r["dx"] < 0.03, (groups, r)


def test_tp2_checkpoint_loads_at_tp1(job):
    for rank in job:
        ck = rank["ckpt"]
        assert ck["coat_missing"] == [] and ck["local_missing"] == []
        assert ck["tp1_matches_tp2_shards"]  # every TP=2 shard equals its slice of the TP=1 tensor
        assert abs(ck["loss_tp1_coat"] - ck["loss_tp2"]) < LOSS_REL_TOL * ck["loss_tp2"]
        # The local BF16 spec reads the same checkpoint (TE layout): same model, BF16 instead of FP8.
        assert abs(ck["loss_tp1_local"] - ck["loss_tp1_coat"]) < LOSS_REL_TOL * ck["loss_tp1_coat"]


# ---- the flag ----------------------------------------------------------------------------------------------------
def _parser_like_megatron():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--transformer-impl", type=str, default="transformer_engine",
                        choices=("local", "transformer_engine", "inference_optimized"))
    return parser


def test_coat_args_extend_transformer_impl_choices():
    from coat_megatron.arguments import add_coat_args

    parser = _parser_like_megatron()
    with pytest.raises(SystemExit):
        parser.parse_args(["--transformer-impl", "coat"])
    args = add_coat_args(parser).parse_args(["--transformer-impl", "coat", "--coat-attention", "sdpa"])
    assert (args.transformer_impl, args.coat_attention) == ("coat", "sdpa") and not args.coat_fprop_fast_accum
    assert add_coat_args(_parser_like_megatron()).parse_args(["--coat-fprop-fast-accum"]).coat_fprop_fast_accum
    assert add_coat_args(_parser_like_megatron()).parse_args([]).transformer_impl == "transformer_engine"


def test_auto_attention_is_sdpa_never_the_unfused_core(monkeypatch):
    """auto: torch SDPA on CUDA machines too, with or without TE; TE's core and Megatron's unfused one only when
    asked for."""
    import megatron.core.extensions.transformer_engine as te_ext
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from coat_megatron.attention import SDPACoreAttention, core_attention_class

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    for have_te in (False, True):
        monkeypatch.setattr(te_ext, "HAVE_TE", have_te)
        assert core_attention_class("auto") is SDPACoreAttention and core_attention_class() is SDPACoreAttention
        assert core_attention_class("sdpa") is SDPACoreAttention
        assert core_attention_class("megatron") is DotProductAttention
    with pytest.raises(ValueError, match="one of"):
        core_attention_class("flash")
    monkeypatch.setattr(te_ext, "TEDotProductAttention", "te-core", raising=False)
    assert core_attention_class("te") == "te-core"
    monkeypatch.setattr(te_ext, "HAVE_TE", False)
    with pytest.raises(ImportError, match="not importable"):
        core_attention_class("te")


def test_coat_args_reject_te_fp8_and_moe():
    from coat_megatron.arguments import validate_coat_args

    base = dict(transformer_impl="coat", coat_attention="auto", fp8=None, num_experts=None,
                normalization="RMSNorm", context_parallel_size=1)
    validate_coat_args(argparse.Namespace(**base))
    with pytest.raises(SystemExit, match="use --coat-attention te"):  # SDPA has no context parallelism
        validate_coat_args(argparse.Namespace(**{**base, "context_parallel_size": 2}))
    validate_coat_args(argparse.Namespace(**{**base, "context_parallel_size": 2, "coat_attention": "te"}))
    for bad in ({"fp8": "hybrid"}, {"num_experts": 8}):
        with pytest.raises(SystemExit, match="--transformer-impl coat"):
            validate_coat_args(argparse.Namespace(**{**base, **bad}))


def test_megatron_training_parses_transformer_impl_coat(monkeypatch):
    try:
        from megatron.training import arguments
    except ImportError:
        pytest.skip("megatron.training is not in this megatron-core (it ships from 0.17 on)")
    from coat_megatron.arguments import install_coat_args

    monkeypatch.setattr(arguments, "add_megatron_arguments", arguments.add_megatron_arguments)  # restored after
    install_coat_args()
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt", "--transformer-impl", "coat", "--coat-attention", "sdpa"])
    # megatron.training re-parses sys.argv by itself (ft_integration.setup): that parser must accept coat too.
    args = arguments.parse_args(ignore_unknown_args=True)
    assert (args.transformer_impl, args.coat_attention) == ("coat", "sdpa")


def test_launcher_without_megatron_training_says_what_is_missing():
    try:
        import megatron.training  # noqa: F401
        pytest.skip("megatron.training is installed")
    except ImportError:
        pass
    proc = subprocess.run([sys.executable, "-m", "coat_megatron.pretrain_gpt", "--transformer-impl", "coat"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0
    assert "megatron-core 0.17.0 is the first wheel that ships megatron.training" in proc.stderr
    if sys.version_info < (3, 12):  # pip cannot install that wheel here: the message says why
        assert "requires Python >= 3.12 (this is Python 3." in proc.stderr


def test_enable_coat_handle_ticks_the_weight_clock_after_inner_steps():
    """The handle attaches the runtime's clock to every inner optimizer of a (chained) Megatron optimizer."""
    import torch
    from types import SimpleNamespace

    from coat_megatron.enable import CoatMegatron

    handle = CoatMegatron()
    params = [torch.nn.Parameter(torch.randn(4))]
    inner = [torch.optim.SGD(params, lr=0.1), torch.optim.SGD([torch.nn.Parameter(torch.randn(4))], lr=0.1)]
    handle.attach(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=o) for o in inner]))
    assert handle.runtime.clock.attached and handle.runtime.clock.count == 0
    inner[0].step()
    inner[1].step()
    assert handle.runtime.clock.count == 2
    config = handle.activation_config(SimpleNamespace(coat_fprop_fast_accum=True))
    assert config.fprop_fast_accum and config.cache_weights


def test_full_iteration_graph_capture_releases_cached_memory_first(monkeypatch):
    """FullCudaGraphWrapper captures at call number cuda_graph_warmup_steps: the eager warm-up's cached blocks are
    released right before that call (once per stage), never at the other calls."""
    import torch
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    from coat_megatron.cuda_graphs import release_memory_before_capture

    events = []

    def fake_call(self, *args, **kwargs):  # the wrapper's own bookkeeping: capture at warmup_steps, then replay
        stage = "validation" if kwargs.get("forward_only") else "training"
        if self.curr_iter(stage) == self.cuda_graph_warmup_steps:
            FullCudaGraphWrapper.cuda_graph[stage] = "graph"
        events.append((stage, self.curr_iter(stage)))
        self.next_iter(stage)

    monkeypatch.setattr(FullCudaGraphWrapper, "__call__", fake_call)
    monkeypatch.setattr(FullCudaGraphWrapper, "cuda_graph", {"training": None, "validation": None})
    monkeypatch.setattr(FullCudaGraphWrapper, "curr_iteration", {"training": 0, "validation": 0})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    assert release_memory_before_capture() and release_memory_before_capture()  # idempotent
    wrapper = object.__new__(FullCudaGraphWrapper)  # its __init__ makes a CUDA stream
    wrapper.cuda_graph_warmup_steps = 2
    for _ in range(4):
        wrapper(forward_only=False)
    wrapper(forward_only=True)
    wrapper(forward_only=True)
    wrapper(forward_only=True)
    assert events == [("training", 0), ("training", 1), "empty_cache", ("training", 2), ("training", 3),
                      ("validation", 0), ("validation", 1), "empty_cache", ("validation", 2)]
