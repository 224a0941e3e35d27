"""One batch through a COAT-converted causal LM and through the same weights unconverted: where FP8 activations
change the forward, and what a per-tensor E4M3 scale does to each GEMM input.

`probe_batch(model, reference, batch)` runs both models on the batch without gradients (training mode, so the
converted layers take their FP8 path) and returns:
- `loss` and `reference_loss`;
- `hidden_error`: per hidden state (embeddings, then each decoder layer's output; the last one after the final
  norm), the relative L2 error of the converted model's against the reference's over the real tokens;
- `gemm_inputs`: per nn.Linear of the reference's decoder layers (its input, as a per-tensor E4M3 scale would see it,
  padded positions included as COAT's scales include them), `e4m3_input_stats` of it: the amax, how many times the
  99.9th percentile of |x| it is, the fraction of nonzero elements a per-tensor E4M3 scale rounds to zero (at most
  half the smallest subnormal) and the fraction it leaves below the smallest normal (3 bits or fewer), and where the
  amax sits (token row, whether that row is padding, its token id).

`launch/train_ds.py --probe-step STEP` runs it on that step's micro-batch before the step's forward (rank 0, the
reference built from the model's own weights) and prints one line `PROBE {json}`.
"""
from __future__ import annotations

import torch

from coat_kernels.formats import E4M3


def e4m3_input_stats(x: torch.Tensor, real_rows: torch.Tensor | None = None, token_ids=None) -> dict:
    """What a per-tensor E4M3 scale (amax / 448) does to x [rows, features] (see the module docstring)."""
    a = x.detach().float().abs().reshape(-1, x.shape[-1])
    amax = a.max().item()
    nonzero = a[a > 0]
    if amax == 0 or not nonzero.numel():
        return {"amax": amax, "amax_over_p999": 0.0, "flushed_to_zero": 0.0, "below_normal": 0.0,
                "amax_row": None, "amax_row_is_padding": None, "amax_token": None}
    scaled = nonzero * (E4M3.max / amax)
    p999 = torch.quantile(nonzero[::max(1, nonzero.numel() >> 20)], 0.999).item()  # quantile's size limit
    row = int(a.max(dim=1).values.argmax())
    return {"amax": amax, "amax_over_p999": amax / p999 if p999 > 0 else float("inf"),
            "flushed_to_zero": (scaled <= E4M3.min_subnormal / 2).float().mean().item(),  # the tie: to 0 (even)
            "below_normal": (scaled < 2.0 ** E4M3.min_normal_exp).float().mean().item(),
            "amax_row": row,
            "amax_row_is_padding": None if real_rows is None else not bool(real_rows[row]),
            "amax_token": None if token_ids is None else int(token_ids[row])}


def probe_batch(model, reference, batch: dict) -> dict:
    """See the module docstring. `batch`: input_ids, labels and optionally attention_mask, as the training step
    passes them; `reference` holds the model's weights, unconverted."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    real = (mask.reshape(-1) != 0) if mask is not None else torch.ones(ids.numel(), dtype=torch.bool,
                                                                        device=ids.device)
    flat_ids = ids.reshape(-1).tolist()
    stats, hooks = {}, []
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            def record(mod, args, name=name):
                stats[name] = e4m3_input_stats(args[0], real, flat_ids)
            hooks.append(module.register_forward_pre_hook(record))
    modes = model.training, reference.training
    model.train()
    reference.train()
    try:
        with torch.no_grad():
            out = model(**batch, output_hidden_states=True)
            ref = reference(**batch, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
        model.train(modes[0])
        reference.train(modes[1])
    errors = []
    for h, r in zip(out.hidden_states, ref.hidden_states):
        h = h.reshape(-1, h.shape[-1])[real].float()
        r = r.reshape(-1, r.shape[-1])[real].float()
        errors.append(((h - r).norm() / r.norm().clamp(min=1e-30)).item())
    return {"loss": out.loss.item(), "reference_loss": ref.loss.item(), "real_tokens": int(real.sum()),
            "tokens": ids.numel(), "hidden_error": errors, "gemm_inputs": stats}


def reference_model(model, build):
    """`build()` (an unconverted model of the same shape) holding `model`'s weights, in their dtype and device."""
    weights = model.state_dict()
    first = next(iter(weights.values()))
    reference = build().to(device=first.device, dtype=first.dtype)
    reference.load_state_dict(weights)
    return reference
