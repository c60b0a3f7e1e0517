"""Traffic harness. Publishers & persistent subscribers spread over nodes; records acks & deliveries.
usage: load.py --tag T --ports 19000,19010,19020 --duration 60 --rate 30 --out /tmp/h_ops/res/T.json [--drain 30]
Runs publishers for --duration s, then waits --drain s (or until all acked msgs delivered), dumps JSON summary."""
import argparse, json, threading, time, sys, os, collections
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
ap = argparse.ArgumentParser()
ap.add_argument('--tag', required=True); ap.add_argument('--ports', required=True)
ap.add_argument('--duration', type=float, default=60); ap.add_argument('--rate', type=float, default=30)
ap.add_argument('--drain', type=float, default=40); ap.add_argument('--out', required=True)
ap.add_argument('--stopfile', default=None)
ap.add_argument('--pubclean', type=int, default=0)
a = ap.parse_args()
PUBCLEAN = bool(a.pubclean)
ports = [int(p) for p in a.ports.split(',')]
T0 = time.time()
log_lines = []
def log(*x):
    s = '%7.2f %s' % (time.time() - T0, ' '.join(str(i) for i in x)); log_lines.append(s); print(s, flush=True)

class C:
    def __init__(self, cid, idx, clean, subs=None):
        self.cid, self.idx, self.clean, self.subs = cid, idx, clean, subs
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid, clean_session=clean)
        self.c.max_inflight_messages_set(20); self.c.max_queued_messages_set(0)
        self.c.reconnect_delay_set(0.5, 2)
        self.c.on_connect = self.on_connect; self.c.on_disconnect = self.on_disconnect
        self.c.on_message = self.on_message
        self.c.on_connect_fail = lambda c, u: (log(self.cid, 'connect failed port', c._port), self.next_port())
        self.connected = False; self.nconn = 0; self.sp_false = 0; self.msgs = []; self.disc = []; self.subscribed = False
        self.c.connect_async('127.0.0.1', ports[idx % len(ports)], keepalive=10)
        self.c.loop_start()
    def on_connect(self, c, u, flags, rc, props):
        if rc != 0:
            log(self.cid, 'connack rc', rc, 'port', c._port); self.refused = True; return
        sp = flags.session_present
        self.nconn += 1; self.connected = True
        log(self.cid, 'connected port', c._port, 'sp', sp)
        if self.subs and (self.clean or not self.subscribed or not sp):
            if not self.clean and self.subscribed and not sp:
                self.sp_false += 1; log(self.cid, 'SESSION LOST (session_present=0 on reconnect)')
            c.subscribe(self.subs); self.subscribed = True
    def next_port(self):
        i = ports.index(self.c._port) if self.c._port in ports else 0
        self.c._port = ports[(i + 1) % len(ports)]
    def on_disconnect(self, c, u, flags, rc, props):
        self.connected = False; self.disc.append(time.time() - T0)
        log(self.cid, 'disconnected rc', rc, 'port', c._port)
        if getattr(self, 'refused', False): self.refused = False
        self.next_port()
    def on_message(self, c, u, m):
        self.msgs.append((m.topic, m.payload.decode(), m.qos, m.retain, round(time.time() - T0, 3)))

tag = a.tag
subs = []
for i, p in enumerate(ports):
    subs.append(C(f'{tag}-sp1-{i}', i, False, [(f't/{tag}/#', 1)]))
    subs.append(C(f'{tag}-sp2-{i}', i + 1, False, [(f't/{tag}/#', 2)]))
time.sleep(3)
pubs = []
for i, (q, idx) in enumerate([(1, 0), (2, 1), (1, 2), (2, 0)][:max(2, len(ports))]):
    pc = C(f'{tag}-pub{i}-q{q}', idx + 1, PUBCLEAN)
    pubs.append((pc, q, f'pub{i}', []))
