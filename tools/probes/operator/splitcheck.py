import time, paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
res = {}
cs = []
for port in (19000, 19020):
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id='term1-sp1-0', clean_session=False)
    c.on_connect = lambda cl, u, f, rc, pr, port=port: res.__setitem__(port, (str(rc), f.session_present))
    c.on_disconnect = lambda cl, u, f, rc, pr, port=port: res.__setitem__(f'{port}-disc', str(rc))
    c.connect('127.0.0.1', port, 30); c.loop_start(); cs.append(c); time.sleep(1.5)
time.sleep(3)
print(res)
got = []
s = mqtt.Client(CallbackAPIVersion.VERSION2, client_id='splitsub', clean_session=True)
s.on_message = lambda cl, u, m: got.append(m.topic)
s.connect('127.0.0.1', 19000, 30); s.loop_start(); s.subscribe('split/#', 1); time.sleep(1)
p = mqtt.Client(CallbackAPIVersion.VERSION2, client_id='splitpub', clean_session=True)
p.connect('127.0.0.1', 19020, 30); p.loop_start(); i = p.publish('split/x', 'hello', qos=1); time.sleep(2)
print('published on c acked', i._published, 'subscriber on a got', got)
for c in cs + [s, p]: c.disconnect(); c.loop_stop()
