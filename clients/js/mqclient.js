/**
 * mqclient.js: the JavaScript client of this queue server: the npm package in clients/js
 * (types in mqclient.d.ts), and the file the server serves at /static/mq/mqclient.js.
 * An ES module with no build step and no dependencies; it runs in browsers and in Node 22+
 * (their global WebSocket; Node 20 needs `--experimental-websocket`, or pass `WebSocket`).
 *
 *   import { connect } from "http://127.0.0.1:8000/static/mq/mqclient.js";
 *   const mq = connect({ url: "http://127.0.0.1:8000", token }); // options: prefetch, ...
 *   mq.on("state", (state, info) => console.log(state, info)); // connecting, open, closed
 *   mq.subscribe("db", "create", async (m) => save(m.payload)); // event null: every event
 *   const answer = await mq.publish("db", "create", { id: 7 }, { key: "user-7" });
 *   await mq.close();
 *
 * What it does for its user (docs/clients/javascript.md and docs/clients/index.md):
 * - One websocket at `url` + /ws/, authenticated by the `auth` frame: a page never puts its
 *   long-lived token in a URL that access logs keep.
 * - A handler is called with the delivery (id, message_id, queue, event, seq, payload, attempt,
 *   published_at), one at a time in the order they arrive; when it returns (or its promise
 *   resolves) the delivery is acked; when it throws (or rejects) it is nacked with the error's
 *   text and the server redelivers it after its backoff.
 * - Effectively once on top of at-least-once: a delivery id it acked is never handed to a
 *   handler again (the last `dedupe` ids are remembered; a repeat is acked again, silently),
 *   and an id being handled is not handed out twice at once. A seek through this client
 *   forgets those of its subscription first: the server hands them out again, same ids. (One
 *   made elsewhere, by another process or an operator, is not known here: what it reopens of
 *   the ids still remembered is acked without a handler call.)
 * - When the socket or the server goes away it reconnects with jittered exponential backoff
 *   (capped), sends again the acks and nacks it could not send, its subscribe frames and the
 *   publishes that have a `key` (one without a key, unanswered when the socket dropped, is
 *   rejected with code `connection_lost`: it may or may not be in). The server resumes
 *   every subscription by itself; deliveries not yet handled go back with the old socket.
 * - Deliveries come in `messages` frames (`batch: true`), acks go out together.
 * - A `rate_limited` error frame pauses its sending for `retry_after` seconds and sends that
 *   frame again; a close with 4429 waits before reconnecting. A bad or revoked token (close
 *   4401) ends it: state "closed" with the error, no retries.
 * - Publishes go over the socket (the `publish` frame with a `ref`), since it is open anyway;
 *   the promise resolves to the `published` answer or rejects with an MQError.
 * - The token goes to `url`'s server only: the auth frame is sent on an open socket, and the
 *   WebSocket of browsers and Node fails a handshake answered with a redirect rather than
 *   following it. An http:// url of a host that is not loopback is warned about (console.warn,
 *   once per client): the token would cross the network in clear text.
 * - A delivery still held as its lease nears its end (handled, or waiting behind a slow
 *   handler) gets it extended (leaseSecs, up to maxExtension); a client that cannot connect, or whose handler keeps failing, says so with
 *   console.warn (warnAfterFailures in a row).
 */

const CLOSE_BAD_TOKEN = 4401;
const CLOSE_TOO_MANY = 4429;
const MAX_NACK_ERROR_CHARS = 1000; // the server refuses a longer nack error
const MAX_ACK_IDS = 1000; // ids per ack frame (the server takes up to 10,000)
const TRACKED_FRAMES = 1000; // recent ack and nack frames kept to send again if rate-limited

const DEFAULTS = {
  backoffInitial: 250, // ms before the first reconnect; doubles up to backoffMax
  backoffMax: 10000,
  heartbeat: 25000, // ms of silence before a ping; 10 s more without a frame and it reconnects
  authTimeout: 15000, // ms for a socket to open and be authenticated
  stableAfter: 5000, // ms a connection must have lasted for the backoff to start again
  dedupe: 10000, // acked delivery ids remembered
  closeTimeout: 5000, // ms close() waits for a running handler and unanswered publishes
  prefetch: null, // deliveries in flight on the socket at most (the server caps it at MQ_PREFETCH)
  // A delivery still held (handled, or waiting behind a slow handler) as its lease nears its end
  // gets the lease extended (as Pub/Sub's clients do): the frames carry no deadline, so the
  // client counts from receipt with the queue's ack_timeout as it assumes it (the server's
  // default, 30 s), extends by that much at 60 % of it, and stops after maxExtension s in all
  // (the handler may be stuck).
  leaseSecs: 30,
  maxExtension: 3600,
  warnAfterFailures: 5, // consecutive handler failures (or failed connects) before a console.warn
};

