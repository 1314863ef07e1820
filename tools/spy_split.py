"""Where the main thread's time goes in the decode steps of a `detaudit bench engine` run sampled by
py-spy (`py-spy record --nonblocking --idle -f raw`, as `tools/gpu_session.sh amxspy` runs it): a
diagnosis aid for issue 55, not part of the package.

`python3 tools/spy_split.py RAW RATE [TOP]`: the samples whose stack passes through a decode step
(eager, or replayed from a recording; not the warm-up and capture of a replayed step), split into the
time inside `Team.run` (a product's or the attention's hand-off to the compiled worker team: its own
slice, then the wait for the workers) and everything else on that thread (Python, torch ops, the row
kernels it runs itself), then the TOP (default 12) innermost Python lines by time. RATE: the samples
a second the file was recorded at."""

from __future__ import annotations

import collections
import re
import sys

_LINE = re.compile(r"^(.*) (\d+)$")
_FRAME = re.compile(r" \((.*?):(\d+)\)")


STEPS = ("eager_step.<locals>.step", "replayed_step.<locals>.step")
SETUP = "replayed_step ("  # a replayed step's warm-up and capture, which run the eager step once each


def split(path: str, rate: float) -> tuple[float, float, collections.Counter]:
    """(seconds in decode steps, seconds of those inside Team.run, seconds per innermost frame)."""
    total, team, leaves = 0.0, 0.0, collections.Counter()
    with open(path) as f:
        for line in f:
            m = _LINE.match(line.rstrip())
            if not m or not any(step in m.group(1) for step in STEPS) or SETUP in m.group(1):
                continue
            t = int(m.group(2)) / rate
            leaf = _FRAME.sub(lambda a: f" {a.group(1).rsplit('/', 1)[-1]}:{a.group(2)}", m.group(1).split(";")[-1])
            total += t
            team += t if leaf.startswith("Team.run ") else 0.0
            leaves[leaf] += t
    return total, team, leaves


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    total, team, leaves = split(sys.argv[1], float(sys.argv[2]))
    if total == 0:
        sys.exit("no decode-step samples in the file")
    print(f"decode steps, main thread: {total:.2f} s sampled")
    print("| where | s | share |\n|---|---:|---:|")
    print(f"| Team.run (hand-off, own slice, wait) | {team:.2f} | {team / total:.0%} |")
    print(f"| elsewhere on the thread | {total - team:.2f} | {(total - team) / total:.0%} |\n")
    print("| innermost line | s |\n|---|---:|")
    for leaf, t in leaves.most_common(int(sys.argv[3]) if len(sys.argv) > 3 else 12):
        print(f"| `{leaf}` | {t:.2f} |")


if __name__ == "__main__":
    main()
