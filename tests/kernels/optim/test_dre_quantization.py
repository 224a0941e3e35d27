"""FP8 group quantization with Dynamic Range Expansion: grouping, edge cases, and Triton (interpreted on CPU)
against the torch reference. The Triton kernels round to the FP8 grid and use portable log2/exp2, so they agree
with the reference bit for bit even under TRITON_INTERPRET."""
import math
import warnings

import pytest
import torch

from coat_kernels.optim import dre_reference as ref
from coat_kernels.optim import dre_triton as tri
from coat_kernels import portable_math as pm
from coat_kernels.optim.grouping import build_layout

warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy's log2(0) inside the interpreter
G = 128
QUANT = {"reference": (ref.quantize, ref.dequantize), "triton": (tri.quantize, tri.dequantize)}


def same_values(a, b):
    """Equal values (FP8 +0 and -0 count as equal, NaN equals NaN)."""
    a, b = a.float(), b.float()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def roundtrip(x, backend="reference", segments=None, **cfg):
    quantize, dequantize = QUANT[backend]
    layout = build_layout(segments, x.numel(), G)
    codes, meta = quantize(x, layout, ref.DREConfig(cfg.pop("fmt", "e4m3"), **cfg))
    return dequantize(codes, meta, layout), codes, meta


def rel_err(approx, exact):
    nz = exact != 0
    return ((approx[nz] - exact[nz]).abs() / exact[nz].abs()).max().item()


def norm_err(approx, exact):
    return ((approx - exact).norm() / exact.norm()).item()


def test_groups_follow_the_parameter_grid_and_never_straddle_segments():
    layout = build_layout([(0, 300, 0), (300, 50, 100), (360, 200, 1000)], 600, G)
    starts, lengths = layout.group_bounds()
    groups = list(zip(starts.tolist(), lengths.tolist()))
    # segment 0: 128,128,44; segment 1 (param offset 100): head of 28, then 22; segment 2 (offset 1000 = 7*128+104)
    assert groups == [(0, 128), (128, 128), (256, 44), (300, 28), (328, 22), (360, 24), (384, 128), (512, 48)]
    assert layout.num_groups == len(groups)
    with pytest.raises(ValueError, match="ordered"):
        build_layout([(10, 5, 0), (12, 5, 0)], 100, G)
    with pytest.raises(ValueError, match="past the buffer"):
        build_layout([(0, 101, 0)], 100, G)


def test_portable_log2_exp2_accuracy():
    x = torch.cat([torch.rand(50_000) * 1e-30 + 1.2e-38, torch.rand(50_000) * 1e4,
                   torch.tensor([2.0 ** -126, 3e38, 1.0])])
    assert (pm.log2(x).double() - torch.log2(x.double())).abs().max() < 4e-5
    # zero and subnormals (below 2^-126) count as zero
    assert pm.log2(torch.tensor([0.0, 1e-45, 1e-39])).eq(-math.inf).all()
    y = torch.rand(100_000) * 250 - 125
    assert ((pm.exp2(y).double() / torch.exp2(y.double())) - 1).abs().max() < 5e-6
    assert pm.exp2(torch.tensor([-200.0, -math.inf])).eq(0).all()


