"""The RoPE + q/k/v split block (coat_kernels.act.rope.rope_split, torch path) against Llama's rotate-half formula
written here in float64, its backward against autograd through that formula: outputs and d(qkv) within bf16's
rounding of each element (the block computes in fp32 and stores bf16). Both column layouts, grouped-query heads, tables
per position with several rows per position."""
import pytest
import torch

from coat_kernels.act.rope import rope_split


def heads_of(qkv, layout, q_heads, kv_heads, d):
    """q [T, Hq, D], k and v [T, Hkv, D] of a packed qkv in `layout` (as the rope module's docstring describes it)."""
    t = qkv.shape[0]
    if layout == "split":
        q, k, v = qkv.split([q_heads * d, kv_heads * d, kv_heads * d], dim=1)
        return q.reshape(t, q_heads, d), k.reshape(t, kv_heads, d), v.reshape(t, kv_heads, d)
    per = q_heads // kv_heads
    groups = qkv.reshape(t, kv_heads, per + 2, d)
    return groups[:, :, :per].reshape(t, q_heads, d), groups[:, :, per], groups[:, :, per + 1]


def rotate(x, cos, sin):
    """Llama: x * cos + rotate_half(x) * sin, cos/sin [T, D/2] duplicated over both halves."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


@pytest.mark.parametrize("layout", ["split", "grouped"])
@pytest.mark.parametrize("rows_per_position", [1, 2])
def test_rope_split_and_its_backward_match_the_rotate_half_formula(layout, rows_per_position):
    torch.manual_seed(0)
    positions, q_heads, kv_heads, d = 12, 4, 2, 16
    t = positions * rows_per_position
    qkv = torch.randn(t, (q_heads + 2 * kv_heads) * d).to(torch.bfloat16).requires_grad_(True)
    angles = torch.rand(positions, d // 2, dtype=torch.float64) * 6.0
    cos, sin = angles.cos().float(), angles.sin().float()
    q, k, v = rope_split(qkv, cos, sin, d, kv_heads, False, layout=layout, rows_per_position=rows_per_position)
    dq, dk, dv = (torch.randn_like(x) for x in (q, k, v))
    torch.autograd.backward((q, k, v), (dq, dk, dv))

    row = torch.arange(t) // rows_per_position  # the table row of each token
    c64, s64 = cos.double()[row], sin.double()[row]
    x = qkv.detach().double().requires_grad_(True)
    q_ref, k_ref, v_ref = heads_of(x, layout, q_heads, kv_heads, d)
    outs = (rotate(q_ref, c64, s64).reshape(t, -1), rotate(k_ref, c64, s64).reshape(t, -1), v_ref.reshape(t, -1))
    torch.autograd.backward(outs, tuple(g.double() for g in (dq, dk, dv)))

    for got, expected in zip((q, k, v), outs):
        bound = 2.0 ** -8 * expected.abs().detach() + 1e-30  # one bf16 rounding of each element
        assert ((got.double() - expected.detach()).abs() <= bound).all()
    bound = 2.0 ** -8 * x.grad.abs() + 1e-6  # the fp32 sums of two products, then one bf16 rounding
    assert ((qkv.grad.double() - x.grad).abs() <= bound).all(), (qkv.grad.double() - x.grad).abs().max()
