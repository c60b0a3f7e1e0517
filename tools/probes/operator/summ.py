import json,sys,collections
r=json.load(open(sys.argv[1]))
print("acked",r["acked"],"unacked",{k:len(v) for k,v in r["pub_unacked"].items()})
for k,v in r["subs"].items():
    print(k,"q%d exp %d uniq %d lost %d dups %d dupsq2 %d reord %d sesslost %d conns %d"%(v["subqos"],v["expected"],v["unique"],v["lost"],v["dups"],v["dups_q2"],v["reorder"],v["session_lost"],v["connects"]))
    if v['lost']:
        by=collections.defaultdict(list)
        for m in v['lost_all']: n,s=m.split(':'); by[n].append(int(s))
        for n,ss in by.items(): print('   lost',n,len(ss),'range',min(ss),max(ss))
    if v['dups_q2']: print('   q2dups', v['dups_q2_sample'][:5])

for k,v in r.get('latency',{}).items(): print('latency',k,'max',v['max'],'over2s',v['over2s'])
