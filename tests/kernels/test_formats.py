"""FP8Format.decode: every code byte of both formats decodes to the bits torch's own conversion gives (NaN, -0 and
subnormals included), for contiguous, strided and empty tensors."""
import pytest
import torch

from coat_kernels.formats import FORMATS


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_decode_is_torchs_conversion_bit_for_bit(name):
    fmt = FORMATS[name]
    every_code = torch.arange(256, dtype=torch.uint8).view(fmt.dtype)
    codes = every_code[torch.randperm(256, generator=torch.Generator().manual_seed(0))].repeat(3).reshape(24, 32)
    for c in (every_code, codes, codes.t(), codes[:, ::2], codes[:0]):
        got = fmt.decode(c)
        assert got.dtype == torch.float32 and got.shape == c.shape
        assert torch.equal(got.view(torch.int32), c.float().view(torch.int32))
