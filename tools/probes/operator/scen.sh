#!/bin/bash
# usage: scen.sh TAG FAULT   FAULT in: follower9 leader9 sick term
cd /tmp/h_ops
TAG=$1; F=$2; PORTS=${PORTS:-19000,19010,19020}; DUR=${DUR:-60}
leader=$(./ctl.sh status 0 --json 2>/dev/null | /work/main/.venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["leader"])')
[ -z "$leader" ] && leader=$(./ctl.sh status 1 --json | /work/main/.venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["leader"])')
echo "leader=$leader"
declare -A IDX=([a]=0 [b]=1 [c]=2 [d]=3 [e]=4)
JOINOF=${JOINOF:-0}
for n in a b c d e; do [ -f run/$n.pid ] && kill -0 $(cat run/$n.pid) 2>/dev/null && [ $n != $leader ] && fol=$n; done
timeout 300 /work/main/.venv/bin/python load.py --tag $TAG --ports $PORTS --duration $DUR --rate ${RATE:-30} --drain 60 --out res/$TAG.json > res/$TAG.log 2>&1 &
LP=$!
sleep 20
case $F in
follower9) V=$fol; ./ctl.sh kill9 $V; sleep ${DOWN:-15}; ./ctl.sh start $V ${IDX[$V]};;
leader9) V=$leader; ./ctl.sh kill9 $V; sleep ${DOWN:-15}; ./ctl.sh start $V ${IDX[$V]};;
sick) V=${VICTIM:-$fol}; ./ctl.sh stopsig $V; sleep 15; ./ctl.sh cont $V;;
term) V=${VICTIM:-$fol}; ./ctl.sh term $V; for i in $(seq 60); do kill -0 $(cat run/$V.pid) 2>/dev/null || break; sleep 1; done; echo "exited after $i s"; wait $(cat run/$V.pid) 2>/dev/null; sleep 3; ./ctl.sh start $V ${IDX[$V]};;
esac
echo "victim=$V"
wait $LP
/work/main/.venv/bin/python summ.py res/$TAG.json