time.sleep(2)
n = 0; period = 1.0 / a.rate
tend = time.time() + a.duration
while time.time() < tend:
    if a.stopfile and os.path.exists(a.stopfile): break
    t = time.time()
    for pc, q, name, infos in pubs:
        seq = len(infos)
        infos.append((seq, pc.c.publish(f't/{tag}/{name}', f'{name}:{seq}', qos=q), round(time.time() - T0, 3)))
    dt = period - (time.time() - t)
    if dt > 0: time.sleep(dt)
log('publishing done')
# wait for outstanding acks (max 30s)
for _ in range(60):
    if all(inf._published for pc, q, name, infos in pubs for s, inf, _t in infos): break
    time.sleep(0.5)
acked = {name: [s for s, inf, _t in infos if inf._published] for pc, q, name, infos in pubs}
pq = {name: q for pc, q, name, infos in pubs}
def expected(sq):
    return {f'{n}:{s}' for n, ss in acked.items() for s in ss if min(pq[n], sq) >= 1}
# drain
tdrain = time.time() + a.drain
while time.time() < tdrain:
    ok = True
    for s in subs:
        got = {m[1] for m in s.msgs}
        if expected(s.subs[0][1]) - got: ok = False
    if ok: break
    time.sleep(1)
res = {'tag': tag, 'published': {name: len(infos) for pc, q, name, infos in pubs},
       'acked': {k: len(v) for k, v in acked.items()}, 'pub_qos': pq,
       'pub_unacked': {name: [s for s, inf, _t in infos if not inf._published][:50] for pc, q, name, infos in pubs}, 'subs': {}}
for s in subs:
    sq = s.subs[0][1]
    exp = expected(sq)
    cnt = collections.Counter(m[1] for m in s.msgs)
    lost = sorted(exp - set(cnt))
    dups = {k: v for k, v in cnt.items() if v > 1}
    dups_q2 = {k: v for k, v in dups.items() if pq[k.split(':')[0]] == 2 and sq == 2}
    # order check per publisher
    last = {}; reorder = 0; rsamp = []
    for m in s.msgs:
        n_, sq_ = m[1].split(':'); sq_ = int(sq_)
        if n_ in last and sq_ < last[n_] and cnt[m[1]] == 1:
            reorder += 1; rsamp.append((m[1], last[n_], m[4]))
        last[n_] = max(last.get(n_, -1), sq_)
    pt = {f'{name}:{sq_}': t_ for pc, q, name, infos in pubs for sq_, inf, t_ in infos}
    lat = sorted((m[4] - pt.get(m[1], m[4]), m[1], m[4]) for m in s.msgs)
    late = [x for x in lat if x[0] > 2.0]
    res.setdefault('latency', {})[s.cid] = {'max': lat[-1] if lat else None, 'over2s': len(late), 'late_sample': late[:5], 'arrivals_per_5s': dict(collections.Counter(int(m[4]//5)*5 for m in s.msgs))}
    res['subs'][s.cid] = {'subqos': sq, 'received': len(s.msgs), 'unique': len(cnt), 'expected': len(exp),
                          'lost': len(lost), 'lost_sample': lost[:30], 'lost_all': lost[:5000], 'dup_times': {k: [m[4] for m in s.msgs if m[1] == k] for k in dups}, 'dups': len(dups), 'dups_q2': len(dups_q2),
                          'dups_q2_sample': list(dups_q2.items())[:20], 'reorder': reorder, 'reorder_sample': rsamp[:20], 'connects': s.nconn,
                          'session_lost': s.sp_false, 'disconnects': s.disc}
    # save raw delivery times of lost neighbours
res['log'] = log_lines
json.dump(res, open(a.out, 'w'), indent=1)
for cl in [x for x in subs] + [p[0] for p in pubs]:
    cl.c.loop_stop(); 
    try: cl.c.disconnect()
    except Exception: pass
print(json.dumps({k: v for k, v in res.items() if k != 'log'}, indent=None)[:4000])