def test_fma_rounds_once():
    # a*b + c lands just below the midpoint 1 + 3*2^-24: rounding the double sum (the midpoint) to fp32 would
    # give 1 + 2^-22; the single rounding of a fused multiply-add gives 1 + 2^-23
    i = torch.arange(1, 200, dtype=torch.float32)
    a, b = 1 + i * 2.0 ** -23, 2.0 ** -24 * (1 - i * 2.0 ** -23)
    c = torch.full_like(a, 1 + 2.0 ** -23)
    assert ((a.double() * b.double() + c.double()).float() == 1 + 2.0 ** -22).all()
    assert (pm.fma(a, b, c) == 1 + 2.0 ** -23).all()
    assert (pm.fma(-a, b, -c) == -(1 + 2.0 ** -23)).all()
    x, y, z = torch.randn(3, 10_000)
    exact = (x.double() * y.double() + z.double())  # exact here: the sum needs < 53 bits for these magnitudes
    assert torch.equal(pm.fma(x, y, z), exact.float())
    assert pm.fma(torch.tensor([-math.inf]), 1.0, 0.0).item() == -math.inf


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("expand", [True, False])
def test_triton_matches_reference_bit_for_bit(fmt, expand):
    torch.manual_seed(0)
    x = torch.randn(3000) * torch.exp(torch.randn(3000) * 2)
    x[::17] = 0
    x[1000:1128] = 0  # an all-zero group
    segments = [(0, 1500, 0), (1500, 7, 77), (1510, 1490, 300)]
    d_ref, c_ref, m_ref = roundtrip(x, "reference", segments, fmt=fmt, expand=expand)
    d_tri, c_tri, m_tri = roundtrip(x, "triton", segments, fmt=fmt, expand=expand)
    assert same_values(c_ref, c_tri)
    assert torch.equal(m_ref, m_tri)
    assert torch.equal(d_ref, d_tri)
    assert d_ref[1507:1510].eq(0).all()  # elements outside every segment stay zero


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_zero_inside_a_group_does_not_collapse_the_expansion(backend):
    torch.manual_seed(1)
    x = (torch.rand(G) + 0.5) * 1e-3  # R < 3: k far above 1
    x_with_zero = x.clone()
    x_with_zero[0] = 0.0
    _, _, meta = roundtrip(x, backend)
    d, _, meta_zero = roundtrip(x_with_zero, backend)
    assert meta[0].item() > 4 and meta_zero[0].item() == meta[0].item()  # same k: the zero is left out of the min
    assert d[0].item() == 0.0
    assert rel_err(d, x_with_zero) < 0.02


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_edge_groups_constant_tail_zero_and_extreme_magnitudes(backend):
    const = torch.full((G,), -3.25)
    const[::2] = 3.25
    tail = torch.tensor([0.7])
    zeros = torch.zeros(G)
    tiny = (torch.rand(G) + 0.1) * 1e-30
    huge = (torch.rand(G) + 0.1) * 1e30
    x = torch.cat([const, zeros, tiny, huge, tail])  # tail: a 1-element last group
    d, codes, meta = roundtrip(x, backend)
    assert torch.isfinite(d).all() and torch.isfinite(meta).all()
    k = meta[0]
    assert k[0] == 1 and rel_err(d[:G], const) < 1e-5  # constant magnitude: k = 1, code 448, exact up to exp2/log2
    assert d[G:2 * G].eq(0).all() and codes[G:2 * G].float().eq(0).all()
    assert rel_err(d[2 * G:3 * G], tiny) < 0.07
    assert rel_err(d[3 * G:4 * G], huge) < 0.07
    assert k[4] == 1 and d[-1].item() == pytest.approx(0.7, rel=1e-5)
    assert (k >= 1 / 16).all() and (k <= 16).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_segments_of_very_different_scales_side_by_side(backend):
    torch.manual_seed(2)
    a, b = torch.randn(200) * 1e-8, torch.randn(200) * 1e4
    x = torch.cat([a, b])
    d, _, _ = roundtrip(x, backend, segments=[(0, 200, 0), (200, 200, 0)])
    assert norm_err(d[:200], a) < 0.05 and norm_err(d[200:], b) < 0.05
    # One segment: the group that straddles both tensors spans 12 decades and must compress (k < 1): its small
    # values keep a coarse, nonzero value instead of flushing to zero (what segments avoid altogether).
    d_one, _, meta = roundtrip(x, backend)
    assert meta[0, 1] < 1 and d_one[128:200].ne(0).all()
    assert norm_err(d_one[128:200], a[128:200]) > 3 * norm_err(d[128:200], a[128:200])


