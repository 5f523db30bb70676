#!/usr/bin/env bash
# The GPU measurements of docs/PERF.md in one call of a lent GPU machine (a bare image with jax, flax, optax and
# orbax; grain, tensorboardX and their needs travel as wheels in .whl/, see the device notes in docs/PERF.md):
#   attention fwd+bwd against cuDNN at MHA, GQA and D 64 shapes; the trainer's step decomposed against bench.train
#   (the trainer gap); d20 sink + aux at T 2048 (MFU) with the roofline estimate of sinkjax.compile beside it.
# Each stage has its own time limit and log under $OUT; the tables are printed again at the end.
#   bash launch/gpu_measure.sh [stage ...]      stages: env attn_mha attn_gqa trainer_small trainer_d20 (default all)
set -u
OUT=${OUT:-/tmp/sinkjax-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda JAX_COMPILATION_CACHE_DIR=/tmp/sinkjax-jax-cache \
  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
D20="--config configs/paper/d20_sink_aux.yaml data.source=default data.val_source= data.tokenizer=bytes
     model.vocab_size=65536 mesh.data=1 mesh.fsdp=1"
run_stage() {   # name limit_s command...
  local name=$1 limit=$2; shift 2
  echo "== $name: $* (limit ${limit}s, $(date +%T))"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? ($(date +%T))"
}
stage() {
  case $1 in
    env) run_stage env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv;
           python3 -c "import jax, flax, optax, orbax.checkpoint as o, grain; print(jax.__version__, flax.__version__,
           optax.__version__, o.__version__, grain.__version__, jax.devices())"' ;;
    attn_mha) run_stage attn_mha 150 python3 -m sinkjax.bench.attention --batch 2 --heads 16 --head-dim 128 \
           --dtype bfloat16 --seq 1024 4096 8192 16384 --impls cudnn pallas_gpu --repeats 5 --max-gib 40 ;;
    attn_gqa) run_stage attn_gqa 100 bash -c 'python3 -m sinkjax.bench.attention --batch 1 --heads 32 --kv-heads 8 \
           --head-dim 128 --dtype bfloat16 --seq 4096 8192 --impls cudnn pallas_gpu --repeats 5 &&
           python3 -m sinkjax.bench.attention --batch 2 --heads 16 --head-dim 64 --dtype bfloat16 --seq 4096 8192 \
           --impls cudnn pallas_gpu --repeats 5' ;;
    trainer_small) run_stage trainer_small 110 python3 -m sinkjax.bench.trainer \
           --config configs/streaming_vanilla.yaml --steps 20 --rounds 3 ;;
    trainer_d20) run_stage trainer_d20 220 python3 -m sinkjax.bench.trainer $D20 train.batch_size=32 \
           --steps 4 --rounds 3 --rows "step, packed" "train loop" ;;
    *) echo "unknown stage $1"; return 2 ;;
  esac
}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env attn_mha attn_gqa trainer_small trainer_d20)
for s in "${stages[@]}"; do stage "$s"; done
for s in "${stages[@]}"; do
  echo; echo "#### $s"
  grep -E '^(#|\||roofline|no roofline|name|NVIDIA|[0-9. ]+ +[a-z_.]+ )|Error|error|Traceback' "$OUT/$s.log" | grep -v -i \
    "tpu_\|libtpu" | tail -n 40
done
