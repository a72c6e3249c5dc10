"""The systems the comparison drives, each through its usual Python client.

Every system gives the workloads the same four things:

- `prepare(run, n)`: a queue (or stream, or exchange) for the run with `n` durable
  subscriptions, and returns a picklable `spec` that a subscriber process uses to connect;
- `publisher(run)`: an object with `one(payload)` (publish, wait for the confirm) and
  `many(payloads)` (publish a batch, wait for every confirm), and `close()`;
- `Consumer(spec, k)` in the subscriber process: `start()` connects and subscribes,
  `batches()` yields lists of (ack token, payload) as they arrive, `ack(tokens)`; its
  `client_modules` are imported before the clock starts (httpx takes 0.3 s, aio_pika 0.6 s:
  W7's whole drain may take a second);
- `stored(run)` and `unacked(run)`: what the system itself says it holds, for the checks.

A consumer keeps at most PREFETCH messages unacked, as the server's MQ_PREFETCH does.

The peers (RabbitMQ, NATS JetStream, Redis Streams, the PostgreSQL ceiling) are whole systems
here; this server's side of the same four (its modes, provisioning, `Ours`) is ours.py, and
its clients on the wire are below with the peers'. The processes that run every system's
consumers, and W6's idle sockets, are subscriber_processes.py.
"""

import asyncio
import json
import resource
import time

PREFETCH = 100
ACK_BATCH = 50  # ack at once when this many are waiting; otherwise within ACK_EVERY
ACK_EVERY = 0.005
MAX_BATCH_FRAME = 1000  # items of one batch `publish` frame (the server's publishing.MAX_BATCH)

RABBIT_URL = "amqp://guest:guest@127.0.0.1:5672/"
NATS_URL = "nats://127.0.0.1:4222"
REDIS_HOST, REDIS_PORT, REDIS_DB = "127.0.0.1", 6379, 11
PG_SERVER = "postgres://postgres@127.0.0.1:5432"
CEILING_DB = "mqbench_ceiling"


