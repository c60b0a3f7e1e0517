#!/bin/bash
# usage: ctl.sh start NAME IDX [JOINIDX] | kill9 NAME | term NAME | stop NAME | cont NAME | status IDX
export MQTTRING_CLUSTER_SECRET=hops-secret-0123456789abcdef
PY=/work/main/.venv/bin/python
D=/tmp/h_ops/run
mkdir -p $D
cmd=$1; name=$2
case $cmd in
start)
  idx=$3; j=$4
  mq=$((19000+10*idx)); cl=$((19001+10*idx))
  extra=""
  [ -n "$j" ] && extra="--join 127.0.0.1:$((19001+10*j))"
  cd /work/main
  nohup $PY -m mqttring.node --node-id $name --mqtt 127.0.0.1:$mq --cluster 127.0.0.1:$cl --data-dir $D/$name --log-level info $extra $EXTRA >> $D/$name.log 2>&1 &
  echo $! > $D/$name.pid
  echo "started $name pid $(cat $D/$name.pid) mqtt $mq cluster $cl"
  ;;
kill9) kill -9 $(cat $D/$name.pid); echo "kill9 $name $(date +%s.%N)";;
term) kill -TERM $(cat $D/$name.pid); echo "term $name $(date +%s.%N)";;
stopsig) kill -STOP $(cat $D/$name.pid); echo "stop $name $(date +%s.%N)";;
cont) kill -CONT $(cat $D/$name.pid); echo "cont $name $(date +%s.%N)";;
status) cd /work/main; timeout 20 $PY -m mqttring status --node 127.0.0.1:$((19001+10*$2)) $3;;
esac
