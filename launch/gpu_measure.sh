#!/usr/bin/env bash
# The GPU measurements of docs/PERF.md in one call of a lent GPU machine (a bare image with jax, flax, optax and
# orbax; grain, tensorboardX and their needs travel as wheels in .whl/, see the device notes in docs/PERF.md):
#   check      every GPU backend (cudnn, mosaic_gpu, pallas_gpu) against the reference with the LSE gradient (out, lse,
#              dq, dk, dv; GQA, packed documents, sink + aux) and that cuDNN's and tokamax's Mosaic-GPU backward read O
#              only through D (sinkjax.bench.kernel_check)
#   attn_mha   fwd+bwd time of sinkjax's cudnn, mosaic_gpu and Triton backends against stock cuDNN (jax.nn.cudnn, no
#              LSE gradient) at B 2 H 16 D 128, T 4k / 8k / 16k; attn_d64 the same at D 64 (H 32); attn_gqa at GQA
#              32:8; attn_d20 at d20's attention shape (B 32, T 2048, H 10, D 128)
#   trainer_d20  the d20 sink + aux step (configs/paper/d20_sink_aux.yaml, 32 x 2048 tokens) on cudnn with its MFU
#              and roofline estimate, then a jax.profiler trace of it summarised by kernel category
#              (sinkjax.bench.profile_summary); trainer_d20_mosaic and trainer_d20_triton: the same step on
#              mosaic_gpu and pallas_gpu (no profile)
#   trainer_small  the small trainer gap rows of earlier sessions (not in the default set)
# Each stage has its own time limit (the default set's sum is 565 s, so that one 600 s call of the device tool holds the
# whole script, the wheels' install included; on a cold H200 on 2026-11-29 the stages took ~370 s, docs/PERF.md) and
# log under $GPU_MEASURE_DIR (default /tmp/sinkjax-gpu); the tables are printed again at the end. Where $OUT is set (the
# device tool's folder, which brings back at most 8 files), the logs, the d20 profile's trace and the step's HLO go
# there as one bundle, $OUT/gpu_measure.tgz. The script exits 1 when a stage failed (its command exited non-zero or
# ran out of time), 0 when every stage passed.
#   bash launch/gpu_measure.sh [--check] [stage ...]   stages: env check attn_mha attn_d64 attn_gqa attn_d20
#                                          trainer_d20 trainer_d20_mosaic trainer_d20_triton (default) and trainer_small
# --check: the dry run on any machine (a CPU): every stage's program with small shapes, the xla backend beside the
# three GPU backends (kernel_check's cuDNN row says it was skipped; mosaic_gpu runs its CPU form where tokamax is
# installed, says skipped where not; Triton runs interpreted; the attention tables say why a backend has no
# figure), so that a typo does not cost a GPU session.
set -u
CHECK=0
if [ "${1:-}" = "--check" ]; then CHECK=1; shift; fi
DIR=${GPU_MEASURE_DIR:-/tmp/sinkjax-gpu}
mkdir -p "$DIR"
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/sinkjax-jax-cache} \
  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
