"""ServerConfig: one named configuration to benchmark, an existing URL or a command that starts a
server ("NAME=http://host:port" or "NAME=shell command with {port}")."""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ServerConfigError(ValueError):
    """A --compare spec that names no server we could reach or start."""


@dataclass(frozen=True)
class ServerConfig:
    """Exactly one of `url` or `command`. A command must contain `{port}` (and may contain
    `{host}`); the runner substitutes a free port on 127.0.0.1 and starts it in its own session."""

    name: str
    url: str | None = None
    command: str | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
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
