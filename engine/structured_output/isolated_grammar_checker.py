"""IsolatedGrammarChecker: the ingress's check of a new constraint, compiled in a small pool
of separate processes (engine/structured_output/grammar_worker.py) with a timeout and a
memory cap, so a native crash or a runaway compile in llguidance costs one request a 400 and
nothing else.

The static bounds (engine/structured_output/grammar_limits.py) run here first, in-process:
they are cheap and refuse the known crashers before any worker sees them. Verdicts (valid, or
the refusal's message, crashes included: a hostile grammar crashes a worker once, not once per
retry) are cached per spec (LRU, GrammarConfig.cache_size); the ingress never needs the
compiled grammar itself, the replicas compile their own copies.

Thread-safe and blocking: the ingress calls check() through asyncio.to_thread.
"""

from __future__ import annotations

import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict

import msgspec

from splitserve.engine.structured_output.grammar_config import GrammarConfig
from splitserve.engine.structured_output.grammar_limits import check_limits
from splitserve.engine.structured_output.grammar_worker import read_frame, write_frame
from splitserve.proto.messages.grammar_spec import GrammarSpec
from splitserve.proto.messages.invalid_request import InvalidRequestError

STARTUP_TIMEOUT_S = 120.0  # interpreter + llguidance + the tokenizer (~1 s for 128k tokens)


class WorkerLost(Exception):
    """The compile process died or was killed (crash, memory cap, timeout)."""


class GrammarWorkerProcess:
    """One compile process, one grammar at a time."""

    def __init__(self, init: dict, env: dict[str, str] | None = None):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "splitserve.engine.structured_output.grammar_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        try:
            write_frame(self.process.stdin, init)
            self._reply(STARTUP_TIMEOUT_S)
        except (WorkerLost, OSError) as exc:
            self.kill()
            raise WorkerLost(f"the grammar worker did not start: {exc}") from None

    @property
    def pid(self) -> int:
        return self.process.pid

    def compile(self, spec: GrammarSpec, timeout_s: float) -> str | None:
        """None when spec compiles, else llguidance's (or our) message. Raises WorkerLost."""
        try:
            write_frame(self.process.stdin, msgspec.structs.asdict(spec))
        except OSError:
            self.kill()
            raise WorkerLost(self._death()) from None
        return self._reply(timeout_s)["error"]

    def _reply(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        if not ready:
            self.kill()
            raise WorkerLost(f"timeout after {timeout_s:g} s")
        try:
            return read_frame(self.process.stdout)
        except (EOFError, ValueError):
            self.kill()
            raise WorkerLost(self._death()) from None

    def _death(self) -> str:
        code = self.process.wait(5)
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(5)
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class IsolatedGrammarChecker:
    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: list[int],
        config: GrammarConfig | None = None,
        env: dict[str, str] | None = None,
    ):
        self.config = config or GrammarConfig()
        self._init = {
            "tokenizer_json": tokenizer_json,
            "vocab_size": vocab_size,
            "eos_token_ids": list(eos_token_ids),
            "memory_mb": self.config.compile_memory_mb,
        }
        self._env = {**os.environ, **(env or {})}
        # Idle workers; None is a slot whose worker is not started yet (or died).
        self._idle: queue.Queue[GrammarWorkerProcess | None] = queue.Queue()
        for _ in range(self.config.compile_workers):
            self._idle.put(None)
        self._verdicts: OrderedDict[GrammarSpec, str | None] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self.num_hits = self.num_misses = self.num_refused = self.num_worker_losses = 0
        self.compile_seconds = 0.0

    def check(self, spec: GrammarSpec) -> None:
        """Raise InvalidRequestError when spec is over a bound, invalid, unsatisfiable, or
        crashes or outlasts its compile worker."""
        check_limits(spec, self.config)
        with self._lock:
            if spec in self._verdicts:
                self._verdicts.move_to_end(spec)
                self.num_hits += 1
                verdict = self._verdicts[spec]
            else:
                self.num_misses += 1
                verdict = self._missing
        if verdict is self._missing:
            verdict = self._compile(spec)
            with self._lock:
                self._verdicts[spec] = verdict
                while len(self._verdicts) > self.config.cache_size:
                    self._verdicts.popitem(last=False)
        if verdict is not None:
            raise InvalidRequestError(verdict)

    _missing = object()

    def _compile(self, spec: GrammarSpec) -> str | None:
        start = time.perf_counter()
        worker = self._idle.get()
        try:
            if worker is None:
                worker = GrammarWorkerProcess(self._init, self._env)
            verdict = worker.compile(spec, self.config.compile_timeout_s)
        except WorkerLost as exc:
            worker = None  # its slot starts a fresh worker on the next miss
            with self._lock:
                self.num_worker_losses += 1
            verdict = (
                f"compiling the {spec.kind} failed in its isolated worker ({exc}); the limits are "
                f"{self.config.compile_timeout_s:g} s (grammar.compile_timeout_s) and "
                f"{self.config.compile_memory_mb} MiB (grammar.compile_memory_mb)"
            )
        finally:
            if self._closed and worker is not None:
                worker.kill()
                worker = None
            if worker is None and not self._closed:
                # Replace a lost worker now, off this request's path.
                threading.Thread(target=self._replace, daemon=True).start()
            else:
                self._idle.put(worker)
        with self._lock:
            self.compile_seconds += time.perf_counter() - start
            if verdict is not None:
                self.num_refused += 1
        return verdict

    def _replace(self) -> None:
        try:
            worker = GrammarWorkerProcess(self._init, self._env)
        except WorkerLost:
            worker = None  # the next miss tries again
        self._idle.put(worker)

    def warm(self) -> None:
        """Start every worker now (an ingress calls this once, off its event loop)."""
        for _ in range(self.config.compile_workers):
            worker = self._idle.get()
            try:
                if worker is None:
                    worker = GrammarWorkerProcess(self._init, self._env)
            except WorkerLost:
                worker = None
            finally:
                self._idle.put(worker)

    def worker_pids(self) -> list[int]:
        """The live workers' process ids (tests: a crashed one is replaced)."""
        with self._idle.mutex:
            return [w.pid for w in self._idle.queue if w is not None and w.process.poll() is None]

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {
                "entries": len(self._verdicts),
                "hits": self.num_hits,
                "misses": self.num_misses,
                "refused": self.num_refused,
                "worker_losses": self.num_worker_losses,
                "compile_seconds": self.compile_seconds,
            }
