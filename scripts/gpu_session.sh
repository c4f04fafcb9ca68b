#!/usr/bin/env bash
# One GPU session's work on a lent, air-gapped host (docs/gpu.md, "Zero overhead"): install the
# offline bundle once, build the models, then run the named steps in order, each writing under OUT.
#   bash scripts/gpu_session.sh STAGE_DIR OUT_DIR COMMIT STEP...
# STAGE_DIR: the bundle's parts + manifest.json (scripts/offline_bundle.sh); the tree (this
# checkout) goes first on PYTHONPATH, the bundle is installed with --target /tmp/site.
# Steps:
#   A  bench prefill, profiling shape (6 of 48 thinker layers, full widths) on one card, production
#      mode, off / built-in / omni-cache up at once: floor, text, chat; c = 1 and 16
#   A4 (eighteenth session) A in the deploy's graph coverage (--max-num-seqs 64), off / omni-cache, floor, miss, text
#   SP (twenty-second session) benchmarks.sync_probe --profile: does a save wait for the GPU (decode,
#      prefill, 8 hit rounds), and where a decode save's host time goes (~20 s; OUT/SP/result-<commit>.json)
#   ES (eighteenth session) the lane's equality and streaming groups at once on one card (a short hold);
#      ES_GROUPS picks the groups (e.g. "streaming" alone), ES_TIMEOUT caps each
#   EA (twenty-fifth session) a 2-GPU host: ES on card EA_ES_CARD (0) and A4 on card EA_A4_CARD (1) at once;
#      A4_VARIANTS (e.g. off,builtin,omni_cache), A4_THINKER_ONLY=1 (omni-cache without the talker's prefix cache),
#      A4_LAYERS (thinker layers of A4's model, default 6; also for A4 alone)
#   SO (twenty-fifth session) benchmarks.scheduler_overhead: the scheduler's host time per decode step, off /
#      built-in / omni-cache, batch 1 and 16 (engine-free, CPU only, ~1 min; OUT/SO/result.json)
#   FB (twenty-sixth session) issue 43's 2 % no-hit bar at full size on a 2-GPU host: the one-GPU full-size
#      config (48 thinker layers, production mode, --max-num-seqs 64), cache off on card FB_OFF_CARD (0) and
#      omni-cache on card FB_OC_CARD (1), both up at once (the one not timed idle); FB_WORKLOADS (floor,miss,text),
#      FB_REQUESTS (16), FB_REPEATS (3), 32-token answers, c = 1 and 16 (48 requests a round at 16)
#   B  the same workloads, off / omni-cache with the hand-off from vLLM-Omni's own snapshot
#      (OMNI_CACHE_HANDOFF_STAGING=snapshot, opt-in), to measure it against A (default: host)
#   C  the GPU lane's equality-compiled group (Qwen3-Omni thinker on CUDA graphs)
#   S  the same group with OMNI_CACHE_HANDOFF_STAGING=snapshot (run it before B: its exactness)
#   P  C and S at once on the one card (two pytest processes, own engines), to fit one hold
#   U  the GPU lane's unit group
#   F  bench prefill at full size (one H200: the one-GPU config), off / built-in / omni-cache,
#      one pipeline at a time
#   G  the full-size table on a 4-GPU H200 host: the one-GPU config once per variant, each on its
#      own card (--variant-devices), all three up at once; c = 1, 4, 16, 64
#   H  G's pipelines on cards 0-2, trimmed to fit one 30-minute hold (floor, text, chat, image; c = 1
#      and 16), while card 3 runs the lane's equality-compiled and streaming groups (OUT/H3/report.json)
#   M  the mutation run on a 4-GPU host (issue 44, item 3): tests.lanes.mutants --device cuda, the 14 planted
#      faults with a pipeline selection split over the four cards (CUDA_VISIBLE_DEVICES), each card's report under
#      OUT/M<card>/report.json (written after every mutant); ~2 min a selection warm: ~8-9 min.
#      MUTANT_CARDS overrides the split ("card:m1,m2 card:m3 ...")
#   R  on one card, what changed since the lane run of 8aa0b18 (docs/gpu.md, "Fourth session"):
#      yoco-eager, yoco-compiled and equality-compiled at once (OUT/R/report.json)
#   N  one 4-GPU hold for two things: the whole lane on cards 0-2 (three groups at a time on each,
#      merged into OUT/L/report.json) while card 3 runs the full-size benchmark, omni-cache then
#      cache off, one pipeline at a time (floor, text, chat; c = 1 and 16): the sixth session's
#      engine death gone or not (result.json's variant_failures), and the step-time counters
#   Y  issue 47, item 1 (never run): Gemma-4-E4B's shape with YOCO at size on a 4-GPU host (H200 or H100: the
#      config follows the card's memory), production mode (CUDA graphs on all three stages), one
#      variant per card (fast prefill off/on x omni-cache off/on), ISL ~8,192 (1,080 shared words +
#      a question; workload miss: the control without a shared prefix), c = 1, 8 and 32
#   V  issue 47, item 2 (never run): realtime duplex sessions at Qwen3-Omni-30B-A3B's size on one card
#      (an H200; card $V_CARD, default 0; on H100s the two-GPU layout on $V_CARDS, default 0,1), three servers one at a time, sessions 1 and 8, 8 turns, with
#      the oracles (recorded hand-offs): docs/benchmarks.md's GPU command at --rounds 1
#   Q  (never run) where the talker's time goes at full size (docs/gpu.md, "The next GPU session", item 3):
#      benchmarks.profile_stage (py-spy) on four cards at once — omni-cache and cache off, each with
#      the thinker (stage 0) and the talker (stage 1) recorded, text and floor, one request at a time
#      Q_SPECS overrides the split ("card:variant:stage ..."; one card's specs run one after another);
#      Q_CONC=16: each workload as one closed loop of 16 senders, recorded as one profile (the talker under load)
#   K  M and Q at once (e.g. MUTANT_CARDS over cards 0-2, Q_SPECS on card 3), to fit one hold
#   W  (never run) the full-size table off / built-in / omni-cache on cards 0-2 (floor, text, chat; c = 1 and 16;
#      one round, ~10 min after a ~7 min cold start) while card 3 runs the four mutants not yet killed by an oracle on CUDA, then the talker's
#      py-spy under c = 16 (omni-cache, cache off): issue 43's table and profile, issue 44's mutants, one hold
#   T  a 4 x H100 host (when 4 x H200 is not lent): the shipped two-GPU layout at full size on cards 0-1
#      (qwen3_omni_30b_a3b_2xh100_dummy.yaml; cache off, built-in, omni-cache one at a time, omni-cache last
#      so the first pipeline on the fresh host pays the Triton compiles: floor, text, chat;
#      c = 1 and 16) while cards 2-3 run the mutants not yet killed by an oracle on CUDA (MUTANT_CARDS)
#   E  (eleventh session) after a change to omni_cache/: the whole lane plus the mutant it was made for,
#      and the full-size floor on the card left: on 4 x H200 the lane on cards 0-2 (N's split), the
#      mutants in MUTANT_CARDS (default "1:async_placeholders_unresolved") beside it, card 3 the
#      one-GPU full-size config, cache off / omni-cache / built-in one at a time (floor, text; c = 1
#      and 16; 12 requests; jit_compiles on); on 4 x H100 (a full-size pipeline needs an H200 or two
#      H100s) the lane over four cards (L's split) and the mutants beside it on card 2
#   X  4 x H100, issues 43 and 47 at once: T's full-size table on cards 0-1 (cache off, built-in,
#      omni-cache last; floor, text, chat; c = 1 and 16; X_REQUESTS, default 12; jit_compiles) while cards
#      2-3 run V on the two-GPU duplex config (V_SESSIONS, default 1,8). Twelfth session: V ran; the table
#      died at its first start (a stage-config key vLLM-Omni refuses, since removed) and ran again without
#      the built-in (docs/gpu.md, "Twelfth session")
#   J  (started once, lost with its host: thirteenth session) 4 x H100, issue 43: the floor's own TTFT spikes — the floor alone at c = 1 (J_REQUESTS,
#      default 48, two rounds, off and omni-cache) on cards 0-1, py-spy on omni-cache's thinker over the same
#      requests on cards 2-3
#   J1 one H200: the c = 1 floor and miss table (off, built-in, omni-cache), then py-spy --stalls on omni-cache
#   J4 (fourteenth session) the floor, miss and text in the deploy's CUDA-graph coverage (max_num_seqs the stage config's
#      64), the shipped two-GPU layout, off / omni-cache: on 4 cards both up at once (pairs 0-1, 2-3), again swapped;
#      on 2 cards one at a time, restarted every round. J_REPEATS (default 2) rounds, J_NAME (2 cards; default J4a)
#      the table's name: a hold too short for two rounds runs J_REPEATS=1 twice, the second with
#      J_VARIANTS=omni_cache,off (the other start order) under another J_NAME
#   O  (fifteenth session) one card, issue 43's zero-overhead bar where a step is shortest: the bench-size embedded
#      model on the one-GPU config in production mode (qwen3_omni_gpu1.yaml: CUDA graphs up to 128 tokens),
#      off / built-in / omni-cache up at once (floor, miss, text; c = 1 and 16; O_REQUESTS, default 24; 3 rounds),
#      then the main job on that config (omni-cache run --repeat 3)
#   Z  (never run) issue 47, item 3: the exactness fuzzer at size (tests.lanes.fuzz_exactness --stage-config
#      --engine-devices): off / built-in / omni-cache one card each (cards 0-2), full size on H200s, the
#      profiling shape on H100s; Z_GROUPS (default 25, ~300 requests), streaming; card 3 is free
#   L  the whole GPU lane on a 4-GPU host: four tests.lanes.gpu_check processes, one per card
#      (CUDA_VISIBLE_DEVICES), two groups at a time on each, then one merged report (OUT/L/report.json)
# Long steps are meant to be started detached (setsid nohup ... &) and polled.
set -u
STAGE="$1"; OUT="$2"; COMMIT="$3"; shift 3
export BENCH_COMMIT="$COMMIT"  # results name this commit (benchmarks/lab.py git(): the host's git metadata is stale)
echo $$ > /tmp/gpujob.pid  # scripts/gpu_launch.sh watches this process
TREE="$(pwd)"
mkdir -p "$OUT"
export PYTHONPATH="/tmp/site:$TREE" OMNI_CACHE_CUDA_PLATFORM=1 OMNI_CACHE_PARALLEL_STAGE_INIT=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# (twentieth session) vLLM's JIT kernel warm-up off unless the caller sets it: ~110 s per stage, the
# three stages one after another on a shared card, ~5.5 of a cold one-card start's ~10 min; the
# kernels compile in the harness's warm-up requests instead (results record it under "settings")
export OMNI_CACHE_JIT_WARMUP="${OMNI_CACHE_JIT_WARMUP:-0}"
PY=python3
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/session.log"; }
if [ ! -f /tmp/site/.omni_cache_installed ]; then
  log "install"
  bash scripts/install_offline.sh "$STAGE" --target /tmp/site > "$OUT/install.log" 2>&1 || { log "install FAILED"; exit 1; }
  $PY -m compileall -q -j 0 /tmp/site > /dev/null 2>&1
  touch /tmp/site/.omni_cache_installed