/** An error the server or the connection reported: `code` is the server's short code (or
 * `unauthorized`, `connection_lost`, `closed`), `detail` its words. */
export class MQError extends Error {
  constructor(code, detail, extra = {}) {
    super(detail || code);
    this.name = "MQError";
    this.code = code;
    this.detail = detail;
    Object.assign(this, extra);
  }
}

/** The last `max` ids added, in insertion order (a Map iterates in that order), each with the
 * queue and event of its delivery (so that a seek can forget those of its subscription), and
 * the queue and event of each subscription seen (a seek by id must know them before its
 * answer is back). */
class RecentIds {
  constructor(max) {
    this.max = max;
    this.ids = new Map();
    this.subscriptions = new Map(); // subscription id (as text: 7 or "7") -> {queue, event}
  }
  has(id) {
    return this.ids.has(id);
  }
  add(id, queue, event) {
    if (this.ids.has(id)) return;
    this.ids.set(id, { queue, event });
    if (this.ids.size > this.max) this.ids.delete(this.ids.keys().next().value);
  }
  /** Forget the ids of `queue` (and `event`; null: every event). */
  forget(queue, event) {
    for (const [id, of] of this.ids) {
      if (of.queue === queue && (event == null || of.event === event)) this.ids.delete(id);
    }
  }
  subscribed(subscription, queue, event) {
    if (subscription == null || queue == null) return;
    this.subscriptions.set(String(subscription), { queue, event: event ?? null });
  }
  /** {queue, event} of a subscription: its id, as a subscribed frame named it, or subscribe()'s
   * answer (which carries them); null when unknown here. */
  subscriptionOf(subscription) {
    if (subscription !== null && typeof subscription === "object") {
      if (subscription.queue != null) return { queue: subscription.queue, event: subscription.event ?? null };
      subscription = subscription.subscription ?? subscription.id;
    }
    return this.subscriptions.get(String(subscription)) ?? null;
  }
}

function socketUrl(url) {
  const base = new URL(url ?? globalThis.location?.origin);
  if (base.protocol === "http:" || base.protocol === "https:") {
    base.protocol = base.protocol === "https:" ? "wss:" : "ws:";
  } else if (base.protocol !== "ws:" && base.protocol !== "wss:") {
    throw new TypeError(`url must be the server's http(s)://host:port, not ${url}`);
  }
  return new URL("/ws/", base).href;
}

/** localhost, *.localhost, 127.0.0.0/8, ::1: traffic that never leaves the machine (names are
 * not resolved: one that merely points at 127.0.0.1 counts as remote). */
function isLoopback(hostname) {
  const host = hostname.replace(/^\[|\]$/g, "").toLowerCase().replace(/\.$/, "");
  return (
    host === "localhost" || host.endsWith(".localhost") || /^127(\.\d{1,3}){3}$/.test(host) || host === "::1"
  );
}

const keyOf = (queue, event) => `${queue}\u0000${event ?? ""}`;

function errorText(error) {
  let text = error instanceof Error ? error.message || error.name : String(error);
  // What the server can store: no NUL, no lone surrogate (toWellFormed is recent: Node 20+).
  text = text.replaceAll("\u0000", "");
  if (typeof text.toWellFormed === "function") text = text.toWellFormed();
  return text.slice(0, MAX_NACK_ERROR_CHARS) || "handler failed";
}

