"""The split CPU attention (earlier keys, then the chunk causally, merged by log-sum-exp) equals
one masked attention call, which stays the path on other devices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_backend.models.attention import _FLASH_CPU, PrefillSegment, prefix_then_causal


@pytest.mark.skipif(_FLASH_CPU is None, reason="this torch has no fused CPU attention with LSE")
@pytest.mark.parametrize(
    "heads,kv_heads,prefix,n", [(4, 4, 7, 5), (8, 2, 33, 16), (4, 2, 1, 1), (6, 3, 64, 40)]
)
def test_split_attention_matches_one_masked_call(heads, kv_heads, prefix, n):
    gen = torch.Generator().manual_seed(heads * 100 + prefix)
    dim = 16
    queries = torch.randn(1, heads, n, dim, generator=gen)
    keys = torch.randn(1, kv_heads, prefix + n, dim, generator=gen)
    values = torch.randn(1, kv_heads, prefix + n, dim, generator=gen)
    segment = PrefillSegment(0, n, torch.arange(prefix + n), prefix)
    expected = F.scaled_dot_product_attention(
        queries,
        keys,
        values,
        attn_mask=segment.mask(),
        scale=dim**-0.5,
        enable_gqa=heads != kv_heads,
    )
    got = prefix_then_causal(queries, keys, values, prefix, dim**-0.5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_mask_lets_each_position_see_itself_and_everything_before():
    mask = PrefillSegment(0, 3, torch.arange(5), 2).mask()
    assert mask.tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]
