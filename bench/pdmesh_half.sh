# Sourced by bench/stream_half.sh and bench/gap_floor.sh: the pdmesh half of ../shared/peers/side_by_side.sh,
# started as that script starts it (nats-server with JetStream, `mesh gateway` with the KV router, 2
# `mesh worker mock` at real pace), each in its own process group.
# Needs BIN (the directory of `mesh` and `nats-server`), TOK (the tokenizer directory), W (a scratch
# directory); takes GW_ARGS and WK_ARGS (more flags). Sets NS, GW, WK (the process groups: nats-server,
# gateway, workers), P2 (the gateway's port) and adds the groups to PIDS.

port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }

start_pdmesh() {
  local np k
  np=$(port); P2=$(port)
  setsid $BIN/nats-server -js -sd $W/js -a 127.0.0.1 -p $np >$W/nats.log 2>&1 & NS=$!; PIDS="$PIDS $NS"
  sleep 1
  setsid $BIN/mesh gateway --nats nats://127.0.0.1:$np --model $TOK --served-name tiny --port $P2 ${GW_ARGS:-} >$W/gw.log 2>&1 & GW=$!; PIDS="$PIDS $GW"
  WK=
  for k in 1 2; do
    setsid $BIN/mesh worker mock --nats nats://127.0.0.1:$np --served-name tiny --block-size 16 --mock-speedup 1 ${WK_ARGS:-} >$W/mock$k.log 2>&1 & WK="$WK $!"
  done
  PIDS="$PIDS $WK"
  for k in $(seq 90); do curl -sf 127.0.0.1:$P2/v1/models | grep -q tiny && curl -sf 127.0.0.1:$P2/health >/dev/null && break; sleep 1; done
}
