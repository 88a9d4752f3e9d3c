#!/bin/bash
# ../shared/peers/side_by_side.sh with one change: its load client (load.py) imports httpx2
# (pydantic's fork of httpx, already in the peers' venv) instead of httpx 0.29 / httpcore 1.0.9,
# whose pool hands many queued requests the same connection and leaves them there for seconds
# while other connections idle (encode/httpcore#822; docs/benchmarks.md, s42). With it both servers
# see the C streams the harness asks for, so the ratio compares the servers at equal concurrency.
# Everything else is the peers' scripts as they stand (copied to a temp dir, load.py's import
# line replaced). Env and output: side_by_side.sh's. Run from the project root, venv active:
#   PYTHONPATH=$PWD bash bench/side_by_side_equal.sh
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
peers=$root/../shared/peers
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/pdmesh-peers}
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
cp -r "$peers"/. "$W"/
sed -i 's/^import httpx$/import httpx2 as httpx/' "$W/load.py"
grep -q '^import httpx2 as httpx$' "$W/load.py" || { echo "side_by_side_equal: load.py no longer has 'import httpx' on its own line; not patched"; exit 1; }
bash "$W/dynamo_env.sh" >/dev/null
"$PEERS_DIR/dynamo/bin/python" -c "import httpx2" 2>/dev/null || { echo "side_by_side_equal: the peers' venv has no httpx2"; exit 1; }
bash "$W/side_by_side.sh" "$@"