def _adam_moments():
    """Moments of a small MLP after 30 AdamW steps on a regression task."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(512, 64), torch.randn(512, 64)
    for _ in range(30):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    states = [opt.state[p] for p in model.parameters()]
    return (torch.cat([s["exp_avg"].flatten() for s in states]),
            torch.cat([s["exp_avg_sq"].flatten() for s in states]))


def test_expansion_beats_plain_e4m3_on_real_moments():
    m, v = _adam_moments()
    exact = m / (v.sqrt() + 1e-8)

    def mse(expand, k_max=16.0):
        dm, _, _ = roundtrip(m, expand=expand, k_max=k_max)
        dv, _, _ = roundtrip(v, expand=expand, k_max=k_max)
        return ((dm / (dv.sqrt() + 1e-8) - exact) ** 2).mean().item()

    plain, expanded = mse(False), mse(True)
    assert expanded < 0.8 * plain, (plain, expanded)
    assert mse(True, k_max=16.0) <= mse(True, k_max=8.0) * 1.05  # the default cap is at least as good as 8


@pytest.mark.parametrize("full", [True, False])
def test_gluon_kernel_compiles_for_hopper(full):
    """The CUDA entry point (Gluon: the interpreter cannot run it) builds for sm_90 without a GPU; full rows get
    16-byte loads; FP8 casts are the saturating hardware conversion."""
    from gluon_ptx import hopper_ptx

    if tri.gluon is None:
        pytest.skip("this Triton has no Gluon")
    ptx = hopper_ptx("fp32", full, remainder=False)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert ("ld.global.v4" in ptx) == full  # fp32 params: vector loads on full rows only


def test_coarse_log2_exp2_accuracy():
    x = torch.rand(100_000) * 1e4 + 1e-3
    assert (pm.log2(x, coarse=True).double() - torch.log2(x.double())).abs().max() < 1.3e-4
    y = torch.rand(100_000) * 250 - 125
    assert ((pm.exp2(y, coarse=True).double() / torch.exp2(y.double())) - 1).abs().max() < 8e-5


def test_keep_nonzero_never_rounds_a_magnitude_to_zero():
    """Without expansion, a group spanning more than E4M3 covers zeroes its small values, which for a second moment
    would turn m / (sqrt(v) + eps) into m / eps; keep_nonzero gives them the smallest code. (With expansion, k
    down to 1/16 maps every fp32 range into the format: nothing rounds to zero.)"""
    x = torch.cat([torch.full((64,), 1.0), torch.full((64,), 1e-9)])
    layout = build_layout(None, x.numel(), 128)
    plain, _ = ref.quantize(x, layout, ref.DREConfig("e4m3", expand=False))
    assert plain.float()[64:].eq(0).all()
    expanded, meta = ref.quantize(x, layout, ref.DREConfig("e4m3"))
    assert meta[0, 0] == 0.5 and expanded.float()[64:].ne(0).all()
    cfg = ref.DREConfig("e4m3", expand=False, keep_nonzero=True)
    codes, meta = ref.quantize(x, layout, cfg)
    assert codes.view(torch.uint8)[64:].eq(1).all()  # the smallest subnormal code
    back = ref.dequantize(codes, meta, layout)
    assert (back[64:] > 0).all() and rel_err(back[:64], x[:64]) < 0.07
    codes_t, meta_t = tri.quantize(x, layout, cfg)
    assert torch.equal(codes_t.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(meta_t, meta)


@pytest.mark.parametrize("decades, bound", [(3, 0.0020), (4, 0.0030), (5, 0.0042)])
def test_wide_groups_compress_instead_of_flushing(decades, bound):
    """Groups whose |m| spans 3-5 decades (v twice as many) need k < 1: the relative MSE of m/(sqrt(v)+eps) stays
    within 2x of NVlabs/COAT's (0.0010/0.0015/0.0021 there); k held at 1 gave 0.011/0.17/0.32 on these moments."""
    gen = torch.Generator().manual_seed(decades)
    magnitudes = 1e-2 * 10 ** (-decades * torch.rand(64 * G, generator=gen))
    g = magnitudes * (torch.randint(0, 2, (64 * G,), generator=gen) * 2 - 1)
    v = g * g * (1 + 0.1 * torch.rand(64 * G, generator=gen))
    layout = build_layout(None, g.numel(), G)
    m_codes, m_meta = ref.quantize(g, layout, ref.DREConfig("e4m3"))
    v_codes, v_meta = ref.quantize(v, layout, ref.DREConfig("e4m3", keep_nonzero=True))
    assert (v_meta[0] < 1).all() and (v_meta[0] >= 1 / 16).all()
    exact = g / (v.sqrt() + 1e-8)
    approx = ref.dequantize(m_codes, m_meta, layout) / (ref.dequantize(v_codes, v_meta, layout).sqrt() + 1e-8)
    assert ((approx - exact) ** 2).mean() / (exact ** 2).mean() < bound


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_moments_up_to_fp32_max_decode_finite(backend):
    """exp2 saturates at fp32's maximum instead of overflowing (2^128 is not an fp32 value): moments near 3.4e38
    come back finite and close, in a group with small values too (k < 1) and alone (k = 1)."""
    top = torch.tensor([3.4028234e38, -3.0e38, 2.41e38, 1.0e38])
    x = torch.cat([top, torch.linspace(1, 2, G - 4), top, torch.full((G - 4,), 3.0e38)])
    d, _, meta = roundtrip(x, backend)
    assert torch.isfinite(d).all(), d[~torch.isfinite(d)]
    assert meta[0, 0] < 1 and meta[0, 1] > 1
    assert rel_err(d[:4], top) < 0.3 and rel_err(d[G:G + 4], top) < 0.07
    y = torch.tensor([127.0, 127.4999, 127.5, 127.9, 127.99999, 128.0 - 2 ** -17])
    assert torch.isfinite(pm.exp2(y)).all() and ((pm.exp2(y).double() / torch.exp2(y.double()) - 1).abs() < 1e-5).all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("expand, keep_nonzero, group_size", [(True, False, 128), (True, True, 32), (False, True, 128)])
