"""FP8 activation kernels: each Triton kernel (TRITON_INTERPRET=1 on CPU, set by conftest) against its torch
reference, plus the numerics the references promise (power-of-two 1x16 scales, saturation, Inf/NaN, padding).

The interpreter rounds fp32 -> bf16 by truncation where the GPU rounds to nearest: BF16 outputs are compared
within one bf16 step; FP8 codes produced from identical fp32 values are compared exactly."""
import math
import warnings

import pytest
import torch
import triton
import triton.language as tl

from coat_kernels.act import group_quant as GQ
from coat_kernels.act import norm as N
from coat_kernels.act import pointwise as P
from coat_kernels.act import rope as R
from coat_kernels.act import swiglu as S
from coat_kernels.act import tensor_quant as TQ
from coat_kernels.act.handoff import GradientAmaxHandoff
from coat_kernels.act.scaling import ScaleTickets, StageOneAmax, finalize_scale
from coat_kernels.act.tiles import cdiv, group_tile, next_power_of_2, pad16, store_cast_groups
from coat_kernels.formats import E4M3, E5M2

warnings.filterwarnings("ignore", category=RuntimeWarning)


def same(a, b):
    a, b = a.float(), b.float()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def close_fp8(a, b, frac=0.02):
    """FP8 codes equal except a small fraction one step apart (fp32 math of different order, e.g. exp)."""
    a, b = a.float(), b.float()
    diff = (a != b) & ~(a.isnan() & b.isnan())
    step = torch.maximum(a.abs(), b.abs()) * 2.0 ** -2 + 2.0 ** -9
    return diff.float().mean().item() <= frac and bool(((a - b).abs()[diff] <= step[diff]).all())


def bf16_close(a, b):
    return torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=1e-6)


def spread(m, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k)).bfloat16()


def test_host_grid_helpers_match_tritons():
    assert [cdiv(a, b) for a in range(0, 300) for b in (1, 3, 16, 2048)] == \
        [triton.cdiv(a, b) for a in range(0, 300) for b in (1, 3, 16, 2048)]
    assert [next_power_of_2(n) for n in range(-3, 5000)] == [triton.next_power_of_2(n) for n in range(-3, 5000)]


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_group_quantize_triton_matches_reference(fmt):
    x = spread(37, 96)
    x[3, 5], x[7, 40], x[9, 0] = float("nan"), float("inf"), -float("inf")
    x[11, 16:32] = 0.0
    q_ref, e_ref = GQ.group_quantize(x, fmt, False)
    q_tri, e_tri = GQ.group_quantize(x, fmt, True)
    assert same(e_ref, e_tri) and e_tri.dtype == torch.bfloat16
    good = (~e_ref.float().isnan()).repeat_interleave(16, -1)
    assert same(q_ref.float()[good], q_tri.float()[good])  # interpreter: NaN -> e4m3 is 384, scale NaN anyway
    d_ref = GQ.group_dequantize(q_ref, e_ref, False, torch.float32)
    d_tri = GQ.group_dequantize(q_tri, e_tri, True, torch.float32)
    assert same(d_ref, d_tri)
    b_ref = GQ.group_dequantize(q_ref, e_ref, False)
    b_tri = GQ.group_dequantize(q_tri, e_tri, True)  # bf16: the interpreter truncates
    assert torch.allclose(b_ref.float(), b_tri.float(), rtol=2 ** -7, atol=0, equal_nan=True)


