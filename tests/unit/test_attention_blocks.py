"""Which layout the backends' attention kernels launch: more than one block of a group's rows (prefill)
share each chunk's key and value loads, SUB blocks a program; a group of one block (decode) runs alone.
The bits do not depend on it (the interpreter checks, `triton_checks`); this is the speed choice."""

from detaudit.backends.kernels import triton_attn


def test_prefill_groups_share_chunk_loads_and_decode_groups_run_alone():
    assert triton_attn.SUB in triton_attn.SUBS and triton_attn.SUB > 1
    r = triton_attn.BLOCK_R
    assert [triton_attn.blocks(rows, r) for rows in (1, 4, r)] == [1, 1, 1]  # decode: 1 position x groups
    assert [triton_attn.blocks(rows, r) for rows in (r + 1, 4 * 512)] == [triton_attn.SUB] * 2
    assert triton_attn.blocks(64, 64) == 1 and triton_attn.blocks(65, 64) == triton_attn.SUB