def test_exact_export_quantizes_back_to_the_same_state(fmt, expand, keep_nonzero, group_size):
    """fp32 moments from exact_export.export quantize back to the same metadata bits and code values (plain
    dequantization does not), on heavy-tailed values, 76-decade log-uniform ones, zeros, constant and near-constant
    groups, over ragged segments."""
    from coat_kernels.optim.exact_export import export, quantized_equal

    g = torch.Generator().manual_seed(0)
    n = 20_000
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    x[5000:10000] = 10 ** (torch.rand(5000, generator=g) * 76 - 38) * torch.sign(torch.randn(5000, generator=g))
    x[10000:10500] = 0
    x[10500:11000] = 2.5
    x[11000:11500] = torch.where(torch.rand(500, generator=g) < 0.5, 1.0, 1.0 + 2 ** -20)
    x[::7] = 0
    layout = build_layout([(0, 3001, 3), (3001, n - 3001, 77)], n, group_size)
    cfg = ref.DREConfig(fmt, expand=expand, keep_nonzero=keep_nonzero)
    codes, meta = ref.quantize(x, layout, cfg)
    values, failed = export(codes, meta, layout, cfg)
    assert failed == 0 and torch.isfinite(values).all()
    assert quantized_equal(*ref.quantize(values, layout, cfg), codes, meta)
    assert torch.equal(ref.dequantize(*ref.quantize(values, layout, cfg), layout), ref.dequantize(codes, meta, layout))
    if expand:
        assert not quantized_equal(*ref.quantize(ref.dequantize(codes, meta, layout), layout, cfg), codes, meta)


# Second-moment groups of a real DeepSpeed run (the 20M Llama, step 3) whose smallest element sits where the
# encoder's coarse log2 parts from the fine one: fp32 neighbours of m that give the same metadata encode to the
# code below m's. (metadata as float.hex: k, log2 centre, log2(scale * Q); the group's E4M3 code bytes)
CODE_BOUNDARY_GROUPS = [
    (['0x1.0000000000000p+0', '-0x1.1948640000000p+5', '0x1.0000040000000p+3'],
     [118, 86, 74, 32, 83, 112, 81, 114, 92, 116, 83, 113, 109, 120, 89, 77, 88, 104, 98, 65, 99, 88, 28, 83, 80,
      93, 94, 110, 28, 93, 109, 115, 104, 101, 84, 117, 91, 65, 126, 88, 101, 66, 104, 24, 112, 116, 102, 106,
      110, 93, 101, 86, 90, 60, 67, 62, 102, 24, 99, 91, 52, 70, 44, 85, 113, 95, 106, 114, 79, 120, 107, 68, 105,
      75, 69, 92, 41, 37, 113, 112, 90, 63, 87, 112, 107, 75, 106, 107, 111, 62, 75, 100, 100, 111, 68, 100, 47,
      116, 49, 96, 113, 111, 55, 96, 76, 96, 96, 63, 76, 100, 96, 104, 90, 78, 106, 104, 77, 118, 86, 4, 79, 99,
      82, 76, 113, 126, 97, 96]),
    (['0x1.8000000000000p+1', '-0x1.90a0fc0000000p+4', '0x1.07c3340000000p+3'],
     [60, 80, 57, 78, 106, 17, 100, 70, 49, 3, 13, 47, 96, 49, 59, 33, 71, 24, 44, 101, 16, 28, 56, 44, 83, 40,
      103, 67, 3, 91, 74, 105, 83, 75, 106, 74, 50, 76, 19, 74, 89, 13, 89, 83, 46, 89, 42, 56, 80, 71, 58, 53,
      57, 94, 84, 42, 87, 95, 104, 126, 33, 69, 101, 86, 59, 76, 59, 82, 105, 17, 101, 72, 49, 4, 16, 45, 93, 52,
      58, 25, 73, 20, 44, 103, 14, 33, 59, 44, 86, 41, 104, 66, 3, 88, 69, 105, 83, 75, 106, 77, 52, 76, 17, 72,
      89, 9, 89, 82, 47, 85, 42, 58, 80, 67, 58, 54, 59, 96, 87, 48, 88, 96, 107, 125, 33, 73, 101, 85]),
]