class Client {
  constructor(options) {
    const { url, token, WebSocket: Socket, ...rest } = options ?? {};
    if (typeof token !== "string" || !token) throw new TypeError("connect() needs a token (a string)");
    this.options = { ...DEFAULTS, ...rest };
    this.url = socketUrl(url);
    this.token = token;
    const where = new URL(this.url);
    if (where.protocol === "ws:" && !isLoopback(where.hostname)) {
      console.warn(
        `mqclient: ${where.origin.replace(/^ws:/, "http:")} is not https and not loopback: the token ` +
          "and every payload cross the network in clear text; use https://",
      );
    }
    this.Socket = Socket ?? globalThis.WebSocket;
    if (typeof this.Socket !== "function") {
      throw new TypeError(
        "This runtime has no global WebSocket (Node before 22): run node with " +
          "--experimental-websocket (Node 20.10+), or pass connect({WebSocket})",
      );
    }
    this.state = null;
    this.error = null;
    this.subscriber = null; // the name the server authenticated
    this._listeners = new Map();
    this._subs = new Map(); // key -> {queue, event, handler, waiters}
    this._requests = new Map(); // ref -> publish or subscribe awaiting its answer, in order
    this._tracked = new Map(); // ref -> recent ack or nack frame
    this._ref = 0;
    this._acked = new RecentIds(this.options.dedupe);
    this._busy = new Set(); // ids queued or being handled
    this._queue = []; // deliveries waiting for their handler
    this._orphans = []; // deliveries of a subscription with no handler here (yet)
    this._ackIds = new Set();
    this._nacks = [];
    this._extends = []; // {ids, seconds} waiting for the socket
    this._receipts = new Map(); // ref -> the receipt promise of a published answer
    this._leases = new Map(); // id -> {due, cap}: deliveries held here, waiting or being handled
    this._handlerFailures = 0; // consecutive
    this._connectFailures = 0; // consecutive, since the last time it got in
    this._ws = null;
    this._authed = false;
    this._attempt = 0;
    this._pausedUntil = 0;
    this._retryAfter = null; // seconds an error frame of this socket asked to wait
    this._limited = false; // this socket was told it is over a limit (the why of a 4429)
    this._closing = false;
    this._closed = null;
    this._draining = false;
    // After connect() returns, so that listeners attached at once see "connecting".
    queueMicrotask(() => this._open());
  }

  /** on("state", fn(state, info)) for "connecting" | "open" | "closed"; on("error", fn(err))
   * for errors no promise carries. Returns a function that removes the listener. */
  on(name, fn) {
    if (!this._listeners.has(name)) this._listeners.set(name, new Set());
    this._listeners.get(name).add(fn);
    return () => this._listeners.get(name).delete(fn);
  }

  /** Handle the deliveries of the subscriber's subscription to `queue` (and `event`, or every
   * event when null). Makes or reuses the durable subscription; resolves to the server's
   * answer {subscription, queue, event, ...}. Calling it again for the same pair replaces the
   * handler. `from` ("new", "all", {seq}, {time} or a Date) is where a new subscription starts;
   * `filter` the server's subscription filter (null: none). */
  subscribe(queue, event, handler, { from, filter } = {}) {
    if (typeof handler !== "function") throw new TypeError("subscribe() needs a handler function");
    if (this._closing) return Promise.reject(new MQError("closed", "This client is closed."));
    queue = String(queue).toLowerCase();
    event = event == null ? null : String(event).toLowerCase();
    const key = keyOf(queue, event);
    const sub = this._subs.get(key) ?? { queue, event, waiters: [] };
    sub.handler = handler;
    // `from` matters to a new subscription only: asked once, not again on each reconnect.
    sub.from = from;
    if (filter !== undefined) sub.filter = filter;
    this._subs.set(key, sub);
    const answer = new Promise((resolve, reject) => sub.waiters.push({ resolve, reject }));
    answer.catch(() => {}); // also told to on("error"): not an unhandled rejection if unawaited
    this._adoptOrphans();
    if (this._authed) this._requestSubscribe(sub);
    return answer;
  }

  /** Publish `payload` (any JSON value) as `event` of `queue`; resolves to the server's
   * answer {id, queue, event, seq, deliveries}. With `key`, the same key again in the same
   * queue gives back the first message, and the client may send it again after a reconnect.
   * `delay_secs` or `deliver_at` (a Date or ISO 8601 text) delay it; `ttl_secs` or `expires_at`
   * make it expire (the server checks them: an `error` frame bad_delay or bad_expiry).
   * `headers` and `group` go with the message; with `receipt: true` the answer's `receipt` is a
   * promise of the receipt frame ({id, deliveries}). */
  publish(queue, event, payload, { key, headers, group, receipt, delay_secs, deliver_at, ttl_secs, expires_at } = {}) {
    if (this._closing) return Promise.reject(new MQError("closed", "This client is closed."));
    const frame = { type: "publish", queue, event, payload: payload === undefined ? null : payload };
    if (key != null) frame.key = String(key);
    if (headers != null) frame.headers = headers;
    if (group != null) frame.group = String(group);
    if (receipt) frame.receipt = true;
    const timing = { delay_secs, deliver_at, ttl_secs, expires_at };
    for (const [name, value] of Object.entries(timing)) {
      if (value != null) frame[name] = value instanceof Date ? value.toISOString() : value;
    }
    return new Promise((resolve, reject) => {
      this._requests.set(this._nextRef(), { kind: "publish", frame, resolve, reject, sent: false });
      this._flush();
    });
  }