def test_group_scales_are_bf16_rounded_to_nearest_and_error_is_bounded():
    x = spread(64, 128)
    q, e = GQ.group_quantize(x, E4M3, False)
    scale = e.float()
    amax = x.float().reshape(64, 8, 16).abs().amax(-1)
    assert same(e, (amax / 448).bfloat16())  # nearest, ties to even
    assert bool(((amax / scale - 448).abs() <= 448 * 2 ** -8).all())
    d = GQ.group_dequantize(q, e, False, torch.float32)
    big = x.float().abs() >= scale.repeat_interleave(16, -1) * 2.0 ** -6  # normal range of E4M3
    rel = ((d - x.float()).abs() / x.float().abs())[big]
    assert rel.max().item() <= 2.0 ** -4 + 1e-6


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_group_scale_ties_to_even_and_the_largest_element_saturates(fmt):
    """amax / FP8_MAX exactly halfway between two bf16 values rounds to the even one (down for 1 + 2^-8, up for
    1 + 3 * 2^-8); rounded down, the largest element saturates to +-FP8_MAX, never NaN; the kernel agrees."""
    x = torch.full((2, 32), 0.5)
    x[0, 3] = fmt.max * (1 + 2 ** -8)
    x[0, 20] = -fmt.max * (1 + 3 * 2 ** -8)
    x[1, :16] = 1e-45  # a subnormal amax: the scale stays the smallest normal fp32
    for use_triton in (False, True):
        q, e = GQ.group_quantize(x, fmt, use_triton)
        assert e[0].float().tolist() == [1.0, 1 + 2 ** -6] and e[1, 0].float().item() == 2.0 ** -126
        assert q[0, 3].float().item() == fmt.max and not q.float().isnan().any()
        assert GQ.group_dequantize(q, e, use_triton, torch.float32)[0, 20].item() == -fmt.max * (1 + 2 ** -6)


def test_group_quantize_special_groups():
    x = torch.randn(4, 64)
    x[0, :16] = 0.0
    x[1, 20] = float("nan")
    x[2, 33] = float("inf")
    q, e = GQ.group_quantize(x, E4M3, False)
    d = GQ.group_dequantize(q, e, False, torch.float32)
    assert e[0, 0].item() == 1.0 and bool((d[0, :16] == 0).all())
    assert bool(d[1, 16:32].isnan().all()) and bool(d[2, 32:48].isnan().all())
    assert int(d.isnan().sum()) == 32  # only the two groups holding Inf/NaN
    with pytest.raises(ValueError, match="multiple of 16"):
        GQ.group_quantize(torch.randn(4, 40), E4M3, False)


def test_per_tensor_scale_and_cast_with_transpose():
    x = spread(37, 48, seed=1)  # 37 rows: the transposed copy is padded to 48 columns of zeros
    s_tri = finalize_scale(TQ.amax_partials(x, True), E4M3, True)
    s_ref = TQ.tensor_scale_reference(x, E4M3)
    assert s_tri.dtype == torch.float32 and s_tri.dim() == 0 and torch.equal(s_tri, s_ref)
    for fmt in (E4M3, E5M2):
        a = TQ.cast(x, s_ref, fmt, True, write_t=True)
        b = TQ.cast(x, s_ref, fmt, False, write_t=True)
        assert same(a[0], b[0]) and same(a[1], b[1])
        assert a[1].shape == (48, 48) and bool((a[1][:, 37:].float() == 0).all())
        assert same(a[1][:, :37].t(), a[0])


def test_cast_of_an_fp32_source_writes_both_copies_like_the_reference():
    x = spread(37, 48, seed=3).float() * (1 + 2 ** -12)  # fp32 values that are not bf16 values
    s = TQ.tensor_scale_reference(x, E4M3)
    for fmt in (E4M3, E5M2):
        a = TQ.cast(x, s, fmt, True, write_t=True)
        b = TQ.cast(x, s, fmt, False, write_t=True)
        assert close_fp8(a[0], b[0]) and close_fp8(a[1], b[1])
        assert same(a[1][:, :37].t(), a[0])


def test_norm_residual_sum_keeps_the_promoted_dtype():
    m, h = 9, 64
    x, w = spread(m, h, seed=4) * 0.01, torch.ones(h).bfloat16()
    r = torch.randn(m, h) * (1 + 2 ** -12)  # an fp32 residual stream under BF16 blocks
    ref = N.norm_forward(x, w, None, False, residual=r)
    tri = N.norm_forward(x, w, None, True, residual=r)
    assert ref[0].dtype == tri[0].dtype == torch.float32
    assert torch.allclose(tri[0], ref[0], rtol=0, atol=1e-6) and torch.equal(ref[0], x.float() + r)


def test_stage_one_partials_across_programs_and_special_values():
    x = torch.randn(40000)
    x[12345] = 77.0
    assert TQ.amax_partials(x, True).partials.numel() > 1
    assert TQ.tensor_scale(x, E4M3, True).item() == pytest.approx(77.0 / 448)
    assert TQ.tensor_scale(torch.zeros(100), E4M3, True).item() == 1.0
    x[5] = float("inf")
    assert math.isnan(TQ.tensor_scale(x, E5M2, True).item())
    assert math.isnan(TQ.tensor_scale(x, E5M2, False).item())


