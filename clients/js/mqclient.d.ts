// Hand-written declarations of mqclient.js (kept beside it: a change to one is a change to both;
// tests/clients/test_client_js_package.py checks that every export is declared here).

/** Any JSON value: what a payload may be. */
export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

/** A point in a queue's history: `"new"` (the default), `"all"`, a `seq`, or a time. */
export type From = "new" | "all" | { seq: number } | { time: string } | Date;

/** A seek's point: a `seq` or a time (ISO 8601 text or a Date). */
export type SeekPoint = { seq: number } | { time: string } | Date;

/** `headers.<name>` or `payload.<field>[.<field>...]` to the list of values allowed. */
export type Filter = Record<string, Array<string | number | boolean | null>>;

export type State = "connecting" | "open" | "closed";

export interface ConnectOptions {
  /** The server, e.g. "https://mq.example.com" (its /ws/ is the socket). */
  url: string;
  /** The subscriber's token; sent in the auth frame, never in a URL. */
  token: string;
  /** A WebSocket class, for a runtime without a global one. */
  WebSocket?: unknown;
  /** Deliveries in flight on the socket at most (the server caps it). */
  prefetch?: number | null;
  /** ms before the first reconnect; doubles up to backoffMax. Default 250. */
  backoffInitial?: number;
  /** Default 10000 ms. */
  backoffMax?: number;
  /** ms of silence before a ping. Default 25000. */
  heartbeat?: number;
  /** ms for a socket to open and be authenticated. Default 15000. */
  authTimeout?: number;
  /** ms a connection must last for the backoff to start again. Default 5000. */
  stableAfter?: number;
  /** Acked delivery ids remembered (a repeat is acked, not handled). Default 10000. */
  dedupe?: number;
  /** ms close() waits for a running handler and unanswered publishes. Default 5000. */
  closeTimeout?: number;
  /** The ack timeout the client assumes (s): a delivery still held here (handled, or waiting
   * for its turn) has its lease extended by this much at 60 % of it. 0: never. Default 30. */
  leaseSecs?: number;
  /** Seconds after receipt past which a held delivery's lease is no longer extended.
   * Default 3600. */
  maxExtension?: number;
  /** Consecutive handler failures, or failed connects, before a console.warn. Default 5. */
  warnAfterFailures?: number;
}

/** One delivery, as a handler gets it. */
export interface Delivery<P = Json> {
  id: number;
  message_id: number;
  queue: string;
  event: string;
  seq: number;
  payload: P;
  attempt: number;
  published_at: string;
  /** The message's group, null when none. */
  group: string | null;
  /** Present when the message has headers. */
  headers?: Record<string, string>;
  [field: string]: unknown;
}

export type Handler<P = Json> = (delivery: Delivery<P>) => unknown | Promise<unknown>;

export interface SubscribeOptions {
  /** Where a new subscription starts (a subscription that exists keeps its place). */
  from?: From;
  /** Only messages that match (null: none). */
  filter?: Filter | null;
}

export interface Subscribed {
  subscription: number;
  queue: string;
  event: string | null;
  filter?: Filter | null;
  /** With `from`: from which seq it could start, and how many deliveries it owes. */
  replay?: { from_seq: number | null; deliveries: number };
  [field: string]: unknown;
}

export interface PublishOptions {
  /** Idempotency key: the same key again in the queue gives back the first message; sent
   * again by the client after a reconnect. */
  key?: string;
  headers?: Record<string, string>;
  group?: string;
  /** Ask for a receipt: the answer's `receipt` resolves once every delivery is acked or dead. */
  receipt?: boolean;
  delay_secs?: number;
  deliver_at?: Date | string;
  ttl_secs?: number;
  expires_at?: Date | string;
}

export interface Published {
  id: number;
  queue: string;
  event: string;
  seq: number;
  /** Deliveries it made (subscriptions that match). */
  deliveries: number;
  /** With `receipt: true`; rejects with `connection_lost` if the socket drops first. */
  receipt?: Promise<Receipt>;
  [field: string]: unknown;
}

export interface Receipt {
  id: number;
  deliveries: { pending: number; inflight: number; acked: number; dead: number };
}

export interface Seeked {
  id: number;
  queue: string;
  event: string | null;
  replay: { from_seq: number | null; deliveries: number };
  [field: string]: unknown;
}

/** An error the server or the connection reported. */
export class MQError extends Error {
  constructor(code: string, detail?: string, extra?: Record<string, unknown>);
  /** The server's short code, or `unauthorized`, `connection_lost`, `closed`, `unreachable`. */
  code: string;
  detail?: string;
  /** Seconds the server asked to wait, when it said. */
  retryAfter?: number;
  [field: string]: unknown;
}

export interface Client {
  readonly state: State | null;
  /** What closed it for good (a refused token), else null. */
  readonly error: MQError | null;
  /** The subscriber the server authenticated. */
  readonly subscriber: string | null;
  on(name: "state", fn: (state: State, info: Record<string, unknown>) => void): () => void;
  on(name: "error", fn: (error: MQError) => void): () => void;
  subscribe<P = Json>(
    queue: string,
    event: string | null,
    handler: Handler<P>,
    options?: SubscribeOptions,
  ): Promise<Subscribed>;
  publish(queue: string, event: string, payload: Json, options?: PublishOptions): Promise<Published>;
  /** Move the ack deadline of deliveries this socket holds to now + seconds (1 to 43200). */
  extend(ids: number | number[], seconds: number): void;
  /** Make a subscription (its id, or subscribe()'s answer) owe again every message from
   * `point` the server still keeps; the handler gets them again (same delivery ids). */
  seek(subscription: number | Subscribed, point: SeekPoint): Promise<Seeked>;
  close(): Promise<void>;
}

export function connect(options: ConnectOptions): Client;