  /** Move the ack deadline of deliveries this socket holds to now + `seconds` (1 to 43200).
   * Sent when the socket is open; ids the server does not know as in flight here come back as
   * an "unknown_ids" error (on("error")). The handler loop does this by itself (leaseSecs). */
  extend(ids, seconds) {
    ids = Array.isArray(ids) ? ids : [ids];
    if (!ids.length) return;
    this._extends.push({ ids, seconds: Math.round(seconds) });
    this._flush();
  }

  /** Make the subscription (its id, or subscribe()'s answer) owe again every message from
   * `point` ({seq: N}, {time: ISO 8601 text} or a Date) that the server still keeps; resolves to
   * the server's answer. Over HTTPS (REST), the socket has no seek frame. The handler gets
   * the reopened deliveries again (same ids). */
  async seek(subscription, point) {
    if (point instanceof Date) point = { time: point.toISOString() };
    // The deliveries it reopens keep their ids, acked here, and the server pushes them down the
    // socket as it commits, before the HTTP answer can be back: forgotten first, so that the
    // handler gets them (not the silent ack of a lost-ack repeat).
    const known = this._acked.subscriptionOf(subscription);
    if (known) this._acked.forget(known.queue, known.event);
    const given = subscription !== null && typeof subscription === "object";
    const id = given ? (subscription.subscription ?? subscription.id) : subscription;
    const base = this.url.replace(/^ws/, "http").replace(/\/ws\/?$/, "");
    const response = await fetch(`${base}/api/subscriptions/${encodeURIComponent(id)}/seek`, {
      method: "POST",
      headers: { Authorization: `Bearer ${this.token}`, "Content-Type": "application/json" },
      body: JSON.stringify(point),
      redirect: "error", // the token goes to this server only
    });
    const body = await response.json().catch(() => ({}));
    if (!response.ok) throw new MQError(body.code ?? `http_${response.status}`, body.detail, { status: response.status });
    // A subscription not known before (or named wrongly): forgotten now, by the answer. Not
    // twice: what a handler acked since the first forget is remembered, as any ack.
    const event = body.event ?? null;
    if (known?.queue !== body.queue || known?.event !== event) this._acked.forget(body.queue, event);
    this._acked.subscribed(body.id, body.queue, body.event);
    return body;
  }

  /** Stop: no new deliveries are handled, a running handler may finish (its ack is sent),
   * then the socket closes. Resolves when it is closed. */
  close() {
    if (this._closed) return this._closed;
    this._closing = true;
    clearTimeout(this._reconnectTimer);
    this._dropQueued();
    this._closed = (async () => {
      const deadline = Date.now() + this.options.closeTimeout;
      const answered = () => ![...this._requests.values()].some((r) => r.kind === "publish" && r.sent);
      while ((this._draining || !answered()) && this._ws && Date.now() < deadline) {
        await new Promise((r) => setTimeout(r, 20));
      }
      this._flush();
      this._rejectAll(new MQError("closed", "This client was closed."));
      const ws = this._ws;
      if (ws) {
        const gone = new Promise((r) => ws.addEventListener("close", r));
        ws.close(1000);
        await Promise.race([gone, new Promise((r) => setTimeout(r, 1000))]);
        this._onClose(ws, 1000, "");
      }
      this._stopTimers();
      this._setState("closed", {});
    })();
    return this._closed;
  }

  // --- the connection ----------------------------------------------------------------------