def test_saturation_never_produces_nan():
    x = torch.tensor([[1e6, -1e6] + [1.0] * 14])
    s = torch.tensor(1.0)
    for tri in (False, True):
        q, _ = TQ.cast(x, s, E4M3, tri)
        assert q.float()[0, 0].item() == 448 and q.float()[0, 1].item() == -448


@pytest.mark.parametrize("kind,bias,zc,residual", [("rmsnorm", False, False, True), ("layernorm", True, True, False)])
def test_norm_kernels_match_reference(kind, bias, zc, residual):
    m, h = 21, 96
    x = spread(m, h, seed=2) * 0.01
    r = torch.randn(m, h).bfloat16() if residual else None
    w = (1 + 0.1 * torch.randn(h)).bfloat16()
    b = (0.1 * torch.randn(h)).bfloat16() if bias else None
    kw = dict(residual=r, kind=kind, zero_centered=zc)
    ref = N.norm_forward(x, w, b, False, **kw)
    tri = N.norm_forward(x, w, b, True, **kw)
    if residual:  # the interpreter's bf16 sum may be one step off: check the rest against the reference of it
        assert bf16_close(tri[0], ref[0])
        ref = N.norm_forward(tri[0], w, b, False, kind=kind, zero_centered=zc)
    assert torch.equal(tri[1].float(), ref[1].float()) and torch.equal(tri[2], ref[2])
    assert torch.allclose(tri[4], ref[4], rtol=1e-4)
    args = tuple(ref[1:5])
    s = finalize_scale(ref[5], E4M3, False)
    assert torch.allclose(finalize_scale(tri[5], E4M3, True), s, rtol=1e-4)
    ca = N.norm_cast(*args, w, b, s, True, zero_centered=zc, write_t=True)
    cb = N.norm_cast(*args, w, b, s, False, zero_centered=zc, write_t=True)
    assert close_fp8(ca[0], cb[0]) and close_fp8(ca[1], cb[1])
    assert same(ca[0].t(), ca[1][:, :m])  # the forward's and the weight-gradient GEMM's operands agree
    dy = torch.randn(m, h).bfloat16()
    dres = torch.randn(m, h).bfloat16()
    kw = dict(dres=dres, has_bias=bias, zero_centered=zc, partial_amax=True)
    ga = N.norm_backward(*args, w, dy, True, **kw)
    gb = N.norm_backward(*args, w, dy, False, **kw)
    assert bf16_close(ga[0], gb[0])
    assert torch.allclose(ga[1], gb[1], rtol=1e-4, atol=1e-4)
    if bias:
        assert torch.allclose(ga[2], gb[2], rtol=1e-4, atol=1e-4)
    assert torch.allclose(ga[3].partials.max(), gb[3].partials.max(), rtol=1e-2)


def test_norm_backward_matches_autograd_on_the_dequantized_input():
    m, h = 8, 64
    x = torch.randn(m, h)
    w = 1 + 0.1 * torch.randn(h)
    _, q, e, mean, rstd, _ = N.norm_forward(x, w, None, False, kind="layernorm")
    xd = GQ.group_dequantize(q, e, False, torch.float32).requires_grad_()
    y = torch.nn.functional.layer_norm(xd, (h,), w, None, 1e-5)
    dy = torch.randn(m, h)
    y.backward(dy)
    dx, dw, _ = N.norm_backward(q, e, mean, rstd, w, dy, False)
    assert torch.allclose(dx, xd.grad, atol=1e-4)
    assert torch.allclose(dw, ((xd.detach() - mean[:, None]) * rstd[:, None] * dy).sum(0), atol=1e-4)


