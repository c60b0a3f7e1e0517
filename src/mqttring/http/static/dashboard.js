// The mqttring dashboard: polls the node's JSON API every POLL_MS and draws what it gets.
// No framework and no build step: plain DOM and uPlot (vendored). A token, when the node
// wants one, comes from the browser's basic-auth prompt or from "#token=..." in the URL
// (kept for the tab in sessionStorage, never sent anywhere but this node).
"use strict";

const POLL_MS = 2000;
let askingToken = false;
const HISTORY = 150; // points kept per chart (5 minutes at 2 s)

const hashToken = new URLSearchParams(location.hash.slice(1)).get("token");
if (hashToken) sessionStorage.setItem("mqttring-token", hashToken);
let token = sessionStorage.getItem("mqttring-token");

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (token) headers["Authorization"] = "Bearer " + token;
  const response = await fetch(path, Object.assign({}, options, { headers }));
  if (response.status === 401 && !askingToken) {
    askingToken = true; // one prompt for all the requests of a round
    const given = window.prompt("This node wants its HTTP token (http_token):");
    askingToken = false;
    if (given) {
      token = given;
      sessionStorage.setItem("mqttring-token", given);
    }
  }
  const body = await response.json().catch(() => ({ error: response.statusText }));
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("data-")) node.setAttribute(key, value);
    else node[key] = value;
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

function num(value) { return el("td", { class: "num" }, value); }
function fmtRate(value) { return value == null ? "–" : value.toFixed(1); }
function setText(id, text) { document.getElementById(id).textContent = text; }

function showError(message) {
  const node = document.getElementById("error");
  node.hidden = !message;
  node.textContent = message || "";
}

// -- charts -------------------------------------------------------------------------------

function makeChart(target, series) {
  const opts = {
    width: 520, height: 220,
    series: [{}].concat(series.map(([label, stroke]) => ({ label, stroke, width: 2 }))),
    axes: [{}, { size: 60 }],
  };
  const data = [[]].concat(series.map(() => []));
  return { plot: new uPlot(opts, data, document.getElementById(target)), data };
}

const messagesChart = makeChart("chart-messages", [["in / s", "#2f6fdb"], ["out / s", "#2e9d5b"]]);
const clientsChart = makeChart("chart-clients", [["clients", "#8a4fd8"]]);

function pushPoint(chart, time, values) {
  chart.data[0].push(time);
  values.forEach((v, i) => chart.data[i + 1].push(v));
  if (chart.data[0].length > HISTORY) chart.data.forEach((column) => column.shift());
  chart.plot.setData(chart.data);
}

// -- state per node: the last counters, to turn totals into rates ---------------------------

const previous = new Map(); // node id -> {time, received, sent}

function rates(node, metrics, now) {
  const last = previous.get(node);
  previous.set(node, { time: now, received: metrics.messages_received, sent: metrics.messages_sent });
  if (!last || now <= last.time) return { in: null, out: null };
  const seconds = (now - last.time) / 1000;
  return {
    in: Math.max(0, metrics.messages_received - last.received) / seconds,
    out: Math.max(0, metrics.messages_sent - last.sent) / seconds,
  };
}

// -- panels ---------------------------------------------------------------------------------