  _open() {
    if (this._closing) return;
    this._setState("connecting", {});
    let ws;
    try {
      ws = new this.Socket(this.url);
    } catch (error) {
      this._reconnect(undefined, String(error), false);
      return;
    }
    this._ws = ws;
    this._authed = false;
    this._retryAfter = null;
    this._limited = false;
    this._openedAt = this._lastFrameAt = Date.now();
    this._pinged = false;
    ws.onopen = () => {
      ws.opened = true;
      const auth = { type: "auth", token: this.token };
      if (this.options.prefetch != null) auth.prefetch = this.options.prefetch;
      ws.send(JSON.stringify(auth));
    };
    ws.onmessage = (event) => this._onFrame(ws, event.data);
    ws.onclose = (event) => this._onClose(ws, event.code, event.reason);
    // A close follows, and says more; but Node 20's WebSocket fires only an error on a refused
    // connection: a socket that never opened is dropped (a second _onClose call is ignored).
    ws.onerror = () => setTimeout(() => !ws.opened && this._drop(ws, "connection failed"), 0);
    clearInterval(this._heartbeat);
    this._heartbeat = setInterval(() => this._checkAlive(ws), 1000);
  }

  /** A silent server (a dead link, a frozen process) is found by pings, not by waiting for
   * TCP: the socket is dropped and a new one made. */
  _checkAlive(ws) {
    if (ws !== this._ws) return;
    const now = Date.now();
    if (!this._authed) {
      if (now - this._openedAt > this.options.authTimeout) this._drop(ws, "no answer to auth");
      return;
    }
    const silent = now - this._lastFrameAt;
    if (silent > this.options.heartbeat + 10000) this._drop(ws, "no answer to ping");
    else if (silent > this.options.heartbeat && !this._pinged) {
      this._pinged = true;
      this._send({ type: "ping", ref: this._nextRef() });
    }
  }

  _drop(ws, reason) {
    try {
      ws.close(1000, reason);
    } catch {
      // closing a socket that never opened may throw: it is dropped all the same
    }
    this._onClose(ws, 1006, reason);
  }

  _onClose(ws, code, reason) {
    if (ws !== this._ws) return;
    ws.onopen = ws.onmessage = ws.onclose = null;
    this._ws = null;
    clearInterval(this._heartbeat);
    const wasAuthed = this._authed;
    this._authed = false;
    this._pausedUntil = 0;
    this._dropQueued(); // the server hands them back with the socket
    this._extends = []; // those leases went with the socket
    // A socket's receipts go with it (the server owes them to that socket).
    this._rejectReceipts(new MQError("connection_lost", "The connection dropped before the receipt came."));
    for (const [ref, req] of this._requests) {
      if (req.kind === "subscribe") this._requests.delete(ref); // sent again on the next open
      else if (req.sent && req.frame.key != null) req.sent = false; // the same key: no twice
      else if (req.sent) {
        this._requests.delete(ref);
        req.reject(
          new MQError(
            "connection_lost",
            "The connection dropped before the server answered: the message may or may not " +
              "be published. Publish with a key to have it sent again safely.",
          ),
        );
      }
    }
    if (this._closing) return;
    if (!ws.opened && !this._toldUnreachable) {
      // Said once until it gets in: a browser tells a page nothing more of a refused handshake.
      this._toldUnreachable = true;
      const detail =
        `Could not open ${this.url}: the server is down or refused the handshake (a page's ` +
        "origin must be a host of the server's ALLOWED_HOSTS, or none: file://). Retrying.";
      this._emit("error", new MQError("unreachable", detail));
    }
    if (code === CLOSE_BAD_TOKEN) {
      const detail = "The server refused the token (close 4401).";
      this._fail(new MQError("unauthorized", detail, { closeCode: code }));
      return;
    }
    this._reconnect(code, reason, wasAuthed);
  }

  _reconnect(code, reason, wasAuthed) {
    if (!wasAuthed && code !== CLOSE_TOO_MANY) {
      this._connectFailures += 1;
      if (this._connectFailures === this.options.warnAfterFailures) {
        console.warn(
          `mqclient: cannot connect to ${this.url} (${this._connectFailures} attempts in a row` +
            `${reason ? `, last: ${reason}` : ""}); still retrying`,
        );
      }
    }
    if (wasAuthed && Date.now() - this._authedAt >= this.options.stableAfter) this._attempt = 0;
    const ceiling = Math.min(this.options.backoffMax, this.options.backoffInitial * 2 ** this._attempt);
    this._attempt = Math.min(this._attempt + 1, 30);
    let wait = ceiling / 2 + (Math.random() * ceiling) / 2;
    if (code === CLOSE_TOO_MANY) {
      // Too many sockets or frames (an error frame before it says which, perhaps how long),
      // or, with no word before it, too many bad tokens from this address: a minute's window.
      let floor = 5000;
      if (this._retryAfter != null) floor = this._retryAfter * 1000;
      else if (!wasAuthed && !this._limited) floor = 60000;
      wait = Math.max(wait, floor * (1 + Math.random() * 0.2));
    }
    this._setState("connecting", { code, reason, retryIn: Math.round(wait) });
    clearTimeout(this._reconnectTimer);
    this._reconnectTimer = setTimeout(() => this._open(), wait);
  }

