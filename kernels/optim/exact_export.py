"""fp32 moments that quantize back to the very codes and metadata they came from.

Checkpoint formats outside CoatFP8AdamW's own (Megatron's distributed-optimizer formats, DeepSpeed's universal
checkpoints, a torch-AdamW-shaped state dict) hold fp32 `exp_avg` / `exp_avg_sq`, which are quantized again on load.
Plain dequantization does not survive that: a group's metadata comes from its largest and smallest nonzero
magnitudes, M and m, and the decoded values of their codes are not M and m, so the groups get new metadata and
many codes change (most in the second moment).

`export` decodes every element as `dre_reference.dequantize` does, except the group's extremes: the elements with
the group's largest code get an fp32 value M' with log2(M') equal (in fp32) to log2 M, and one element at the
smallest code gets an m' with log2(m') equal to log2 m. The metadata is a function of log2 M and log2 m alone, so a
group quantized again gets the same metadata, and then the same codes (the other decoded values sit well inside
their codes' rounding intervals). log2 M and log2 m are recovered from the metadata (k, log2 c, log2(sQ)) by trying
the fp32 neighbours of log2 c +- log2(sQ)/k against the encoder's own formulas; M' and m' by searching the fp32
neighbours of 2^log2 M. Every exported group is quantized again and compared; a group that does not reproduce
(none in the tests) keeps its plain decoded values and is counted.

Equality is of what training reads: metadata bit for bit and every code's value; a code -0 comes back as +0 (both
decode to +0.0, so the next step computes the same bits).
"""
from __future__ import annotations

import torch

from .. import portable_math as pm
from . import dre_reference as reference
from .dre_reference import LOG2_RATIO_EPS, DREConfig, f32
from .grouping import GroupLayout

# fp32 neighbours of the estimated M and m tried on each side: NARROW for both first; where log2 M (or log2 m) is
# much closer to 0 than log2 c, its estimate is off by many of its own ulps: WIDE on that side, NEIGHBOURS on the other.
NARROW = 16
WIDE = 1024
NEIGHBOURS = 4
CHUNK_GROUPS = 1 << 12  # groups per pass: candidate tensors hold ~2,500 values per group


def export(codes: torch.Tensor, meta: torch.Tensor, layout: GroupLayout, cfg: DREConfig) -> tuple[torch.Tensor, int]:
    """(flat fp32 values, number of groups left with plain decoded values) of one quantized moment."""
    values = reference.dequantize(codes, meta, layout)
    if layout.num_groups == 0:
        return values, 0
    index, mask = reference._group_index(layout, codes.device)
    raw_all = reference._take(codes, index).view(torch.uint8)
    failed = 0
    for lo in range(0, layout.num_groups, CHUNK_GROUPS):
        sl = slice(lo, lo + CHUNK_GROUPS)
        idx, valid = index[sl], mask[sl]
        anchored, ok = _anchor_groups(values[idx], raw_all[sl], valid, meta[:, sl], cfg)
        write = valid & ok[:, None]
        values[idx[write]] = anchored[write]
        failed += int((~ok).sum())
    return values, failed


def quantized_equal(codes_a, meta_a, codes_b, meta_b) -> bool:
    """Same metadata bits and same code values (the sign of a zero code aside)."""
    same_codes = torch.equal(_zero_sign_dropped(codes_a.view(torch.uint8)),
                             _zero_sign_dropped(codes_b.view(torch.uint8)))
    return same_codes and torch.equal(meta_a.view(torch.int32), meta_b.view(torch.int32))


def _anchor_groups(x, raw, valid, meta, cfg):
    """x [n, G] plain decoded values, raw [n, G] code bytes, valid [n, G]: (values with anchors, ok [n])."""
    k, log2_center, log2_scale_q = meta
    mag = torch.where(valid, raw & 0x7F, 0).long()
    negative = raw >= 128
    code_max = mag.amax(dim=1)
    nonzero_groups = code_max > 0
    if cfg.expand:
        inf = torch.full_like(mag, 1 << 20)
        code_min = torch.where(valid & (mag > 0), mag, inf).amin(dim=1)
        zero_code = valid & (mag == 0)
        has_zero = zero_code.any(dim=1)
        # one element at the largest code (a 1-element group, or one nonzero element): if m' has that code too,
        # that element carries both M' and m'
        single_max = (valid & (mag == code_max[:, None])).sum(dim=1) == 1
        codes = (code_max, code_min, has_zero, single_max)
        big, small, small_code, found = _solve_extremes(meta, *codes, cfg, NARROW, NARROW)
        for widths in ((WIDE, NEIGHBOURS), (NEIGHBOURS, WIDE)):  # log2 M (or log2 m) near 0: finer than log2 c
            retry = (~found).nonzero()[:, 0]
            if len(retry):
                found_now = _solve_extremes(meta[:, retry], *(c[retry] for c in codes), cfg, *widths)
                for out, new in zip((big, small, small_code, found), found_now):
                    out[retry] = new
    else:  # k = 1, log2 c = 0: log2(sQ) is log2 M itself
        candidates, usable, _, log2_values = _preimages(log2_scale_q, NARROW, meta, cfg, code_max)
        good = usable & (log2_values == log2_scale_q[:, None])
        big, found = candidates.gather(1, good.int().argmax(dim=1, keepdim=True))[:, 0], good.any(dim=1)
    out = torch.where(valid & (mag == code_max[:, None]), _signed(big, negative), x)
    ok = found
    if cfg.expand:
        at_min = valid & (mag == code_min[:, None])
        # one nonzero code (M and m share it): one of its elements carries m', the others M'
        at_min = torch.where((code_min == code_max)[:, None], _first(at_min), at_min)
        carries_small = torch.where(small_code[:, None] > 0, at_min, _first(zero_code))
        out = torch.where(carries_small, _signed(small, negative), out)
    ok = torch.where(nonzero_groups, ok, True)  # all-zero groups: zeros come back as zeros
    out = torch.where(nonzero_groups[:, None], out, x)
    ok &= _requantizes(out, raw, valid, meta, cfg)
    return out, ok


