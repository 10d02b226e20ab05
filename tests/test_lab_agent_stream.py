"""The lab agent's long-lived streams: a ping that times out must not desync the stream."""

from __future__ import annotations

import asyncio
import socket
import time

from kproxy.lab.agent import Agent, LineSocket, Stream

ANSWER = b"pod8 10.0.0.1:40000\n"


def test_answer_arriving_as_the_ping_times_out_is_kept_for_the_next_ping() -> None:
    async def run() -> tuple[dict[str, object], dict[str, object]]:
        mine, peer = socket.socketpair()
        mine.setblocking(False)
        peer.setblocking(False)
        agent = Agent()
        agent.streams["s1"] = Stream(mine, LineSocket(mine), 0)
        loop = asyncio.get_running_loop()

        def late_answer() -> None:
            peer.recv(100)
            peer.send(ANSWER)
            # Block the loop past the ping's deadline: the answer and the timeout are then
            # handled in the same loop iteration (what a loaded machine does now and then).
            time.sleep(0.02)

        loop.call_later(0.09, late_answer)
        late = await agent.stream_ping("s1", timeout=0.1)
        loop.call_later(0.01, lambda: (peer.recv(100), peer.send(ANSWER)))
        prompt = await agent.stream_ping("s1", timeout=0.5)
        agent.close_all()
        peer.close()
        return late, prompt

    late, prompt = asyncio.run(run())
    assert late["ok"] is False and late["error"] == "timeout"
    # Before the fix the late answer's bytes were lost with the cancelled receive: the stream
    # then waited for one answer more than would ever come, and every ping timed out.
    assert prompt["ok"] is True and prompt["pod"] == "pod8", prompt
