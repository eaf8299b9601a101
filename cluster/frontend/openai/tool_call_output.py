"""OpenAI tool calling on the response side: reads a tool-calling request's output (made
under the grammar of openai/tools.py) back into `tool_calls`, whole or as stream deltas.

Streaming: a named function's arguments stream as they are generated (the call's id and
name come first); "required" calls and "auto" tool-call blocks are emitted once complete, at
the end; an "auto" request that answers in text streams that text as content. Only a
request whose grammar completed (engine finish_reason "stop") claims tool calls, with
finish_reason "tool_calls"; one cut off by max_tokens returns its text as content, "length".
"""

from __future__ import annotations

import json
import re
import uuid

from splitserve.cluster.frontend.openai.responses import (
    ChatDelta,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
)
from splitserve.cluster.frontend.openai.tools import TOOL_CALL_BEGIN, TOOL_CALL_END, ToolCallPlan

_BLOCK = re.compile(re.escape(TOOL_CALL_BEGIN) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallOutput:
    def __init__(self, plan: ToolCallPlan):
        self.plan = plan
        self._named_id = _call_id() if plan.mode == "named" else None
        self._streamed_any = False
        self._is_text: bool | None = None  # auto: decided by the first character

    # ---- whole response ------------------------------------------------------------------
    def parse(self, text: str) -> list[ToolCall] | None:
        """The calls in a complete output, or None if it holds none (or cannot be read)."""
        try:
            if self.plan.mode == "named":
                json.loads(text)  # the grammar made it valid; never claim otherwise
                return [
                    ToolCall(id=self._named_id, function=FunctionCall(name=self.plan.function_names[0], arguments=text))
                ]
            if self.plan.mode == "required":
                raw_calls = json.loads(text)
            else:
                if not text.startswith(TOOL_CALL_BEGIN):
                    return None
                raw_calls = [json.loads(block) for block in _BLOCK.findall(text)]
            calls = [
                ToolCall(
                    id=_call_id(),
                    function=FunctionCall(name=c["name"], arguments=json.dumps(c["arguments"], ensure_ascii=False)),
                )
                for c in raw_calls
            ]
        except (ValueError, TypeError, KeyError):
            return None
        return calls or None

    def message(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall] | None, str | None]:
        """(content, tool_calls, finish_reason) of a non-streamed response."""
        calls = self.parse(text) if finish_reason == "stop" else None
        if calls is None:
            return text, None, finish_reason
        return None, calls, "tool_calls"

    # ---- streaming -----------------------------------------------------------------------
    def stream_deltas(self, new_text: str, full_text: str) -> list[ChatDelta]:
        """Deltas for text generated since the last call (full_text includes it)."""
        if not new_text:
            return []
        if self.plan.mode == "named":
            first = not self._streamed_any
            self._streamed_any = True
            call = ToolCallDelta(
                index=0,
                id=self._named_id if first else None,
                type="function" if first else None,
                function=FunctionCallDelta(name=self.plan.function_names[0] if first else None, arguments=new_text),
            )
            return [ChatDelta(tool_calls=[call])]
        if self.plan.mode == "auto":
            if self._is_text is None:
                self._is_text = not full_text.startswith("<")
            if self._is_text:
                return [ChatDelta(content=new_text)]
        return []  # calls are emitted whole at the end

    def final_deltas(self, full_text: str, finish_reason: str | None) -> tuple[list[ChatDelta], str | None]:
        """Deltas still owed when the stream ends, and the finish_reason to report."""
        if self.plan.mode == "named":
            return [], ("tool_calls" if finish_reason == "stop" and self.parse(full_text) else finish_reason)
        if self._is_text:
            return [], finish_reason
        calls = self.parse(full_text) if finish_reason == "stop" else None
        if calls is None:  # not a completed call: hand back what was generated
            return ([ChatDelta(content=full_text)] if full_text else []), finish_reason
        deltas = [
            ChatDelta(
                tool_calls=[
                    ToolCallDelta(
                        index=i,
                        id=call.id,
                        type="function",
                        function=FunctionCallDelta(name=call.function.name, arguments=call.function.arguments),
                    )
                ]
            )
            for i, call in enumerate(calls)
        ]
        return deltas, "tool_calls"
