"""The records and options a benchmark run passes around, in one place.

Inputs: BenchRequest (one request a workload asks for), LoadPoint (how requests are offered),
ClientOptions (how the client talks to a server), ServerConfig (one named configuration).
Outputs: RequestRecord (what the client saw for one request), RunResult (one run's records),
ConfigResult (every run of one configuration). All are plain dataclasses; the outputs
round-trip through results.json with to_dict / from_dict.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # metrics imports this module; RunMetrics appears here in annotations only
    from splitserve.bench.loadgen.metrics import RunMetrics

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
PROMPT_FORMATS = ("token-ids", "text")
# Error value of requests still in flight when the run's wall-time bound expired; metrics leave
# them out of latency and SLO figures (their latency is unknown, not bad) and count them apart.
DEADLINE_ERROR = "deadline"
_CONFIG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

# replica name -> [(seconds since scraping began just before the run, value)], e.g. a gauge
# scraped from /metrics.
ReplicaSamples = dict[str, list[tuple[float, float]]]


class WorkloadError(ValueError):
    """A workload, trace or load description that cannot produce valid requests."""


class ServerConfigError(ValueError):
    """A --compare spec that names no server we could reach or start."""


@dataclass(frozen=True)
class BenchRequest:
    """A prompt (token ids, optionally rendered as text), an output length and when to send it.

    `arrival_offset_s` is seconds after the run starts (open-loop); closed-loop runs ignore it.
    `depends_on` names the request that must finish before this one is sent (the previous turn
    of a conversation), so a multi-turn prompt reaches the server after its history did.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_offset_s: float = 0.0
    group_id: str | None = None
    conversation_id: str | None = None
    turn_index: int = 0
    depends_on: str | None = None
    prompt_text: str | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise WorkloadError("request_id must be non-empty")
        if len(self.prompt_token_ids) == 0:
            raise WorkloadError(f"{self.request_id}: prompt_token_ids must be non-empty")
        if self.max_tokens < 1:
            raise WorkloadError(f"{self.request_id}: max_tokens must be >= 1, got {self.max_tokens}")
        if self.arrival_offset_s < 0:
            raise WorkloadError(f"{self.request_id}: arrival_offset_s must be >= 0, got {self.arrival_offset_s}")
        if self.turn_index < 0:
            raise WorkloadError(f"{self.request_id}: turn_index must be >= 0")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def with_arrival(self, arrival_offset_s: float) -> BenchRequest:
        return dataclasses.replace(self, arrival_offset_s=arrival_offset_s)

    def with_text(self, prompt_text: str) -> BenchRequest:
        return dataclasses.replace(self, prompt_text=prompt_text)

    def to_dict(self, include_tokens: bool = False) -> dict[str, Any]:
        """JSON-friendly summary; token ids only on request since they dominate the size."""
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "num_prompt_tokens": self.num_prompt_tokens,
            "max_tokens": self.max_tokens,
            "arrival_offset_s": self.arrival_offset_s,
            "group_id": self.group_id,
            "conversation_id": self.conversation_id,
            "turn_index": self.turn_index,
            "depends_on": self.depends_on,
        }
        if include_tokens:
            out["prompt_token_ids"] = list(self.prompt_token_ids)
        return out


@dataclass(frozen=True)
class LoadPoint:
    """How requests are offered to the server during one run.

    rate set: open loop, Poisson arrivals at `rate` req/s (inf = all at t=0); `concurrency`, if
    also set, caps requests in flight (later arrivals queue). rate unset, concurrency set: closed
    loop, `concurrency` requests always in flight. Neither: open loop at the requests' own
    arrival offsets (trace timestamps).
    """

    rate: float | None = None
    concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.rate is not None and not self.rate > 0:
            raise WorkloadError(f"rate must be > 0 (or inf), got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise WorkloadError(f"concurrency must be >= 1, got {self.concurrency}")

    @property
    def mode(self) -> str:
        if self.rate is not None:
            return "poisson"
        return "closed-loop" if self.concurrency is not None else "trace-timing"

    @property
    def label(self) -> str:
        if self.rate is not None:
            text = f"rate={self.rate:g}"
            return text if self.concurrency is None else f"{text},cap={self.concurrency}"
        if self.concurrency is not None:
            return f"concurrency={self.concurrency}"
        return "trace-timing"

    def to_dict(self) -> dict[str, Any]:
        rate = None if self.rate is None else ("inf" if math.isinf(self.rate) else self.rate)
        return {"mode": self.mode, "rate": rate, "concurrency": self.concurrency, "label": self.label}


@dataclass(frozen=True)
class ClientOptions:
    """How the benchmark client talks to the server and bounds a run."""

    base_url: str = DEFAULT_BASE_URL
    model: str | None = None  # None: the first id that GET /v1/models lists
    endpoint: str = "completions"
    prompt_format: str = "token-ids"  # chat always sends text
    api_key: str | None = None
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    max_requests: int | None = None
    max_seconds: float | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    show_progress: bool = True
    # Untimed requests sent first (short prompts unlike the workload's, so they warm connections
    # and the server's code paths but not its prefix cache).
    num_warmup_requests: int = 0
    # Ask a splitserve server for each request's first-token stages (return_first_token_stages).
    first_token_stages: bool = False

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}, got {self.endpoint!r}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {self.prompt_format!r}")
        if not (self.request_timeout_s > 0 and self.connect_timeout_s > 0):
            raise ValueError("request and connect timeouts must be > 0")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")
        if self.num_warmup_requests < 0:
            raise ValueError(f"num_warmup_requests must be >= 0, got {self.num_warmup_requests}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be > 0, got {self.max_seconds}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")

    @property
    def sends_text(self) -> bool:
        return self.endpoint == "chat" or self.prompt_format == "text"


