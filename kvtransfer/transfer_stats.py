"""Byte and time counters of one pair or a whole transport, for metrics."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds_sending: float = 0.0  # wall time of successful send calls (post + wait)
    seconds_receiving: float = 0.0  # wall time of successful recv calls (post + wait)
    num_sends: int = 0
    num_recvs: int = 0
    num_failures: int = 0  # send/recv calls that raised TransferError
    num_pairs_opened: int = 0

    def __post_init__(self):
        for field in fields(self):
            if getattr(self, field.name) < 0:
                raise ValueError(f"TransferStats.{field.name} must be >= 0")

    def add(self, other: TransferStats) -> None:
        for field in fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def copy(self) -> TransferStats:
        return TransferStats(**{field.name: getattr(self, field.name) for field in fields(self)})

    @property
    def send_bandwidth_bytes_per_s(self) -> float:
        return self.bytes_sent / self.seconds_sending if self.seconds_sending > 0 else 0.0

    @property
    def recv_bandwidth_bytes_per_s(self) -> float:
        return self.bytes_received / self.seconds_receiving if self.seconds_receiving > 0 else 0.0