  _fail(error) {
    this._closing = true;
    this._closed = Promise.resolve();
    this.error = error;
    this._stopTimers();
    this._rejectAll(error);
    this._setState("closed", { error, code: error.closeCode });
    this._emit("error", error);
  }

  _stopTimers() {
    clearInterval(this._heartbeat);
    clearInterval(this._leaseTimer);
    this._leaseTimer = null;
    clearTimeout(this._reconnectTimer);
    clearTimeout(this._flushTimer);
  }

  _rejectAll(error) {
    for (const req of this._requests.values()) if (req.kind === "publish") req.reject(error);
    this._requests.clear();
    this._rejectReceipts(error);
    for (const sub of this._subs.values()) for (const w of sub.waiters.splice(0)) w.reject(error);
  }

  // --- frames from the server ----------------------------------------------------------------

  _onFrame(ws, data) {
    if (ws !== this._ws) return;
    this._lastFrameAt = Date.now();
    this._pinged = false;
    let frame;
    try {
      frame = JSON.parse(data);
    } catch {
      return;
    }
    switch (frame.type) {
      case "authenticated":
        this._onAuthenticated(frame);
        break;
      case "message":
        this._receive([frame]);
        break;
      case "messages":
        this._receive(frame.messages ?? []);
        break;
      case "published":
        this._onAnswer(frame);
        break;
      case "subscribed":
        this._onSubscribed(frame);
        break;
      case "unsubscribed":
        if (frame.reason) {
          const detail = `Unsubscribed from ${frame.queue}/${frame.event ?? "*"}`;
          this._emit("error", new MQError(frame.reason, detail, frame));
        }
        break;
      case "error":
        this._onError(frame);
        break;
      case "receipt":
        this._onReceipt(frame);
        break;
      default: // pong, and what later servers add
    }
  }

  _onAuthenticated(frame) {
    this._authed = true;
    this._authedAt = Date.now();
    this._toldUnreachable = false;
    this._connectFailures = 0;
    this.subscriber = frame.subscriber;
    // Before the server's resume (it waits a moment for them): acks that could not be sent,
    // so those deliveries are not handed out again, then the subscribe frames.
    for (const sub of this._subs.values()) this._requestSubscribe(sub, false);
    this._flush();
    this._setState("open", { subscriber: frame.subscriber });
  }

  _requestSubscribe(sub, flush = true) {
    const frame = { type: "subscribe", queue: sub.queue, batch: true };
    if (sub.event != null) frame.event = sub.event;
    if (this.options.prefetch != null) frame.prefetch = this.options.prefetch;
    if (sub.from != null) frame.from = sub.from instanceof Date ? { time: sub.from.toISOString() } : sub.from;
    if (sub.filter !== undefined) frame.filter = sub.filter;
    const key = keyOf(sub.queue, sub.event);
    this._forgetSubscribe(key);
    this._requests.set(this._nextRef(), { kind: "subscribe", key, frame, sent: false });
    if (flush) this._flush();
  }

  _forgetSubscribe(key) {
    for (const [ref, req] of this._requests) {
      if (req.kind === "subscribe" && req.key === key) this._requests.delete(ref);
    }
  }

  _onSubscribed(frame) {
    this._acked.subscribed(frame.subscription, frame.queue, frame.event); // for a seek by id
    const key = keyOf(frame.queue, frame.event);
    this._forgetSubscribe(key);
    const sub = this._subs.get(key);
    if (!sub) return;
    sub.from = undefined;
    const { type, ref, ...answer } = frame;
    for (const w of sub.waiters.splice(0)) w.resolve(answer);
  }

