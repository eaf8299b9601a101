"""Helpers of the serving backend: the ingress replica's id and the prompt text check."""

from __future__ import annotations

import uuid

from splitserve.cluster.request_error import invalid


def default_ingress_id() -> str:
    """The Serve replica's unique id inside a Serve replica; else a fresh local one."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not in a Serve replica (tests, the driver API)
        return f"local{uuid.uuid4().hex[:8]}"


def check_unicode(text: str) -> None:
    """JSON may escape lone surrogates ("\\ud800"), which are no text: refuse them here, where
    the tokenizer would otherwise fail with a TypeError (a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid(f"the prompt is not valid Unicode: {exc.reason} at position {exc.start}") from None