fi
log "models"
case " $* " in *" A "*|*" B "*|*" A4 "*|*" EA "*) $PY -m omni_cache.cli make-model --size full --thinker-layers 6 > "$OUT/models.log" 2>&1 ;; esac
# (twenty-fifth session) A4_LAYERS: A4's thinker layers (default 6, the profiling shape; e.g. 24: a step where the
# GPU, not the host, sets the pace); the model is made here, the l6 stage config serves it (KV sized in bytes)
A4_LAYERS="${A4_LAYERS:-6}"
case " $* " in *" A4 "*|*" EA "*) [ "$A4_LAYERS" = 6 ] || \
  $PY -m omni_cache.cli make-model --size full --thinker-layers "$A4_LAYERS" >> "$OUT/models.log" 2>&1 ;; esac
$PY -m omni_cache.cli make-model >> "$OUT/models.log" 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" 2>&1
L6=(--stage-config stage_configs/qwen3_omni_30b_a3b_l6_h100_dummy.yaml
    --model "$HOME/.cache/omni-cache/models/qwen3-omni-full-l6" --modalities floor,text,chat --requests 6
    --concurrency 1,16 --max-num-seqs 16 --alternation concurrent --out "$OUT")
run_M() {
  $PY -m omni_cache.cli make-model --family gemma4 >> "$OUT/models.log" 2>&1
  $PY -m omni_cache.cli make-model --family gemma3n >> "$OUT/models.log" 2>&1
  # --device cuda: the lane's environment, pipeline selections only (the 14 mutants that have one)
  for spec in ${MUTANT_CARDS:-"0:foreign_block,stale_generation,talker_length_keys,cap_disabled" \
              "1:slot_shift,talker_seed_dropped,talker_media_dropped,decode_rows_corrupted" \
              "2:bit_flip,seam_off_by_one,write_batch_shift" \
              "3:async_placeholders_unresolved,resume_rows_lost,key_misaligned"}; do
    dev=${spec%%:*}
    CUDA_VISIBLE_DEVICES=$dev $PY -m tests.lanes.mutants --device cuda --only "${spec#*:}" --out "$OUT/M$dev" \
      > "$OUT/M$dev.log" 2>&1 &
  done
  wait
}
run_Q() {
  # Q_SPECS: "card:variant:stage ..."; specs on one card run one after another, cards at once
  $PY -m omni_cache.cli make-model --size full >> "$OUT/models.log" 2>&1
  local specs=${Q_SPECS:-"0:omni_cache:0 1:omni_cache:1 2:off:0 3:off:1"} dev
  for dev in $(for s in $specs; do echo "${s%%:*}"; done | sort -u); do
    (for spec in $specs; do
       IFS=: read -r d variant stage <<< "$spec"
       [ "$d" = "$dev" ] || continue
       CUDA_VISIBLE_DEVICES=$dev $PY -m benchmarks.profile_stage \
         --stage-config stage_configs/qwen3_omni_30b_a3b_h200_dummy.yaml \
         --model "$HOME/.cache/omni-cache/models/qwen3-omni-full" --variant "$variant" --stage "$stage" \
         --workloads text,floor --requests 6 --thinker-kv-mib 12288 --talker-kv-mib 4096 \
         --concurrency "${Q_CONC:-1}" --max-num-seqs 16 --out "$OUT/Q" >> "$OUT/Q$dev.log" 2>&1
       log "Q card $dev $variant stage $stage rc=$?"
     done) &
  done
  wait
}
run_A4() {
  # eighteenth session, issue 43's 2 % no-hit bar on one card: the profiling shape (full widths, 6 of 48
  # thinker layers) in the deploy's graph coverage (--max-num-seqs 64: graphs up to 128 tokens; step A ran 16 -> 32,
  # so the floor's ~100-token prefills ran without graphs), cache off and omni-cache up at once (the one not being
  # timed frozen): floor and miss (no hit), text (a 97 % hit); c = 1 and 16; A4_REQUESTS (default 24), 3 rounds
  # (twenty-first session) A4_ANSWER_TOKENS (default 32) thinker tokens per answer: the bar's decode part
  # (thinker_tpot_ms; the harness's default of 2 tokens times no decode)
  # (twenty-fourth session) A4_MIN_HIT: OMNI_CACHE_MIN_HIT_TOKENS for this table only (the floor's one-block
  # template hit recomputed; ES keeps the default: its oracle is the built-in cache, which hits it)
  OMNI_CACHE_MIN_HIT_TOKENS="${A4_MIN_HIT:-0}" \
  $PY -m benchmarks.prefill --stage-config stage_configs/qwen3_omni_30b_a3b_l6_h100_dummy.yaml \
    --model "$HOME/.cache/omni-cache/models/qwen3-omni-full-l$A4_LAYERS" --modalities "${A4_WORKLOADS:-floor,miss,text}" \
    --requests "${A4_REQUESTS:-24}" --answer-tokens "${A4_ANSWER_TOKENS:-32}" --concurrency 1,16 --max-num-seqs 64 \
    ${A4_LOAD_REQUESTS:+--load-requests "$A4_LOAD_REQUESTS"} \
    --alternation concurrent \
    --variants "${A4_VARIANTS:-off,omni_cache}" ${A4_THINKER_ONLY:+--thinker-cache-only} --repeats "${A4_REPEATS:-3}" --out "$OUT" --name A4 > "$OUT/A4.log" 2>&1
  log "A4: table rc=$?"
}
run_ES() {
  # eighteenth session, a short hold: the lane's equality and streaming groups at once on one card
  # (omni_cache/engine and driver/streaming.py changed since their last GPU run), each capped at ES_TIMEOUT
  for g in ${ES_GROUPS:-equality streaming}; do
    $PY -m tests.lanes.gpu_check --groups $g --jobs 1 --timeout "${ES_TIMEOUT:-480}" --out "$OUT/ES-$g" \
      --commit "$COMMIT" > "$OUT/ES-$g.log" 2>&1 &
  done
  wait
  log "ES: equality + streaming done"
}
for step in "$@"; do
  log "step $step start"
  case "$step" in
    A) $PY -m benchmarks.prefill "${L6[@]}" --repeats 2 --name A > "$OUT/A.log" 2>&1 ;;
    A4) run_A4 ;;
    B) OMNI_CACHE_HANDOFF_STAGING=snapshot $PY -m benchmarks.prefill "${L6[@]}" --repeats 1 --variants off,omni_cache \
         --name B > "$OUT/B.log" 2>&1 ;;
    C) $PY -m tests.lanes.gpu_check --groups equality-compiled --jobs 1 --timeout 900 --out "$OUT/C" \
         --commit "$COMMIT" > "$OUT/C.log" 2>&1 ;;
    S) OMNI_CACHE_HANDOFF_STAGING=snapshot $PY -m tests.lanes.gpu_check --groups equality-compiled --jobs 1 \
         --timeout 900 --out "$OUT/S" --commit "$COMMIT" > "$OUT/S.log" 2>&1 ;;
    P) $PY -m tests.lanes.gpu_check --groups equality-compiled --jobs 1 --timeout 1100 --out "$OUT/C" \
         --commit "$COMMIT" > "$OUT/C.log" 2>&1 &
       sleep 20
       OMNI_CACHE_HANDOFF_STAGING=snapshot $PY -m tests.lanes.gpu_check --groups equality-compiled --jobs 1 \
         --timeout 1100 --out "$OUT/S" --commit "$COMMIT" > "$OUT/S.log" 2>&1 &
       wait ;;
    SP) $PY -m benchmarks.sync_probe --profile --label "$COMMIT" --out "$OUT/SP" > "$OUT/SP.log" 2>&1
       log "SP: sync probe rc=$?"
       # (twenty-fourth session) SP_PAIRS=1: the probe again with kept input ids and with the one-launch writes
       # off, on the same host (hosts differ by ~1.5x in Python speed: only a same-host pair compares)
       if [ "${SP_PAIRS:-0}" = 1 ]; then
         $PY -m benchmarks.sync_probe --tokens kept --label "$COMMIT-kept" --out "$OUT/SP" >> "$OUT/SP.log" 2>&1
         OMNI_CACHE_FUSED=0 $PY -m benchmarks.sync_probe --label "$COMMIT-nofused" --out "$OUT/SP" >> "$OUT/SP.log" 2>&1
         log "SP: pairs rc=$?"
       fi ;;
    ES) run_ES ;;
    EA) # (twenty-fifth session) a 2-GPU host: ES on card EA_ES_CARD (default 0) while A4 runs on card
       # EA_A4_CARD (default 1): the exactness groups and the table in one hold's time
       (export CUDA_VISIBLE_DEVICES="${EA_ES_CARD:-0}"; run_ES) &
       (export CUDA_VISIBLE_DEVICES="${EA_A4_CARD:-1}"; run_A4) &
       wait
       log "EA: ES and A4 done" ;;
    SO) # (twenty-fifth session) the scheduler's host time per decode step, off / built-in / omni-cache
       # (engine-free, vLLM's real async scheduler; CPU only)
       $PY -m benchmarks.scheduler_overhead --batch 1,16 --rounds 3 --out "$OUT/SO" > "$OUT/SO.log" 2>&1
       log "SO: scheduler overhead rc=$?" ;;
    FB) # (twenty-sixth session) the bar where the GPU sets the pace: full size, each variant on its own card
       $PY -m omni_cache.cli make-model --size full >> "$OUT/models.log" 2>&1
       OMNI_CACHE_MIN_HIT_TOKENS="${A4_MIN_HIT:-32}" \
       $PY -m benchmarks.prefill --stage-config stage_configs/qwen3_omni_30b_a3b_h200_dummy.yaml \
         --model "$HOME/.cache/omni-cache/models/qwen3-omni-full" --modalities "${FB_WORKLOADS:-floor,miss,text}" \
         --requests "${FB_REQUESTS:-16}" --answer-tokens 32 --concurrency 1,16 --max-num-seqs 64 \
         --load-requests "${FB_LOAD_REQUESTS:-48}" --alternation concurrent --variants off,omni_cache \
         --variant-devices "off=${FB_OFF_CARD:-0};omni_cache=${FB_OC_CARD:-1}" --repeats "${FB_REPEATS:-3}" \
         --out "$OUT" --name FB > "$OUT/FB.log" 2>&1
       log "FB: table rc=$?" ;;
    U) $PY -m tests.lanes.gpu_check --groups unit --jobs 1 --timeout 900 --out "$OUT/U" \
         --commit "$COMMIT" > "$OUT/U.log" 2>&1 ;;
    F) $PY -m omni_cache.cli make-model --size full >> "$OUT/models.log" 2>&1
       $PY -m benchmarks.prefill --stage-config stage_configs/qwen3_omni_30b_a3b_h200_dummy.yaml \
         --model "$HOME/.cache/omni-cache/models/qwen3-omni-full" --modalities floor,text,chat --requests 6 \
         --repeats 1 --concurrency 1,16 --max-num-seqs 16 --alternation restart --variants omni_cache,off,builtin \
         --out "$OUT" --name F > "$OUT/F.log" 2>&1 ;;
    G) $PY -m omni_cache.cli make-model --size full >> "$OUT/models.log" 2>&1
       $PY -m benchmarks.prefill --stage-config stage_configs/qwen3_omni_30b_a3b_h200_dummy.yaml \
         --model "$HOME/.cache/omni-cache/models/qwen3-omni-full" --modalities floor,text,image,audio,chat \
         --requests 6 --repeats 1 --concurrency 1,4,16,64 --max-num-seqs 64 --alternation concurrent \
         --variant-devices "omni_cache=0;off=1;builtin=2" --out "$OUT" --name G > "$OUT/G.log" 2>&1 ;;
    H) $PY -m omni_cache.cli make-model --size full >> "$OUT/models.log" 2>&1
       CUDA_VISIBLE_DEVICES=3 $PY -m tests.lanes.gpu_check --groups equality-compiled,streaming --jobs 2 \
         --out "$OUT/H3" --commit "$COMMIT" > "$OUT/H3.log" 2>&1 &
       $PY -m benchmarks.prefill --stage-config stage_configs/qwen3_omni_30b_a3b_h200_dummy.yaml \
         --model "$HOME/.cache/omni-cache/models/qwen3-omni-full" --modalities floor,text,chat,image \
         --requests 6 --repeats 1 --concurrency 1,16 --max-num-seqs 16 --alternation concurrent \
         --variant-devices "omni_cache=0;off=1;builtin=2" --out "$OUT" --name H > "$OUT/H.log" 2>&1
       wait ;;
    M) run_M ;;
    W) # cards 0-2: the three-variant full-size table (as H, without the lane); card 3: the mutants not yet
       # killed by an oracle there, then the talker profiled under c = 16 (omni-cache, cache off)
       $PY -m omni_cache.cli make-model --size full >> "$OUT/models.log" 2>&1
       (MUTANT_CARDS=${MUTANT_CARDS:-"3:seam_off_by_one,stale_generation,resume_rows_lost,async_placeholders_unresolved"}
        run_M
        Q_SPECS=${Q_SPECS:-"3:omni_cache:1 3:off:1"} Q_CONC=${Q_CONC:-16} run_Q) &
       $PY -m benchmarks.prefill --stage-config stage_configs/qwen3_omni_30b_a3b_h200_dummy.yaml \
         --model "$HOME/.cache/omni-cache/models/qwen3-omni-full" --modalities floor,text,chat \
         --requests 6 --repeats 1 --concurrency 1,16 --max-num-seqs 16 --alternation concurrent \
         --variant-devices "omni_cache=0;off=1;builtin=2" --out "$OUT" --name W > "$OUT/W.log" 2>&1
       wait ;;
    T) # 4 x H100: the shipped two-GPU layout at full size on cards 0-1, omni-cache / cache off / built-in one
       # pipeline at a time (results written after each variant), while cards 2-3 run the mutants
       $PY -m omni_cache.cli make-model --size full >> "$OUT/models.log" 2>&1
       (MUTANT_CARDS=${MUTANT_CARDS:-"2:seam_off_by_one,stale_generation,cap_disabled 3:resume_rows_lost,async_placeholders_unresolved"}
        run_M) &
       CUDA_VISIBLE_DEVICES=0,1 $PY -m benchmarks.prefill --stage-config stage_configs/qwen3_omni_30b_a3b_2xh100_dummy.yaml \
         --model "$HOME/.cache/omni-cache/models/qwen3-omni-full" --modalities floor,text,chat \
         --requests 6 --repeats 1 --concurrency 1,16 --max-num-seqs 16 --alternation restart \
         --variants off,builtin,omni_cache --thinker-kv-mib 12288 --talker-kv-mib 4096 \
         --out "$OUT" --name T > "$OUT/T.log" 2>&1
       wait ;;
    X) # 4 x H100, issues 43 and 47 at once: T's two-GPU table on cards 0-1 (omni-cache last), the realtime
       # duplex sessions (V) on the two-GPU layout on cards 2-3; 12 requests a point (6 could not show a 2 % bar:
       # a start costs minutes, a point at c = 1 seconds)
       $PY -m omni_cache.cli make-model --size full >> "$OUT/models.log" 2>&1
       (export V_CARDS=2,3
        CUDA_VISIBLE_DEVICES=2,3 $PY -m benchmarks.realtime_bench \
          --stage-config stage_configs/qwen3_omni_30b_a3b_2xh100_dummy_duplex.yaml \
          --model "$HOME/.cache/omni-cache/models/qwen3-omni-full" --servers one-at-a-time \
          --sessions "${V_SESSIONS:-1,8}" --turns 8 --rounds 1 --out "$OUT/V" > "$OUT/V.log" 2>&1
        log "X: V rc=$?") &
       CUDA_VISIBLE_DEVICES=0,1 $PY -m benchmarks.prefill --stage-config stage_configs/qwen3_omni_30b_a3b_2xh100_dummy.yaml \
         --model "$HOME/.cache/omni-cache/models/qwen3-omni-full" --modalities floor,text,chat \
         --requests "${X_REQUESTS:-12}" --repeats 1 --concurrency 1,16 --max-num-seqs 16 --alternation restart \
         --variants off,builtin,omni_cache --thinker-kv-mib 12288 --talker-kv-mib 4096 \
         --out "$OUT" --name X > "$OUT/X.log" 2>&1
       log "X: table rc=$?"; wait ;;
    J) # 4 x H100, issue 43: the floor's ~1 s TTFT spikes (twelfth session: omni-cache's own, two of twelve at
       # c = 1). Cards 0-1: the floor alone, 48 requests a round, two rounds rotated (off and omni-cache, each
       # started twice), with the JIT report reading Triton's disk caches; cards 2-3: py-spy on omni-cache's
       # thinker over the same floor requests (benchmarks.profile_stage): a ~1 s stall is ~200 samples of one stack
       $PY -m omni_cache.cli make-model --size full >> "$OUT/models.log" 2>&1
       # --stalls: py-spy --idle --threads (a thread blocked in a sync counts) and the heaviest stacks of each
       # request over 1.5 x the median prefill; then cache off the same way, the control
       (for v in omni_cache off; do
          VLLM_GC_DEBUG=1 CUDA_VISIBLE_DEVICES=2,3 $PY -m benchmarks.profile_stage \
            --stage-config stage_configs/qwen3_omni_30b_a3b_2xh100_dummy.yaml --stalls \
            --model "$HOME/.cache/omni-cache/models/qwen3-omni-full" --variant $v --workloads floor \
            --requests "${J_REQUESTS:-48}" --thinker-kv-mib 12288 --talker-kv-mib 4096 \
            --out "$OUT/J-profile" > "$OUT/J-profile-$v.log" 2>&1
          log "J: profile $v rc=$?"
        done) &
       # VLLM_GC_DEBUG=1: every collection logged with its time (CPU, bench model: ~85 lines a pipeline, none over
       # 1.4 ms while serving: vLLM freezes the start-up heap), matched with the spikes by the JIT report
       VLLM_GC_DEBUG=1 CUDA_VISIBLE_DEVICES=0,1 $PY -m benchmarks.prefill \
         --stage-config stage_configs/qwen3_omni_30b_a3b_2xh100_dummy.yaml \
         --model "$HOME/.cache/omni-cache/models/qwen3-omni-full" --modalities floor \
         --requests "${J_REQUESTS:-48}" --repeats 2 --concurrency 1 --max-num-seqs 16 --alternation restart \
         --variants off,omni_cache --thinker-kv-mib 12288 --talker-kv-mib 4096 \
         --out "$OUT" --name J > "$OUT/J.log" 2>&1
       log "J: table rc=$?"; wait ;;
    J1) # one H200, issue 43 on the one-GPU full-size config. First the c = 1 table with all three variants, two
       # rounds rotated, VLLM_GC_DEBUG=1: floor (its requests share their first block, the chat template and the
       # question's opening: a 16-token hit for both caches, so the built-in isolates vLLM's own hit-prefill cost
       # from omni-cache's) and miss
       # (distinct from the first token: no hit at all). Then py-spy --stalls on omni-cache's thinker (floor).
       # Thirteenth session: the old order (profile first) ran out of device time 25 requests in.
       $PY -m omni_cache.cli make-model --size full >> "$OUT/models.log" 2>&1
       jcfg=stage_configs/qwen3_omni_30b_a3b_h200_dummy.yaml
       VLLM_GC_DEBUG=1 $PY -m benchmarks.prefill --stage-config $jcfg \
         --model "$HOME/.cache/omni-cache/models/qwen3-omni-full" --modalities floor,miss \
         --requests "${J_REQUESTS:-32}" --repeats 2 --concurrency 1 --alternation restart \
         --variants off,builtin,omni_cache --out "$OUT" --name J1 > "$OUT/J1.log" 2>&1
       log "J1: table rc=$?"
       VLLM_GC_DEBUG=1 $PY -m benchmarks.profile_stage --stage-config $jcfg --stalls \
         --model "$HOME/.cache/omni-cache/models/qwen3-omni-full" --variant omni_cache --workloads floor \
         --requests "${J_REQUESTS:-32}" --out "$OUT/J-profile" > "$OUT/J-profile-omni_cache.log" 2>&1
       log "J1: profile rc=$?" ;;
    J4) # fourteenth session, issue 43 in the deploy's graph coverage: no --max-num-seqs, so every stage keeps the
       # stage config's 64 and vLLM captures CUDA graphs up to 128 tokens (before: 16 -> 32 tokens, the profile 2 -> 4,
       # and every floor prefill ran without graphs). The shipped two-GPU layout: the thinker alone on its card starts
       # without waiting for the talker (on one card vLLM-Omni's phase locks serialize them: ~15 min cold in the
       # fourteenth session, ~8 expected here). 4 cards: cache off and omni-cache up at once on cards 0-1 and 2-3 (floor,
       # miss, text; c = 1 and 16; two rounds), then again with the pairs swapped (a card's own speed cancels);
       # 2 cards: the two one after another, restarted every round (cache off first: it pays the cold compiles).
       $PY -m omni_cache.cli make-model --size full >> "$OUT/models.log" 2>&1
       jcfg=stage_configs/qwen3_omni_30b_a3b_2xh100_dummy.yaml; jm="$HOME/.cache/omni-cache/models/qwen3-omni-full"
       jtable() {  # name alternation [variant devices]
         VLLM_GC_DEBUG=1 $PY -m benchmarks.prefill --stage-config $jcfg --model "$jm" --modalities "${J_WORKLOADS:-floor,miss,text}" \
           --requests "${J_REQUESTS:-24}" --repeats "${J_REPEATS:-2}" --concurrency "${J_CONC:-1,16}" --alternation "$2" \
           ${3:+--variant-devices "$3"} --variants "${J_VARIANTS:-off,omni_cache}" --thinker-kv-mib 12288 \
           --out "$OUT" --name "$1" > "$OUT/$1.log" 2>&1
         log "J4: table $1 ($2 ${3:-}) rc=$?"
       }
       if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then
         jtable J4a concurrent "off=0,1;omni_cache=2,3"
         jtable J4b concurrent "off=2,3;omni_cache=0,1"
       else
         CUDA_VISIBLE_DEVICES=0,1 jtable "${J_NAME:-J4a}" restart
       fi ;;
    O) $PY -m benchmarks.prefill --stage-config stage_configs/qwen3_omni_gpu1.yaml --size bench \
         --modalities floor,miss,text --requests "${O_REQUESTS:-24}" --repeats 3 --concurrency 1,16 \
         --alternation concurrent --variants off,builtin,omni_cache --out "$OUT" --name O > "$OUT/O.log" 2>&1
       log "O: table rc=$?"
       $PY -m omni_cache.cli run --stage-config stage_configs/qwen3_omni_gpu1.yaml --out "$OUT/O-run" --repeat 3 \
         > "$OUT/O-run.log" 2>&1
       log "O: main job rc=$?" ;;
    Z) # issue 47, item 3: the exactness fuzzer at size, its three engines (off, built-in, omni-cache) one card
       # each — full size on H200s, the profiling shape (Qwen3-Omni-30B-A3B's widths, 6 of 48 thinker layers)
       # on H100s — Z_GROUPS seeded groups (~12 requests each), streaming
       mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | tr -d ' ')
       if [ "${mib:-0}" -ge 100000 ]; then
         $PY -m omni_cache.cli make-model --size full >> "$OUT/models.log" 2>&1
         zcfg=stage_configs/qwen3_omni_30b_a3b_h200_dummy.yaml; zmodel=qwen3-omni-full
       else
         $PY -m omni_cache.cli make-model --size full --thinker-layers 6 >> "$OUT/models.log" 2>&1
         zcfg=stage_configs/qwen3_omni_30b_a3b_l6_h100_dummy.yaml; zmodel=qwen3-omni-full-l6
       fi
       log "Z: ${mib} MiB a card: $zcfg"
       $PY -m tests.lanes.fuzz_exactness --modes streaming --groups "${Z_GROUPS:-25}" --stage-config "$zcfg" --fail-on a,b \
         --model "$HOME/.cache/omni-cache/models/$zmodel" --engine-devices "${Z_DEVICES:-off=0;builtin=1;omni=2}" \
         --out "$OUT/Z" > "$OUT/Z.log" 2>&1 ;;
    R) $PY -m omni_cache.cli make-model --family gemma4 >> "$OUT/models.log" 2>&1
       $PY -m omni_cache.cli make-model --family gemma3n >> "$OUT/models.log" 2>&1
       $PY -m tests.lanes.gpu_check --groups yoco-eager,yoco-compiled,equality-compiled --jobs 3 --out "$OUT/R" \
         --commit "$COMMIT" > "$OUT/R.log" 2>&1 ;;
    L) $PY -m omni_cache.cli make-model --family gemma4 >> "$OUT/models.log" 2>&1
       $PY -m omni_cache.cli make-model --family gemma3n >> "$OUT/models.log" 2>&1
       # card: groups (the lane's measured seconds: ~700 s the longest slot on each card)
       for spec in "0:equality-compiled,yoco-eager" "1:yoco-compiled,streaming" "2:serve,equality-default,main-job" \
                   "3:stress,equality,unit"; do
         dev=${spec%%:*}
         CUDA_VISIBLE_DEVICES=$dev $PY -m tests.lanes.gpu_check --groups "${spec#*:}" --jobs 2 --out "$OUT/L$dev" \
           --commit "$COMMIT" > "$OUT/L$dev.log" 2>&1 &
       done
       wait
       $PY -m tests.lanes.gpu_check --groups "" --out "$OUT/L" --commit "$COMMIT" \
         --merge "$OUT"/L0/report.json "$OUT"/L1/report.json "$OUT"/L2/report.json "$OUT"/L3/report.json \
         > "$OUT/L.log" 2>&1 ;;
    N) $PY -m omni_cache.cli make-model --family gemma4 >> "$OUT/models.log" 2>&1
       $PY -m omni_cache.cli make-model --family gemma3n >> "$OUT/models.log" 2>&1
       $PY -m omni_cache.cli make-model --size full >> "$OUT/models.log" 2>&1
       CUDA_VISIBLE_DEVICES=3 PYTHONFAULTHANDLER=1 $PY -m benchmarks.prefill \
         --stage-config stage_configs/qwen3_omni_30b_a3b_h200_dummy.yaml \
         --model "$HOME/.cache/omni-cache/models/qwen3-omni-full" --modalities floor,text,chat \
         --requests 6 --repeats 1 --concurrency 1,16 --max-num-seqs 16 --alternation restart \
         --variants omni_cache,off --out "$OUT" --name N3 > "$OUT/N3.log" 2>&1 &
       bench=$!; lane=()
       for spec in "0:equality-compiled,yoco-eager,equality" "1:streaming,yoco-compiled,main-job" \
                   "2:serve,stress,equality-default,unit"; do
         dev=${spec%%:*}
         CUDA_VISIBLE_DEVICES=$dev $PY -m tests.lanes.gpu_check --groups "${spec#*:}" --jobs 3 --out "$OUT/L$dev" \
           --commit "$COMMIT" > "$OUT/L$dev.log" 2>&1 &
         lane+=($!)
       done
       wait "${lane[@]}"
       $PY -m tests.lanes.gpu_check --groups "" --out "$OUT/L" --commit "$COMMIT" \
         --merge "$OUT"/L0/report.json "$OUT"/L1/report.json "$OUT"/L2/report.json > "$OUT/L.log" 2>&1
       log "lane merged"; wait $bench ;;
    E) $PY -m omni_cache.cli make-model --family gemma4 >> "$OUT/models.log" 2>&1
       $PY -m omni_cache.cli make-model --family gemma3n >> "$OUT/models.log" 2>&1
       mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | tr -d ' ')
       lane=(); bench=""
       if [ "${mib:-0}" -ge 100000 ]; then
         $PY -m omni_cache.cli make-model --size full >> "$OUT/models.log" 2>&1
         CUDA_VISIBLE_DEVICES=3 $PY -m benchmarks.prefill \
           --stage-config stage_configs/qwen3_omni_30b_a3b_h200_dummy.yaml \
           --model "$HOME/.cache/omni-cache/models/qwen3-omni-full" --modalities floor,text \
           --requests 12 --repeats 1 --concurrency 1,16 --max-num-seqs 16 --alternation restart \
           --variants off,omni_cache,builtin --out "$OUT" --name E3 > "$OUT/E3.log" 2>&1 &
         bench=$!
         specs=("0:equality-compiled,yoco-eager,equality" "1:streaming,yoco-compiled,main-job"
                "2:serve,stress,equality-default,unit"); jobs=3; mcards=${MUTANT_CARDS:-"1:async_placeholders_unresolved"}
       else
         specs=("0:equality-compiled,yoco-eager" "1:yoco-compiled,streaming" "2:serve,equality-default,main-job"
                "3:stress,equality,unit"); jobs=2; mcards=${MUTANT_CARDS:-"2:async_placeholders_unresolved"}
       fi
       log "E: ${mib} MiB a card; lane ${specs[*]}; mutants $mcards; bench ${bench:-none}"
       (MUTANT_CARDS=$mcards run_M) &
       mut=$!
       parts=()
       for spec in "${specs[@]}"; do
         dev=${spec%%:*}
         CUDA_VISIBLE_DEVICES=$dev $PY -m tests.lanes.gpu_check --groups "${spec#*:}" --jobs $jobs --out "$OUT/L$dev" \
           --commit "$COMMIT" > "$OUT/L$dev.log" 2>&1 &
         lane+=($!); parts+=("$OUT/L$dev/report.json")
       done
       wait "${lane[@]}"
       $PY -m tests.lanes.gpu_check --groups "" --out "$OUT/L" --commit "$COMMIT" --merge "${parts[@]}" \
         > "$OUT/L.log" 2>&1
       log "lane merged"; wait $mut; log "mutants done"; if [ -n "$bench" ]; then wait $bench; fi ;;
    Y) $PY -m omni_cache.cli make-model --family gemma4 --size full >> "$OUT/models.log" 2>&1
       mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | tr -d ' ')
       ycfg=stage_configs/gemma4_e4b_yoco_h200_dummy.yaml
       [ "${mib:-0}" -lt 100000 ] && ycfg=stage_configs/gemma4_e4b_yoco_h100_dummy.yaml
       log "Y: ${mib} MiB a card: $ycfg"
       $PY -m benchmarks.prefill --stage-config "$ycfg" \
         --model "$HOME/.cache/omni-cache/models/gemma4-omni-full" --modalities text,miss --prefix-words 1080 \
         --variants off,fast,omni_cache,fast+omni_cache --requests 8 --repeats 1 --concurrency 1,8,32 \
         --max-num-seqs 32 --alternation concurrent \
         --variant-devices "off=0;fast=1;omni_cache=2;fast+omni_cache=3" --out "$OUT" --name Y > "$OUT/Y.log" 2>&1 ;;
    V) $PY -m omni_cache.cli make-model --size full >> "$OUT/models.log" 2>&1
       mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | tr -d ' ')
       vcfg=stage_configs/qwen3_omni_30b_a3b_h200_dummy_duplex.yaml; vcards=${V_CARD:-0}
       if [ "${mib:-0}" -lt 100000 ]; then  # H100s: the shipped two-GPU layout
         vcfg=stage_configs/qwen3_omni_30b_a3b_2xh100_dummy_duplex.yaml; vcards=${V_CARDS:-0,1}
       fi
       log "V: ${mib} MiB a card: $vcfg on cards $vcards"
       CUDA_VISIBLE_DEVICES=$vcards $PY -m benchmarks.realtime_bench \
         --stage-config "$vcfg" \
         --model "$HOME/.cache/omni-cache/models/qwen3-omni-full" --servers one-at-a-time \
         --sessions "${V_SESSIONS:-1,8}" --turns 8 --rounds 1 --out "$OUT/V" > "$OUT/V.log" 2>&1 ;;
    Q) run_Q ;;
    K) run_M & run_Q & wait ;;
    *) log "unknown step $step" ;;
  esac
  log "step $step rc=$?"
done
log "done"