  _onAnswer(frame) {
    const req = this._requests.get(frame.ref);
    if (!req || req.kind !== "publish") return;
    this._requests.delete(frame.ref);
    const { type, ref, ...answer } = frame;
    if (req.frame.receipt) {
      // The server sends it on this socket once every delivery is acked or dead.
      answer.receipt = new Promise((resolve, reject) => this._receipts.set(ref, { resolve, reject }));
      answer.receipt.catch(() => {}); // not an unhandled rejection if the caller never awaits it
    }
    req.resolve(answer);
  }

  _onReceipt(frame) {
    const waiter = this._receipts.get(frame.ref);
    if (!waiter) return;
    this._receipts.delete(frame.ref);
    const { type, ref, ...receipt } = frame;
    waiter.resolve(receipt);
  }

  _rejectReceipts(error) {
    for (const waiter of this._receipts.values()) waiter.reject(error);
    this._receipts.clear();
  }

  _onError(frame) {
    const ref = frame.ref;
    const error = new MQError(frame.code, frame.detail, { ...frame, retryAfter: frame.retry_after });
    delete error.type;
    if (frame.code === "rate_limited") {
      // Not processed: send it again once the wait is over, and nothing else before then.
      this._pausedUntil = Math.max(this._pausedUntil, Date.now() + (frame.retry_after ?? 1) * 1000);
      const req = this._requests.get(ref);
      const tracked = this._tracked.get(ref);
      if (req) req.sent = false;
      else if (tracked?.type === "ack") for (const id of tracked.ids) this._ackIds.add(id);
      else if (tracked?.type === "nack") this._nacks.push({ ids: tracked.ids, error: tracked.error });
      this._tracked.delete(ref);
      this._flush();
      return;
    }
    if (frame.retry_after != null) this._retryAfter = frame.retry_after;
    if (frame.code?.startsWith("too_many")) this._limited = true;
    const req = this._requests.get(ref);
    if (req) {
      this._requests.delete(ref);
      if (req.kind === "publish") {
        req.reject(error);
        return;
      }
      // A subscription the server refuses (forbidden, no such queue, a bad name) is dropped
      // here too, so that a reconnect does not ask for it again.
      const sub = this._subs.get(req.key);
      this._subs.delete(req.key);
      for (const w of sub?.waiters ?? []) w.reject(error);
    }
    // Acks and nacks of ids another socket or an operator settled are harmless.
    if (this._tracked.has(ref) && (frame.code === "unknown_ids" || frame.code === "already_settled")) return;
    this._emit("error", error);
  }

  // --- deliveries ----------------------------------------------------------------------------

  _receive(messages) {
    for (const frame of messages) {
      const { type, ...delivery } = frame;
      if (this._acked.has(delivery.id)) {
        this._ackIds.add(delivery.id); // our ack was lost: ack again, never a second call
        continue;
      }
      if (this._busy.has(delivery.id)) continue; // handled now: its outcome is sent when it ends
      this._busy.add(delivery.id);
      this._hold(delivery.id);
      (this._handlerFor(delivery) ? this._queue : this._orphans).push(delivery);
    }
    this._scheduleFlush();
    this._drain();
  }

  _handlerFor(delivery) {
    const subs = this._subs;
    const sub = subs.get(keyOf(delivery.queue, delivery.event)) ?? subs.get(keyOf(delivery.queue, null));
    return sub?.handler;
  }

  /** Deliveries of subscriptions the server resumed before subscribe() named them: they wait
   * (holding the socket's window) until a handler for them is registered. */
  _adoptOrphans() {
    const still = [];
    for (const d of this._orphans) (this._handlerFor(d) ? this._queue : still).push(d);
    this._orphans = still;
    this._drain();
  }

  _dropQueued() {
    this._leases.clear(); // the server takes them back with the socket
    for (const d of this._queue) this._busy.delete(d.id);
    for (const d of this._orphans) this._busy.delete(d.id);
    this._queue = [];
    this._orphans = [];
  }

  _drain() {
    if (this._draining || !this._queue.length) return;
    this._draining = true;
    // A sync handler runs the whole queue before this returns: the flag is reset only after.
    this._handleQueue().finally(() => {
      this._draining = false;
      this._drain(); // what arrived while the last handler ran
    });
  }

