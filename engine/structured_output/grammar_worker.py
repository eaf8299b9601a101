"""The isolated grammar-compile process
(`python -m splitserve.engine.structured_output.grammar_worker`): compiles one grammar at a
time for the ingress's IsolatedGrammarChecker and answers whether it is valid. A crash of
llguidance's native code here (a segfault, an abort, an allocation past RLIMIT_AS) ends this
process only; the checker refuses that one request and starts a fresh worker.

Wire format, both ways: a 4-byte big-endian length, then JSON. First the parent sends
{"tokenizer_json", "vocab_size", "eos_token_ids", "memory_mb"} and the child answers
{"ready": true}; then each {"kind", "value"} gets {"error": null | message}.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import Any, BinaryIO

_HEADER = struct.Struct(">I")
# Test hook: a spec whose value contains this text makes the worker call os.abort(), a real
# native-style crash (SIGABRT) of the process, so the checker's recovery can be tested.
CRASH_MARKER_ENV = "SPLITSERVE_GRAMMAR_WORKER_CRASH_MARKER"


def write_frame(stream: BinaryIO, message: Any) -> None:
    body = json.dumps(message).encode()
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def read_frame(stream: BinaryIO) -> Any:
    """The next message; EOFError when the other side is gone."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the stream ended")
    (size,) = _HEADER.unpack(header)
    body = stream.read(size)
    if len(body) < size:
        raise EOFError("the stream ended mid-message")
    return json.loads(body)


def _cap_memory(memory_mb: int) -> None:
    import resource

    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the pipe
    init = read_frame(stdin)
    _cap_memory(init["memory_mb"])
    import llguidance

    from splitserve.engine.structured_output.grammar_compiler import compile_grammar
    from splitserve.proto.messages.grammar_spec import GrammarSpec
    from splitserve.proto.messages.invalid_request import InvalidRequestError

    tokenizer = llguidance.LLTokenizer(
        init["tokenizer_json"], n_vocab=init["vocab_size"], eos_token=init["eos_token_ids"]
    )
    crash_marker = os.environ.get(CRASH_MARKER_ENV)
    write_frame(stdout, {"ready": True})
    while True:
        try:
            request = read_frame(stdin)
        except EOFError:
            return  # the parent closed the pipe: shut down
        if crash_marker and crash_marker in request.get("value", ""):
            os.abort()
        try:
            compile_grammar(GrammarSpec(request["kind"], request["value"]), tokenizer)
            reply = {"error": None}
        except InvalidRequestError as exc:
            reply = {"error": str(exc)}
        except MemoryError:
            reply = {"error": "compiling the grammar ran out of memory"}
        write_frame(stdout, reply)


if __name__ == "__main__":
    main()