def test_exact_export_anchors_the_smallest_element_at_its_own_code():
    """The fp32 m' exported for a group's smallest element encodes to that element's code and gives the metadata
    back: in these groups some fp32 values that give the metadata encode to the code below (a universal checkpoint
    holding those would resume with other codes)."""
    from coat_kernels.optim.exact_export import export, quantized_equal

    cfg = ref.DREConfig("e4m3", expand=True)
    for meta_hex, code_bytes in CODE_BOUNDARY_GROUPS:
        layout = build_layout([(0, len(code_bytes), 0)], len(code_bytes), G)
        meta = torch.tensor([[float.fromhex(v)] for v in meta_hex], dtype=torch.float32)
        codes = torch.tensor(code_bytes, dtype=torch.uint8).view(torch.float8_e4m3fn)
        values, failed = export(codes, meta, layout, cfg)
        assert failed == 0
        assert quantized_equal(*ref.quantize(values, layout, cfg), codes, meta)


def test_groups_exported_inexactly_are_reported(monkeypatch):
    """A group with no exact fp32 preimage is exported as its decoded values: to_fp32 says so (a warning naming the
    count) instead of letting a resumed run depart silently."""
    from coat_kernels.optim import CoatFP8AdamW, exact_export, state

    p = torch.nn.Parameter(torch.randn(1000))
    opt = CoatFP8AdamW([p], lr=1e-3, backend="torch")
    p.grad = torch.randn(1000)
    opt.step()
    m_cfg, v_cfg = state.config_of(opt.param_groups[0]).moment_configs()
    exact = state.to_fp32(opt.state[p], m_cfg, v_cfg)
    real_export = exact_export.export
    monkeypatch.setattr(exact_export, "export", lambda *a: (real_export(*a)[0], 2))
    with pytest.warns(RuntimeWarning, match="2 of 8 exp_avg groups have no fp32 values"):
        reported = state.to_fp32(opt.state[p], m_cfg, v_cfg)
    assert all(torch.equal(reported[k], exact[k]) for k in exact)


def test_random_segment_tables_keep_every_group_on_its_parameters_grid():
    """Properties on 300 random segment tables (ordered runs of a flat buffer, each at a random offset of its
    parameter, as ZeRO partitions cut them): the groups tile exactly the segments' elements, in order; none crosses
    a segment's edge or a multiple of the group size in its parameter's coordinates; and none could be longer (each
    group ends at such a boundary)."""
    g = torch.Generator().manual_seed(5)
    for _ in range(300):
        group = int(torch.randint(1, 9, (1,), generator=g)) * 16
        segments, flat = [], int(torch.randint(0, 40, (1,), generator=g))
        for _ in range(int(torch.randint(1, 6, (1,), generator=g))):
            length = int(torch.randint(1, 4 * group, (1,), generator=g))
            offset = int(torch.randint(0, 5 * group, (1,), generator=g))
            segments.append((flat, length, offset))
            flat += length + int(torch.randint(0, 30, (1,), generator=g))
        numel = flat + int(torch.randint(0, 30, (1,), generator=g))
        starts, lengths = build_layout(segments, numel, group).group_bounds()
        groups = list(zip(starts.tolist(), lengths.tolist()))
        expected_elements = [i for s, n, _ in segments for i in range(s, s + n)]
        assert [i for s, n in groups for i in range(s, s + n)] == expected_elements
        for start, length in groups:
            seg_start, seg_len, offset = next(seg for seg in segments if seg[0] <= start < seg[0] + seg[1])
            assert start + length <= seg_start + seg_len  # inside one segment
            first = offset + start - seg_start  # the group's first element in its parameter's coordinates
            assert first // group == (first + length - 1) // group  # one grid cell of the parameter
            ends_segment = start + length == seg_start + seg_len
            assert ends_segment or (first + length) % group == 0  # maximal