def test_swiglu_kernels_match_reference():
    m, f = 19, 48
    x = spread(m, 2 * f, seed=3) * 0.01
    ref = S.swiglu_forward(x, False, write_out=True)
    tri = S.swiglu_forward(x, True, write_out=True)
    assert torch.equal(ref[0].float(), tri[0].float()) and torch.equal(ref[1], tri[1])
    assert bf16_close(tri[3], ref[3])
    s = finalize_scale(ref[2], E4M3, False)
    assert torch.allclose(finalize_scale(tri[2], E4M3, True), s, rtol=1e-5)
    ca = S.swiglu_cast(ref[0], ref[1], s, True, write_t=True)
    cb = S.swiglu_cast(ref[0], ref[1], s, False, write_t=True)
    assert close_fp8(ca[0], cb[0]) and close_fp8(ca[1], cb[1])
    dy = torch.randn(m, f).bfloat16()
    ga, pa = S.swiglu_backward(ref[0], ref[1], dy, True)
    gb, pb = S.swiglu_backward(ref[0], ref[1], dy, False)
    assert bf16_close(ga, gb) and torch.allclose(pa.partials.max(), pb.partials.max(), rtol=1e-2)
    ds = TQ.tensor_scale(gb, E5M2, False)
    ca = S.swiglu_backward_cast(ref[0], ref[1], dy, ds, True)
    cb = S.swiglu_backward_cast(ref[0], ref[1], dy, ds, False)
    assert close_fp8(ca[0], cb[0], frac=0.04) and close_fp8(ca[1], cb[1], frac=0.04)
    # exact against the cast of the kernel's own BF16 gradient (the interpreter truncates to BF16, so about half
    # of them are one BF16 step off the reference's, which moves 1-2% of the E5M2 codes by one step)
    cc = TQ.cast(ga, ds, E5M2, False, write_t=True)
    assert same(ca[0], cc[0]) and same(ca[1], cc[1])
    amax_only, none = S.swiglu_backward_amax(ref[0], ref[1], dy, True)
    assert none is None and same(amax_only.partials.max(), pa.partials.max())
    # the amax pass that also writes the product's transposed copy (fc2's wgrad operand)
    ptri = S.swiglu_cast(ref[0], ref[1], s, True, write_row=False, write_t=True)[1]
    for tri in (True, False):
        pa2, pt = S.swiglu_backward_amax(ref[0], ref[1], dy, tri, product_scale=s)
        assert torch.allclose(pa2.partials.max(), pb.partials.max(), rtol=1e-2) and pt.shape == ptri.shape
        assert same(pt, ptri) if tri else close_fp8(pt, ptri)


@pytest.mark.parametrize("name,fn", [("silu", torch.nn.functional.silu), ("gelu", torch.nn.functional.gelu)])
def test_pointwise_kernels(name, fn):
    x = (torch.randn(5, 64) * 3).bfloat16()
    ya, qa, ea = P.act_forward(x, name, True)
    yb, qb, eb = P.act_forward(x, name, False)
    assert torch.equal(qa.float(), qb.float()) and torch.equal(ea, eb) and bf16_close(ya, yb)
    xd = GQ.group_dequantize(qb, eb, False, torch.float32).requires_grad_()
    fn(xd).backward(torch.ones_like(xd))
    dy = torch.ones(5, 64)
    for tri in (True, False):
        assert torch.allclose(P.act_backward(qb, eb, dy, name, tri), xd.grad, atol=1e-5)


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_rope_split_matches_rotate_half(q_heads, kv_heads):
    seq, d = 8, 16
    h, hkv = q_heads * d, kv_heads * d
    cos, sin = R.rope_tables(seq, d)
    qkv = torch.randn(2 * seq, h + 2 * hkv, requires_grad=True)
    grads = [torch.randn(2 * seq, w) for w in (h, hkv, hkv)]
    results = []
    for tri in (True, False):
        qkv.grad = None
        handoff = GradientAmaxHandoff()
        outs = R.rope_split(qkv, cos, sin, d, kv_heads, tri, handoff=handoff, tickets=ScaleTickets())
        torch.autograd.backward(outs, grads)
        results.append((outs, qkv.grad.clone()))
        assert handoff.take(qkv.grad) is None  # the hand-off is keyed by the very tensor autograd got
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.allclose(a, b, atol=1e-5)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-5)

    def rotated(x, heads):
        x = x.reshape(2 * seq, heads, d)
        pos = torch.arange(2 * seq) % seq
        c, s = torch.cat([cos, cos], -1)[pos][:, None], torch.cat([sin, sin], -1)[pos][:, None]
        return (x * c + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * s).reshape(2 * seq, heads * d)

    x = qkv.detach()
    assert torch.allclose(results[1][0][0], rotated(x[:, :h], q_heads), atol=1e-5)
    assert torch.allclose(results[1][0][1], rotated(x[:, h:h + hkv], kv_heads), atol=1e-5)
    assert torch.equal(results[1][0][2], x[:, h + hkv:])
    # backward is the inverse rotation: the gradient of sum(v * g) is g
    assert torch.allclose(results[1][1][:, h + hkv:], grads[2])


