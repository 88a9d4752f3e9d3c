#!/bin/bash
# The chunk-gap floor that side_by_side.sh's client sets: the same load (../shared/peers/load.py, C
# streams, N requests, T tokens) against three servers kept up side by side and taken in turn, R rounds:
#   ideal  bench/ideal_stream.py: no host cost, one write per stream per step every STEP_MS (default 8,
#          pdmesh's mock decode step, mocker.engine.TimingModel.decode_base_ms), and, with IDEAL2_MS set,
#          a second one at that step (e.g. 5.75, what Dynamo's mocker takes at batch 1);
#   dynamo ../shared/peers/dynamo_up.sh (frontend with KV router + 2 mockers, real pace);
#   pdmesh nats-server + `mesh gateway` + 2 `mesh worker mock` (real pace), as side_by_side.sh runs them.
# One line per run: req/s, TTFT p50, chunk-gap p50 and p99. If the ideal server's p99 is at or above
# Dynamo's, no server whose steps take STEP_MS can be held under Dynamo's p99 by its own costs.
# Run from the project root with its venv active. Env: R (3), C (128), N (1000), T (64), STEP_MS, IDEAL2_MS.
set -u
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/.." && pwd)
PEERS=$root/../shared/peers; PEERS_DIR=${PEERS_DIR:-$HOME/.cache/pdmesh-peers}; D=$PEERS_DIR/dynamo; TOK=$PEERS_DIR/tok32k
R=${R:-3}; C=${C:-128}; N=${N:-1000}; T=${T:-64}; STEP_MS=${STEP_MS:-8}
BIN=$(dirname "$(command -v mesh)")
[ -x "$BIN/mesh" ] || { echo "no mesh command: activate the project's venv"; exit 1; }
W=$(mktemp -d); PIDS=
cleanup() {  # TERM first: dynamo_up.sh stops its own process groups on it
  for g in $PIDS; do kill -TERM -- -$g 2>/dev/null; done; sleep 1; for g in $PIDS; do kill -9 -- -$g 2>/dev/null; done; for g in $PIDS; do wait $g 2>/dev/null; done; rm -rf $W; }
trap cleanup EXIT
trap 'exit 130' INT TERM
. "$here/pdmesh_half.sh"  # port, start_pdmesh
up() { for i in $(seq 90); do curl -sf 127.0.0.1:$1/v1/models | grep -q tiny && return 0; sleep 1; done; echo "$2 did not come up"; exit 1; }
PI=$(port); setsid python "$here/ideal_stream.py" $PI $STEP_MS $T >$W/ideal.log 2>&1 & PIDS="$PIDS $!"
SERVERS="ideal_${STEP_MS}ms:$PI"
if [ -n "${IDEAL2_MS:-}" ]; then
  PI2=$(port); setsid python "$here/ideal_stream.py" $PI2 $IDEAL2_MS $T >$W/ideal2.log 2>&1 & PIDS="$PIDS $!"
  SERVERS="$SERVERS ideal_${IDEAL2_MS}ms:$PI2"
fi
PD=$(port); setsid bash $PEERS/dynamo_up.sh $PD 2 1 >$W/dynamo.log 2>&1 & PIDS="$PIDS $!"
start_pdmesh
up $PI ideal; up $PD dynamo; up $P2 pdmesh
sleep 2
SERVERS="$SERVERS dynamo:$PD pdmesh:$P2"
for r in $(seq $R); do
  for s in $SERVERS; do
    name=${s%%:*}; p=${s##*:}
    out=$($D/bin/python $PEERS/load.py http://127.0.0.1:$p $N $C $T tiny | tail -1)
    python3 - "$r" "$name" "$out" <<'PY'
import json, sys
r, name, out = sys.argv[1:]
try:
    d = json.loads(out)
    print(f"round {r} {name:>14}: req/s {d['req_s']:5.1f}  ttft p50 {d['ttft_p50_ms']:7.1f} ms  "
          f"chunk gap p50 {d['chunk_gap_p50_ms']:6.2f}  p99 {d['chunk_gap_p99_ms']:6.2f} ms  errors {d['errors']}")
except (ValueError, KeyError):
    print(f"round {r} {name:>14}: no result: {out[:200]}")
PY
  done
done