def _signed(magnitude, negative):
    return torch.where(negative, -magnitude[:, None], magnitude[:, None])


def _solve_extremes(meta, code_max, code_min, has_zero, single_max, cfg, width_big, width_small):
    """Per group, fp32 M' and m' whose log2 values give the metadata (k, log2 c, log2(sQ)) through
    dre_reference.group_params, M' encoding to the group's largest code and m' to its smallest nonzero code (or to 0
    where the group holds a zero code): (M', m', m's code magnitude, found). Several fp32 neighbours share one fine
    log2 but the encoder reads a coarse one, so candidates that fit the metadata can still encode to the next code:
    the code is part of the condition. Candidates: `width_*` fp32 neighbours on each side of the values whose log2
    is log2 c +- log2(sQ)/k. single_max [n]: the group has one element at its largest code; an m' at that code is
    then carried by the same element as M', so log2 m' must equal log2 M'."""
    k, log2_center, log2_scale_q = meta
    half_range = log2_scale_q / k
    big, big_ok, _, a = _preimages(log2_center + half_range, width_big, meta, cfg, code_max)  # [n, A]
    small, small_ok, small_code, b = _preimages(log2_center - half_range, width_small, meta, cfg)  # [n, B]
    a3, b3 = a[:, :, None], b[:, None, :]
    kc, lc, ls = (t[:, None, None] for t in (k, log2_center, log2_scale_q))
    ratio = a3 - b3
    k_new = torch.floor(torch.full_like(ratio, cfg.expand_numerator) / ratio) * cfg.inv_expand_min
    k_new = torch.where(ratio <= LOG2_RATIO_EPS, 1.0, k_new.clamp(cfg.inv_expand_min, f32(cfg.k_max)))
    good = ((a3 + b3) * 0.5 == lc) & (kc * (a3 - lc) == ls) & (k_new == kc) & (a3 >= b3)
    small_ok &= (small_code == code_min[:, None]) | ((small_code == 0) & has_zero[:, None])
    good &= big_ok[:, :, None] & small_ok[:, None, :]
    shared = single_max[:, None] & (small_code == code_max[:, None])  # [n, B]
    good &= (a3 == b3) | ~shared[:, None, :]
    flat = good.flatten(1)
    pick = flat.int().argmax(dim=1)
    i, j = pick // b.shape[1], pick % b.shape[1]
    rows = torch.arange(len(k), device=k.device)
    return big[rows, i], small[rows, j], small_code[rows, j], flat.any(dim=1)


def _neighbours(x: torch.Tensor, count: int) -> torch.Tensor:
    """x and its `count` fp32 neighbours on each side, along a new last dim."""
    down, up = [x], [x]
    for _ in range(count):
        down.append(torch.nextafter(down[-1], torch.full_like(x, -torch.inf)))
        up.append(torch.nextafter(up[-1], torch.full_like(x, torch.inf)))
    return torch.stack(down[:0:-1] + up, dim=-1)


def _preimages(log2_estimate, width, meta, cfg, code=None):
    """Candidates around the fp32 values whose portable log2 is `log2_estimate` [n]: `width` fp32 neighbours on each
    side. Returns (values [n, C], usable [n, C] (finite, nonzero, code magnitude `code` [n] if given), their code
    magnitudes [n, C], their portable log2 [n, C])."""
    start = torch.exp2(log2_estimate.double())
    for _ in range(2):  # Newton's iteration on the portable log2
        start = start * torch.exp2(log2_estimate.double() - pm.log2(start.float()).double())
    candidates = _neighbours(start.float(), width)
    codes = _encoded_magnitude(candidates, meta, cfg)
    usable = torch.isfinite(candidates) & (candidates >= pm.MIN_NORMAL)
    if code is not None:
        usable &= codes == code[:, None]
    return candidates, usable, codes, pm.log2(candidates.nan_to_num(1.0, posinf=1.0))


def _encoded_magnitude(values, meta, cfg):
    """|code| of each candidate [n, C] under its group's metadata (NaN candidates: any code)."""
    return (reference.encode(values, meta, cfg).view(torch.uint8) & 0x7F).long()


def _first(mask: torch.Tensor) -> torch.Tensor:
    """Only the first True of each row."""
    return mask & (mask.int().cumsum(dim=1) == 1)


def _requantizes(values, raw, valid, meta, cfg) -> torch.Tensor:
    """Per group: quantizing `values` again gives `meta` bit for bit and the same code values."""
    new_codes, new_meta = reference._quantize_rows(values, valid, cfg)
    same_meta = (new_meta.view(torch.int32) == meta.view(torch.int32)).all(dim=0)
    new_raw = new_codes.view(torch.uint8)
    same_codes = ((_zero_sign_dropped(new_raw) == _zero_sign_dropped(raw)) | ~valid).all(dim=1)
    return same_meta & same_codes


def _zero_sign_dropped(raw: torch.Tensor) -> torch.Tensor:
    return torch.where(raw == 0x80, 0, raw)
