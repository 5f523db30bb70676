#!/usr/bin/env bash
# The GPU measurements of docs/PERF.md in one call of a GPU machine (a bare image with torch 2.11, jax, flax, optax
# and orbax, no network; grain, tensorboardX, tokamax and their needs travel as wheels in .whl/, nanochat's code in
# .peers/, both made here by launch/gpu_wheels.sh and git-ignored). Default stages, in this order:
#   install       the wheels of .whl/ into /tmp/site (pip --no-index --no-deps)
#   env           the GPU, the driver, the packages' versions
#   side_by_side  nanochat 9d4c9b7's GPT at depth 20 with its own settings (torch.compile, bf16 autocast, Muon +
#                 AdamW, 32 x 2,048 tokens) beside sinkjax's d20 sink + aux and vanilla at the same shape, each in its
#                 own process: tokens/s, MFU in nanochat's estimate_flops convention, the ratio; writes
#                 side_by_side.json (device, commit, rows) for docs/results/gpu_<device>/ (sinkjax.bench.side_by_side)
#   check         cudnn against the reference with the LSE gradient (GQA, packed documents, sink + aux) and that
#                 cuDNN's backward reads O only through D (sinkjax.bench.kernel_check)
#   ab_NAME       one A/B per lever of launch/gpu_levers.txt: the sink + aux row with the lever's overrides against
#                 the side by side's sink + aux row (sinkjax.bench.side_by_side --ab NAME)
# On request only: attn_mha attn_d64 attn_gqa attn_d20 (attention fwd+bwd micro-benchmarks of cudnn, mosaic_gpu and
# Triton against stock cuDNN), check_all (kernel_check of every GPU backend), trainer_d20 (the d20 step on cudnn with
# its roofline estimate and a profile), trainer_d20_mosaic, trainer_d20_triton, trainer_small.
#   bash launch/gpu_measure.sh [--check] [stage ...]
# Budget: the whole script, wheel install included, gets GPU_MEASURE_BUDGET seconds (default 480: a 600 s call of a
# cold machine with room for one rerun in a 15-minute window); each stage runs under its own limit, cut to what is left
# of the budget, and a stage with no time left fails unrun. Compiles are cached in $GPU_MEASURE_CACHE (default
# .gpu_cache/ in the checkout, git-ignored, so a rerun on the same machine reuses them): jax's persistent
# compilation cache, torch inductor's and Triton's.
# Every stage's log is $GPU_MEASURE_DIR/<stage>.log (default /tmp/sinkjax-gpu) and its summary <stage>.json (stage,
# status, exit, seconds, limit). Where $OUT is set (the folder a device call brings back), while a stage runs its log
# is teed live into $OUT/running.log, and when it ends $OUT/gpu_measure.tgz is rebuilt with every finished stage's
# log and summary (and the profile's trace, if any), $OUT/stages.jsonl gets its summary line and
# $OUT/side_by_side.json the side by side's result: a call cut off at its limit still brings back what finished.
# A stage fails when its command exits non-zero or runs past its limit, and an attention benchmark also when a GPU
# backend has no figure but for lack of memory; the script exits 1 when any stage failed, 0 when all passed.
# --check: the dry run on any machine (a CPU), so that a typo does not cost a GPU session: every default stage with
# small shapes (the side by side at depth 2, 2 x 64 tokens, nanochat eager: torch.compile would take minutes on a
# small CPU; kernel_check with the xla backend beside cudnn, which it reports skipped), the budget x 4.
# Environment: GPU_MEASURE_PYTHON (python3) runs sinkjax, SINKJAX_TORCH_PYTHON (the same) nanochat, SINKJAX_NANOCHAT_PEERS
# (.peers) holds nanochat-9d4c9b7, GPU_MEASURE_LEVERS (launch/gpu_levers.txt), SINKJAX_COMMIT the commit written into
# side_by_side.json where the tree is not a git checkout.
set -u
CHECK=0
if [ "${1:-}" = "--check" ]; then CHECK=1; shift; fi
DIR=${GPU_MEASURE_DIR:-/tmp/sinkjax-gpu}
CACHE=${GPU_MEASURE_CACHE:-$PWD/.gpu_cache}
BUDGET=${GPU_MEASURE_BUDGET:-480}
PY=${GPU_MEASURE_PYTHON:-python3}
LEVERS=${GPU_MEASURE_LEVERS:-launch/gpu_levers.txt}
[ "$CHECK" = 1 ] && BUDGET=$((BUDGET * 4))     # a small CPU compiles slowly
START=$SECONDS
mkdir -p "$DIR" "$CACHE"
rm -f "$DIR"/*.log "$DIR"/*.json "$DIR/stages.jsonl"
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$CACHE/jax} \
  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 \
  TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$CACHE/inductor} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$CACHE/triton}
export SINKJAX_TORCH_PYTHON=${SINKJAX_TORCH_PYTHON:-$PY}
if [ "$CHECK" = 1 ]; then export JAX_PLATFORMS=cpu; else export JAX_PLATFORMS=cuda; fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; rm -f "$OUT/running.log" "$OUT/stages.jsonl"; fi

FAILED=()
bundle() {   # every finished stage's log and summary (and the d20 profile's trace) into $OUT, replacing the last bundle
  [ -n "${OUT:-}" ] || return 0
  (cd "$DIR" && find . -maxdepth 1 \( -name '*.log' -o -name '*.json' \) && find profile_d20 \
     \( -name '*.trace.json.gz' -o -name step.hlo.txt \) 2>/dev/null) > "$DIR/bundle.list"
  tar czf "$OUT/gpu_measure.tgz.part" -C "$DIR" -T "$DIR/bundle.list" && mv -f "$OUT/gpu_measure.tgz.part" "$OUT/gpu_measure.tgz"
  cp -f "$DIR/stages.jsonl" "$OUT/stages.jsonl"
  if [ -f "$DIR/side_by_side.json" ]; then cp -f "$DIR/side_by_side.json" "$OUT/side_by_side.json"; fi
}
backend_failed() {   # log -> the attention table's lines of a GPU backend with no figure (not for lack of memory)
  grep -E '^ *[0-9]+ +(jax\.nn\.cudnn|cudnn|mosaic_gpu|pallas_gpu) +- ' "$1" \
    | grep -v -E '\((out of device memory|needs [0-9.]+ GiB)\)$'
}
run_stage() {   # name limit_s command...
  local name=$1 limit=$2 rc status left t0 live why=""; shift 2
  [ "$CHECK" = 1 ] && limit=$((limit * 4))
  left=$((BUDGET - (SECONDS - START)))
  [ "$left" -lt "$limit" ] && limit=$left
  t0=$SECONDS live=${OUT:+$OUT/running.log}
  if [ "$limit" -lt 5 ]; then
    echo "== $name: not run, ${left}s of the ${BUDGET}s budget left" | tee "$DIR/$name.log"
    rc=124 status=failed why="not run: no time left in the budget"
  else
    echo "== $name: $* (limit ${limit}s, $(date +%T))"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "${live:-/dev/null}" > "$DIR/$name.log"
    rc=${PIPESTATUS[0]}
    status=passed
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then status=failed why="ran past its ${limit}s"
    elif [ "$rc" != 0 ]; then status=failed why="exit $rc"
    elif [ "$CHECK" = 0 ] && [[ $name == attn_* ]] && backend_failed "$DIR/$name.log" > "$DIR/$name.backends"; then
      status=failed why="a backend has no figure: $(head -n 1 "$DIR/$name.backends" | tr -s ' ')"
    fi
    echo "== $name: $status${why:+ ($why)} after $((SECONDS - t0))s ($(date +%T))"
  fi
  [ "$status" = passed ] || FAILED+=("$name ($why)")
  printf '{"stage": "%s", "status": "%s", "exit": %d, "seconds": %d, "limit": %d, "why": "%s"}\n' \
    "$name" "$status" "$rc" "$((SECONDS - t0))" "$limit" "${why//\"/\'}" | tee "$DIR/$name.stage.json" >> "$DIR/stages.jsonl"
  bundle
}

SBS="$PY -m sinkjax.bench.side_by_side"
SMALL="--config configs/tiny.yaml train.batch_size=4 data.seq_len=128 model.max_seq_len=128 mesh.data=1 mesh.fsdp=1"
D20="--config configs/paper/d20_sink_aux.yaml data.source=default data.val_source= data.tokenizer=bytes
     model.vocab_size=65536 mesh.data=1 mesh.fsdp=1"
ATTN="$PY -m sinkjax.bench.attention --dtype bfloat16 --impls jax.nn.cudnn cudnn mosaic_gpu pallas_gpu --repeats 5"
TINY="--depth 2 --batch 2 --seq 64 --vocab 512"       # --check: nanochat's and sinkjax's model at depth 2 (128 wide)
if [ "$CHECK" = 1 ]; then
  ATTN="$PY -m sinkjax.bench.attention --dtype float32 --impls xla jax.nn.cudnn cudnn mosaic_gpu pallas_gpu --repeats 1"
  SBS_ARGS="$TINY --steps 1 --rounds 1 --nanochat-warmup 1 --nanochat-steps 2 --no-compile model.attn_impl=xla"
else
  SBS_ARGS=""
fi
levers() { grep -v -E '^[[:space:]]*(#|$)' "$LEVERS" | cut -d: -f1 | tr -d ' '; }

# shellcheck disable=SC2086  # $ATTN, $D20, $SMALL, $SBS, $SBS_ARGS are word lists
stage() {
  local c=$CHECK
  case $1 in
    install) if [ -d .whl ] && [ "$c" = 0 ]; then
               run_stage install 30 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                 --target /tmp/site .whl/*.whl
               export PYTHONPATH=/tmp/site:$PYTHONPATH
             else run_stage install 5 echo "install: nothing to install (no .whl/, or --check)"; fi ;;
    env) if [ "$c" = 1 ]; then run_stage env 15 "$PY" -c "import jax, flax, optax; print(jax.__version__, jax.devices())"
         else
           # shellcheck disable=SC2016  # the inner script's variables expand in the inner bash
           run_stage env 15 bash -ec 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv;
           "$0" -c "import jax, flax, optax, orbax.checkpoint as o, grain; print(jax.__version__, flax.__version__,
           optax.__version__, o.__version__, grain.__version__, jax.devices())";
           "$SINKJAX_TORCH_PYTHON" -c "import torch; print(\"torch\", torch.__version__, torch.cuda.get_device_name())"' "$PY"
         fi ;;
    side_by_side) run_stage side_by_side 250 $SBS $SBS_ARGS --timeout 160 --out "$DIR/side_by_side.json" ;;
    check) if [ "$c" = 1 ]; then run_stage check 40 "$PY" -m sinkjax.bench.kernel_check --seq 64 --head-dim 32 \
             --impls xla cudnn
           else run_stage check 45 "$PY" -m sinkjax.bench.kernel_check --seq 512 --impls cudnn; fi ;;
    check_all) if [ "$c" = 1 ]; then run_stage check_all 100 "$PY" -m sinkjax.bench.kernel_check --seq 64 \
             --head-dim 32 --impls xla cudnn mosaic_gpu pallas_gpu
           else run_stage check_all 120 "$PY" -m sinkjax.bench.kernel_check --seq 512 --impls cudnn mosaic_gpu pallas_gpu; fi ;;
    ab_*) run_stage "$1" 70 $SBS $SBS_ARGS --ab "${1#ab_}" --levers "$LEVERS" --baseline "$DIR/side_by_side.json" \
            --timeout 65 ;;
    attn_mha) if [ "$c" = 1 ]; then run_stage attn_mha 50 $ATTN --batch 1 --heads 2 --head-dim 32 --seq 128 256
           else run_stage attn_mha 45 $ATTN --batch 2 --heads 16 --head-dim 128 --seq 4096 8192 16384 --max-gib 40; fi ;;
    attn_d64) if [ "$c" = 1 ]; then run_stage attn_d64 25 $ATTN --batch 1 --heads 2 --head-dim 16 --seq 128
           else run_stage attn_d64 40 $ATTN --batch 2 --heads 32 --head-dim 64 --seq 4096 8192 16384 --max-gib 40; fi ;;
    attn_gqa) if [ "$c" = 1 ]; then run_stage attn_gqa 25 $ATTN --batch 1 --heads 4 --kv-heads 1 --head-dim 32 --seq 128
           else run_stage attn_gqa 30 $ATTN --batch 1 --heads 32 --kv-heads 8 --head-dim 128 --seq 4096 8192; fi ;;
    attn_d20) if [ "$c" = 1 ]; then run_stage attn_d20 25 $ATTN --batch 2 --heads 2 --head-dim 32 --seq 128
           else run_stage attn_d20 25 $ATTN --batch 32 --heads 10 --head-dim 128 --seq 2048; fi ;;
    trainer_d20) if [ "$c" = 1 ]; then run_stage trainer_d20 55 "$PY" -m sinkjax.bench.trainer $SMALL \
             --steps 2 --rounds 1 --no-estimate --rows "step, packed" --profile "$DIR/profile_d20"
           else run_stage trainer_d20 110 "$PY" -m sinkjax.bench.trainer $D20 train.batch_size=32 \
             model.attn_impl=cudnn --steps 4 --rounds 3 --rows "step, packed" "train loop" --profile "$DIR/profile_d20"; fi ;;
    trainer_d20_mosaic|trainer_d20_triton)
           impl=mosaic_gpu; [ "$1" = trainer_d20_triton ] && impl=pallas_gpu
           if [ "$c" = 1 ]; then run_stage "$1" 55 "$PY" -m sinkjax.bench.trainer $SMALL model.attn_impl=xla \
             --steps 2 --rounds 1 --no-estimate --rows "step, packed"
           else run_stage "$1" 90 "$PY" -m sinkjax.bench.trainer $D20 train.batch_size=32 \
             model.attn_impl=$impl --steps 3 --rounds 2 --rows "step, packed"; fi ;;
    trainer_small) run_stage trainer_small 110 "$PY" -m sinkjax.bench.trainer \
           --config configs/streaming_vanilla.yaml --steps 20 --rounds 3 ;;
    *) echo "gpu_measure: unknown stage $1 (see the list at the top of launch/gpu_measure.sh)"
       FAILED+=("$1 (unknown stage)") ;;
  esac
}
stages=("$@")
if [ ${#stages[@]} -eq 0 ]; then
  mapfile -t ab < <(levers | sed 's/^/ab_/')
  stages=(install env side_by_side check "${ab[@]}")
fi
echo "gpu_measure: stages ${stages[*]}; budget ${BUDGET}s; logs in $DIR${OUT:+, brought back in $OUT}"
for s in "${stages[@]}"; do stage "$s"; done
for s in "${stages[@]}"; do
  [ -f "$DIR/$s.log" ] || continue
  echo; echo "#### $s"
  grep -E '^(#|\||==|roofline|no roofline|profile of|name|NVIDIA|torch|[a-z_]+ reads O|all passed|[0-9]+ FAILED|side_by_side|ab |[0-9. ]+ +[a-z_.]+ )|Error|error|Traceback' \
    "$DIR/$s.log" | grep -v -i "tpu_\|libtpu\|^   |" | tail -n 40
done
echo
echo "gpu_measure: $((SECONDS - START))s of the ${BUDGET}s budget"
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu_measure: ${#FAILED[@]} stage(s) failed: ${FAILED[*]}"
  exit 1
fi
echo "gpu_measure: every stage passed"
