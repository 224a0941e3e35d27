"""MomentBatch: one (de)quantization call over many tensors gives each tensor the bits of its own call (torch
reference and interpreted Triton), and CoatFP8Muon's FP8 step, batched, is torch.optim.Muon's step on the dequantized
momentum with the new momentum quantized, bit for bit, whatever the batches."""
import pytest
import torch

from coat_kernels.optim import CoatFP8Muon, dre_reference, moment_batch
from coat_kernels.optim.dre_reference import DREConfig
from coat_kernels.optim.grouping import build_layout

CFG = DREConfig("e4m3")


def layouts_and_values(group_size):
    gen = torch.Generator().manual_seed(0)
    layouts = [build_layout(None, 300, group_size), build_layout([(0, 50, 70), (60, 100, 0)], 170, group_size),
               build_layout(None, 5 * group_size, group_size)]
    values = [torch.randn(lay.numel, generator=gen) * torch.logspace(-6, 2, lay.numel) for lay in layouts]
    return layouts, values


def test_batches_split_consecutive_layouts_by_element_count():
    layouts = [build_layout(None, n, 4) for n in (5, 5, 20, 3, 3)]
    assert moment_batch.batches(layouts, 10) == [range(0, 2), range(2, 3), range(3, 5)]
    assert moment_batch.batches(layouts) == [range(0, 5)]
    assert moment_batch.batches([], 10) == []


@pytest.mark.parametrize("use_triton", [False, True])
def test_one_call_gives_each_tensor_the_bits_of_its_own_call(use_triton):
    if use_triton:
        from coat_kernels.optim import dre_triton as impl
    else:
        impl = dre_reference
    layouts, values = layouts_and_values(32)
    batch = moment_batch.MomentBatch(layouts, torch.device("cpu"), use_triton)
    codes, metas = batch.quantize(values, CFG)
    decoded = batch.dequantize(codes, metas)
    for lay, x, c, meta, d in zip(layouts, values, codes, metas, decoded):
        own_codes, own_meta = impl.quantize(x, lay, CFG)
        assert torch.equal(c.view(torch.uint8), own_codes.view(torch.uint8)) and torch.equal(meta, own_meta)
        assert torch.equal(d, impl.dequantize(own_codes, own_meta, lay))
    finite = [torch.tensor(True), torch.tensor(False), torch.tensor(False)]
    assert int(batch.skipped(finite)) == layouts[1].num_groups + layouts[2].num_groups


def test_quantize_reads_values_lying_end_to_end_in_place_and_copies_others(monkeypatch):
    """dequantize's views, updated in place, reach the quantizer as one view of their buffer (no copy); values
    elsewhere are joined by a copy; the codes are the same either way."""
    layouts, values = layouts_and_values(32)
    batch = moment_batch.MomentBatch(layouts, torch.device("cpu"), False)
    codes, metas = batch.quantize(values, CFG)
    views = batch.dequantize(codes, metas)
    seen = []
    real = dre_reference.quantize
    monkeypatch.setattr(dre_reference, "quantize", lambda flat, *a: seen.append(flat) or real(flat, *a))
    for v in views:
        v.mul_(0.5)
    halved_codes, halved_metas = batch.quantize(views, CFG)
    assert seen[-1].data_ptr() == views[0].data_ptr() and seen[-1].numel() == sum(v.numel() for v in views)
    apart = [v.clone() for v in views]
    apart_codes, apart_metas = batch.quantize(apart, CFG)
    assert seen[-1].data_ptr() not in {v.data_ptr() for v in apart}
    for a, b, ma, mb in zip(halved_codes, apart_codes, halved_metas, apart_metas):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(ma, mb)
    assert moment_batch._joined_values(views[1:]).data_ptr() == views[1].data_ptr()  # a run from mid-buffer


def oracle_steps(weights, grads_per_step, kwargs):
    """torch.optim.Muon, one matrix at a time, its momentum_buffer the dequantized FP8 momentum before each step and
    quantized (the torch reference) after it; a matrix with a NaN/Inf gradient keeps everything."""
    layouts = [build_layout(None, w.numel(), 128) for w in weights]
    state = [dre_reference.quantize(torch.zeros(w.numel()), lay, CFG) for w, lay in zip(weights, layouts)]
    for grads in grads_per_step:
        for i, (w, g, lay) in enumerate(zip(weights, grads, layouts)):
            if not torch.isfinite(g).all():
                continue
            muon = torch.optim.Muon([w], **kwargs)
            w.grad = g.clone()
            muon.state[w]["momentum_buffer"] = dre_reference.dequantize(*state[i], lay).view(w.shape)
            muon.step()
            state[i] = dre_reference.quantize(muon.state[w]["momentum_buffer"].reshape(-1), lay, CFG)
    return state


@pytest.mark.parametrize("max_numel", [None, 1500])
def test_batched_fp8_muon_step_is_torch_muon_on_the_dequantized_momentum(monkeypatch, max_numel):
    if max_numel is not None:
        monkeypatch.setattr(moment_batch, "MAX_BATCH_NUMEL", max_numel)  # three batches of the four matrices
    gen = torch.Generator().manual_seed(1)
    shapes = [(48, 32), (24, 40), (64, 16), (20, 30)]
    start = [torch.randn(s, generator=gen) for s in shapes]
    steps = [[torch.randn(s, generator=gen) * 10.0 ** torch.randint(-4, 1, (1,), generator=gen) for s in shapes]
             for _ in range(4)]
    steps[2][1][3, 4] = float("nan")
    kwargs = dict(lr=0.02, weight_decay=0.1, momentum=0.9)
    ours = [torch.nn.Parameter(w.clone()) for w in start]
    opt = CoatFP8Muon(ours, backend="torch", **kwargs)
    for grads in steps:
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        opt.step()
    theirs = [torch.nn.Parameter(w.clone()) for w in start]
    expected = oracle_steps(theirs, steps, kwargs)
    for p, q, (codes, meta) in zip(ours, theirs, expected):
        assert torch.equal(p.detach(), q.detach())
        assert torch.equal(opt.state[p]["exp_avg_q"].view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(opt.state[p]["exp_avg_meta"], meta)
    assert opt.skipped_groups == build_layout(None, 24 * 40, 128).num_groups
