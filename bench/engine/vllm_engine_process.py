"""A vllm.LLM living in another Python (the vLLM venv), driven over stdin/stdout.

bench/engine/vllm_throughput_worker.py is the other end. vLLM is never a splitserve dependency, so it
runs as a subprocess of whatever interpreter has it installed.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
from pathlib import Path
from typing import IO

from splitserve.bench.engine.vllm_throughput_worker import RESULT_MARKER

WORKER_SCRIPT = Path(__file__).with_name("vllm_throughput_worker.py")


class VllmProcessError(RuntimeError):
    """The vLLM worker failed to start, died, or did not answer in time."""


class VllmEngineProcess:
    def __init__(
        self,
        python: str,
        model: str,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        log_path: Path,
        env: dict[str, str] | None = None,
        enforce_eager: bool = False,
        start_timeout_s: float = 900.0,
    ):
        if not Path(python).is_file():
            raise VllmProcessError(f"no python interpreter at {python}")
        cmd = [
            python,
            str(WORKER_SCRIPT),
            "--model",
            model,
            "--max-num-seqs",
            str(max_num_seqs),
            "--max-num-batched-tokens",
            str(max_num_batched_tokens),
            "--max-model-len",
            str(max_model_len),
        ]
        if enforce_eager:
            cmd.append("--enforce-eager")
        self.log_path = log_path
        self._log = open(log_path, "w")
        self._results: queue.Queue[dict | None] = queue.Queue()
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, **(env or {})},
            cwd=str(WORKER_SCRIPT.parent),
        )
        # A reader thread keeps draining stdout, so vLLM's logging can never fill the pipe
        # while this process is busy running the other engine.
        self._reader = threading.Thread(target=self._read_stdout, args=(self._proc.stdout,), daemon=True)
        self._reader.start()
        hello = self._next_result(start_timeout_s, "start")
        self.version = str(hello.get("vllm_version", "?"))

    def _read_stdout(self, stream: IO[str]) -> None:
        for line in stream:
            if line.startswith(RESULT_MARKER):
                self._results.put(json.loads(line[len(RESULT_MARKER) :]))
            else:
                self._log.write(line)
                self._log.flush()
        self._results.put(None)  # EOF: the worker exited

    def _next_result(self, timeout_s: float, what: str) -> dict:
        try:
            result = self._results.get(timeout=timeout_s)
        except queue.Empty:
            self.close()
            raise VllmProcessError(
                f"vLLM worker gave no answer to {what} within {timeout_s:.0f} s; see {self.log_path}"
            ) from None
        if result is None:
            code = self._proc.wait(timeout=30)
            self.close()
            raise VllmProcessError(f"vLLM worker exited (code {code}) during {what}; see {self.log_path}")
        return result

    def generate(
        self, prompts: list[list[int]], max_tokens: int, timeout_s: float = 900.0
    ) -> tuple[float, float | None, list[list[int]]]:
        """Wall seconds of one LLM.generate over prompts, CPU seconds of all vLLM processes
        meanwhile (None when unknown), and each prompt's generated ids."""
        if self._proc.poll() is not None:
            raise VllmProcessError(f"vLLM worker is not running; see {self.log_path}")
        self._proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self._proc.stdin.flush()
        result = self._next_result(timeout_s, f"a batch of {len(prompts)}")
        cpu = result.get("cpu_seconds")
        return (
            float(result["seconds"]),
            None if cpu is None else float(cpu),
            [list(ids) for ids in result["token_ids"]],
        )

    def close(self, timeout_s: float = 60.0) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write("\n")
                self._proc.stdin.flush()
                self._proc.stdin.close()
                self._proc.wait(timeout=timeout_s)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait(timeout=timeout_s)
        self._reader.join(timeout=timeout_s)
        self._log.close()

    def __enter__(self) -> VllmEngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
