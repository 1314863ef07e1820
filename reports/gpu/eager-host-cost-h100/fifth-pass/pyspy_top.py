"""Summarise a py-spy raw profile (`py-spy record -f raw`) of `detaudit bench e2e`: samples inside the
eager decode step (graphs.py's step), by the innermost detaudit frame (the library call a sample's time
went to is attributed to the detaudit line that made it). Usage: pyspy_top.py PROFILE [N]."""

import sys
from collections import Counter

counts, total = Counter(), 0
for line in open(sys.argv[1]):
    stack, n = line.rstrip("\n").rsplit(" ", 1)
    frames = stack.split(";")
    if not any("eager_step.<locals>.step" in f for f in frames):
        continue
    total += int(n)
    own = [f for f in frames if "/detaudit/" in f]
    counts[own[-1] if own else frames[-1]] += int(n)
print(f"samples inside the eager decode step: {total}")
for frame, n in counts.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 25):
    print(f"{n:6d} {100 * n / total:5.1f}%  {frame}")
