#!/bin/bash
# The pdmesh half of ../shared/peers/side_by_side.sh, for A/B runs of one tree against another on a
# shared box: nats-server + `mesh gateway` + 2 `mesh worker mock` at real pace, the same closed-loop
# load (C streams, N requests, T tokens each), then one line: the load average, host CPU us per
# generated token of the three together, CPU ms per request of each, pdmesh_gateway_direct_deltas_total,
# and load.py's figures.
#   bash bench/stream_half.sh [TREE]   (TREE: the source tree to run, default this one; env N C T, PEERS_DIR,
#   LOAD: another load.py, e.g. one whose client keeps C streams open: docs/benchmarks.md, s42;
#   GW_ARGS: more `mesh gateway` flags, e.g. GW_ARGS="--router round-robin"; WK_ARGS: more `mesh worker mock` flags;
#   PROBE=1: also sample, every 0.25 s, the gateway's in-flight requests and the load client's CPU,
#   and time one more streamed request (64 tokens) each second from curl: one more line says whether
#   the run was bound by the client (docs/benchmarks.md, "The harness's client in its pile-up"); the
#   probe's requests (one a second) are served beside the load's, so read the CPU figures from runs without it)
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
. "$(dirname "$0")/pdmesh_half.sh"  # port, start_pdmesh
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
start_pdmesh
sleep 2
g0=$(cpu $GW); w0=$(cpu $WK); n0=$(cpu $NS)
[ -n "${PROBE:-}" ] && { python3 - "$P2" "$LOAD" "$W/probe.stop" >"$W/probe.txt" 2>&1 <<'PY' &
import json, os, re, subprocess, sys, time
port, load, stop = sys.argv[1], sys.argv[2], sys.argv[3]
tick = os.sysconf("SC_CLK_TCK")
body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hello world how are you"}],
                   "max_tokens": 64, "min_tokens": 64, "ignore_eos": True, "stream": True})
def client_cpu():
    out = subprocess.run(["pgrep", "-f", f"{load} http://127.0.0.1:{port}"], capture_output=True, text=True).stdout.split()
    try:
        f = open(f"/proc/{out[0]}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / tick
    except (IndexError, OSError):
        return None
def inflight():
    m = subprocess.run(["curl", "-s", "-m", "2", f"127.0.0.1:{port}/metrics"], capture_output=True, text=True).stdout
    got = re.search(r"^pdmesh_gateway_inflight_requests (\S+)", m, re.M)
    return float(got.group(1)) if got else None
samples, probes, last, t_probe = [], [], (time.monotonic(), client_cpu()), time.monotonic() + 1
while not os.path.exists(stop):
    time.sleep(0.25)
    now, cpu = time.monotonic(), client_cpu()
    if cpu is not None and last[1] is not None:
        samples.append(((cpu - last[1]) / (now - last[0]), inflight()))
    last = (now, cpu)
    if now >= t_probe:
        t_probe = now + 1
        r = subprocess.run(["curl", "-s", "-m", "30", "-o", "/dev/null", "-w", "%{time_starttransfer} %{time_total}",
                            "-H", "content-type: application/json", "-d", body,
                            f"127.0.0.1:{port}/v1/chat/completions"], capture_output=True, text=True).stdout.split()
        if len(r) == 2:
            probes.append((float(r[0]) * 1000, float(r[1]) * 1000))
busy = [s for s in samples if s[0] > 0.9]
low = [s for s in busy if s[1] is not None and s[1] < 32]
probes.sort()
print(f"probe: samples={len(samples)} client_busy(>90% of a core)={len(busy)} of those gateway_inflight<32={len(low)}",
      f"probe_ttfb_ms p50={probes[len(probes) // 2][0]:.0f} max={max(p[0] for p in probes):.0f}" if probes else "no probes",
      f"probe_total_ms p50={sorted(p[1] for p in probes)[len(probes) // 2]:.0f}" if probes else "")
PY
PROBE_PID=$!; }
ours=$($D/bin/python $LOAD http://127.0.0.1:$P2 $N $C $T tiny | tail -1)
[ -n "${PROBE:-}" ] && { touch "$W/probe.stop"; wait $PROBE_PID; }
direct=$(curl -s 127.0.0.1:$P2/metrics | awk '/^pdmesh_gateway_direct_deltas_total/ {print $2}')
linked=$(curl -s 127.0.0.1:$P2/metrics | awk '/^pdmesh_gateway_link_batches_total/ {print $2}')
ogw=$(per_req $(cpu $GW) $g0); owk=$(per_req $(cpu $WK) $w0); ons=$(per_req $(cpu $NS) $n0)
tot=$(python3 -c "print(round(($ogw+$owk+$ons)/$T*1000,1))")
[ -n "${PROBE:-}" ] && cat "$W/probe.txt"
echo "$TREE load=$(cut -d' ' -f1 /proc/loadavg) us/token=$tot gateway=$ogw workers=$owk nats=$ons direct=${direct:-0} link_batches=${linked:-0} $ours"
