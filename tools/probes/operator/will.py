"""Wills under a node fault. usage: will.py TAG FAULT(kill9|stop|term) VICTIM
Will clients on every node (clean and persistent); observers on survivors. Reports wills that arrived, when."""
import json, subprocess, sys, time, collections, os
sys.path.insert(0, '/work/main/src')
from mqttring.ring.hashing import shard_of
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
TAG, FAULT, V = sys.argv[1], sys.argv[2], sys.argv[3]
NODES = {'a': 0, 'b': 1, 'c': 2, 'd': 3, 'e': 4}
LIVE = [n for n in NODES if os.path.exists(f'/tmp/h_ops/run/{n}.pid') and subprocess.run(['kill', '-0', open(f'/tmp/h_ops/run/{n}.pid').read().strip()], capture_output=True).returncode == 0]
def port(n): return 19000 + 10 * NODES[n]
T0 = time.time()
def log(*x): print('%7.2f' % (time.time() - T0), *x, flush=True)
r = subprocess.run(['/tmp/h_ops/ctl.sh', 'status', str(NODES[[n for n in LIVE if n != V][0]]), '--json --shards'], capture_output=True, text=True)
view = json.loads(r.stdout)['view']
def home(cid): return view['shards'][shard_of(cid, 1024)][0][0]
got = collections.defaultdict(list)
def mk(cid, p, clean=True, will=True, ka=60):
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid, clean_session=clean)
    if will: c.will_set(f'will/{TAG}/{cid}', 'dead', qos=1)
    c.ok = None
    c.on_connect = lambda cl, u, f, rc, pr: setattr(cl, 'ok', rc)
    c.connect('127.0.0.1', p, keepalive=ka); c.loop_start()
    for _ in range(100):
        if c.ok is not None: break
        time.sleep(0.1)
    return c
obs = []
for n in LIVE:
    if n == V: continue
    o = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f'{TAG}-obs-{n}', clean_session=True)
    o.on_message = lambda cl, u, m, n=n: got[m.topic.split('/')[-1]].append((n, round(time.time() - T0, 2)))
    o.connect('127.0.0.1', port(n), 30); o.loop_start(); o.subscribe(f'will/{TAG}/#', 1); obs.append(o)
time.sleep(1)
clients = {}
for n in LIVE:
    for k in range(4):
        cid = f'{TAG}-w{n}{k}'
        clean = k % 2 == 0
        clients[cid] = (n, home(cid), clean, mk(cid, port(n), clean=clean))
j = 0
for n in LIVE:
    if n == V: continue
    added = 0
    while added < 2:
        cid = f'{TAG}-x{n}{j}'; j += 1
        if home(cid) != V: continue
        clean = added == 0; added += 1
        clients[cid] = (n, home(cid), clean, mk(cid, port(n), clean=clean))
log('clients', {c: v[:3] for c, v in clients.items()})
time.sleep(3)
if FAULT == 'kill9': subprocess.run(['/tmp/h_ops/ctl.sh', 'kill9', V])
elif FAULT == 'stop': subprocess.run(['/tmp/h_ops/ctl.sh', 'stopsig', V])
elif FAULT == 'term': subprocess.run(['/tmp/h_ops/ctl.sh', 'term', V])
tk = time.time() - T0; log('fault', FAULT, V)
time.sleep(15)
if FAULT == 'stop': subprocess.run(['/tmp/h_ops/ctl.sh', 'cont', V]); log('cont', V)
if FAULT == 'kill9' and os.environ.get('RESTART'): subprocess.run(['/tmp/h_ops/ctl.sh', 'start', V, str(NODES[V])]); log('restarted', V)
time.sleep(15)
log('RESULTS (t relative to fault):')
bad = 0
for cid, (n, h, clean, c) in clients.items():
    w = got.get(cid, [])
    should = (n == V)
    ts = sorted(set(round(t - tk, 2) for _, t in w))
    flag = 'OK' if bool(w) == should else 'BAD'
    if flag == 'BAD': bad += 1
    log(f'{cid} edge {n} home {h} clean {clean} expect_will {should} got {len(w)} copies at {ts} {flag}')
log('bad', bad)
for cid, (n, h, clean, c) in clients.items():
    c.disconnect(); c.loop_stop()
for o in obs: o.disconnect(); o.loop_stop()
