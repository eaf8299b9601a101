"""A process that writes to the state store without pause until it is killed (the kill tests).

`python -m tests.helpers.state_writer URL` creates batches of LINES lines, each in one
transaction, and records a result per line; after every transaction it prints a line, so
the parent can kill it mid-way at a point it chose.
"""

from __future__ import annotations

import sys
import time

from splitserve.cluster.state.database import open_state_engine
from splitserve.cluster.state.records import IN_PROGRESS, BatchLine, BatchRecord, LineResult
from splitserve.cluster.state.sql_batch_store import SqlBatchStore

LINES = 200


def main(url: str) -> None:
    store = SqlBatchStore(open_state_engine(url))
    n = 0
    while True:
        batch_id = f"batch_w{n}"
        lines = [BatchLine(i, f"req-{i}", {"prompt": "x" * 100, "max_tokens": i}) for i in range(LINES)]
        now = int(time.time())
        store.create_batch(
            BatchRecord(batch_id, "/v1/completions", "file-x", "24h", IN_PROGRESS, now, now, LINES), lines
        )
        print(f"batch {batch_id}", flush=True)
        for line in lines[: LINES // 2]:
            store.record_result(batch_id, LineResult(line.custom_id, line.line_no, True, 200, "r", {"n": line.line_no}))
            print(f"result {batch_id} {line.custom_id}", flush=True)
        n += 1


if __name__ == "__main__":
    main(sys.argv[1])
