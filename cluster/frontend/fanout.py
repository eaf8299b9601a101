"""One OpenAI request, several generations: a completions request with a list of prompts
and/or n > 1 runs one backend generation per choice. These helpers start them together
(refusing the whole request if any is refused), interleave their chunks as they come, and
close every one of them however the response ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

_END = object()


async def first_chunks(sources: list[AsyncGenerator]) -> list:
    """The first chunk (or None) of every source, fetched concurrently. If one fails (a
    refusal: 400/429/503), the others are cancelled, which aborts their generations, and
    the failure is raised."""
    if len(sources) == 1:
        return [await anext(sources[0], None)]
    tasks = [asyncio.ensure_future(anext(src, None)) for src in sources]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            failure = task.exception()
            if failure is not None:
                raise failure
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merged(sources: list[AsyncGenerator]) -> AsyncIterator[tuple[int, object]]:
    """(source index, chunk) from every source as they arrive, until all are exhausted. The
    first failure is raised; closing this generator closes every source."""
    try:
        if len(sources) == 1:  # the common case, without a task per chunk
            async for chunk in sources[0]:
                yield 0, chunk
            return
        pending = {asyncio.ensure_future(anext(src, _END)): i for i, src in enumerate(sources)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    index = pending.pop(task)
                    chunk = task.result()
                    if chunk is _END:
                        continue
                    pending[asyncio.ensure_future(anext(sources[index], _END))] = index
                    yield index, chunk
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        await close_all(sources)


async def close_all(sources: list[AsyncGenerator]) -> None:
    """Close every source (a finished or never-started one closes at once)."""
    for src in sources:
        try:
            await src.aclose()
        except RuntimeError:  # still running inside a cancelled task that has not unwound yet
            pass