if [ "$CHECK" = 1 ]; then export JAX_PLATFORMS=cpu; else export JAX_PLATFORMS=cuda; fi
if [ -d .whl ] && [ "$CHECK" = 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
D20="--config configs/paper/d20_sink_aux.yaml data.source=default data.val_source= data.tokenizer=bytes
     model.vocab_size=65536 mesh.data=1 mesh.fsdp=1"
SMALL="--config configs/tiny.yaml train.batch_size=4 data.seq_len=128 model.max_seq_len=128 mesh.data=1 mesh.fsdp=1"
ATTN="python3 -m sinkjax.bench.attention --dtype bfloat16 --impls jax.nn.cudnn cudnn mosaic_gpu pallas_gpu --repeats 5"
if [ "$CHECK" = 1 ]; then
  ATTN="python3 -m sinkjax.bench.attention --dtype float32 --impls xla jax.nn.cudnn cudnn mosaic_gpu pallas_gpu --repeats 1"
fi
FAILED=()
run_stage() {   # name limit_s command...
  local name=$1 limit=$2 rc; shift 2
  [ "$CHECK" = 1 ] && limit=$((limit * 3))    # the dry run on a CPU: room for a loaded machine's compiles
  echo "== $name: $* (limit ${limit}s, $(date +%T))"
  timeout "$limit" "$@" >"$DIR/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc ($(date +%T))"
  [ "$rc" = 0 ] || FAILED+=("$name (exit $rc)")
}
# shellcheck disable=SC2086  # $ATTN, $D20, $SMALL are word lists
stage() {
  local c=$CHECK
  case $1 in
    env) run_stage env 15 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv;
           python3 -c "import jax, flax, optax, orbax.checkpoint as o, grain; print(jax.__version__, flax.__version__,
           optax.__version__, o.__version__, grain.__version__, jax.devices())"' ;;
    check) if [ "$c" = 1 ]; then run_stage check 100 python3 -m sinkjax.bench.kernel_check --seq 64 --head-dim 32 \
             --impls xla cudnn mosaic_gpu pallas_gpu
           else run_stage check 120 python3 -m sinkjax.bench.kernel_check --seq 512 --impls cudnn mosaic_gpu pallas_gpu; fi ;;
    attn_mha) if [ "$c" = 1 ]; then run_stage attn_mha 200 $ATTN --batch 1 --heads 2 --head-dim 32 --seq 128 256
           else run_stage attn_mha 45 $ATTN --batch 2 --heads 16 --head-dim 128 --seq 4096 8192 16384 --max-gib 40; fi ;;
    attn_d64) if [ "$c" = 1 ]; then run_stage attn_d64 100 $ATTN --batch 1 --heads 2 --head-dim 16 --seq 128
           else run_stage attn_d64 40 $ATTN --batch 2 --heads 32 --head-dim 64 --seq 4096 8192 16384 --max-gib 40; fi ;;
    attn_gqa) if [ "$c" = 1 ]; then run_stage attn_gqa 100 $ATTN --batch 1 --heads 4 --kv-heads 1 --head-dim 32 --seq 128
           else run_stage attn_gqa 30 $ATTN --batch 1 --heads 32 --kv-heads 8 --head-dim 128 --seq 4096 8192; fi ;;
    attn_d20) if [ "$c" = 1 ]; then run_stage attn_d20 100 $ATTN --batch 2 --heads 2 --head-dim 32 --seq 128
           else run_stage attn_d20 25 $ATTN --batch 32 --heads 10 --head-dim 128 --seq 2048; fi ;;
    trainer_d20) if [ "$c" = 1 ]; then run_stage trainer_d20 220 python3 -m sinkjax.bench.trainer $SMALL \
             --steps 2 --rounds 1 --no-estimate --rows "step, packed" --profile "$DIR/profile_d20"
           else run_stage trainer_d20 110 python3 -m sinkjax.bench.trainer $D20 train.batch_size=32 \
             model.attn_impl=cudnn --steps 4 --rounds 3 --rows "step, packed" "train loop" --profile "$DIR/profile_d20"; fi ;;
    trainer_d20_mosaic|trainer_d20_triton)
           impl=mosaic_gpu; [ "$1" = trainer_d20_triton ] && impl=pallas_gpu
           if [ "$c" = 1 ]; then run_stage "$1" 220 python3 -m sinkjax.bench.trainer $SMALL model.attn_impl=xla \
             --steps 2 --rounds 1 --no-estimate --rows "step, packed"
           else run_stage "$1" 90 python3 -m sinkjax.bench.trainer $D20 train.batch_size=32 \
             model.attn_impl=$impl --steps 3 --rounds 2 --rows "step, packed"; fi ;;
    trainer_small) run_stage trainer_small 110 python3 -m sinkjax.bench.trainer \
           --config configs/streaming_vanilla.yaml --steps 20 --rounds 3 ;;
    *) echo "unknown stage $1"; FAILED+=("$1 (unknown stage)"); return 2 ;;
  esac
}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env check attn_mha attn_d64 attn_gqa attn_d20 trainer_d20 trainer_d20_mosaic
                                   trainer_d20_triton)
[ "$CHECK" = 1 ] && [ "$*" = "" ] && stages=(check attn_mha attn_d64 attn_gqa attn_d20 trainer_d20 trainer_d20_mosaic)
for s in "${stages[@]}"; do stage "$s"; done
for s in "${stages[@]}"; do
  echo; echo "#### $s"
  grep -E '^(#|\||roofline|no roofline|profile of|name|NVIDIA|[a-z_]+ reads O|all passed|[0-9]+ FAILED|[0-9. ]+ +[a-z_.]+ )|Error|error|Traceback' \
    "$DIR/$s.log" | grep -v -i "tpu_\|libtpu" | tail -n 40
done
echo
if [ -n "${OUT:-}" ]; then    # one bundle for the device tool: the logs, the profile's trace and the step's HLO
  mkdir -p "$OUT"
  (cd "$DIR" && find . -maxdepth 1 -name '*.log' && find profile_d20 \( -name '*.trace.json.gz' -o -name step.hlo.txt \) \
     2>/dev/null) > "$DIR/bundle.list"
  tar czf "$OUT/gpu_measure.tgz" -C "$DIR" -T "$DIR/bundle.list" && echo "gpu_measure: logs in $OUT/gpu_measure.tgz"
fi
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu_measure: ${#FAILED[@]} stage(s) failed: ${FAILED[*]}"
  exit 1
fi
echo "gpu_measure: every stage passed"
