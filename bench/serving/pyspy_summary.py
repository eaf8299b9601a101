"""Self and inclusive share of each function in a py-spy `--format raw` file (collapsed stacks):
`python -m splitserve.bench.serving.pyspy_summary FILE` (bench/scripts/splitserve_vs_vllm_pyspy_ingress.sh
runs it on the ingress replica's and the decode actor's profiles)."""

from __future__ import annotations

import collections
import re
import sys


def summarize(path: str, top: int = 30) -> str:
    own, inclusive = collections.Counter(), collections.Counter()
    total = 0
    for line in open(path, encoding="utf-8").read().splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        frames = [re.sub(r":\d+\)", ")", frame) for frame in stack.split(";")]  # one line per function
        total += int(count)
        own[frames[-1]] += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    lines = [f"{path}: {total} samples", "self:"]
    lines += [f"{n / total:6.1%} {frame}" for frame, n in own.most_common(top)]
    lines += ["inclusive:"] + [f"{n / total:6.1%} {frame}" for frame, n in inclusive.most_common(2 * top)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1]))
