#!/bin/bash
# How long `omni-cache serve` takes to stop in vLLM-Omni's distributed mode, and whether it leaves
# a stage process behind (docs/routing.md, "Closing a distributed-mode engine").
#
# On this host: a head (`omni-cache serve ... -- --stage-id 0 --omni-master-address ...`: API
# server, orchestrator, coordinator, the thinker's replica) and headless processes for stages 1
# and 2 (`python -m omni_cache.driver.vllm_serve ... --headless --stage-id N`) registering with
# its master; once the head prints its URL, SIGTERM to the head; prints the head's stage
# processes, the seconds until it exited, and those left running. Logs under OUT.
#
# usage: bash scripts/distributed_serve_stop.sh [OUT]   (default OUT: /tmp/distributed-serve-stop)
set -u
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/distributed-serve-stop}
mkdir -p "$OUT"
PY=.venv/bin/python
M=$($PY -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])")
CFG=stage_configs/qwen3_omni_cpu.yaml
DIR=$($PY -c "from omni_cache.models import build_qwen3_omni, default_model_dir; print(build_qwen3_omni(default_model_dir('tiny'), 'tiny'))")
$PY -m omni_cache.cli serve --stage-config $CFG --model "$DIR" --port 0 --log "$OUT/head.log" --ready-timeout 900 -- \
    --stage-id 0 --omni-master-address 127.0.0.1 --omni-master-port "$M" > "$OUT/head.out" 2>&1 &
HEAD=$!
sleep 20  # the head's master is up before the headless stages register
PIDS=()
for s in 1 2; do
  $PY -m omni_cache.driver.vllm_serve "$DIR" --omni --deploy-config $CFG --headless --stage-id $s \
      --omni-master-address 127.0.0.1 --omni-master-port "$M" > "$OUT/headless$s.log" 2>&1 &
  PIDS+=($!)
done
t0=$SECONDS
until grep -q "http://" "$OUT/head.out"; do
  sleep 5
  if ! kill -0 $HEAD 2>/dev/null || (( SECONDS - t0 > 900 )); then echo "the head did not start: $OUT/head.out"; break; fi
done
echo "head: $(grep -m1 'ready in' "$OUT/head.out")"
$PY - $HEAD <<'PY'
import signal, sys, time
import psutil
head = psutil.Process(int(sys.argv[1]))
kids = head.children(recursive=True)
print("head's processes:", [(k.pid, k.name()) for k in kids])
t0 = time.monotonic()
head.send_signal(signal.SIGTERM)
try:
    head.wait(180)
    print(f"head exited {time.monotonic() - t0:.1f} s after SIGTERM")
except psutil.TimeoutExpired:
    print("head still running 180 s after SIGTERM")
left = []
for k in kids:
    try:
        if k.status() != psutil.STATUS_ZOMBIE:
            left.append((k.pid, k.name()))
    except psutil.NoSuchProcess:
        pass
print("left running:", left)
PY
grep -h "did not stop within\|Deferring StageRuntime" "$OUT/head.log" || echo "(no orchestrator stall in the head's log)"
kill "${PIDS[@]}" $HEAD 2>/dev/null
wait 2>/dev/null
