"""How many query rows a block of the backends' attention kernels holds: a bf16 / fp16 group with more
than one 16-row block of rows (prefill), a head size in WIDE_DS and chunks of 64 keys runs
blocks of WIDE_R rows, each chunk's keys and values loaded once for all of them; every other group runs
16. The bits do not depend on it (the GPU checks: `tests/gpu/test_attention_in_place.py`); this is the
speed choice."""

import torch

from detaudit.backends.kernels import triton_attn


def test_16_bit_prefill_groups_of_wide_heads_run_wide_blocks_and_the_rest_narrow_ones():
    r, wide, d = triton_attn.BLOCK_R, triton_attn.WIDE_R, triton_attn.WIDE_DS[0]
    assert r < wide < 64 and wide in triton_attn.BLOCK_RS  # 64 rows and up: another MMA instruction
    for dt in (torch.bfloat16, torch.float16):
        assert [triton_attn.rows_per_block(rows, dt, d, 64) for rows in (1, 4, r)] == [r] * 3  # decode
        assert [triton_attn.rows_per_block(rows, dt, d, 64) for rows in (r + 1, 4 * 512)] == [wide] * 2
        assert triton_attn.rows_per_block(4 * 512, dt, 256, 64) == r  # not measured: 16
        # a 32-column tile may lay its warps along the rows: narrow heads and chunks stay at 16
        assert triton_attn.rows_per_block(4 * 512, dt, 32, 64) == r
        assert triton_attn.rows_per_block(4 * 512, dt, d, 32) == r
    # fp32's "ieee" product is no MMA: 32 rows a block gave an H200 other bits
    assert [triton_attn.rows_per_block(rows, torch.float32, d, 64) for rows in (4, r + 1, 4 * 512)] == [r] * 3
