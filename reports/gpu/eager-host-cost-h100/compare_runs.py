"""Compare two sweep run directories' cell files bitwise: output token ids, token logprobs, top-k."""

import sys
from pathlib import Path

import pyarrow.parquet as pq

a, b = Path(sys.argv[1]), Path(sys.argv[2])
cols = ["prompt_id", "output_token_ids", "token_logprobs", "topk_ids", "topk_logprobs"]
ca, cb = sorted((a / "cells").glob("*.parquet")), sorted((b / "cells").glob("*.parquet"))
print(f"cells: {len(ca)} in {a.name}, {len(cb)} in {b.name}")
ok = bool(ca) and len(ca) == len(cb)
for fa, fb in zip(ca, cb):
    ta, tb = pq.read_table(fa), pq.read_table(fb)
    use = [c for c in cols if c in ta.column_names]
    da = ta.select(use).to_pylist()
    db = tb.select(use).to_pylist()
    key = lambda r: r["prompt_id"]
    da.sort(key=key)
    db.sort(key=key)
    same = da == db
    ntok = sum(len(r["output_token_ids"]) for r in da)
    print(
        f"{fa.name} vs {fb.name}: rows {len(da)}/{len(db)}, tokens {ntok}, columns {use[1:]}: {'bitwise equal' if same else 'DIFFER'}"
    )
    ok &= same and fa.name == fb.name
print("ALL EQUAL" if ok else "NOT EQUAL")
