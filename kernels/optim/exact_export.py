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
their codes' rounding intervals). M' and m' are searched among the fp32 values around the estimates
2^(log2 c +- log2(sQ)/k), every pair of candidates checked against the encoder's own formulas: first a few
neighbours on each side, then, for the groups that this misses, as far as the estimates' error bound reaches, so that
the group's own M and m are among the candidates and a pair is always found. Every exported group is quantized again
and compared; a group that still does not reproduce keeps its plain decoded values and is counted.

Equality is of what training reads: metadata bit for bit and every code's value; a code -0 comes back as +0 (both
decode to +0.0, so the next step computes the same bits).
"""
from __future__ import annotations

import math

import torch

from .. import portable_math as pm
from . import dre_reference as reference
from .dre_reference import LOG2_RATIO_EPS, DREConfig, f32
from .grouping import GroupLayout

# fp32 neighbours of the estimated M and m tried on each side first (most groups); the groups this misses are searched
# again as wide as the estimates' error bound (_search_widths), which holds the group's true M and m.
NARROW = 16
CHUNK_GROUPS = 1 << 12  # groups per pass of the first search
CANDIDATE_BUDGET = 1 << 14  # candidates per side and pass of the wider search


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
        big, small, small_code, found = _solve_extremes(meta, *codes, cfg, NARROW)
        for rows, width in _retry_passes(~found & nonzero_groups, _search_widths(meta)):
            found_now = _solve_extremes(meta[:, rows], *(c[rows] for c in codes), cfg, width)
            for out, new in zip((big, small, small_code, found), found_now):
                out[rows] = new
    else:  # k = 1, log2 c = 0: log2(sQ) is log2 M itself
        big, found = _solve_max(meta, code_max, cfg, NARROW)
        for rows, width in _retry_passes(~found & nonzero_groups, _search_widths(meta)):
            big[rows], found[rows] = _solve_max(meta[:, rows], code_max[rows], cfg, width)
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


def _solve_extremes(meta, code_max, code_min, has_zero, single_max, cfg, width):
    """Per group, fp32 M' and m' whose log2 values give the metadata (k, log2 c, log2(sQ)) through
    dre_reference.group_params, M' encoding to the group's largest code and m' to its smallest nonzero code (or to 0
    where the group holds a zero code): (M', m', m's code magnitude, found). Several fp32 neighbours share one fine
    log2 but the encoder reads a coarse one, so candidates that fit the metadata can still encode to the next code:
    the code is part of the condition. Candidates: `width` fp32 neighbours on each side of the values whose log2
    is log2 c +- log2(sQ)/k. single_max [n]: the group has one element at its largest code; an m' at that code is
    then carried by the same element as M', so log2 m' must equal log2 M'."""
    k, log2_center, log2_scale_q = meta
    half_range = log2_scale_q / k
    big, big_ok, _, a = _preimages(log2_center + half_range, width, meta, cfg, code_max)  # [n, A]
    small, small_ok, small_code, b = _preimages(log2_center - half_range, width, meta, cfg)  # [n, B]
    big_ok &= k[:, None] * (a - log2_center[:, None]) == log2_scale_q[:, None]
    small_ok &= (small_code == code_min[:, None]) | ((small_code == 0) & has_zero[:, None])
    j, reachable = _partners(a, big_ok, b, small_ok, log2_center)  # [n, A, W]
    b3 = b.gather(1, j.flatten(1)).view(j.shape)
    code3 = small_code.gather(1, j.flatten(1)).view(j.shape)
    a3 = a[:, :, None]
    kc, lc = k[:, None, None], log2_center[:, None, None]
    ratio = a3 - b3
    k_new = torch.floor(torch.full_like(ratio, cfg.expand_numerator) / ratio) * cfg.inv_expand_min
    k_new = torch.where(ratio <= LOG2_RATIO_EPS, 1.0, k_new.clamp(cfg.inv_expand_min, f32(cfg.k_max)))
    good = reachable & ((a3 + b3) * 0.5 == lc) & (k_new == kc) & (a3 >= b3)
    shared = single_max[:, None, None] & (code3 == code_max[:, None, None])
    good &= (a3 == b3) | ~shared
    flat = good.flatten(1)
    pick = flat.int().argmax(dim=1)
    rows = torch.arange(len(k), device=k.device)
    i, jj = pick // j.shape[2], j.flatten(1)[rows, pick]
    return big[rows, i], small[rows, jj], small_code[rows, jj], flat.any(dim=1)


def _partners(a, a_ok, b, b_ok, log2_center):
    """For each usable log2 M' candidate a [n, A]: the indices [n, A, W] of the usable log2 m' candidates b [n, B]
    within an ulp of 2 log2 c from 2 log2 c - a (every b with fl(a + b) = 2 log2 c is among them), and which of the
    W slots hold one (rows have different counts)."""
    # stable: candidates sharing a log2 keep their index order, so every device picks the same m'
    sorted_b, order = torch.where(b_ok, b.double(), torch.inf).sort(dim=1, stable=True)
    target = 2 * log2_center.double()[:, None] - a.double()
    reach = _ulp(2 * log2_center).double()[:, None]
    lo = torch.searchsorted(sorted_b, target - reach)
    hi = torch.where(a_ok, torch.searchsorted(sorted_b, target + reach, right=True), lo)
    width = max(int((hi - lo).max()), 1) if lo.numel() else 1
    slots = lo[..., None] + torch.arange(width, device=a.device)
    reachable = slots < hi[..., None]
    j = order.gather(1, slots.clamp(max=b.shape[1] - 1).flatten(1)).view(slots.shape)
    return j, reachable


def _solve_max(meta, code_max, cfg, width):
    """Without expansion (k = 1, log2 c = 0, log2(sQ) = log2 M): per group an fp32 M' of code magnitude `code_max`
    whose log2 is log2(sQ): (M', found)."""
    log2_scale_q = meta[2]
    candidates, usable, _, log2_values = _preimages(log2_scale_q, width, meta, cfg, code_max)
    good = usable & (log2_values == log2_scale_q[:, None])
    return candidates.gather(1, good.int().argmax(dim=1, keepdim=True))[:, 0], good.any(dim=1)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    x = x.abs()
    return torch.nextafter(x, torch.full_like(x, torch.inf)) - x


def _search_widths(meta) -> torch.Tensor:
    """Per group, how many fp32 steps from the estimated M (and m) the group's true M (and m) can lie: a bound on
    the estimates' log2 error (log2(sQ) was rounded before the division by k; log2 c, log2 M and log2 m are each
    within a few of their own ulps of what the encoder computed), with margin, times the fp32 values per unit of
    log2 near any x (x / ulp(x) < 2^24, d(log2 x) = dx / (x ln 2))."""
    k, log2_center, log2_scale_q = meta
    half_range = log2_scale_q / k
    log2_error = _ulp(log2_scale_q) / k + 4 * (_ulp(log2_center) + _ulp(log2_center + half_range)
                                               + _ulp(log2_center - half_range))
    return (log2_error.double() * (1.01 * math.log(2) * 2 ** 24)).ceil().long() + 2


def _retry_passes(missed: torch.Tensor, widths: torch.Tensor):
    """(group rows, width) passes over the missed groups, narrowest first, each within CANDIDATE_BUDGET candidates."""
    rows = missed.nonzero()[:, 0]
    rows = rows[widths[rows].argsort(stable=True)]
    start = 0
    while start < len(rows):
        count = max(1, CANDIDATE_BUDGET // (2 * int(widths[rows[start]]) + 1))
        width = int(widths[rows[start:start + count]].max())
        count = max(1, min(count, CANDIDATE_BUDGET // (2 * width + 1)))
        yield rows[start:start + count], width
        start += count


def _neighbours(x: torch.Tensor, count: int) -> torch.Tensor:
    """x >= 0 and its `count` fp32 neighbours on each side, along a new last dim: consecutive bit patterns are
    consecutive fp32 values there. Steps past 0 or past inf give NaNs, which no caller can use."""
    steps = torch.arange(-count, count + 1, dtype=torch.int64, device=x.device)
    bits = x.view(torch.int32).long()[..., None] + steps
    return torch.where((bits >= 0) & (bits <= 0x7F800000), bits, 0x7FC00000).int().view(torch.float32)


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
