"""RunResult: the records of one benchmark run (one configuration at one load point)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.bench.arrivals import LoadPoint
from splitserve.bench.request_record import RequestRecord


@dataclass
class RunResult:
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