  async _handleQueue() {
    while (this._queue.length && !this._closing) {
      const delivery = this._queue.shift();
      const handler = this._handlerFor(delivery);
      if (!handler) {
        this._orphans.push(delivery); // its subscription was refused meanwhile
        continue;
      }
      let failure = null;
      try {
        const result = handler(delivery);
        if (result && typeof result.then === "function") await result;
      } catch (error) {
        failure = error ?? new Error("handler failed");
      }
      this._busy.delete(delivery.id);
      this._leases.delete(delivery.id);
      if (failure === null) {
        this._handlerFailures = 0;
        this._acked.add(delivery.id, delivery.queue, delivery.event);
        this._ackIds.add(delivery.id);
      } else {
        this._nacks.push({ ids: [delivery.id], error: errorText(failure) });
        this._handlerFailures += 1;
        if (this._handlerFailures === this.options.warnAfterFailures) {
          console.warn(
            `mqclient: ${this._handlerFailures} handler calls in a row failed, the last on ` +
              `${delivery.queue}/${delivery.event}: ${errorText(failure)}`,
          );
        }
      }
      this._scheduleFlush();
    }
  }

  /** A delivery held here (waiting for its handler or being handled) has its lease extended
   * at 60 % of leaseSecs, counted from receipt, again and again, until maxExtension seconds
   * after receipt (a stuck handler's deliveries then go back to the server). One timer for all:
   * the ids due go in one extend frame. */
  _hold(id) {
    const lease = this.options.leaseSecs * 1000;
    if (!(lease > 0)) return;
    const now = Date.now();
    this._leases.set(id, { due: now + lease * 0.6, cap: now + this.options.maxExtension * 1000 });
    if (this._leaseTimer == null) {
      this._leaseTimer = setInterval(() => this._extendDue(), Math.min(1000, lease * 0.1));
    }
  }

  _extendDue() {
    if (!this._leases.size) {
      clearInterval(this._leaseTimer); // none held: no timer keeps the process alive
      this._leaseTimer = null;
      return;
    }
    const now = Date.now();
    const lease = this.options.leaseSecs * 1000;
    const due = [];
    for (const [id, held] of this._leases) {
      if (now < held.due || now >= held.cap) continue;
      held.due = now + lease * 0.6;
      due.push(id);
    }
    if (due.length) this.extend(due, this.options.leaseSecs);
  }

  // --- frames to the server ------------------------------------------------------------------

  _nextRef() {
    this._ref += 1;
    return this._ref;
  }

  /** Acks go out together: those of one batch's handlers in one frame. */
  _scheduleFlush() {
    if (this._flushTimer == null) this._flushTimer = setTimeout(() => this._flush(), 0);
  }

  /** Send what waits: acks, nacks, subscribe and publish frames, once the socket is
   * authenticated and no rate limit holds it. */
  _flush() {
    clearTimeout(this._flushTimer);
    this._flushTimer = null;
    // Not into a closing socket: what waits is sent on the next one.
    if (!this._authed || this._ws?.readyState !== 1) return;
    const wait = this._pausedUntil - Date.now();
    if (wait > 0) {
      this._flushTimer = setTimeout(() => this._flush(), wait);
      return;
    }
    const ids = [...this._ackIds];
    this._ackIds.clear();
    for (let i = 0; i < ids.length; i += MAX_ACK_IDS) {
      this._sendTracked({ type: "ack", ids: ids.slice(i, i + MAX_ACK_IDS) });
    }
    for (const nack of this._nacks.splice(0)) this._sendTracked({ type: "nack", ...nack });
    for (const ext of this._extends.splice(0)) this._send({ type: "extend", ...ext });
    for (const [ref, req] of this._requests) {
      if (req.sent) continue;
      req.sent = true;
      this._send({ ...req.frame, ref });
    }
  }

  _sendTracked(frame) {
    const ref = this._nextRef();
    this._tracked.set(ref, frame);
    if (this._tracked.size > TRACKED_FRAMES) this._tracked.delete(this._tracked.keys().next().value);
    this._send({ ...frame, ref });
  }

  _send(frame) {
    this._ws.send(JSON.stringify(frame));
  }

  _setState(state, info) {
    if (state === this.state) return;
    this.state = state;
    this._emit("state", state, info);
  }

  _emit(name, ...args) {
    for (const fn of this._listeners.get(name) ?? []) {
      try {
        fn(...args);
      } catch (error) {
        console.error(`mqclient: a "${name}" listener failed`, error);
      }
    }
  }
}

/** Connect to the server at `url` (http(s)://host:port; in a page it defaults to the page's
 * own origin) as the subscriber whose token this is. Returns the client at once; it
 * connects, and reconnects, by itself. */
export function connect(options) {
  return new Client(options);
}
