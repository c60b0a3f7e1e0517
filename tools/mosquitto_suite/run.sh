#!/bin/bash
# Run eclipse/mosquitto's broker tests (test/broker/*.py) against an mqttring node, one by
# one, and list which passed.  Usage: tools/mosquitto_suite/run.sh MOSQUITTO_CHECKOUT [TEST...]
# Needs python3 with psutil for two tests, and openssl. Results: docs/design.md, "Checked against
# mosquitto's broker tests". Each test starts and stops its own node on port 1888+.
set -u
here=$(cd "$(dirname "$0")" && pwd)
export SHIM_MQTTRING_REPO=${SHIM_MQTTRING_REPO:-$(cd "$here/../.." && pwd)}
checkout=$(cd "$1" && pwd); shift
python3 "$here/lenient.py" "$checkout"
# The checkout's test certificates expire (2025 for the ones of late 2024): make new ones.
if ! openssl x509 -checkend 3600 -noout -in "$checkout/test/ssl/server.crt" > /dev/null; then
  (cd "$checkout/test/ssl" && bash gen.sh > /dev/null 2>&1)
fi
mkdir -p "$checkout/src" && cp "$here/mosquitto" "$checkout/src/mosquitto"
cd "$checkout/test/broker"
tests=("$@")
[ ${#tests[@]} -eq 0 ] && tests=($(ls 0[1-5]-*.py 07-*.py 08-ssl-connect-*.py 08-ssl-hup-*.py 09-acl-*.py 09-auth-*.py 09-pwfile-*.py 1[1-3]-*.py | grep -v helper))
out=$(mktemp -d)
for t in "${tests[@]}"; do
  timeout 60 python3 "./$t" > "$out/$t.log" 2>&1 < /dev/null; rc=$?
  echo "$rc $t"
  pkill -f "mqttring.node --mqtt 127.0.0.1:18" 2>/dev/null
done
echo "logs: $out"
