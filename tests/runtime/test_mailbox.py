"""The engine thread's events reach the event loop's queues in order, with one wakeup for a burst."""

from __future__ import annotations

import asyncio
import threading

from localmoe.runtime.service import Mailbox


def test_a_burst_wakes_the_loop_once_and_keeps_each_queues_order():
    loop = asyncio.new_event_loop()
    try:
        queues = [asyncio.Queue() for _ in range(16)]
        mailbox = Mailbox.of(loop)
        assert Mailbox.of(loop) is mailbox

        def engine_step():  # a batched step: every stream gets its token, then a second step's
            for step in range(3):
                for i, queue in enumerate(queues):
                    mailbox.post(queue, ("delta", (i, step)))

        thread = threading.Thread(target=engine_step)
        thread.start()
        thread.join()  # all posted before the loop runs: one wakeup delivers them

        async def read_all():
            return [[await queue.get() for _ in range(3)] for queue in queues]

        got = loop.run_until_complete(read_all())
        assert got == [[("delta", (i, step)) for step in range(3)] for i in range(16)]
        assert mailbox.wakeups == 1
        mailbox.post(queues[0], ("done", None))  # the loop took the burst: the next post wakes it again
        assert loop.run_until_complete(queues[0].get()) == ("done", None)
        assert mailbox.wakeups == 2
    finally:
        loop.close()


def test_posting_to_a_closed_loop_is_dropped_quietly():
    loop = asyncio.new_event_loop()
    mailbox = Mailbox.of(loop)
    loop.close()
    queue = asyncio.Queue()
    mailbox.post(queue, ("delta", "x"))  # nobody listens: no error, nothing kept
    mailbox.post(queue, ("done", None))
    assert mailbox.wakeups == 2 and queue.empty()