def test_rope_tables_per_token():
    """Tables gathered per token (position ids, P = T rows) equal per-position tables used with t % seq."""
    seq, d = 8, 16
    cos, sin = R.rope_tables(seq, d)
    pos = torch.arange(2 * seq) % seq
    qkv = torch.randn(2 * seq, 3 * 2 * d)
    for tri in (True, False):
        a = R.rope_split(qkv, cos, sin, d, 2, tri)
        b = R.rope_split(qkv, cos[pos].contiguous(), sin[pos].contiguous(), d, 2, tri)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="heads"):
        R.rope_split(torch.randn(4, 5 * d), cos, sin, d, 2, False)


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_rope_split_megatron_layout(q_heads, kv_heads):
    """Megatron's linear_qkv layout (per key/value group: its query heads, its key, its value) with sequence-major
    tokens ([s, b] order, table row t // b): the same as splitting with Megatron's views and rotating per position."""
    seq, b, d = 6, 3, 16
    r = q_heads // kv_heads
    cos, sin = R.rope_tables(seq, d)
    qkv = torch.randn(seq * b, (q_heads + 2 * kv_heads) * d, requires_grad=True)
    grads = [torch.randn(seq * b, w * d) for w in (q_heads, kv_heads, kv_heads)]
    results = []
    for tri in (True, False):
        qkv.grad = None
        outs = R.rope_split(qkv, cos, sin, d, kv_heads, tri, layout="grouped", rows_per_position=b)
        torch.autograd.backward(outs, grads)
        results.append(([o.detach() for o in outs], qkv.grad.clone()))
    for a, c in zip(results[0][0] + [results[0][1]], results[1][0] + [results[1][1]]):
        assert torch.allclose(a, c, atol=1e-5)

    x = qkv.detach().view(seq, b, kv_heads, r + 2, d)  # Megatron: [s, b, ng, (np/ng + 2) * hn]
    q, k, v = x[:, :, :, :r], x[:, :, :, r], x[:, :, :, r + 1]
    c2, s2 = (torch.cat([t, t], -1)[:, None, None] for t in (cos, sin))  # [s, 1, 1, d], Megatron's emb form

    def rotated(t):
        t = t.reshape(seq, b, -1, d)
        return (t * c2 + torch.cat([-t[..., d // 2:], t[..., : d // 2]], -1) * s2).reshape(seq * b, -1)

    ref = (rotated(q), rotated(k), v.reshape(seq * b, -1))
    for out, want in zip(results[1][0], ref):
        assert torch.allclose(out, want, atol=1e-5)
    # backward: the inverse rotation, written back into the grouped layout (v's gradient passes through)
    dv = results[1][1].view(seq, b, kv_heads, r + 2, d)[:, :, :, r + 1]
    assert torch.equal(dv.reshape(seq * b, -1), grads[2])
    with pytest.raises(ValueError, match="layout"):
        R.rope_split(qkv, cos, sin, d, kv_heads, False, layout="interleaved")
    with pytest.raises(ValueError, match="rows_per_position"):
        R.rope_split(qkv, cos, sin, d, kv_heads, False, rows_per_position=0)


def test_gradient_amaxes_are_handed_over_only_to_the_same_unchanged_tensor():
    handoff = GradientAmaxHandoff()
    t = torch.randn(4, 16)
    amax = StageOneAmax(torch.tensor([3.0]))
    handoff.give(t, amax)
    assert handoff.take(t.clone()) is None
    assert handoff.take(t) is amax
    assert handoff.take(t) is None  # taken once
    handoff.give(t, amax)
    t.add_(1.0)  # in-place change after the amax was taken
    assert handoff.take(t) is None


@triton.jit
def _cast_groups_kernel(x_ptr, scale_ptr, out_ptr, out_t_ptr, M, N, M_PAD, BM: tl.constexpr, G: tl.constexpr,
                        BY_PERMUTE: tl.constexpr):
    pid = tl.program_id(0)
    n_g = tl.cdiv(N // 16, G)
    g0 = (pid % n_g) * G
    rows = ((pid // n_g) * BM + tl.arange(0, BM)).to(tl.int64)
    offs, _, mask = group_tile(rows, g0, M, N, N // 16, G)
    y = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    store_cast_groups(y, rows, g0, tl.load(scale_ptr), out_ptr, out_t_ptr, M, N, M_PAD, G, True, True, False,
                      BY_PERMUTE)


@pytest.mark.parametrize("by_permute", [False, True])
@pytest.mark.parametrize("bm,g", [(8, 2), (16, 4)])
def test_group_tile_casts_write_the_reference_codes_both_ways(by_permute, bm, g):
    """Both ways store_cast_groups transposes a tile (reshape + trans, permute + reshape) give the reference codes,
    row-major and transposed, for tiles that do and do not divide the shape."""
    m, n = 37, 96
    x = spread(m, n, seed=7).float()
    scale = TQ.tensor_scale_reference(x, E4M3)
    mp = pad16(m)
    out = torch.empty(m, n, dtype=E4M3.dtype)
    out_t = torch.empty(n, mp, dtype=E4M3.dtype)
    grid = (triton.cdiv(mp, bm) * triton.cdiv(n // 16, g),)
    _cast_groups_kernel[grid](x, scale, out, out_t, m, n, mp, BM=bm, G=g, BY_PERMUTE=by_permute)
    ref, ref_t = TQ.cast_reference(x, scale, E4M3, write_row=True, write_t=True)
    assert same(out, ref) and same(out_t, ref_t)


def test_stage_two_runs_in_the_producing_launch(monkeypatch):
    """Kernels that write partial amaxes also reduce them to the scale (the last program to finish does it), so
    finalize_scale launches nothing; the result equals the separate reduction, and the tickets are left at 0."""
    monkeypatch.setattr(TQ, "AMAX_BLOCK", 1024)
    tickets = ScaleTickets()
    x = spread(300, 64, seed=9)
    for fmt in (E4M3, E5M2):
        amax = TQ.amax_partials(x, True, fmt, tickets)
        assert amax.partials.numel() > 1 and amax.scale is not None
        separate = finalize_scale(StageOneAmax(amax.partials.clone()), fmt, True)
        assert torch.equal(finalize_scale(amax, fmt, True), separate)
        assert torch.equal(separate, TQ.tensor_scale_reference(x, fmt))
    *_, amax = N.norm_forward(x, torch.ones(64), None, True, tickets=tickets)
    assert torch.equal(finalize_scale(amax, E4M3, True), finalize_scale(StageOneAmax(amax.partials), E4M3, True))
    x[17, 3] = float("inf")
    assert math.isnan(TQ.tensor_scale(x, E4M3, True, tickets).item())
    assert not bool(tickets._pools[torch.device("cpu")][0].any())


def test_blocks_launch_no_separate_finalize(monkeypatch):
    from coat_kernels.act import ActivationConfig, CoatRuntime, fp8_norm_linear, fp8_norm_swiglu_mlp
    from coat_kernels.act import scaling

    launches = []
    real = scaling._finalize_scale_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(scaling, "_finalize_scale_kernel", Counting())
    torch.manual_seed(3)
    kw = dict(config=ActivationConfig(backend="triton"), runtime=CoatRuntime())
    x = torch.randn(40, 64).bfloat16().requires_grad_()
    nw, w, w1, w2 = (torch.ones(64).bfloat16(), torch.randn(96, 64).bfloat16() / 8, torch.randn(96, 64).bfloat16() / 8,
                     torch.randn(64, 48).bfloat16() / 7)
    y, xr = fp8_norm_linear(x, nw, None, w, residual_out=True, **kw)
    out, h = fp8_norm_swiglu_mlp(y[:, :64].contiguous(), nw, None, w1, w2, residual=xr, **kw)
    (out + h).sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad.float()).all())
    assert launches == []  # every scale was reduced in the launch that produced its partials


def test_gelu_tanh_kernels_match_reference():
    """GeGLU (gelu_tanh(gate) * up): every gated-GLU kernel against its torch reference."""
    m, f, act = 19, 48, "gelu_tanh"
    x = (torch.randn(m, 2 * f, generator=torch.Generator().manual_seed(5)) * 2).bfloat16()
    ref = S.swiglu_forward(x, False, activation=act, write_out=True)
    tri = S.swiglu_forward(x, True, activation=act, write_out=True)
    assert torch.equal(ref[0].float(), tri[0].float()) and torch.equal(ref[1], tri[1])
    assert bf16_close(tri[3], ref[3])
    assert not torch.equal(ref[3], S.swiglu_forward(x, False, write_out=True)[3])  # not the SiLU product
    s = finalize_scale(ref[2], E4M3, False)
    assert torch.allclose(finalize_scale(tri[2], E4M3, True), s, rtol=1e-5)
    ca = S.swiglu_cast(ref[0], ref[1], s, True, activation=act, write_t=True)
    cb = S.swiglu_cast(ref[0], ref[1], s, False, activation=act, write_t=True)
    assert close_fp8(ca[0], cb[0]) and close_fp8(ca[1], cb[1])
    dy = torch.randn(m, f).bfloat16()
    ga, pa = S.swiglu_backward(ref[0], ref[1], dy, True, activation=act)
    gb, pb = S.swiglu_backward(ref[0], ref[1], dy, False, activation=act)
    assert bf16_close(ga, gb) and torch.allclose(pa.partials.max(), pb.partials.max(), rtol=1e-2)
    ds = TQ.tensor_scale(gb, E5M2, False)
    ca = S.swiglu_backward_cast(ref[0], ref[1], dy, ds, True, activation=act)
    cb = S.swiglu_backward_cast(ref[0], ref[1], dy, ds, False, activation=act)
    assert close_fp8(ca[0], cb[0], frac=0.04) and close_fp8(ca[1], cb[1], frac=0.04)
    cc = TQ.cast(ga, ds, E5M2, False, write_t=True)  # exact against the cast of the kernel's own BF16 gradient
    assert same(ca[0], cc[0]) and same(ca[1], cc[1])
    amax_only, none = S.swiglu_backward_amax(ref[0], ref[1], dy, True, activation=act)
    assert none is None and same(amax_only.partials.max(), pa.partials.max())
    ptri = S.swiglu_cast(ref[0], ref[1], s, True, activation=act, write_row=False, write_t=True)[1]
    for tri in (True, False):
        pa2, pt = S.swiglu_backward_amax(ref[0], ref[1], dy, tri, activation=act, product_scale=s)
        assert torch.allclose(pa2.partials.max(), pb.partials.max(), rtol=1e-2) and pt.shape == ptri.shape
        assert same(pt, ptri) if tri else close_fp8(pt, ptri)


def test_gelu_tanh_reference_is_autograd_of_torch_gelu_on_the_dequantized_input():
    m, f = 8, 32
    x = (torch.randn(m, 2 * f, generator=torch.Generator().manual_seed(6)) * 3).bfloat16()
    x[0, :4] = torch.tensor([30.0, -30.0, 0.0, 1e-3])  # saturated tanh, zero, tiny
    q, e = GQ.group_quantize(x, E4M3, False)
    xd = GQ.group_dequantize(q, e, False, torch.float32).requires_grad_()
    g, u = xd.chunk(2, -1)
    y = torch.nn.functional.gelu(g, approximate="tanh") * u
    dy = torch.randn(m, f).bfloat16()
    y.backward(dy.float())
    assert torch.allclose(S.swiglu_product_reference(q, e, "gelu_tanh"), y.detach(), rtol=1e-5, atol=1e-5)
    # within one bf16 step, or 1e-4 where the derivative is a cancellation near zero (tanh's fp32 form vs torch's)
    assert torch.allclose(S.swiglu_grad_reference(q, e, dy, "gelu_tanh").float(), xd.grad, rtol=2 ** -7, atol=1e-4)


def test_gated_activations_are_checked():
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(ValueError, match="gelu_erf"):
        S.swiglu_forward(x, False, activation="gelu_erf")
