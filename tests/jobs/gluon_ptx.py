"""PTX of the optimizer's Gluon kernel (its CUDA entry point) built for sm_90 without a GPU: the CPU tests check
what the hardware will run. `hopper_ptx(...)` builds it in a subprocess (TRITON_INTERPRET off, so Triton compiles
instead of interpreting); this file's __main__ is that subprocess."""
from __future__ import annotations

import os
import subprocess
import sys


def hopper_ptx(param_dtype: str, full: bool, remainder: bool) -> str:
    """param_dtype: "fp32" or "bf16"; full: rows of whole aligned groups (the vectorized path); remainder: the
    master-remainder variant."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    args = [param_dtype, "full" if full else "ragged", "remainder" if remainder else "plain"]
    return subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True,
                          check=True).stdout


def _compile(param_dtype: str, full: bool, remainder: bool) -> str:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from coat_kernels.optim import dre_reference as ref
    from coat_kernels.optim import dre_triton as tri

    kernel = tri._fused_adamw_gluon
    groups_per_row, threads_per_group = tri.launch_shape(128)
    consts = dict(P_DTYPE={"fp32": tl.float32, "bf16": tl.bfloat16}[param_dtype], G_DTYPE=tl.bfloat16,
                  SKIP_NONFINITE=True, GROUP=128, NG=groups_per_row, ALIGNED=True, FULL=full,
                  THREADS_PER_GROUP=threads_per_group, REMAINDER=remainder,
                  **{f"{m}_{k}": v for m in "MV" for k, v in tri._moment_args(ref.DREConfig("e4m3")).items()})
    pointers = {"rows": "*i64", "tensors": "*i64", "skipped": "*i32"}
    signature = {n: "constexpr" if n in consts else pointers.get(n, "*fp32") for n in kernel.arg_names}
    source = GluonASTSource(kernel, signature,
                            constexprs={(kernel.arg_names.index(k),): v for k, v in consts.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=tri.NUM_WARPS, enable_fp_fusion=False))
    return compiled.asm["ptx"]


if __name__ == "__main__":
    dtype, rows, variant = sys.argv[1:4]
    print(_compile(dtype, rows == "full", variant == "remainder"))
