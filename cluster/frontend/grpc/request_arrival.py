"""RequestArrivalTimeout: an RPC whose request message does not arrive within
grpc.request_timeout_s is answered DEADLINE_EXCEEDED, so a client cannot hold a call (and with
it a connection that is never idle) by opening an RPC and sending nothing.

grpc has no such timeout: for a unary-request method it waits for the message before it calls
the handler, for as long as the client likes. So this interceptor serves every unary-request
method as a stream-request one (the same bytes on the wire: a message, then the half-close),
reads the one message under a timeout, and hands it to the original handler. Methods that
stream requests (server reflection) are left as they are.
"""

from __future__ import annotations

import asyncio
import inspect

import grpc


class RequestArrivalTimeout(grpc.aio.ServerInterceptor):
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                self._streaming(handler.unary_stream), handler.request_deserializer, handler.response_serializer
            )
        return grpc.stream_unary_rpc_method_handler(
            self._unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer
        )

    async def _first_message(self, request_iterator, context: grpc.aio.ServicerContext):
        try:
            return await asyncio.wait_for(anext(request_iterator), self.timeout_s)
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the request message did not arrive within grpc.request_timeout_s ({self.timeout_s:g} s)",
            )
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without a request message")

    def _unary(self, behavior):
        async def serve(request_iterator, context):
            request = await self._first_message(request_iterator, context)
            response = behavior(request, context)
            return await response if inspect.isawaitable(response) else response

        return serve

    def _streaming(self, behavior):
        # A coroutine function that writes through the context: grpc.aio serves it as a
        # reader-writer handler, whichever way the wrapped behavior produces its responses.
        async def serve(request_iterator, context):
            request = await self._first_message(request_iterator, context)
            responses = behavior(request, context)
            if inspect.isasyncgen(responses):
                async for response in responses:
                    await context.write(response)
            elif inspect.isawaitable(responses):
                await responses
            else:
                for response in responses:
                    await context.write(response)

        return serve
