"""coat_kernels: the FP8 core shared by coat_ds (DeepSpeed) and coat_megatron (Megatron-core).

- `coat_kernels.optim`: CoatFP8AdamW (engine-agnostic), its options, state and quantizers (FP8 moments with
  per-group Dynamic Range Expansion);
- `coat_kernels.act`: FP8 activations: modules, autograd blocks and kernels;
- shared: `formats` (E4M3/E5M2), `portable_math` (log2/exp2/fma identical in torch and Triton), `triton_fp8`
  (fp32 -> FP8 casts in Triton).
Every Triton kernel has a torch reference of the same math: the CPU path and the test oracle.
"""
