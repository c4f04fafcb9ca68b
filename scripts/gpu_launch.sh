#!/usr/bin/env bash
# Launch scripts/gpu_session.sh on the lent GPU host and watch it from the same `run` call, so
# the call that launches is also the first poll (docs/gpu.md, "Sixteenth session": a host goes
# back 30 s after a call returns; a run left to a later call is lost with it if that call is late).
#
#   bash scripts/gpu_launch.sh STAGE_DIR JOB_DIR COMMIT STEP...   # copy the tree to /tmp/tree,
#                                   # start the session there detached, then watch it
#   bash scripts/gpu_launch.sh --watch JOB_DIR                     # a later poll: watch only
#
# Watching: every 29 s, the job's logs and results (*.log *.txt *.xml *.json *.jsonl *.csv *.png
# under 20 MB) go to "$OUT/lane.tgz" (the `run` tool's folder that comes back, even from a call
# stopped at its limit), until WATCH_S seconds (default 540: a call's limit is 600) have passed
# or the session logged "done" or its process ended. Environment for the session (J_REPEATS,
# J_WORKLOADS, ...) passes through. Exit code: 0, or 3 when there is no session to watch (at once)
# or the job folder has no session log after the watch.
set -u
: "${OUT:?set OUT, the folder the run tool brings back}"
WATCH_S="${WATCH_S:-540}"
if [ "${1:-}" = "--watch" ]; then
  JOB="${2:?usage: gpu_launch.sh --watch JOB_DIR}"
else
  [ "$#" -ge 4 ] || { echo "usage: gpu_launch.sh STAGE_DIR JOB_DIR COMMIT STEP..." >&2; exit 2; }
  STAGE="$1"; JOB="$2"; COMMIT="$3"; shift 3
  rm -rf /tmp/tree /tmp/gpujob.pid && mkdir -p /tmp/tree && cp -a . /tmp/tree/ || { echo "copying the tree failed" >&2; exit 1; }
  (cd /tmp/tree && setsid nohup bash scripts/gpu_session.sh "$STAGE" "$JOB" "$COMMIT" "$@" \
     > /tmp/gpujob.log 2>&1 &)
  echo "launched: gpu_session.sh $STAGE $JOB $COMMIT $* (log /tmp/gpujob.log)"
fi
# (twentieth session) polls go in the same message as the launch: a poll that finds no session
# (a fresh host, a launch that failed) or a session that has ended must return at once, not
# spend its whole watch of device time
running() { [ -f /tmp/gpujob.pid ] && kill -0 "$(cat /tmp/gpujob.pid)" 2>/dev/null; }  # gpu_session.sh's $$
if [ "${1:-}" = "--watch" ] && ! running && [ ! -f "$JOB/session.log" ]; then
  echo "no session on this host (no /tmp/gpujob.pid alive, no $JOB/session.log): a fresh host, or the launch failed"
  exit 3
fi
collect() {
  find "$JOB" /tmp/gpujob.log -type f \( -name '*.log' -o -name '*.txt' -o -name '*.xml' -o -name '*.json' \
       -o -name '*.jsonl' -o -name '*.csv' -o -name '*.png' \) -size -20M 2>/dev/null \
    | tar czf "$OUT/lane.tgz" -T - 2>/dev/null
}
t0=$(date +%s)
while :; do
  sleep 29
  collect
  if grep -q "\] done$" "$JOB/session.log" 2>/dev/null; then echo "session done"; break; fi
  if ! running; then echo "session ended without \"done\" (see the logs)"; break; fi
  [ $(( $(date +%s) - t0 + 29 )) -lt "$WATCH_S" ] || break
done
echo "--- $JOB/session.log"; tail -20 "$JOB/session.log" 2>/dev/null || { echo "(none yet)"; exit 3; }
echo "--- /tmp/gpujob.log"; tail -c 1500 /tmp/gpujob.log 2>/dev/null
exit 0
