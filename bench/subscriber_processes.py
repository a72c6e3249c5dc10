"""The processes that run the workloads' subscribers, apart from the publisher's event loop:
`Subscribers` starts `n` consumers of any system (systems.CONSUMERS, by the `system` of the
spec its prepare() returned) in a process of their own, which records every message it gets
and acks within ACK_EVERY or at ACK_BATCH waiting (or, with `ack_each`, each message the moment
it has it: W7's prompt consumer); `idle_process` holds W6's idle websockets
and counts those that still answer a ping.
"""

import asyncio
import contextlib
import importlib
import json
import multiprocessing
import time

from systems import ACK_BATCH, ACK_EVERY, CONSUMERS, raise_nofile

# --- The subscriber process ----------------------------------------------------------------------


async def _consume(consumer, expect, phase, record, acked_all, ack_each=False):
    """Receive, record and ack until `expect` distinct messages of `phase` arrived and are acked.
    With `ack_each`, each message is acked on its own as soon as it is recorded, the ack awaited
    before the next is read (a consumer of an ordered queue, which is handed the next message
    only once this one is acked)."""
    pending, seen = [], set()
    flushing = asyncio.Lock()

    async def flush():
        nonlocal pending
        async with flushing:
            if pending:
                tokens, pending = pending, []
                await consumer.ack(tokens)

    async def ticker():
        while True:
            await asyncio.sleep(ACK_EVERY)
            await flush()

    tick = asyncio.ensure_future(ticker())
    try:
        async for batch in consumer.batches():
            now = time.monotonic()
            for token, payload in batch:
                record.append((payload.get("phase"), payload["i"], payload.get("sent", 0.0), now))
                if payload.get("phase") == phase:
                    seen.add(payload["i"])
                if ack_each:
                    await consumer.ack([token])
                else:
                    pending.append(token)
            if len(pending) >= ACK_BATCH:
                await flush()
            if len(seen) >= expect:
                await flush()
                acked_all.append(time.monotonic())
                return
    finally:
        tick.cancel()


async def _subscriber_main(spec, n, expect, phase, limit, pipe, ack_each=False):
    kind = CONSUMERS[spec["system"]]
    for module in getattr(kind, "client_modules", ()):
        importlib.import_module(module)  # the client's import is not the system's time
    started = time.monotonic()
    consumers = [kind(spec, k) for k in range(n)]
    await asyncio.gather(*(c.start() for c in consumers))
    pipe.send(("ready", time.monotonic(), started))
    records = [[] for _ in range(n)]
    done_at = [[] for _ in range(n)]
    error = None
    try:
        await asyncio.wait_for(
            asyncio.gather(
                *(
                    _consume(c, expect, phase, records[k], done_at[k], ack_each)
                    for k, c in enumerate(consumers)
                )
            ),
            limit,
        )
    except TimeoutError:
        error = f"time limit of {limit:.0f} s reached"
    except Exception as exc:
        error = f"{exc.__class__.__name__}: {exc}"
    await asyncio.sleep(0.2)  # let the last acks leave
    frames = frame_stats(consumers)
    for c in consumers:
        with contextlib.suppress(Exception):  # a consumer that failed may be half open
            await c.close()
    pipe.send(
        (
            "done",
            {
                "records": records,
                "done_at": [d[0] if d else None for d in done_at],
                "error": error,
                "frames": frames,
                # Request times a consumer took (W7's pull: each lease and ack), if it does.
                "timings": [c.timings() if hasattr(c, "timings") else None for c in consumers],
            },
        )
    )


def frame_stats(consumers):
    """The frames batch consumers received, summed over them (None if none counts them)."""
    counted = [c.stats() for c in consumers if hasattr(c, "stats")]
    if not counted:
        return None
    out = {k: sum(c[k] for c in counted) for k in counted[0] if k != "largest"}
    out["largest"] = max(c["largest"] for c in counted)
    out["items_per_frame"] = (
        round(out["batch_items"] / out["batch_frames"], 1) if out["batch_frames"] else None
    )
    return out


def subscriber_process(spec, n, expect, phase, limit, pipe, ack_each=False):
    raise_nofile()
    asyncio.run(_subscriber_main(spec, n, expect, phase, limit, pipe, ack_each))


class Subscribers:
    """`n` consumers of one system in a process of their own (so that they do not share a CPU
    with the publisher's event loop more than the machine makes them)."""

    def __init__(self, spec, n, expect, phase, limit, ack_each=False):
        ctx = multiprocessing.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=subscriber_process, args=(spec, n, expect, phase, limit, child, ack_each), daemon=True
        )
        self.limit = limit

    def start(self, timeout=120):
        self.proc.start()
        if not self.pipe.poll(timeout):
            raise RuntimeError("the subscribers did not connect in time")
        msg = self.pipe.recv()
        if msg[0] != "ready":
            raise RuntimeError(f"subscribers: {msg}")
        self.ready_at, self.started_at = msg[1], msg[2]
        return self

    async def result(self):
        loop = asyncio.get_running_loop()
        ok = await loop.run_in_executor(None, self.pipe.poll, self.limit + 60)
        if not ok:
            self.proc.kill()
            raise RuntimeError("the subscriber process did not report")
        msg = self.pipe.recv()
        self.proc.join(10)
        return msg[1]


# --- W6: idle websocket subscribers --------------------------------------------------------------


async def _idle_main(url, tokens, pipe, concurrency, connect_limit):
    from websockets.asyncio.client import connect

    raise_nofile()
    sockets, failures = [], []
    gate = asyncio.Semaphore(concurrency)
    deadline = time.monotonic() + connect_limit

    async def one(token):
        if time.monotonic() > deadline:
            return
        async with gate:
            if time.monotonic() > deadline:
                return
            try:
                ws = await connect(
                    f"{url}?token={token}",
                    ping_interval=None,
                    open_timeout=30,
                    close_timeout=1,
                    max_size=None,
                )
                sockets.append(ws)
            except Exception as exc:
                failures.append(f"{exc.__class__.__name__}: {exc}"[:200])

    async def report():
        while True:
            await asyncio.sleep(1)
            pipe.send(("progress", len(sockets), len(failures)))

    async def answering():
        """How many sockets answer a `ping` frame with `pong` within 20 s: an open socket whose
        consumer died behind it (the server accepted it, then failed) does not."""
        gate, stop = asyncio.Semaphore(concurrency), time.monotonic() + 20

        async def ping(ws):
            async with gate:
                try:
                    await ws.send('{"type": "ping", "ref": 1}')
                    while True:
                        left = stop - time.monotonic()
                        if left <= 0:
                            return False
                        frame = json.loads(await asyncio.wait_for(ws.recv(), left))
                        if frame.get("type") == "pong":
                            return True
                except Exception:
                    return False

        return sum(await asyncio.gather(*(ping(ws) for ws in sockets)))

    reporter = asyncio.ensure_future(report())
    await asyncio.gather(*(one(t) for t in tokens))
    reporter.cancel()
    alive = await answering()
    pipe.send(("connected", alive, failures[:5], len(failures)))
    loop = asyncio.get_running_loop()
    # Hold them until told to stop (the server sends idle ones nothing).
    await loop.run_in_executor(None, pipe.poll, None)
    pipe.send(("still_open", await answering()))
    await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)


def idle_process(url, tokens, pipe, concurrency, connect_limit):
    asyncio.run(_idle_main(url, tokens, pipe, concurrency, connect_limit))
