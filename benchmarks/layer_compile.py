"""torch.compile and COAT: fwd+bwd ms and memory saved for backward of one decoder layer (Hugging Face's Llama
layer; COAT = that layer converted by coat_hf), compiled per layer as a model compiles it, against eager COAT and
compiled BF16, measured as the other layer benchmarks measure (layer_common.measure, one process). The compiled
COAT layer runs the FP8 blocks as custom ops (coat_kernels.act.compiled_ops): no weight cache, no gradient-amax
hand-off; its output and gradients are checked against eager COAT's before it is timed.

Rows: BF16 eager; BF16 compiled (per mode); COAT eager with weights quantized every forward and with a warm weight
cache (micro-batches after the first of a step); COAT compiled (per mode). Modes: "default" (Inductor),
"max-autotune-no-cudagraphs", "reduce-overhead" (CUDA graphs). Default shape: Llama-2-7B's layer (hidden 4096,
FFN 11008, 32 heads) at micro-batch 8 x 2048. Writes $OUT/compile.log (setup, checks), $OUT/bench.log (rows) and
$OUT/layer_compile.json.

    python benchmarks/layer_compile.py [--batch 8] [--seq 2048] [--modes default,reduce-overhead] [--iters 20]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import layer_common as lc  # noqa: E402  (imports TransformerEngine before torch touches CUDA)
import torch  # noqa: E402

MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead")


def compiled(layer: lc.DecoderLayer, mode: str) -> lc.DecoderLayer:
    """The Hugging Face decoder layer inside `layer` replaced by its torch.compile (fullgraph: a graph break inside
    the layer is an error)."""
    inner = layer.model.layers[0]
    layer.model.layers[0] = torch.compile(inner, mode=None if mode == "default" else mode, fullgraph=True)
    return layer


def bf16_copy(ref: lc.DecoderLayer) -> lc.DecoderLayer:
    layer = copy.deepcopy(ref)
    layer._rotary = {}
    return layer


def check_against_eager(eager, comp, x):
    """Relative errors (0.0: the same bits) of the compiled layer's output and input gradient against eager's."""
    dy = torch.randn_like(x)
    results = []
    for module in (eager, comp):
        xi = x.detach().clone().requires_grad_()
        out = module(xi)
        out.backward(dy)
        results.append((out.detach().clone(), xi.grad.clone()))
    (out_e, dx_e), (out_c, dx_c) = results
    return {"out": lc.rel(out_c, out_e), "dx": lc.rel(dx_c, dx_e)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=11008)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--modes", default="default", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--skip", default="", help="comma list: bf16, coat_eager, coat_cached")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown mode(s) {sorted(unknown)}; valid: {', '.join(MODES)}")
    skip = set(args.skip.split(","))
    lc.log(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  micro-batch {args.batch} x seq "
           f"{args.seq}, hidden {args.hidden}, ffn {args.ffn}, heads {args.heads}/{args.kv_heads}; modes {modes}",
           name="compile.log")
    _, ref = lc.make_layers("cuda", args.batch, args.seq, args.hidden, args.ffn, args.heads, args.kv_heads)
    ref = ref.cuda()
    x = torch.randn(args.batch, args.seq, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rows = []

    def run(name, module):
        lc.run_variants([(name, module)], x, args.iters, rows)
        torch._dynamo.reset()
        torch.cuda.empty_cache()

    if "bf16" not in skip:
        run("BF16 eager", ref)
        for mode in modes:
            run(f"BF16 compiled ({mode})", compiled(bf16_copy(ref), mode))
    if "coat_eager" not in skip:
        run("COAT eager (weights quantized every forward)", lc.coat_layer(ref))
    if "coat_cached" not in skip:
        run("COAT eager, warm weight cache", lc.coat_layer(ref, warm_cache=True))
    for mode in modes:
        comp = compiled(lc.coat_layer(ref), mode)
        errors = check_against_eager(lc.coat_layer(ref), comp, x)
        lc.log(f"COAT compiled ({mode}) against eager COAT: relative error of output {errors['out']:.2e}, of dx "
               f"{errors['dx']:.2e} (0: the same bits)", name="compile.log")
        run(f"COAT compiled ({mode})", comp)
    lc.save_json(dict(args=vars(args), rows=rows), "layer_compile.json")


if __name__ == "__main__":
    main()
