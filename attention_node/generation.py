"""The choices of a request running in the engine, and their outputs merged for the response (moved out of
api_server.py to keep it small)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator

from afd.engine import request as rq
from afd.engine.grammar import Grammar
from attention_node.openai_protocol import sampling_params, stop_strings
from attention_node.request_fields import OutputEdit, chat_echo


class Generation:
    """The n choices of one prompt, running in the engine; outputs arrive on an asyncio queue, each edited
    first by the choice's OutputEdit (chat echo, include_stop_str_in_output)."""

    def __init__(
        self, st, prompt_ids: list[int], body, max_tokens: int, index0: int, chat: bool, grammar: Grammar | None = None
    ):
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt_ids, self.st, self.ids = prompt_ids, st, []
        echo = chat_echo(body) if chat else ""
        for j in range(body.n):
            rid = uuid.uuid4().hex
            self.ids.append(rid)
            edit = OutputEdit(echo, body.include_stop_str_in_output)

            def on_output(out: rq.RequestOutput, i: int = index0 + j, e: OutputEdit = edit) -> None:
                loop.call_soon_threadsafe(self.queue.put_nowait, (i, e(out)))

            r = rq.Request(
                rid,
                prompt_ids,
                sampling_params(body, j, st.limits),
                max_tokens,
                on_output,
                stop=stop_strings(body),
                ignore_eos=body.ignore_eos,
                skip_special_tokens=body.skip_special_tokens is not False,
                grammar=None
                if grammar is None
                else grammar.copy(),  # each choice advances its own (structured outputs)
            )
            st.engine.add_request(r)

    def abort(self) -> None:
        for rid in self.ids:
            self.st.engine.abort(rid)


async def outputs(gens: list[Generation]) -> AsyncGenerator[tuple[int, rq.RequestOutput], None]:
    """Merged outputs of every choice until all finished."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(g: Generation):
        left = len(g.ids)
        while left:
            item = await g.queue.get()
            left -= item[1].finished
            await q.put(item)

    tasks = [asyncio.create_task(pump(g)) for g in gens]
    left = sum(len(g.ids) for g in gens)
    try:
        while left:
            i, out = await q.get()
            left -= out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            g.abort()