def raise_nofile():
    """As many file descriptors as the hard limit allows (W6 holds thousands of sockets)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def dumps(payload):
    return json.dumps(payload, separators=(",", ":")).encode()


class Window:
    """How many more messages a consumer may take before acking some (its prefetch)."""

    def __init__(self, size=PREFETCH):
        self.size, self.inflight, self.room = size, 0, asyncio.Event()
        self.room.set()

    def take(self, n):
        self.inflight += n
        if self.inflight >= self.size:
            self.room.clear()

    def give(self, n):
        self.inflight = max(self.inflight - n, 0)
        if self.inflight < self.size:
            self.room.set()

    @property
    def free(self):
        return self.size - self.inflight


# --- RabbitMQ: quorum queues, persistent messages, publisher confirms --------------------------


class Rabbit:
    name = "rabbitmq"
    label = "RabbitMQ quorum"
    note = "quorum queue (x-queue-type=quorum), delivery_mode=2, publisher confirms; fsyncs before confirming"

    async def _connect(self):
        import aio_pika

        return await aio_pika.connect(RABBIT_URL)

    async def prepare(self, run, n, ordered=False):
        """`ordered` (W7): each queue has a single active consumer, and the consumer a prefetch
        of 1, RabbitMQ's way to hand a queue's messages out one at a time in order."""
        import aio_pika

        arguments = {"x-queue-type": "quorum"}
        if ordered:
            arguments["x-single-active-consumer"] = True
        conn = await self._connect()
        async with conn:
            ch = await conn.channel()
            ex = await ch.declare_exchange(f"mqbench.{run}", aio_pika.ExchangeType.FANOUT, durable=True)
            for k in range(n):
                q = await ch.declare_queue(f"mqbench.{run}.{k}", durable=True, arguments=arguments)
                await q.bind(ex)
        return {
            "system": "rabbitmq",
            "queues": [f"mqbench.{run}.{k}" for k in range(n)],
            "prefetch": 1 if ordered else PREFETCH,
        }

    async def publisher(self, run):
        return RabbitPublisher(await self._connect(), run)

    async def _counts(self, run, n):
        conn = await self._connect()
        async with conn:
            ch = await conn.channel()
            out = []
            for k in range(n):
                q = await ch.declare_queue(f"mqbench.{run}.{k}", passive=True)
                out.append(q.declaration_result.message_count)
            return out

    async def stored(self, run, n):
        return sum(await self._counts(run, n))

    async def unacked(self, run, n):
        # After the consumer closed, what it had not acked is back in the queue's ready count.
        return sum(await self._counts(run, n))

    async def cleanup(self, run, n):
        conn = await self._connect()
        async with conn:
            ch = await conn.channel()
            for k in range(n):
                await ch.queue_delete(f"mqbench.{run}.{k}")
            await ch.exchange_delete(f"mqbench.{run}")


class RabbitPublisher:
    def __init__(self, conn, run):
        self.conn, self.run, self.ex = conn, run, None
        self.opening = asyncio.Lock()

    async def _ex(self):
        # One channel for all: the publishes of a first many() would otherwise each open one,
        # and messages on different channels reach the queue in any order (W7 checks it).
        async with self.opening:
            if self.ex is None:
                ch = await self.conn.channel(publisher_confirms=True)
                self.ex = await ch.get_exchange(f"mqbench.{self.run}")
        return self.ex

    async def one(self, payload):
        import aio_pika

        ex = await self._ex()
        # With confirms on, publish() returns once the broker confirmed the message.
        await ex.publish(aio_pika.Message(dumps(payload), delivery_mode=aio_pika.DeliveryMode.PERSISTENT), "")

    async def many(self, payloads):
        await asyncio.gather(*(self.one(p) for p in payloads))

    async def close(self):
        await self.conn.close()


class RabbitConsumer:
    client_modules = ("aio_pika",)

    def __init__(self, spec, k):
        self.queue_name, self.prefetch = spec["queues"][k], spec.get("prefetch", PREFETCH)

    async def start(self):
        import aio_pika

        self.conn = await aio_pika.connect(RABBIT_URL)
        self.ch = await self.conn.channel()
        await self.ch.set_qos(prefetch_count=self.prefetch)
        queue = await self.ch.get_queue(self.queue_name, ensure=False)
        self.incoming = asyncio.Queue()
        await queue.consume(self.incoming.put, no_ack=False)

    async def batches(self):
        while True:
            batch = [await self.incoming.get()]
            while not self.incoming.empty():
                batch.append(self.incoming.get_nowait())
            yield [(m, json.loads(m.body)) for m in batch]

    async def ack(self, tokens):
        # Delivery tags grow on a channel: acking the last with multiple=True acks them all.
        await tokens[-1].ack(multiple=True)

    async def close(self):
        await self.conn.close()


# --- NATS JetStream: a file-storage stream, js.publish awaiting its ack, explicit acks ----------


class Nats:
    name = "nats"
    label = "NATS JetStream"
    note = (
        "file-storage stream, js.publish awaits the PubAck; push consumers, explicit ack, max_ack_pending=100"
    )

    async def _connect(self):
        import nats

        return await nats.connect(NATS_URL)

    async def prepare(self, run, n):
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig

        nc = await self._connect()
        try:
            js = nc.jetstream()
            stream = f"MQBENCH_{run}".replace("-", "_").upper()
            await js.add_stream(
                StreamConfig(name=stream, subjects=[f"mqbench.{run}"], storage=StorageType.FILE)
            )
            for k in range(n):
                await js.add_consumer(
                    stream,
                    ConsumerConfig(
                        durable_name=f"c{k}",
                        deliver_subject=f"mqbench.deliver.{run}.{k}",
                        deliver_policy=DeliverPolicy.ALL,
                        ack_policy=AckPolicy.EXPLICIT,
                        max_ack_pending=PREFETCH,
                        ack_wait=30,
                    ),
                )
        finally:
            await nc.close()
        return {"system": "nats", "stream": stream, "subject": f"mqbench.{run}", "n": n}

    async def publisher(self, run):
        nc = await self._connect()
        return NatsPublisher(nc, f"mqbench.{run}")

    async def _info(self, run, n):
        nc = await self._connect()
        try:
            js = nc.jetstream()
            stream = f"MQBENCH_{run}".replace("-", "_").upper()
            info = await js.stream_info(stream)
            consumers = [await js.consumer_info(stream, f"c{k}") for k in range(n)]
            return info, consumers
        finally:
            await nc.close()

    async def stored(self, run, n):
        return (await self._info(run, n))[0].state.messages

    async def unacked(self, run, n):
        _, consumers = await self._info(run, n)
        return sum(c.num_ack_pending + c.num_pending for c in consumers)

    async def cleanup(self, run, n):
        nc = await self._connect()
        try:
            await nc.jetstream().delete_stream(f"MQBENCH_{run}".replace("-", "_").upper())
        finally:
            await nc.close()


class NatsPublisher:
    def __init__(self, nc, subject):
        self.nc, self.js, self.subject = nc, nc.jetstream(), subject

    async def one(self, payload):
        await self.js.publish(self.subject, dumps(payload))

    async def many(self, payloads):
        await asyncio.gather(*(self.js.publish(self.subject, dumps(p)) for p in payloads))

    async def close(self):
        await self.nc.close()


class NatsConsumer:
    client_modules = ("nats",)

    def __init__(self, spec, k):
        self.spec, self.k = spec, k

    async def start(self):
        import nats

        self.nc = await nats.connect(NATS_URL)
        js = self.nc.jetstream()
        self.sub = await js.subscribe(
            self.spec["subject"],
            durable=f"c{self.k}",
            stream=self.spec["stream"],
            manual_ack=True,
            pending_msgs_limit=10 * PREFETCH,
        )

    async def batches(self):
        queue = self.sub._pending_queue  # what nats-py's sub.messages iterates, read in batches
        while True:
            msgs = [await self.sub.next_msg(timeout=None)]
            while not queue.empty():
                msgs.append(await self.sub.next_msg(timeout=None))
            yield [(m, json.loads(m.data)) for m in msgs]

    async def ack(self, tokens):
        for m in tokens:  # explicit ack: one per message (sent, not awaited for a reply)
            await m.ack()

    async def close(self):
        await self.nc.close()


# --- Redis Streams: XADD, consumer groups, XREADGROUP + XACK ------------------------------------


class RedisStreams:
    name = "redis"
    label = "Redis Streams"
    note = (
        "XADD, XREADGROUP + XACK per consumer group; this Redis has appendonly=no and no save: "
        "nothing reaches disk"
    )

    def _client(self):
        import redis.asyncio

        return redis.asyncio.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB)

    async def prepare(self, run, n):
        r = self._client()
        try:
            await r.delete(f"mqbench:{run}")
            for k in range(n):
                await r.xgroup_create(f"mqbench:{run}", f"g{k}", id="0", mkstream=True)
        finally:
            await r.aclose()
        return {"system": "redis", "stream": f"mqbench:{run}", "n": n}

    async def publisher(self, run):
        return RedisPublisher(self._client(), f"mqbench:{run}")

    async def stored(self, run, n):
        r = self._client()
        try:
            return await r.xlen(f"mqbench:{run}")
        finally:
            await r.aclose()

    async def unacked(self, run, n):
        r = self._client()
        try:
            total = 0
            for g in await r.xinfo_groups(f"mqbench:{run}"):
                total += g["pending"] + (g.get("lag") or 0)
            return total
        finally:
            await r.aclose()

    async def cleanup(self, run, n):
        r = self._client()
        try:
            await r.delete(f"mqbench:{run}")
        finally:
            await r.aclose()


class RedisPublisher:
    def __init__(self, r, stream):
        self.r, self.stream = r, stream

    async def one(self, payload):
        await self.r.xadd(self.stream, {"d": dumps(payload)})

    async def many(self, payloads):
        pipe = self.r.pipeline(transaction=False)
        for p in payloads:
            pipe.xadd(self.stream, {"d": dumps(p)})
        await pipe.execute()

    async def close(self):
        await self.r.aclose()


class RedisConsumer:
    client_modules = ("redis.asyncio",)

    def __init__(self, spec, k):
        self.stream, self.group = spec["stream"], f"g{k}"

    async def start(self):
        import redis.asyncio

        self.r = redis.asyncio.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB)
        self.window = Window()

    async def batches(self):
        while True:
            await self.window.room.wait()
            got = await self.r.xreadgroup(
                self.group, "c", {self.stream: ">"}, count=self.window.free, block=1000
            )
            for _, entries in got or []:
                if entries:
                    self.window.take(len(entries))
                    yield [(eid, json.loads(fields[b"d"])) for eid, fields in entries]

    async def ack(self, tokens):
        await self.r.xack(self.stream, self.group, *tokens)
        self.window.give(len(tokens))

    async def close(self):
        await self.r.aclose()


# --- The PostgreSQL ceiling: one table, INSERT per publish, SKIP LOCKED claims ------------------

CEILING_DDL = """
CREATE TABLE IF NOT EXISTS {table} (
    id bigserial PRIMARY KEY,
    sub bigint NOT NULL,
    payload text NOT NULL,
    status text NOT NULL DEFAULT 'pending',
    attempt int NOT NULL DEFAULT 0,
    lease_until timestamptz,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS {table}_claim ON {table} (sub, status, id);
"""
# One statement in its own transaction (autocommit): one round trip and one commit, the rows
# for every subscription of the queue. The wake-up goes after it, as a second round trip
# outside that transaction: a NOTIFY inside it would serialise the commits of concurrent
# publishers on PostgreSQL's notify queue lock (measured: 500/s could not be sustained).
CEILING_PUBLISH = """
INSERT INTO {table} (sub, payload)
SELECT s, p FROM unnest(%(payloads)s::text[]) WITH ORDINALITY AS x(p, o)
CROSS JOIN unnest(%(subs)s::bigint[]) AS s
ORDER BY o, s
"""
CEILING_NOTIFY = "SELECT count(pg_notify('ceiling_' || s, '')) FROM unnest(%(subs)s::bigint[]) s"
CEILING_CLAIM = """
UPDATE {table} SET status = 'inflight', attempt = attempt + 1, lease_until = now() + interval '30 seconds'
WHERE id IN (
    SELECT id FROM {table} WHERE sub = %s AND status = 'pending' ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED
)
RETURNING id, payload
"""
CEILING_ACK = "UPDATE {table} SET status = 'acked', lease_until = NULL WHERE id = ANY(%s)"


def ceiling_url(db=CEILING_DB):
    return f"{PG_SERVER}/{db}"


class Ceiling:
    name = "pg-ceiling"
    label = "PostgreSQL ceiling"
    note = (
        "one table, INSERT ... per publish in its own transaction (+NOTIFY), claim with "
        "UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED LIMIT n) RETURNING, ack UPDATE"
    )

    def __init__(self, table="ceiling"):
        self.table = table
        self.next_sub = 0

    async def setup(self, fresh=True):
        import psycopg

        with psycopg.connect(ceiling_url("postgres"), autocommit=True) as conn:
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [CEILING_DB]).fetchone():
                conn.execute(f"CREATE DATABASE {CEILING_DB}")
        async with await psycopg.AsyncConnection.connect(ceiling_url(), autocommit=True) as conn:
            if fresh:
                await conn.execute(f"DROP TABLE IF EXISTS {self.table}")
            await conn.execute(CEILING_DDL.format(table=self.table))
            top = await (await conn.execute(f"SELECT coalesce(max(sub), 0) FROM {self.table}")).fetchone()
            self.next_sub = top[0] + 1

    def _subs(self, run):
        return self.runs[run]

    async def prepare(self, run, n):
        if not hasattr(self, "runs"):
            self.runs = {}
        self.runs[run] = list(range(self.next_sub, self.next_sub + n))
        self.next_sub += n
        return {"system": "pg-ceiling", "table": self.table, "subs": self.runs[run]}

    async def publisher(self, run):
        from psycopg_pool import AsyncConnectionPool

        pool = AsyncConnectionPool(
            ceiling_url(), min_size=4, max_size=20, kwargs={"autocommit": True}, open=False
        )
        await pool.open(wait=True)
        return CeilingPublisher(pool, self.table, self._subs(run))

    async def _count(self, run, where):
        import psycopg

        async with await psycopg.AsyncConnection.connect(ceiling_url(), autocommit=True) as conn:
            cur = await conn.execute(
                f"SELECT count(*) FROM {self.table} WHERE sub = ANY(%s) {where}", [self._subs(run)]
            )
            return (await cur.fetchone())[0]

    async def stored(self, run, n):
        return await self._count(run, "")

    async def unacked(self, run, n):
        return await self._count(run, "AND status <> 'acked'")

    async def cleanup(self, run, n):
        pass  # the table is dropped at the next setup(fresh=True)


class CeilingPublisher:
    def __init__(self, pool, table, subs):
        self.pool, self.sql, self.subs = pool, CEILING_PUBLISH.format(table=table), subs

    async def many(self, payloads):
        async with self.pool.connection() as conn:
            await conn.execute(
                self.sql, {"payloads": [dumps(p).decode() for p in payloads], "subs": self.subs}
            )
            await conn.execute(CEILING_NOTIFY, {"subs": self.subs})

    async def one(self, payload):
        await self.many([payload])

    async def close(self):
        await self.pool.close()


class CeilingConsumer:
    client_modules = ("psycopg",)

    def __init__(self, spec, k):
        self.table, self.sub = spec["table"], spec["subs"][k]

    async def start(self):
        import psycopg

        self.conn = await psycopg.AsyncConnection.connect(ceiling_url(), autocommit=True)
        self.listen = await psycopg.AsyncConnection.connect(ceiling_url(), autocommit=True)
        await self.listen.execute(f"LISTEN ceiling_{self.sub}")
        self.woken = asyncio.Event()
        self.listener = asyncio.ensure_future(self._listen())
        self.window = Window()
        self.claim_sql = CEILING_CLAIM.format(table=self.table)
        self.ack_sql = CEILING_ACK.format(table=self.table)
        self.lock = asyncio.Lock()  # one connection: claims and acks take turns

    async def _listen(self):
        async for _ in self.listen.notifies():
            self.woken.set()

    async def batches(self):
        while True:
            await self.window.room.wait()
            self.woken.clear()
            async with self.lock:
                rows = await (
                    await self.conn.execute(self.claim_sql, [self.sub, self.window.free])
                ).fetchall()
            if rows:
                rows.sort()
                self.window.take(len(rows))
                yield [(i, json.loads(p)) for i, p in rows]
            else:
                try:
                    await asyncio.wait_for(self.woken.wait(), 1.0)
                except TimeoutError:
                    pass

    async def ack(self, tokens):
        async with self.lock:
            await self.conn.execute(self.ack_sql, [list(tokens)])
        self.window.give(len(tokens))

    async def close(self):
        self.listener.cancel()
        await self.conn.close()
        await self.listen.close()


# --- The peers by name, as compare.py's --peers names them --------------------------------------

PEERS = {"rabbitmq": Rabbit, "nats": Nats, "redis": RedisStreams, "pg-ceiling": Ceiling}


def make_peer(name):
    return PEERS[name]()


class PeerRuns:
    """A peer with per-run names that do not collide with earlier runs; cleaned up after."""

    def __init__(self, peer, stamp):
        self.peer, self.stamp, self.made = peer, stamp, []

    def run_name(self, workload):
        return f"{workload.lower()}-{self.stamp}"

    async def prepare(self, run, n, consumer=None, ordered=False):
        self.made.append((run, n))
        # Only the peers that run W7 (workloads.ORDERED_PEERS) know `ordered`.
        return await self.peer.prepare(run, n, **({"ordered": True} if ordered else {}))

    def __getattr__(self, name):
        return getattr(self.peer, name)

    async def cleanup(self):
        for run, n in self.made:
            try:
                await self.peer.cleanup(run, n)
            except Exception as exc:
                print(f"  cleanup of {run}: {exc}")


# --- This server: REST and websockets ------------------------------------------------------------


class OursPublisherRest:
    def __init__(self, port, token, queue, concurrency=32):
        import httpx

        self.client = httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {token}"},
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
            timeout=60,
        )
        self.path = f"/api/queues/{queue}/messages"

    async def _post(self, body):
        r = await self.client.post(self.path, json=body)
        if r.status_code != 201:
            raise RuntimeError(f"publish answered {r.status_code}: {r.text[:200]}")

    async def one(self, payload):
        await self._post({"event": "create", "payload": payload})

    async def many(self, payloads):
        await self._post({"messages": [{"event": "create", "payload": p} for p in payloads]})

    async def close(self):
        await self.client.aclose()


class OursPublisherWs:
    """`publish` frames on one websocket; each answered `published` (the 201 of the socket)."""

    def __init__(self, port, token, queue):
        self.url, self.queue = f"ws://127.0.0.1:{port}/ws/?token={token}", queue
        self.ws, self.waiting, self.ref, self.reconnects = None, {}, 0, 0

    async def connect(self):
        from websockets.asyncio.client import connect

        self.ws = await connect(self.url, max_size=None, ping_interval=None, open_timeout=30)
        self.reader = asyncio.ensure_future(self._read())
        return self

    async def _read(self):
        from websockets.exceptions import ConnectionClosed

        try:
            async for raw in self.ws:
                frame = json.loads(raw)
                fut = self.waiting.pop(frame.get("ref"), None)
                if fut is None or fut.done():
                    continue
                if frame.get("type") == "published":
                    fut.set_result(frame)
                else:
                    fut.set_exception(RuntimeError(f"publish answered {json.dumps(frame)[:200]}"))
        except ConnectionClosed:
            pass  # the frames still waiting fail below; send() opens a new socket
        finally:
            for fut in self.waiting.values():
                if not fut.done():
                    fut.set_exception(RuntimeError("the publisher's socket closed"))

    async def send(self, payload):
        """Send one frame; returns the future of its answer. A socket the server closed is
        opened again first, as a client would (the close is counted, and the frames it left
        unanswered fail)."""
        return await self._send({"event": "create", "payload": payload})

    async def _send(self, fields):
        if self.ws.state.name != "OPEN":
            self.reconnects += 1
            await self.connect()
        self.ref += 1
        fut = asyncio.get_running_loop().create_future()
        self.waiting[self.ref] = fut
        await self.ws.send(json.dumps({"type": "publish", "queue": self.queue, **fields, "ref": self.ref}))
        return fut

    async def one(self, payload):
        await (await self.send(payload))

    async def many(self, payloads):
        # No batch frame on the socket: a window of frames in flight, then every answer.
        futs = [await self.send(p) for p in payloads]
        await asyncio.gather(*futs)

    async def close(self):
        await self.ws.close()
        self.reader.cancel()


class OursConsumerWs:
    client_modules = ("websockets.asyncio.client",)

    def __init__(self, spec, k):
        self.url = f"ws://127.0.0.1:{spec['port']}/ws/?token={spec['tokens'][k]}"
        self.queue = spec["queue"]

    async def start(self):
        from websockets.asyncio.client import connect

        self.ws = await connect(self.url, max_size=None, ping_interval=None, open_timeout=60)
        await self.ws.send(json.dumps({"type": "subscribe", "queue": self.queue}))
        self.frames = asyncio.Queue()
        while True:  # deliveries may come before "subscribed": the subscription already exists
            frame = json.loads(await asyncio.wait_for(self.ws.recv(), 60))
            if frame.get("type") == "subscribed":
                break
            self.frames.put_nowait(frame)
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self):
        try:
            async for raw in self.ws:
                self.frames.put_nowait(json.loads(raw))
        except Exception as exc:
            self.frames.put_nowait({"type": "closed", "detail": repr(exc)})
        else:
            self.frames.put_nowait({"type": "closed"})

    async def batches(self):
        while True:
            frames = [await self.frames.get()]
            while not self.frames.empty():  # and what else has arrived, without waiting
                frames.append(self.frames.get_nowait())
            batch = []
            for f in frames:
                if f.get("type") != "message":
                    raise RuntimeError(f"unexpected frame {json.dumps(f)[:200]}")
                batch.append((f["id"], f["payload"]))
            yield batch

    async def ack(self, tokens):
        await self.ws.send(json.dumps({"type": "ack", "ids": list(tokens)}))

    async def close(self):
        self.reader.cancel()
        await self.ws.close()


class OursPublisherWsBatch(OursPublisherWs):
    """As OursPublisherWs, but a batch goes as one batch `publish` frame (`"messages": [...]`,
    all or nothing) answered by one `published` frame listing every message in order. A single
    message is still one plain `publish` frame (W1a, W3)."""

    async def send_batch(self, payloads):
        return await self._send({"messages": [{"event": "create", "payload": p} for p in payloads]})

    async def many(self, payloads):
        for first in range(0, len(payloads), MAX_BATCH_FRAME):
            part = payloads[first : first + MAX_BATCH_FRAME]
            answer = await (await self.send_batch(part))
            if len(answer.get("messages") or ()) != len(part):
                raise RuntimeError(f"a batch of {len(part)} answered {json.dumps(answer)[:200]}")


class OursConsumerWsBatch(OursConsumerWs):
    """Subscribes with `"batch": true`: deliveries come as `messages` frames of many `message`
    frames each, acked with the usual `ack` frame. What the server sends before `subscribed`
    (the resume of the connect, which does not know of the batch yet) may still be single
    `message` frames; after it, a single one is an error. Counts the frames and their items."""

    async def start(self):
        from websockets.asyncio.client import connect

        self.ws = await connect(self.url, max_size=None, ping_interval=None, open_timeout=60)
        await self.ws.send(json.dumps({"type": "subscribe", "queue": self.queue, "batch": True}))
        self.frames = asyncio.Queue()
        self.counts = {"single_before_subscribed": 0, "batch_frames": 0, "batch_items": 0, "largest": 0}
        batch = []
        while True:
            frame = json.loads(await asyncio.wait_for(self.ws.recv(), 60))
            if frame.get("type") == "subscribed":
                break
            if frame.get("type") == "message":
                self.counts["single_before_subscribed"] += 1
                batch.append(frame)
            else:
                self.frames.put_nowait(frame)
        if batch:
            self.frames.put_nowait({"type": "messages", "messages": batch, "before_subscribed": True})
        self.reader = asyncio.ensure_future(self._read())

    async def batches(self):
        while True:
            frames = [await self.frames.get()]
            while not self.frames.empty():
                frames.append(self.frames.get_nowait())
            batch = []
            for f in frames:
                if f.get("type") != "messages":
                    raise RuntimeError(f"unexpected frame {json.dumps(f)[:200]}")
                items = f["messages"]
                if not f.get("before_subscribed"):
                    self.counts["batch_frames"] += 1
                    self.counts["batch_items"] += len(items)
                    self.counts["largest"] = max(self.counts["largest"], len(items))
                for m in items:
                    if m.get("type") != "message":
                        raise RuntimeError(f"unexpected item {json.dumps(m)[:200]}")
                    batch.append((m["id"], m["payload"]))
            yield batch

    def stats(self):
        return self.counts


class OursConsumerRest:
    """Pull: GET /api/deliveries (long-polling), POST /api/deliveries/ack."""

    client_modules = ("httpx",)

    def __init__(self, spec, k):
        self.spec, self.k = spec, k

    async def start(self):
        import httpx

        self.client = httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{self.spec['port']}",
            headers={"Authorization": f"Bearer {self.spec['tokens'][self.k]}"},
            timeout=60,
        )
        self.window = Window()

    async def batches(self):
        while True:
            await self.window.room.wait()
            r = await self.client.get(
                "/api/deliveries", params={"queue": self.spec["queue"], "limit": self.window.free, "wait": 1}
            )
            if r.status_code != 200:
                raise RuntimeError(f"pull answered {r.status_code}: {r.text[:200]}")
            got = r.json()["deliveries"]
            if got:
                self.window.take(len(got))
                yield [(d["id"], d["payload"]) for d in got]

    async def ack(self, tokens):
        r = await self.client.post("/api/deliveries/ack", json={"ids": list(tokens)})
        if r.status_code != 200:
            raise RuntimeError(f"ack answered {r.status_code}: {r.text[:200]}")
        self.window.give(len(tokens))

    async def close(self):
        await self.client.aclose()


class OursConsumerPull(OursConsumerRest):
    """W7's prompt pull consumer: lease one delivery (a long-poll, so that it is answered as
    soon as one is ready), ack it, lease the next; two requests a message, each timed
    (`timings`: where a message's time goes)."""

    async def start(self):
        await super().start()
        self.times = {"lease": [], "ack": []}

    async def batches(self):
        while True:
            t = time.perf_counter()
            r = await self.client.get(
                "/api/deliveries", params={"queue": self.spec["queue"], "limit": 1, "wait": 5}
            )
            self.times["lease"].append(time.perf_counter() - t)
            if r.status_code != 200:
                raise RuntimeError(f"pull answered {r.status_code}: {r.text[:200]}")
            got = r.json()["deliveries"]
            if got:
                yield [(d["id"], d["payload"]) for d in got]

    async def ack(self, tokens):
        t = time.perf_counter()
        await super().ack(tokens)
        self.times["ack"].append(time.perf_counter() - t)

    def timings(self):
        return self.times


CONSUMERS = {
    "rabbitmq": RabbitConsumer,
    "nats": NatsConsumer,
    "redis": RedisConsumer,
    "pg-ceiling": CeilingConsumer,
    "ours-ws": OursConsumerWs,
    "ours-ws-batch": OursConsumerWsBatch,
    "ours-rest": OursConsumerRest,
    "ours-pull": OursConsumerPull,
}
