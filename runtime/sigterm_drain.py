"""SIGTERM on a replica's worker process asks for a drain instead of ending its streams.

Kubernetes deletes a pod (a rollout, a node drain, a spot notice) by sending its processes
SIGTERM and, after the grace period, SIGKILL. A replica that exits at once loses every
stream it runs; one that is drained hands them to other replicas first (migration.
migrate_after_s). So the worker's SIGTERM handler only records the request: the replica's
state (PollReply.terminating) carries it to the controller, which drains the replica as a
scale-down does, keeps the pool's target (the replica is replaced), and kills its actor once
drained -- the process exits then.

What still ends the process: a second SIGTERM, or `grace_s` without the controller acting
(the controller gone): either passes SIGTERM on to the handler that was there before (Ray's,
which exits). ray.kill and a raylet's death do not go through SIGTERM and are unchanged.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Past this without the controller acting, the process exits as if no drain were asked:
# the controller's drain timeout (120 s) plus its probe interval, with room to spare.
DEFAULT_GRACE_S = 180.0


class SigtermDrain:
    def __init__(self, replica_id: str, on_request: Callable[[], None], grace_s: float = DEFAULT_GRACE_S):
        """on_request(): called once, in the signal handler's thread, on the first SIGTERM."""
        self.replica_id = replica_id
        self.on_request = on_request
        self.grace_s = grace_s
        self.requested = False
        self._lock = threading.Lock()

    def install(self) -> bool:
        """Take SIGTERM's first delivery over; False where neither way below is open."""
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGTERM)

            def on_sigterm(signum, frame) -> None:
                if not self._first():
                    signal.signal(signal.SIGTERM, previous)
                    os.kill(os.getpid(), signal.SIGTERM)

            signal.signal(signal.SIGTERM, on_sigterm)
            return True
        # A Ray actor's constructor runs off the main thread, where signal.signal cannot be
        # called. The handler Ray's worker installs (ray._private.worker's main loop) ends the
        # process through this module-level function, looked up when the signal comes: take
        # the first SIGTERM's call there, and pass every other call on.
        ray_worker = importlib.import_module("ray._private.worker")
        exit_process = getattr(ray_worker, "raise_sys_exit_with_custom_error_message", None)
        if exit_process is None:
            logger.warning("%s: SIGTERM will not drain the replica (no Ray worker hook)", self.replica_id)
            return False

        def on_exit(message: str, exit_code: int = 1) -> None:
            if "SIGTERM" in message and self._first():
                return
            exit_process(message, exit_code)

        ray_worker.raise_sys_exit_with_custom_error_message = on_exit  # type: ignore[attr-defined]
        return True

    def _first(self) -> bool:
        """Record the drain request: True for the first SIGTERM (the process stays)."""
        with self._lock:
            if self.requested:
                return False
            self.requested = True
        logger.warning("%s got SIGTERM: asking the controller to drain it", self.replica_id)
        timer = threading.Timer(self.grace_s, self._grace_over)
        timer.daemon = True
        timer.start()
        self.on_request()
        return True

    def _grace_over(self) -> None:
        logger.warning("%s: not drained %.0f s after SIGTERM; exiting", self.replica_id, self.grace_s)
        os.kill(os.getpid(), signal.SIGTERM)  # the second: the handler that was there ends it
