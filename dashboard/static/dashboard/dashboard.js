// The live dashboard: one websocket (/ws/dashboard/) sends a snapshot every second; this
// draws it. No library: DOM nodes built with textContent (payloads are never parsed as
// HTML) and two small SVG charts. Not mqclient.js: this socket is the operator's session
// reading read-only snapshots, not a subscriber's token taking deliveries (nothing to ack,
// resume or dedupe), and a page must not carry a subscriber's token to look at the queues.
"use strict";

(function () {
  const FEED_KEEP = 60;
  const SVG = "http://www.w3.org/2000/svg";
  const body = document.body;
  const mayRedeliver = body.dataset.mayRedeliver === "1";
  const redeliverUrl = (id) => body.dataset.redeliverUrl.replace("/0/", "/" + id + "/");
  const csrf = document.querySelector('meta[name="csrf-token"]').content;
  const $ = (id) => document.getElementById(id);

  let feed = []; // newest first: {id, queue, event, seq, published_at, payload}
  let feedStatus = {};
  let lastSnapshot = null;

  // --- small helpers ---------------------------------------------------------------------

  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") el.className = v;
      else if (k === "text") el.textContent = v;
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else el.setAttribute(k, v);
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      el.appendChild(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
    }
    return el;
  }

  const fmt = new Intl.NumberFormat("en-US");
  function num(n) { return n === null || n === undefined ? "–" : fmt.format(n); }
  function rate(r) {
    if (r === null || r === undefined) return "–";
    if (r === 0) return "0";
    return r >= 100 ? fmt.format(Math.round(r)) : r >= 10 ? r.toFixed(1) : r.toFixed(2);
  }
  function ms(v) {
    if (v === null || v === undefined) return "–";
    if (v >= 10000) return (v / 1000).toFixed(1) + " s";
    if (v >= 1000) return (v / 1000).toFixed(2) + " s";
    return Math.round(v) + " ms";
  }
  function age(secs) {
    if (secs === null || secs === undefined) return "–";
    secs = Math.max(0, Math.round(secs));
    if (secs < 60) return secs + " s";
    if (secs < 3600) return Math.floor(secs / 60) + " min " + (secs % 60) + " s";
    if (secs < 86400) return Math.floor(secs / 3600) + " h " + Math.floor((secs % 3600) / 60) + " min";
    return Math.floor(secs / 86400) + " d " + Math.floor((secs % 86400) / 3600) + " h";
  }
  function clock(iso) {
    const d = new Date(iso);
    return d.toLocaleTimeString([], { hour12: false });
  }
  function cell(value, status, cls) {
    const zero = !value;
    return h("td", { class: "n " + (zero ? "zero" : status ? "num-" + status : "") + (cls ? " " + cls : "") }, num(value));
  }
  function setText(id, text) {
    const el = $(id);
    if (el.textContent !== text) {
      el.textContent = text;
      el.classList.remove("bump");
      void el.offsetWidth; // restart the animation
      el.classList.add("bump");
    }
  }
  function toast(text, isError) {
    const t = $("toast");
    t.textContent = text;
    t.className = "toast show" + (isError ? " error" : "");
    clearTimeout(toast.timer);
    toast.timer = setTimeout(() => { t.className = "toast"; }, 3500);
  }

  // --- the websocket -----------------------------------------------------------------------

  let retryMs = 500;
  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const ws = new WebSocket(scheme + location.host + "/ws/dashboard/");
    ws.onopen = () => { retryMs = 500; };
    ws.onmessage = (e) => {
      const frame = JSON.parse(e.data);
      if (frame.type === "snapshot") {
        setConn("live", "live");
        render(frame);
      }
    };
    ws.onclose = (e) => {
      if (e.code === 4403) { setConn("down", "logged out"); location.reload(); return; }
      setConn("down", "reconnecting…");
      setTimeout(connect, retryMs);
      retryMs = Math.min(retryMs * 2, 10000);
    };
  }
  function setConn(state, text) {
    $("conn").className = "conn " + state;
    $("conn-text").textContent = text;
  }

  // --- drawing a snapshot ------------------------------------------------------------------

  function render(s) {
    lastSnapshot = s;
    const t = s.totals;
    setText("t-published", num(t.published));
    setText("t-pending", num(t.pending));
    setText("t-inflight", num(t.inflight));
    setText("t-acked", num(t.acked));
    setText("t-dead", num(t.dead));
    document.querySelector(".tile.dead").classList.toggle("nonzero", t.dead > 0);
    setText("t-publish-rate", rate(t.publish_rate));
    setText("t-ack-rate", rate(t.ack_rate));
    setText("t-p50", ms(t.latency_p50_ms));
    setText("t-p95", ms(t.latency_p95_ms));
    setText("t-connections", num(t.connections));
    renderQueues(s.queues);
    renderSubscribers(s.subscribers);
    renderFeed(s.feed, s.feed_status);
    renderDead(s.dead_letters, t.dead);
    drawCharts(s.series);
    renderHistory(s.history);
    $("updated").textContent = "last snapshot " + clock(s.at);
  }

  function renderQueues(rows) {
    const tbody = $("queues").tBodies[0];
    const out = [];
    let last = null;
    for (const r of rows) {
      const first = r.queue !== last;
      last = r.queue;
      const total = r.pending + r.inflight + r.acked + r.dead;
      const part = (n, cls) => (total && n ? h("span", { class: cls, style: "width:" + (100 * n / total) + "%", title: cls + ": " + n }) : null);
      out.push(
        h("tr", { class: first ? "queue-start" : "", "data-queue": r.queue, "data-event": r.event || "" },
          h("td", { class: "qname" }, first ? r.queue : ""),
          h("td", {}, r.event === null ? h("span", { class: "muted" }, "(no event yet)") : r.event),
          h("td", { class: "n published" }, num(r.published)),
          cell(r.pending, "pending", "pending"),
          cell(r.inflight, "inflight", "inflight"),
          cell(r.acked, "acked", "acked"),
          cell(r.dead, "dead", "dead"),
          cell(r.connected, null, "connected"),
          h("td", { class: "n" + (r.publish_rate ? "" : " zero") }, rate(r.publish_rate)),
          h("td", { class: "n" + (r.ack_rate ? "" : " zero") }, rate(r.ack_rate)),
          h("td", {}, h("div", { class: "bar" }, part(r.acked, "acked"), part(r.inflight, "inflight"), part(r.pending, "pending"), part(r.dead, "dead")))
        )
      );
    }
    if (!out.length) out.push(h("tr", { class: "empty" }, h("td", { colspan: 11 }, "No queue yet: make one in the admin or with manage.py createqueue.")));
    tbody.replaceChildren(...out);
  }

  function renderSubscribers(rows) {
    const tbody = $("subscribers").tBodies[0];
    const out = rows.map((s) =>
      h("tr", { "data-subscriber": s.subscriber },
        h("td", { class: "qname" }, s.subscriber),
        h("td", {}, s.connections
          ? h("span", { class: "badge live", title: "connected since " + clock(s.connected_since) }, h("span", { class: "dot" }), s.connections === 1 ? "websocket" : s.connections + " websockets")
          : h("span", { class: "badge away" }, h("span", { class: "dot" }), "not connected (pull / webhook)"),
          s.webhook_disabled
            ? h("span", { class: "badge webhook-disabled", title: "last error: " + s.webhook_disabled.last_error },
                "webhook disabled since " + clock(s.webhook_disabled.since) + " after " + s.webhook_disabled.failures + " failures")
            : null),
        h("td", {}, s.subscriptions.length ? s.subscriptions.map((x) => x.paused
          ? h("span", { class: "chip paused", title: "paused: still owed what is published, handed nothing until resumed" }, x.queue + "/" + (x.event || "*") + " \u23f8 paused")
          : h("span", { class: "chip" }, x.queue + "/" + (x.event || "*"))) : h("span", { class: "muted" }, "none")),
        cell(s.pending, "pending"),
        cell(s.inflight, "inflight"),
        cell(s.dead, "dead"),
        h("td", { class: "n" + (s.oldest_pending_age_s > 60 ? " late" : "") }, age(s.oldest_pending_age_s)),
        h("td", { class: "n" + (s.ack_rate ? "" : " zero") }, rate(s.ack_rate))
      )
    );
    if (!out.length) out.push(h("tr", { class: "empty" }, h("td", { colspan: 8 }, "No subscriber holds a subscription yet.")));
    tbody.replaceChildren(...out);
  }

  function progress(st, receipt) {
    if (!st) return h("span", { class: "pill none" }, "…");
    const total = st.pending + st.inflight + st.acked + st.dead;
    if (!total) return h("span", { class: "pill none", title: "no subscription matched it" }, "no subscriber");
    // The receipt count: how many of its subscriptions acked it ("3/5"), as its publisher reads it.
    const settled = st.pending + st.inflight === 0;
    const parts = [h("span", {
      class: "receipt" + (settled ? " settled" : ""),
      title: (receipt ? "the publisher waits for a receipt; " : "") + (settled ? "every delivery settled" : "deliveries still open"),
    }, (receipt ? "✉ " : "") + "acked " + st.acked + "/" + total)];
    if (st.acked) parts.push(h("span", { class: "pill acked", title: "acked" }, "✓ " + st.acked));
    if (st.inflight) parts.push(h("span", { class: "pill inflight", title: "in flight" }, "→ " + st.inflight));
    if (st.pending) parts.push(h("span", { class: "pill pending", title: "pending" }, "… " + st.pending));
    if (st.dead) parts.push(h("span", { class: "pill dead", title: "dead" }, "✗ " + st.dead));
    return h("span", { title: st.acked + " of " + total + " subscriptions acked" }, parts);
  }

  function renderFeed(newer, status) {
    Object.assign(feedStatus, status || {});
    const fresh = new Set();
    if (newer && newer.length) {
      const known = new Set(feed.map((m) => m.id));
      for (const m of newer) if (!known.has(m.id)) fresh.add(m.id);
      feed = newer.filter((m) => fresh.has(m.id)).concat(feed).sort((a, b) => b.id - a.id).slice(0, FEED_KEEP);
    }
    const list = $("feed");
    if (!feed.length) { list.replaceChildren(h("li", { class: "empty" }, "No message yet: publish one (or run make demo).")); return; }
    list.querySelectorAll("li.empty").forEach((li) => li.remove());
    // Only new rows are added (on top); rows already shown stay where they are, so that their
    // arrival highlight is not restarted, and only their delivery pills are updated.
    const existing = new Map([...list.querySelectorAll("li[data-id]")].map((li) => [Number(li.dataset.id), li]));
    const highlight = existing.size > 0;
    const keep = new Set(feed.map((m) => m.id));
    for (const [id, li] of existing) if (!keep.has(id)) li.remove();
    let before = list.firstChild;
    for (const m of feed) {
      let li = existing.get(m.id);
      if (!li) {
        li = h("li", { "data-id": m.id, class: highlight ? "new" : "" },
          h("span", { class: "time" }, clock(m.published_at)),
          h("span", { class: "where", title: "message " + m.id }, m.queue + "/" + m.event, h("span", { class: "seq" }, " #" + m.seq)),
          h("span", { class: "payload", title: m.headers ? m.headers + "\n" + m.payload : m.payload },
            m.headers ? h("span", { class: "headers" }, m.headers) : null, m.payload),
          h("span", { class: "progress" }));
        li.addEventListener("animationend", () => li.classList.remove("new"));
        list.insertBefore(li, before);
      } else {
        before = li.nextSibling;
      }
      li.querySelector(".progress").replaceChildren(progress(feedStatus[m.id], m.receipt));
      if (!existing.has(m.id)) before = li.nextSibling;
    }
    for (const k of Object.keys(feedStatus)) if (!keep.has(Number(k))) delete feedStatus[k];
  }

  function renderDead(rows, total) {
    const tbody = $("dead").tBodies[0];
    $("dead-note").textContent = total ? (total > rows.length ? "the newest " + rows.length + " of " + num(total) : "newest first") : "";
    const out = rows.map((d) =>
      h("tr", { "data-delivery": d.id },
        h("td", {}, h("a", { href: "/admin/delivery/delivery/" + d.id + "/change/" }, "#" + d.id)),
        h("td", {}, d.subscriber),
        h("td", {}, h("span", { class: "chip" }, d.queue + "/" + d.event + " #" + d.seq)),
        h("td", { class: "n" }, num(d.attempt)),
        h("td", { class: "why", title: d.last_error }, d.last_error || "–"),
        h("td", { class: "n" }, mayRedeliver ? h("button", { class: "redeliver", type: "button", onclick: (e) => redeliver(d.id, e.target) }, "Redeliver") : null)
      )
    );
    if (!out.length) out.push(h("tr", { class: "empty" }, h("td", { colspan: 6 }, "None: nothing has given up.")));
    tbody.replaceChildren(...out);
  }

  async function redeliver(id, button) {
    button.disabled = true;
    try {
      const r = await fetch(redeliverUrl(id), {
        method: "POST",
        headers: { "X-CSRFToken": csrf, "Accept": "application/json" },
        credentials: "same-origin",
      });
      const body = await r.json().catch(() => ({}));
      if (r.ok) toast("Delivery " + id + " is pending again: it will be handed out now.");
      else { toast(body.detail || "Could not redeliver " + id + " (" + r.status + ").", true); button.disabled = false; }
    } catch (e) {
      toast("Could not reach the server: " + e, true);
      button.disabled = false;
    }
  }

  // --- charts --------------------------------------------------------------------------------

  function drawCharts(series) {
    if (!series) return;
    chart($("chart-throughput"), series, [
      { values: series.published, color: "#3a6ff7", area: true, label: "published/s" },
      { values: series.acked, color: "#1f9d63", area: false, label: "acked/s" },
    ], rate);
    chart($("chart-latency"), series, [
      { values: series.latency_p95_ms, color: "#e0762b", area: true, label: "p95" },
      { values: series.latency_p50_ms, color: "#7b4fd6", area: false, label: "p50" },
    ], ms);
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  // An SVG of W x H and a function that appends an element to it (the charts' one way to draw).
  function svgCanvas(W, H) {
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    const add = (tag, attrs, text) => {
      const el = document.createElementNS(SVG, tag);
      for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
      if (text !== undefined) el.textContent = text;
      svg.appendChild(el);
      return el;
    };
    return [svg, add];
  }

  // Horizontal grid lines from 0 to `top` in `steps`, each labelled on the left.
  function gridLines(add, pad, W, y, top, steps, format) {
    for (let k = 0; k <= steps; k++) {
      const v = (top * k) / steps;
      add("line", { x1: pad.l, x2: W - pad.r, y1: y(v), y2: y(v), class: "grid-line" });
      add("text", { x: pad.l - 6, y: y(v) + 3.5, "text-anchor": "end", class: "axis-label" }, format(v));
    }
  }

  function chart(box, series, lines, format) {
    const W = Math.max(box.clientWidth, 200), H = Math.max(box.clientHeight, 120);
    const pad = { l: 52, r: 10, t: 8, b: 22 };
    const n = series.published.length;
    const all = lines.flatMap((l) => l.values.filter((v) => v !== null));
    const top = niceMax(Math.max(0, ...all) * 1.1);
    const x = (i) => pad.l + (W - pad.l - pad.r) * (n <= 1 ? 1 : i / (n - 1));
    const y = (v) => pad.t + (H - pad.t - pad.b) * (1 - v / top);
    const [svg, add] = svgCanvas(W, H);
    gridLines(add, pad, W, y, top, 4, format);
    const step = series.step_secs;
    for (let i = 0; i < n - 1; i++) {
      const secsAgo = (n - 1 - i) * step;
      if (secsAgo % 60 === 0) add("text", { x: x(i), y: H - 6, "text-anchor": "middle", class: "axis-label" }, "−" + secsAgo / 60 + " min");
    }
    add("text", { x: x(n - 1), y: H - 6, "text-anchor": "end", class: "axis-label" }, "now");
    for (const line of lines) {
      // Gaps where there is no value (no ack in that bucket: no latency to show).
      let runs = [], run = [];
      line.values.forEach((v, i) => {
        if (v === null) { if (run.length) runs.push(run); run = []; } else run.push([x(i), y(v)]);
      });
      if (run.length) runs.push(run);
      for (const r of runs) {
        const d = r.map((p, i) => (i ? "L" : "M") + p[0].toFixed(1) + " " + p[1].toFixed(1)).join(" ");
        if (line.area && r.length > 1) {
          add("path", { d: d + " L" + r[r.length - 1][0].toFixed(1) + " " + y(0) + " L" + r[0][0].toFixed(1) + " " + y(0) + " Z", fill: line.color, "fill-opacity": "0.12", stroke: "none" });
        }
        add("path", { d: d, fill: "none", stroke: line.color, "stroke-width": "2", "stroke-linejoin": "round", "stroke-linecap": "round" });
        if (r.length === 1) add("circle", { cx: r[0][0], cy: r[0][1], r: 2.5, fill: line.color });
      }
    }
    if (!all.some((v) => v > 0)) {
      add("text", { x: (pad.l + W - pad.r) / 2, y: H / 2, "text-anchor": "middle", class: "nodata" }, "nothing in the last five minutes");
    }
    box.replaceChildren(svg);
  }

  // --- history: what the last `manage.py analyze` computed over the whole history ----------------

  let historyShown = null; // the computed_at drawn: the panel is redrawn only when a run lands

  function percent(v) {
    if (v === null || v === undefined) return "–";
    if (v === 0) return "0 %";
    return (100 * v < 0.1 ? "<0.1" : (100 * v).toFixed(100 * v >= 10 ? 0 : 1)) + " %";
  }
  function fixed(v, digits) { return v === null || v === undefined ? "–" : v.toFixed(digits); }
  function when(iso) {
    const d = new Date(iso);
    return d.toLocaleString([], { hour12: false, year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" });
  }

  function renderHistory(hist) {
    const note = $("history-note");
    if (!hist || !hist.computed_at) {
      note.textContent = "no analytics results yet";
      if (historyShown !== "none") {
        historyShown = "none";
        $("history-body").replaceChildren(h("p", { class: "history-empty" },
          "No analytics results yet: run ", h("code", {}, "manage.py analyze"),
          " to compute, over the whole history (the Parquet archive and the hot tables), each queue's and event's volume and rates, fan-out, publish → ack latency p50 / p95 / p99, attempts and dead-letter rate, and each subscriber's backlog and lag."));
      }
      return;
    }
    const ago = (Date.now() - new Date(hist.computed_at).getTime()) / 1000;
    note.textContent = "last analyze at " + when(hist.computed_at) + " (" + age(ago) + " ago) · archive and hot tables together";
    if (historyShown === hist.computed_at) return;
    historyShown = hist.computed_at;
    const maxP99 = Math.max(0, ...hist.events.map((e) => e.latency_p99_ms || 0));
    const latencyBar = (e) => {
      if (!maxP99 || e.latency_p99_ms === null) return null;
      const w = (v) => (100 * (v || 0) / maxP99).toFixed(2) + "%";
      return h("div", { class: "lat-bar", title: "p50 " + ms(e.latency_p50_ms) + " · p95 " + ms(e.latency_p95_ms) + " · p99 " + ms(e.latency_p99_ms) },
        h("span", { class: "p99", style: "width:" + w(e.latency_p99_ms) }),
        h("span", { class: "p95", style: "width:" + w(e.latency_p95_ms) }),
        h("span", { class: "p50", style: "width:" + w(e.latency_p50_ms) }));
    };
    let last = null;
    const events = hist.events.map((e) => {
      const first = e.queue !== last;
      last = e.queue;
      return h("tr", { class: first ? "queue-start" : "", "data-queue": e.queue, "data-event": e.event },
        h("td", { class: "qname" }, first ? e.queue : ""),
        h("td", {}, e.event),
        h("td", { class: "n" }, num(e.messages)),
        h("td", { class: "n", title: "busiest minute: " + num(e.peak_per_minute) }, rate(e.messages_per_minute), h("span", { class: "peak" }, " ↑" + num(e.peak_per_minute))),
        h("td", { class: "n", title: "busiest hour: " + num(e.peak_per_hour) }, rate(e.messages_per_hour), h("span", { class: "peak" }, " ↑" + num(e.peak_per_hour))),
        h("td", { class: "n" }, fixed(e.fanout, 2)),
        h("td", { class: "n" }, ms(e.latency_p50_ms)),
        h("td", { class: "n" }, ms(e.latency_p95_ms)),
        h("td", { class: "n" }, ms(e.latency_p99_ms)),
        h("td", {}, latencyBar(e)),
        h("td", { class: "n" }, fixed(e.attempts_mean, 2)),
        h("td", { class: "n" + (e.dead_letter_rate ? " num-dead" : " zero") }, percent(e.dead_letter_rate)));
    });
    if (!events.length) events.push(h("tr", { class: "empty" }, h("td", { colspan: 12 }, "The last run found no message.")));
    const subscribers = hist.subscribers.map((s) =>
      h("tr", { "data-subscriber": s.subscriber },
        h("td", { class: "qname" }, s.subscriber),
        h("td", { class: "n" }, num(s.deliveries)),
        cell(s.backlog, "pending"),
        cell(s.dead, "dead"),
        h("td", { class: "n" + (s.lag_s > 60 ? " late" : s.lag_s === null ? " zero" : "") }, s.lag_s === null ? "none" : age(s.lag_s))));
    if (!subscribers.length) subscribers.push(h("tr", { class: "empty" }, h("td", { colspan: 5 }, "No delivery in the history.")));
    const head = (...cols) => h("thead", {}, h("tr", {}, cols.map(([text, cls, title]) => h("th", { class: cls || null, title: title || null }, text))));
    const chartBox = h("div", { class: "chart hourly", id: "chart-hourly" });
    $("history-body").replaceChildren(
      h("div", { class: "history-grid" },
        h("div", { class: "history-chart" },
          h("div", { class: "sub-head" }, "Messages per hour", h("span", { class: "muted" }, " all queues, the newest hours of the history")),
          chartBox),
        h("div", {},
          h("div", { class: "sub-head" }, "Per subscriber"),
          h("table", { class: "grid", id: "history-subscribers" },
            head(["subscriber"], ["deliveries", "n"], ["backlog", "n", "pending and in flight at the run"], ["dead", "n"], ["lag at the run", "n", "age of its oldest pending delivery when analyze ran"]),
            h("tbody", {}, subscribers)))),
      h("div", { class: "sub-head" }, "Per queue and event"),
      h("table", { class: "grid", id: "history-events" },
        head(["queue"], ["event"], ["messages", "n"], ["per min ↑peak", "n", "mean over the minutes from the first message to the last; ↑ the busiest minute"], ["per hour ↑peak", "n", "mean over the hours from the first message to the last; ↑ the busiest hour"], ["fan-out", "n", "deliveries per message"], ["p50", "n", "publish → ack"], ["p95", "n"], ["p99", "n"], ["latency", "bar-col", "p50 · p95 · p99, to the scale of the slowest p99"], ["attempts", "n", "mean attempts of acked and dead deliveries"], ["dead-letter rate", "n", "dead / deliveries"]),
        h("tbody", {}, events)));
    drawHourly(hist.hourly);
  }

  function drawHourly(hourly) {
    const box = $("chart-hourly");
    if (!box) return;
    const values = (hourly && hourly.messages) || [];
    if (!values.length) { box.replaceChildren(h("p", { class: "history-empty" }, "No message in the history.")); return; }
    const W = Math.max(box.clientWidth, 200), H = Math.max(box.clientHeight, 100);
    const pad = { l: 44, r: 8, t: 8, b: 20 };
    const top = niceMax(Math.max(...values));
    const n = values.length;
    const slot = (W - pad.l - pad.r) / n;
    const y = (v) => pad.t + (H - pad.t - pad.b) * (1 - v / top);
    const [svg, add] = svgCanvas(W, H);
    gridLines(add, pad, W, y, top, 2, num);
    const start = new Date(hourly.start).getTime();
    const every = Math.max(1, Math.ceil(n / Math.max(1, Math.floor((W - pad.l) / 60))));
    values.forEach((v, i) => {
      const t = new Date(start + i * 3600 * 1000);
      const x = pad.l + i * slot;
      const bar = add("rect", { x: (x + slot * 0.12).toFixed(1), y: y(v).toFixed(1), width: Math.max(slot * 0.76, 1).toFixed(1), height: (y(0) - y(v)).toFixed(1), class: "hour-bar" });
      const title = document.createElementNS(SVG, "title");
      title.textContent = when(t.toISOString()) + ": " + num(v) + " messages";
      bar.appendChild(title);
      if (i % every === 0) {
        const label = t.getHours() === 0 || i === 0 ? t.toLocaleDateString([], { month: "short", day: "numeric" }) : String(t.getHours()).padStart(2, "0") + ":00";
        add("text", { x: (x + slot / 2).toFixed(1), y: H - 5, "text-anchor": "middle", class: "axis-label" }, label);
      }
    });
    box.replaceChildren(svg);
  }

  window.addEventListener("resize", () => {
    if (!lastSnapshot) return;
    drawCharts(lastSnapshot.series);
    if (lastSnapshot.history && lastSnapshot.history.computed_at) drawHourly(lastSnapshot.history.hourly);
  });
  connect();
})();
