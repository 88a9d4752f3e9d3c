#!/bin/bash
# The pdmesh half of ../shared/peers/side_by_side.sh, for A/B runs of one tree against another on a
# shared box: nats-server + `mesh gateway` + 2 `mesh worker mock` at real pace, the same closed-loop
# load (C streams, N requests, T tokens each), then one line: the load average, host CPU us per
# generated token of the three together, CPU ms per request of each, pdmesh_gateway_direct_deltas_total,
# and load.py's figures.
#   bash bench/stream_half.sh [TREE]   (TREE: the source tree to run, default this one; env N C T, PEERS_DIR,
#   LOAD: another load.py, e.g. one whose client keeps C streams open: docs/benchmarks.md, s42;
#   GW_ARGS: more `mesh gateway` flags, e.g. GW_ARGS="--router round-robin")
# Alternate two trees (e.g. a `git worktree` of main and a branch) and compare several runs of each.
set -u
TREE=$(cd "${1:-$(dirname "$0")/..}" && pwd); export PYTHONPATH=$TREE
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/pdmesh-peers}; D=$PEERS_DIR/dynamo; TOK=${TOK:-$PEERS_DIR/tok32k}
LOAD=${LOAD:-$(cd "$(dirname "$0")/.." && pwd)/../shared/peers/load.py}
BIN=${PDMESH_BIN:-$(dirname "$(command -v mesh)")}
W=$(mktemp -d); PIDS=
cleanup() { for g in $PIDS; do kill -9 -- -$g 2>/dev/null; done; for g in $PIDS; do wait $g 2>/dev/null; done; }
trap 'cleanup; rm -rf $W' EXIT
trap 'exit 130' INT TERM  # through the EXIT trap: a stopped run stops, not just its processes
C=${C:-128}; N=${N:-500}; T=${T:-64}
port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
cpu() { python3 - "$@" <<'PY'
import os, sys
groups, t = set(sys.argv[1:]), 0
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if f[2] in groups:  # process group
            t += int(f[11]) + int(f[12])
print(t / os.sysconf("SC_CLK_TCK"))
PY
}
per_req() { python3 -c "print(round(($1-$2)*1000/$N,2))"; }
NP=$(port); P2=$(port)
setsid $BIN/nats-server -js -sd $W/js -a 127.0.0.1 -p $NP >$W/nats.log 2>&1 & NS=$!; PIDS="$PIDS $NS"
sleep 1
setsid $BIN/mesh gateway --nats nats://127.0.0.1:$NP --model $TOK --served-name tiny --port $P2 ${GW_ARGS:-} >$W/gw.log 2>&1 & GW=$!; PIDS="$PIDS $GW"
WK=
for k in 1 2; do
  setsid $BIN/mesh worker mock --nats nats://127.0.0.1:$NP --served-name tiny --block-size 16 --mock-speedup 1 >$W/mock$k.log 2>&1 & WK="$WK $!"
done
PIDS="$PIDS $WK"
for i in $(seq 90); do curl -sf 127.0.0.1:$P2/v1/models | grep -q tiny && curl -sf 127.0.0.1:$P2/health >/dev/null && break; sleep 1; done
sleep 2
g0=$(cpu $GW); w0=$(cpu $WK); n0=$(cpu $NS)
ours=$($D/bin/python $LOAD http://127.0.0.1:$P2 $N $C $T tiny | tail -1)
direct=$(curl -s 127.0.0.1:$P2/metrics | awk '/^pdmesh_gateway_direct_deltas_total/ {print $2}')
linked=$(curl -s 127.0.0.1:$P2/metrics | awk '/^pdmesh_gateway_link_batches_total/ {print $2}')
ogw=$(per_req $(cpu $GW) $g0); owk=$(per_req $(cpu $WK) $w0); ons=$(per_req $(cpu $NS) $n0)
tot=$(python3 -c "print(round(($ogw+$owk+$ons)/$T*1000,1))")
echo "$TREE load=$(cut -d' ' -f1 /proc/loadavg) us/token=$tot gateway=$ogw workers=$owk nats=$ons direct=${direct:-0} link_batches=${linked:-0} $ours"
