"""What the state store holds for the Batch API, as plain values (no database types)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Batch statuses, OpenAI's names. UNFINISHED ones are resumed after any restart.
VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED = "validating", "in_progress", "finalizing", "completed"
FAILED, EXPIRED, CANCELLING, CANCELLED = "failed", "expired", "cancelling", "cancelled"
UNFINISHED = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)
FINISHED = (COMPLETED, FAILED, EXPIRED, CANCELLED)
# The timestamp column each status sets when a batch enters it.
STATUS_TIMESTAMP = {
    IN_PROGRESS: "in_progress_at",
    FINALIZING: "finalizing_at",
    COMPLETED: "completed_at",
    FAILED: "failed_at",
    EXPIRED: "expired_at",
    CANCELLING: "cancelling_at",
    CANCELLED: "cancelled_at",
}


@dataclass(frozen=True)
class FileRecord:
    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: int
    expires_at: int | None = None
    owner: str = ""  # the tenant that uploaded it ("" without tenants)


@dataclass(frozen=True)
class BatchLine:
    """One validated input line: its position, custom_id and request body."""

    line_no: int
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineResult:
    """The outcome of one line: ok (a 200 body) goes to the output file, the rest to the error file."""

    custom_id: str
    line_no: int
    ok: bool
    status_code: int
    request_id: str
    body: dict[str, Any]
    completion_tokens: int = 0


@dataclass(frozen=True)
class BatchRecord:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    total: int
    metadata: dict[str, str] | None = None
    errors: dict[str, Any] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    # status name -> epoch seconds it was entered (in_progress_at, completed_at, ...)
    timestamps: dict[str, int | None] = field(default_factory=dict)
    completed: int = 0  # lines with an ok result
    failed: int = 0  # lines with an error result
    owner: str = ""  # the tenant that created it, and that its lines run as ("" without tenants)
