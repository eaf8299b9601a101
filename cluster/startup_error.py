"""StartupError: the one line that says why the ingress could not start.

The ingress replica raises it from its constructor with the root cause of the failure
(e.g. a worker that could not load its weights), and Ray Serve puts the constructor's
traceback into the deployment's status message; `splitserve serve` finds the line again
there (startup_error_in) and prints it once. Torch- and ray-free.
"""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# "pkg.module.SomeError: message" or "SomeError: message": the innermost exception line.
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Exit)\w*): (.+)$")


class StartupError(RuntimeError):
    """The splitserve ingress failed to start; the message is the root cause, one line."""


def root_cause(exc: BaseException) -> str:
    """ "ErrorType: message" of the innermost exception behind `exc`. Ray wraps an actor's
    failure in its own errors whose text ends with the original traceback's last line."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    cause = getattr(exc, "cause", None)  # RayTaskError keeps the original exception here
    if isinstance(cause, BaseException) and cause is not exc:
        return root_cause(cause)
    for line in reversed(_ANSI.sub("", str(exc)).splitlines()):
        match = _EXCEPTION_LINE.match(line.strip())
        if match:
            return f"{match.group(1)}: {match.group(2)}"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def startup_error_in(text: str) -> str | None:
    """The StartupError message in a traceback text (a Serve deployment message), if any."""
    for line in reversed(_ANSI.sub("", text).splitlines()):
        _, found, message = line.strip().partition(f"{StartupError.__name__}: ")
        if found:
            return message
    return None
