"""The interface of the Batch API's persistent state; `SqlBatchStore` implements it.

Every method is one transaction: a process killed during a call leaves the store as it was
before the call or after it. `owner` scopes a read or a delete to one owner's files and
batches (another owner's are as if they did not exist); None: every owner's (the runner, the
admin key).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from splitserve.cluster.state.records import BatchLine, BatchRecord, FileRecord, LineResult


class BatchStore(ABC):
    # --- files ---
    @abstractmethod
    def put_file(self, record: FileRecord, content: bytes) -> None: ...

    @abstractmethod
    def get_file(self, file_id: str, owner: str | None = None) -> FileRecord | None: ...

    @abstractmethod
    def file_content(self, file_id: str, owner: str | None = None) -> bytes | None: ...

    @abstractmethod
    def list_files(
        self, purpose: str | None, after: str | None, limit: int, newest_first: bool, owner: str | None = None
    ) -> list[FileRecord]:
        """Files ordered by creation; after: the id of the last file of the previous page."""

    @abstractmethod
    def delete_file(self, file_id: str, owner: str | None = None) -> bool:
        """True when the file existed (and was owner's)."""

    # --- batches ---
    @abstractmethod
    def create_batch(self, record: BatchRecord, lines: list[BatchLine]) -> None:
        """The batch and all its lines, or nothing."""

    @abstractmethod
    def get_batch(self, batch_id: str, owner: str | None = None) -> BatchRecord | None: ...

    @abstractmethod
    def list_batches(self, after: str | None, limit: int, owner: str | None = None) -> list[BatchRecord]:
        """Newest first; after: the id of the last batch of the previous page."""

    @abstractmethod
    def count_batches(self) -> dict[str, int]:
        """How many batches are in each status."""

    @abstractmethod
    def unfinished_batches(self) -> list[BatchRecord]:
        """Batches not yet completed, failed, expired or cancelled, oldest first."""

    @abstractmethod
    def transition(self, batch_id: str, from_statuses: tuple[str, ...], to_status: str, at: int, **fields) -> bool:
        """Compare-and-set: moves the batch to to_status (setting its timestamp and fields) only
        if it is in one of from_statuses. False when it was not (another process moved it)."""

    @abstractmethod
    def pending_lines(self, batch_id: str, limit: int, skip: frozenset[str] = frozenset()) -> list[BatchLine]:
        """Lines with no result yet, in file order, leaving out the custom_ids in skip."""

    @abstractmethod
    def record_result(self, batch_id: str, result: LineResult) -> bool:
        """Stores a line's result unless it already has one; True when this call stored it."""

    @abstractmethod
    def record_results(self, batch_id: str, results: list[LineResult]) -> int:
        """record_result for many lines in one transaction; returns how many were new."""

    @abstractmethod
    def results(self, batch_id: str) -> list[LineResult]:
        """Every stored result of the batch, in file order."""

    @abstractmethod
    def finish_batch(
        self,
        batch_id: str,
        from_statuses: tuple[str, ...],
        to_status: str,
        at: int,
        output: tuple[FileRecord, bytes] | None,
        error: tuple[FileRecord, bytes] | None,
    ) -> bool:
        """Writes the output and error files and moves the batch to to_status, all or nothing."""

    @abstractmethod
    def finished_batches_before(self, created_before: int) -> list[str]:
        """Ids of finished batches created before created_before (epoch s): the retention policy's."""

    @abstractmethod
    def delete_batch(self, batch_id: str, with_files: bool) -> None:
        """Deletes the batch, its lines and results (and its input, output and error files)."""

    # --- leases ---
    @abstractmethod
    def acquire_lease(self, name: str, holder: str, ttl_s: float, now: float) -> bool:
        """Takes or renews the lease: True when holder holds it until now + ttl_s."""

    @abstractmethod
    def release_lease(self, name: str, holder: str) -> None: ...
