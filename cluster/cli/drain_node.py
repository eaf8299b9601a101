"""`splitserve drain-node`: hand every replica on this node off before the node goes.

Kubernetes stops a pod (a rollout, a node drain, a spot notice, a scale-down of the Ray worker
group) by running its preStop hook, then sending SIGTERM to the container's first process, and
SIGKILL after terminationGracePeriodSeconds. The first process of a Ray worker pod is `ray
start`, which takes the node down at once: the replicas' streams would end. So the Helm chart's
worker pods run this command as their preStop hook. It sends SIGTERM to each replica worker
process on the node (a Ray actor process titled `ray::...PrefillWorker...` or
`ray::...DecodeWorker...`); each takes it as a drain request (runtime/sigterm_drain.py), the
controller drains it (its streams move to other replicas, migration.migrate_after_s) and
removes it. The command returns once every one of them has exited, or at --timeout-s.

Exit status: 0 when every replica process exited, 1 at the timeout (the ones left are named).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

# What Ray titles a replica actor's process: ray::<name>:<class>.<method> or ray::<class>.
REPLICA_CLASSES = ("PrefillWorker", "DecodeWorker")


def replica_processes(proc: Path = Path("/proc")) -> dict[int, str]:
    """This node's replica worker processes, pid -> title."""
    found = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if title.startswith("ray::") and any(cls in title for cls in REPLICA_CLASSES):
            found[int(entry.name)] = title
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def drain(processes: dict[int, str], timeout_s: float, poll_s: float = 0.5) -> int:
    """SIGTERM each of processes (pid -> title), then wait until all exited or timeout_s."""
    for pid in processes:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    print(f"splitserve drain-node: asked {len(processes)} replica process(es) to drain", flush=True)
    deadline = time.monotonic() + timeout_s
    while (left := {pid: title for pid, title in processes.items() if alive(pid)}) and time.monotonic() < deadline:
        time.sleep(poll_s)
    if left:
        print(f"splitserve drain-node: still running after {timeout_s:g} s: {sorted(left.values())}", file=sys.stderr)
        return 1
    return 0


def drain_node(timeout_s: float) -> int:
    return drain(replica_processes(), timeout_s)


def add_drain_node_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "drain-node",
        help="drain every replica on this node and wait for them to go (a worker pod's preStop hook)",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--timeout-s", type=float, default=150.0, help="give up waiting after this long")
    p.set_defaults(func=lambda args: drain_node(args.timeout_s))
    return p