async function refreshCluster() {
  const cluster = await api("api/v1/cluster");
  setText("node", "node " + cluster.node_id);
  const badge = document.getElementById("quorum");
  badge.textContent = cluster.quorum ? "quorum" : "NO QUORUM";
  badge.className = "badge " + (cluster.quorum ? "ok" : "bad");
  setText("leader", cluster.clustered
    ? `leader ${cluster.leader ?? "(none)"} · epoch ${cluster.epoch} · term ${cluster.term}`
    : "single node");

  const now = Date.now();
  const live = cluster.members.filter((m) => m.state !== "down");
  const stats = await Promise.all(live.map((m) =>
    api(`api/v1/nodes/${encodeURIComponent(m.id)}/stats`).catch(() => null)));
  const byNode = new Map();
  let clients = 0, rateIn = 0, rateOut = 0, received = 0, sent = 0, dropped = 0, known = false;
  live.forEach((member, i) => {
    const s = stats[i];
    if (!s) return;
    const r = rates(member.id, s.metrics, now);
    byNode.set(member.id, { metrics: s.metrics, rate: r });
    clients += s.metrics.clients_connected;
    received += s.metrics.messages_received;
    sent += s.metrics.messages_sent;
    dropped += s.metrics.messages_dropped;
    if (r.in != null) { rateIn += r.in; rateOut += r.out; known = true; }
  });
  setText("clients-connected", clients);
  setText("total-received", received);
  setText("total-sent", sent);
  setText("total-dropped", dropped);
  setText("rate-in", known ? fmtRate(rateIn) : "–");
  setText("rate-out", known ? fmtRate(rateOut) : "–");
  const t = now / 1000;
  if (known) pushPoint(messagesChart, t, [rateIn, rateOut]);
  pushPoint(clientsChart, t, [clients]);

  const body = document.querySelector("#members tbody");
  body.replaceChildren(...cluster.members.map((m) => {
    const seen = byNode.get(m.id);
    return el("tr", { "data-node": m.id },
      el("td", {}, m.id), el("td", { class: "state-" + m.state }, m.state),
      el("td", {}, m.mqtt ?? "–"), num(m.shards.owner), num(m.shards.replica),
      num(m.shards.catching_up), num(seen ? seen.metrics.clients_connected : "–"),
      num(seen ? fmtRate(seen.rate.in) : "–"), num(seen ? fmtRate(seen.rate.out) : "–"));
  }));
}

async function refreshClients() {
  const page = await api("api/v1/clients?limit=200");
  setText("clients-note", (page.next ? "(first 200)" : "") +
    (page.unreachable.length ? ` not answering: ${page.unreachable.join(", ")}` : ""));
  const body = document.querySelector("#clients tbody");
  body.replaceChildren(...page.clients.map((c) => el("tr", { "data-client": c.client_id },
    el("td", {}, c.client_id), el("td", {}, c.node), el("td", {}, c.address),
    el("td", {}, c.clean_session ? "yes" : "no"), num(c.keepalive),
    el("td", {}, new Date(c.connected_since * 1000).toLocaleString()),
    num(c.subscriptions), num(c.queued), num(c.inflight),
    el("td", {}, el("button", {
      class: "kick", "data-client": c.client_id, title: "close this connection",
      onclick: () => kick(c.client_id),
    }, "kick")))));
}

async function kick(clientId) {
  try {
    // The id goes in the query, never the path: a browser rewrites a path's "." and ".."
    // segments, so an id such as ".." would name another resource there.
    await api("api/v1/clients?client=" + encodeURIComponent(clientId), { method: "DELETE" });
    showError("");
  } catch (err) {
    showError(`kick ${clientId}: ${err.message}`);
  }
  await refreshClients().catch((err) => showError(err.message));
}

async function refreshRetained() {
  const filter = document.getElementById("retained-filter").value || "#";
  const page = await api("api/v1/retained?limit=200&filter=" + encodeURIComponent(filter));
  const body = document.querySelector("#retained tbody");
  body.replaceChildren(...page.retained.map((r) => el("tr", { "data-topic": r.topic },
    el("td", {}, r.topic), num(r.qos), num(r.size),
    el("td", {}, el("code", {}, (r.encoding === "base64" ? "base64: " : "") + r.preview +
      (r.truncated ? "…" : ""))),
    el("td", {}, el("button", {
      class: "delete", "data-topic": r.topic, title: "delete this retained message",
      onclick: async () => {
        // The topic goes in the query, never the path: a browser rewrites a path's "." and
        // ".." segments, so "junk/../victim/cfg" would arrive as "victim/cfg" (another topic).
        await api("api/v1/retained?topic=" + encodeURIComponent(r.topic), { method: "DELETE" })
          .catch((e) => showError(e.message));
        await refreshRetained().catch((e) => showError(e.message));
      },
    }, "delete")))));
}

document.getElementById("retained-form").addEventListener("submit", (event) => {
  event.preventDefault();
  refreshRetained().then(() => showError("")).catch((err) => showError(err.message));
});

async function tick() {
  try {
    await Promise.all([refreshCluster(), refreshClients()]);
    showError("");
  } catch (err) {
    showError(err.message);
  }
  setTimeout(tick, POLL_MS);
}

tick();
refreshRetained().catch((err) => showError(err.message));
