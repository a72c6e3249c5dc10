// Drives the served mqclient.js in Node for tests/clients/test_client_js.py, as a user's program would:
// one JSON command a line on stdin, one JSON event a line on stdout.
//   node node_client.mjs MODULE_PATH URL TOKEN [CONNECT_OPTIONS_JSON]
// (MODULE_PATH may be a bare name, "mqclient", as imported from an npm install)
// Commands: {"cmd": "subscribe", "queue", "event", "sync", "delay_ms", "fail": "first" | "always",
// "options"}, {"cmd": "publish", "tag", "queue", "event", "payload", "key", "options"},
// {"cmd": "seek", "subscription", "point"}, {"cmd": "close"}.
// Events (each with `t`, ms): state, error, warn (console.warn), call (a handler call),
// subscribed, published, publish_error, seeked, closed.
import { createInterface } from "node:readline";

const [modulePath, url, token, options] = process.argv.slice(2);
const { connect } = await import(modulePath);
const out = (event) => process.stdout.write(`${JSON.stringify({ ...event, t: Date.now() })}\n`);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

const warn = console.warn; // still on stderr too, as a user sees it
console.warn = (...args) => {
  out({ kind: "warn", text: args.join(" ") });
  warn(...args);
};
const client = connect({ url, token, ...JSON.parse(options ?? "{}") });
client.on("state", (state, info) =>
  out({ kind: "state", state, code: info?.code ?? null, error: info?.error?.code ?? null }),
);
client.on("error", (error) => out({ kind: "error", code: error.code, detail: error.detail ?? error.message }));

function called(m) {
  const { id, message_id, seq, payload, attempt, headers, group } = m;
  out({ kind: "call", id, message_id, seq, payload, attempt, headers, group });
}

function handlerFor(cmd) {
  const failed = new Set();
  if (cmd.sync) {
    return (m) => called(m);
  }
  return async (m) => {
    called(m);
    if (cmd.delay_ms) await sleep(cmd.delay_ms);
    if (cmd.fail === "always" || (cmd.fail === "first" && !failed.has(m.id))) {
      failed.add(m.id);
      throw new Error(`cannot file ${m.id}: no such customer`);
    }
  };
}

const commands = {
  async subscribe(cmd) {
    try {
      out({ kind: "subscribed", ...(await client.subscribe(cmd.queue, cmd.event, handlerFor(cmd), cmd.options)) });
    } catch (error) {
      out({ kind: "subscribe_error", code: error.code, detail: error.detail });
    }
  },
  async publish(cmd) {
    try {
      const { receipt, ...answer } = await client.publish(cmd.queue, cmd.event, cmd.payload, {
        key: cmd.key,
        ...cmd.options,
      });
      out({ kind: "published", tag: cmd.tag, answer });
      if (receipt) out({ kind: "receipt", tag: cmd.tag, receipt: await receipt });
    } catch (error) {
      out({ kind: "publish_error", tag: cmd.tag, code: error.code, detail: error.detail });
    }
  },
  async seek(cmd) {
    try {
      out({ kind: "seeked", answer: await client.seek(cmd.subscription, cmd.point) });
    } catch (error) {
      out({ kind: "seek_error", code: error.code, detail: error.detail });
    }
  },
  async close() {
    await client.close();
    out({ kind: "closed", state: client.state });
  },
};

// Commands run concurrently, as a program's calls would; stdin's end ends nothing by itself:
// the process exits when the client has nothing left to do (after close, or a refused token).
for await (const line of createInterface({ input: process.stdin })) {
  if (line.trim()) commands[JSON.parse(line).cmd](JSON.parse(line));
}
