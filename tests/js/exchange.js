'use strict';
// One MQTT.js exchange against mqttring nodes, driven by tests/test_e2e_mqttjs.py.
//
// Usage: node exchange.js '<spec as JSON>'
//
// spec = {
//   timeout_ms: 20000,            // the whole run; past it: partial result, exit 2
//   quiet_ms: 300,                // after the expected count: how long to watch for extras
//   expect: 4,                    // deliveries to wait for, summed over all subscribers
//   subscribers: [{name, url, protocolVersion, clientId?, topicAliasMaximum?,
//                  subscribe: [{filter, qos, subscriptionIdentifier?, nl?, rap?}]}],
//   publisher: {url, protocolVersion, clientId?,
//               messages: [{topic, payload, qos, retain?, userProperties?,
//                           messageExpiryInterval?, contentType?}]}
// }
//
// Order: every subscriber connects and gets its SUBACK, then the publisher connects and
// publishes each message, awaiting its PUBACK/PUBCOMP (QoS 1/2), then the script waits for
// `expect` deliveries and `quiet_ms` more. It prints ONE line of JSON on stdout:
// {ok, error?, connacks: {name: {sessionPresent, reasonCode, properties}},
//  granted: {name: [codes]}, received: [{to, topic, payload, qos, retain, properties}]}
// and exits 0 only if everything it awaited happened in time. Python asserts on the rest.

const mqtt = require('mqtt');

const spec = JSON.parse(process.argv[2]);
const result = { ok: false, connacks: {}, granted: {}, received: [], published: 0 };
const clients = [];
let finishing = false;

function finish(code, error) {
  if (finishing) return;
  finishing = true;
  if (error) result.error = String(error && error.stack ? error.stack : error);
  result.ok = code === 0;
  process.stdout.write(JSON.stringify(result) + '\n');
  for (const c of clients) c.end(true);
  // end(true) closes the sockets at once; exit explicitly so that no timer keeps us alive
  process.exit(code);
}

setTimeout(() => finish(2, `timeout after ${spec.timeout_ms} ms`), spec.timeout_ms).unref();

function connect(name, cfg) {
  return new Promise((resolve, reject) => {
    const client = mqtt.connect(cfg.url, {
      protocolVersion: cfg.protocolVersion,
      clientId: cfg.clientId || `js-${name}-${Math.random().toString(16).slice(2, 10)}`,
      clean: true,
      reconnectPeriod: 0, // a refused or broken connection fails the run, never retries
      connectTimeout: spec.timeout_ms,
      keepalive: 30,
      // MQTT 5: let the server alias topics towards this client (3.3.2.3.4)
      ...(cfg.topicAliasMaximum ? { properties: { topicAliasMaximum: cfg.topicAliasMaximum } } : {}),
    });
    clients.push(client);
    client.once('connect', (connack) => {
      result.connacks[name] = {
        sessionPresent: connack.sessionPresent,
        reasonCode: connack.reasonCode === undefined ? connack.returnCode : connack.reasonCode,
        properties: connack.properties || null,
      };
      // from now on a closed connection or an error fails the whole run at once
      client.on('close', () => finish(1, `${name}: connection closed`));
      client.on('error', (err) => finish(1, `${name}: ${err}`));
      resolve(client);
    });
    client.once('error', reject);
    client.once('close', () => reject(new Error(`${name}: connection closed before CONNACK`)));
  });
}

function subscribe(name, client, subs) {
  return Promise.all(subs.map((s) => new Promise((resolve, reject) => {
    const opts = { qos: s.qos };
    if (s.nl !== undefined) opts.nl = s.nl;
    if (s.rap !== undefined) opts.rap = s.rap;
    if (s.subscriptionIdentifier !== undefined) {
      opts.properties = { subscriptionIdentifier: s.subscriptionIdentifier };
    }
    client.subscribe(s.filter, opts, (err, granted) => {
      if (err) return reject(err);
      (result.granted[name] = result.granted[name] || []).push(...granted.map((g) => g.qos));
      resolve();
    });
  })));
}

function publish(client, m) {
  return new Promise((resolve, reject) => {
    const opts = { qos: m.qos, retain: Boolean(m.retain) };
    const props = {};
    if (m.userProperties) props.userProperties = m.userProperties;
    if (m.messageExpiryInterval !== undefined) props.messageExpiryInterval = m.messageExpiryInterval;
    if (m.contentType !== undefined) props.contentType = m.contentType;
    if (Object.keys(props).length) opts.properties = props;
    client.publish(m.topic, m.payload, opts, (err) => (err ? reject(err) : resolve()));
  });
}

async function main() {
  let done;
  const enough = new Promise((resolve) => { done = resolve; });
  const subscribers = [];
  for (const s of spec.subscribers) {
    const client = await connect(s.name, s);
    client.on('message', (topic, payload, packet) => {
      result.received.push({
        to: s.name, topic, payload: payload.toString('utf8'), qos: packet.qos,
        retain: packet.retain, properties: packet.properties || null,
      });
      if (result.received.length >= spec.expect) done();
    });
    await subscribe(s.name, client, s.subscribe);
    subscribers.push(client);
  }
  if (spec.expect === 0) done();
  const pubCfg = spec.publisher;
  const pub = await connect('publisher', pubCfg);
  for (const m of pubCfg.messages) {
    await publish(pub, m);
    result.published += 1;
  }
  await enough;
  await new Promise((resolve) => setTimeout(resolve, spec.quiet_ms || 0));
  finish(0);
}

main().catch((err) => finish(1, err));
