"""coat_kernels: the FP8 numerics shared by coat_ds and coat_megatron.

Optimizer states: formats (E4M3/E5M2), grouping (segments -> groups of 128), dre_reference (torch reference of
quantization with Dynamic Range Expansion and of the fused AdamW step), dre_triton (the Triton twins, bit-identical),
portable_math (log2/exp2 identical in torch and Triton), triton_fp8 (fp32 -> FP8 casts).
Activations: act_* kernels and the autograd blocks in `blocks` (see docs/activations.md).
"""
