"""coat_megatron's layers take what they need as arguments: CoatMLP builds fc2 with the config's activation as a
constructor argument, linear_proj's reuse_input is an argument of the call, and the fused norms and the final norm
create their parameters the same way. One gloo process on CPU (tests/jobs/megatron_job.py's set-up); also against
megatron-core 0.19: `PYTHONPATH=<unzipped 0.19.2 wheel> pytest tests/megatron/test_megatron_layers.py`."""
import json
import os
import subprocess
import sys

import pytest
from rank_helpers import JOBS, free_port

CHECKS = r'''
import json, sys
import torch
import torch.nn.functional as F
from megatron_job import apply_cpu_shims, init_parallel, make_config
from rank_helpers import init_gloo_rank

apply_cpu_shims()
init_gloo_rank(0, 1, int(sys.argv[1]))
init_parallel(1)
from megatron.core.transformer.spec_utils import build_module
from coat_megatron import CoatLayerNormColumnParallelLinear, CoatNorm, CoatRowParallelLinear, get_coat_mlp_spec

out = {}
torch.manual_seed(0)
x = torch.randn(16, 2, 64, dtype=torch.bfloat16)
for name, glu, act in (("swiglu", True, F.silu), ("gelu", False, F.gelu)):
    config = make_config(1)
    config.gated_linear_unit, config.activation_func = glu, act
    spec = get_coat_mlp_spec()
    if hasattr(spec, "module"):  # a ModuleSpec (megatron-core 0.16)
        mlp = build_module(spec, config=config)
    else:  # 0.19+: the MLP builder TransformerLayer calls
        from megatron.core.process_groups_config import ProcessGroupCollection

        mlp = spec(config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups(), is_mtp_layer=False)
    y, _ = mlp(x)
    h = F.rms_norm(x.float(), (64,), mlp.linear_fc1.layer_norm_weight.float(), config.layernorm_epsilon)
    h = h @ mlp.linear_fc1.weight.float().t()
    if glu:
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    else:
        h = F.gelu(h)
    ref = h @ mlp.linear_fc2.weight.float().t()
    out[name] = {"activation": mlp.linear_fc2.activation,
                 "rel_err": ((y.float() - ref).norm() / ref.norm()).item()}

config = make_config(1)
proj = CoatRowParallelLinear(64, 64, config=config, init_method=torch.nn.init.xavier_normal_, bias=False,
                             input_is_parallel=True, skip_bias_add=True)
for reuse in (True, False):
    inp = torch.randn(16, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y, _ = proj(inp, reuse_input=reuse)
    out[f"reuse_{reuse}"] = any(t.data_ptr() == inp.data_ptr() and t.dtype == inp.dtype for t in saved)
    y.float().sum().backward()
try:
    CoatRowParallelLinear(64, 64, config=config, init_method=torch.nn.init.xavier_normal_, bias=False,
                          input_is_parallel=True, skip_bias_add=True, activation="relu")
    out["bad_activation"] = "accepted"
except ValueError as exc:
    out["bad_activation"] = str(exc)

for normalization, zero_centered in (("RMSNorm", False), ("LayerNorm", True)):
    config = make_config(1)
    config.normalization, config.layernorm_zero_centered_gamma = normalization, zero_centered
    fused = CoatLayerNormColumnParallelLinear(64, 32, config=config, init_method=torch.nn.init.xavier_normal_)
    final = CoatNorm(config, 64, eps=config.layernorm_epsilon)
    out[normalization] = [[None if p is None else [p.dtype == torch.bfloat16, p.float().mean().item(), p.numel()]
                           for p in (m_weight, m_bias)]
                          for m_weight, m_bias in ((fused.layer_norm_weight, fused.layer_norm_bias),
                                                   (final.weight, final.bias))]
    out[normalization].append([fused.norm, fused.eps, fused.zero_centered_gamma,
                               final.norm, final.eps, final.zero_centered_gamma])
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def checks():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(JOBS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", CHECKS, str(free_port())], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_mlp_builds_fc2_with_the_configs_activation(checks, activation):
    assert checks[activation]["activation"] == activation
    assert checks[activation]["rel_err"] < 0.1, checks[activation]  # FP8 against the float MLP


def test_reuse_input_is_an_argument_of_the_call(checks):
    assert checks["reuse_True"] is True  # the input itself saved for the weight gradient
    assert checks["reuse_False"] is False  # an FP8 copy instead
    assert "activation must be one of" in checks["bad_activation"]


def test_fused_and_final_norms_create_their_parameters_alike(checks):
    rms_fused, rms_final, rms_options = checks["RMSNorm"]
    assert rms_fused == rms_final == [[True, 1.0, 64], None]
    assert rms_options[:3] == rms_options[3:] and rms_options[0] == "rmsnorm"
    ln_fused, ln_final, ln_options = checks["LayerNorm"]
    assert ln_fused == ln_final == [[True, 0.0, 64], [True, 0.0, 64]]  # zero-centred gamma: weights start at 0
    assert ln_options[:3] == ln_options[3:] and ln_options[0] == "layernorm" and ln_options[2] is True
