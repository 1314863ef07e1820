"""How many query rows a block of the backends' attention kernels holds: a group with more than one
16-row block of rows (prefill) runs blocks of WIDE_R rows, each chunk's keys and values loaded once for
all of them; a group of one block (decode) runs 16. The bits do not depend on it (the GPU checks:
`tests/gpu/test_attention_in_place.py`); this is the speed choice."""

from detaudit.backends.kernels import triton_attn


def test_prefill_groups_run_wide_blocks_and_decode_groups_narrow_ones():
    r, wide = triton_attn.BLOCK_R, triton_attn.WIDE_R
    assert r < wide < 64 and wide in triton_attn.BLOCK_RS  # 64 rows and up: another MMA instruction
    assert [triton_attn.rows_per_block(rows) for rows in (1, 4, r)] == [r] * 3  # decode: 1 position x groups
    assert [triton_attn.rows_per_block(rows) for rows in (r + 1, 4 * 512)] == [wide] * 2