@dataclass(frozen=True)
class ServerConfig:
    """One named configuration to benchmark: exactly one of `url` or `command` (parsed from
    "NAME=http://host:port" or "NAME=shell command with {port}"). A command must contain
    `{port}` (and may contain `{host}`); the runner substitutes a free port on 127.0.0.1 and
    starts it in its own session."""

    name: str
    url: str | None = None
    command: str | None = None

    def __post_init__(self) -> None:
        if not _CONFIG_NAME.match(self.name):
            raise ServerConfigError(f"config name must be letters, digits, '_', '.', '-': {self.name!r}")
        if (self.url is None) == (self.command is None):
            raise ServerConfigError(f"config {self.name!r} needs exactly one of a URL or a command")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ServerConfigError(f"config {self.name!r}: URL must start with http:// or https://")
        if self.command is not None and "{port}" not in self.command:
            raise ServerConfigError(
                f"config {self.name!r}: the command must contain {{port}} so the server listens "
                "on the free port the runner picks"
            )

    @classmethod
    def parse(cls, spec: str) -> ServerConfig:
        name, sep, value = spec.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise ServerConfigError(f"expected NAME=COMMAND_OR_URL, got {spec!r}")
        if value.startswith(("http://", "https://")):
            return cls(name=name, url=value.rstrip("/"))
        return cls(name=name, command=value)

    @property
    def target(self) -> str:
        return self.url if self.url is not None else str(self.command)


@dataclass
class RequestRecord:
    """What the client observed for one request (times are seconds since run start)."""

    request_id: str
    num_prompt_tokens_sent: int
    max_tokens: int
    scheduled_time_s: float
    group_id: str | None = None
    conversation_id: str | None = None
    send_time_s: float | None = None
    first_token_time_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    end_time_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    status: int | None = None
    error: str | None = None
    # stage -> seconds, as the server measured this request's first token (ClientOptions.first_token_stages)
    first_token_stages: dict[str, float] | None = None

    @property
    def ok(self) -> bool:
        return (
            self.error is None
            and self.status == 200
            and self.end_time_s is not None
            and self.first_token_time_s is not None
        )

    @property
    def unfinished(self) -> bool:
        return self.error == DEADLINE_ERROR

    @property
    def error_key(self) -> str:
        """'ok', 'http_<status>' for a non-200 answer, 'deadline', or the failure's name."""
        if self.ok:
            return "ok"
        if self.status is not None and self.status != 200:
            return f"http_{self.status}"
        return (self.error or "no_tokens").split(":", 1)[0]

    @property
    def ttft_s(self) -> float | None:
        if self.send_time_s is None or self.first_token_time_s is None:
            return None
        return self.first_token_time_s - self.send_time_s

    @property
    def e2e_s(self) -> float | None:
        if self.send_time_s is None or self.end_time_s is None:
            return None
        return self.end_time_s - self.send_time_s

    @property
    def itl_gaps_s(self) -> list[float]:
        """Gaps between consecutive token-bearing chunks (one gap fewer than chunks)."""
        times = self.chunk_times_s
        return [later - earlier for earlier, later in zip(times, times[1:])]

    @property
    def num_output_tokens(self) -> int:
        """Server-reported completion tokens, else the number of token-bearing chunks."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times_s)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["chunk_times_s"] = [round(t, 6) for t in self.chunk_times_s]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})


@dataclass
class RunResult:
    """The records of one benchmark run (one configuration at one load point)."""

    config_name: str
    load: LoadPoint
    model: str
    base_url: str
    duration_s: float
    records: list[RequestRecord] = field(default_factory=list)
    num_not_sent: int = 0  # requests whose turn never came before the wall-time bound
    started_at_unix_s: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.config_name} @ {self.load.label}"

    def to_dict(self, include_records: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "config_name": self.config_name,
            "load": self.load.to_dict(),
            "model": self.model,
            "base_url": self.base_url,
            "duration_s": self.duration_s,
            "num_not_sent": self.num_not_sent,
            "started_at_unix_s": self.started_at_unix_s,
        }
        if include_records:
            out["records"] = [record.to_dict() for record in self.records]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        load = data["load"]
        rate = load.get("rate")
        return cls(
            config_name=data["config_name"],
            load=LoadPoint(rate=None if rate is None else float(rate), concurrency=load.get("concurrency")),
            model=data["model"],
            base_url=data["base_url"],
            duration_s=data["duration_s"],
            records=[RequestRecord.from_dict(r) for r in data.get("records", [])],
            num_not_sent=data.get("num_not_sent", 0),
            started_at_unix_s=data.get("started_at_unix_s", 0.0),
        )


@dataclass
class ConfigResult:
    """Every run of one named configuration (a server URL or a server command)."""

    name: str
    target: str  # the URL benchmarked, or the command that started the server
    runs: list[RunResult] = field(default_factory=list)
    metrics: list[RunMetrics] = field(default_factory=list)
    replica_samples: list[ReplicaSamples] = field(default_factory=list)  # one per run, maybe empty
    goodput_rps: float | None = None
    error: str | None = None  # why the configuration could not be benchmarked

    def to_dict(self, include_records: bool = True) -> dict[str, Any]:
        samples_per_run = self.replica_samples + [{}] * (len(self.runs) - len(self.replica_samples))
        return {
            "name": self.name,
            "target": self.target,
            "error": self.error,
            "goodput_rps": self.goodput_rps,
            "runs": [
                {**run.to_dict(include_records=include_records), "metrics": metrics.to_dict(), "replica_samples": s}
                for run, metrics, s in zip(self.runs, self.metrics, samples_per_run)
            ],
        }
