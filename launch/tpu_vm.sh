#!/usr/bin/env bash
# Cloud TPU VM launcher for sinkjax (single host and multi-host pods).
#
#   launch/tpu_vm.sh create  --name NAME --zone ZONE --type v5litepod-8 [--version RUNTIME] [--spot]
#   launch/tpu_vm.sh setup   --name NAME --zone ZONE [--repo URL] [--branch BRANCH]
#   launch/tpu_vm.sh run     --name NAME --zone ZONE -- --config configs/paper/d20_sink_aux.yaml [key=value ...]
#   launch/tpu_vm.sh ssh     --name NAME --zone ZONE
#   launch/tpu_vm.sh delete  --name NAME --zone ZONE
#
# Every subcommand accepts --dry-run: print the gcloud commands instead of running them.
# `setup` and `run` go to every worker (--worker=all): on a pod slice each host runs the same command,
# sinkjax.train calls jax.distributed.initialize() (auto-detected on TPU) and each host reads its own data shard.
# Runs survive preemption: rerunning `run` resumes from the latest checkpoint in run.dir (use a gs:// run.dir or a
# persistent disk so that it outlives the VM).
set -euo pipefail

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }

cmd=${1:-}
[[ -z "$cmd" || "$cmd" == "-h" || "$cmd" == "--help" ]] && { usage; exit 0; }
shift
name="" zone="" type="v5litepod-8" version="v2-alpha-tpuv5-lite" spot="" dry_run=0
repo="https://github.com/sinkjax/sinkjax.git" branch="main" train_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name=$2; shift 2 ;;
    --zone) zone=$2; shift 2 ;;
    --type) type=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    --spot) spot="--spot"; shift ;;
    --repo) repo=$2; shift 2 ;;
    --branch) branch=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; train_args=("$@"); break ;;
    *) echo "tpu_vm.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$name" ]] || { echo "tpu_vm.sh: --name is required (the TPU VM's name)" >&2; exit 2; }
[[ -n "$zone" ]] || { echo "tpu_vm.sh: --zone is required (e.g. us-central2-b)" >&2; exit 2; }

run() {
  if [[ $dry_run == 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}
remote() {   # remote COMMAND: the same command on every worker of the slice
  run gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --worker=all --command="$1"
}

case "$cmd" in
  create)
    run gcloud compute tpus tpu-vm create "$name" --zone="$zone" --accelerator-type="$type" \
      --version="$version" ${spot:+"$spot"} ;;
  setup)
    remote "set -e; if [ ! -d sinkjax ]; then git clone --branch $branch $repo sinkjax; fi; cd sinkjax && git pull --ff-only && pip install -U -e '.[tpu]'" ;;
  run)
    [[ ${#train_args[@]} -gt 0 ]] || { echo "tpu_vm.sh: run needs training arguments after --, e.g. -- --config configs/paper/d20_sink_aux.yaml" >&2; exit 2; }
    args=$(printf '%q ' "${train_args[@]}")
    remote "cd sinkjax && python -m sinkjax.train $args" ;;
  ssh)
    run gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" ;;
  delete)
    run gcloud compute tpus tpu-vm delete "$name" --zone="$zone" --quiet ;;
  *)
    echo "tpu_vm.sh: unknown subcommand '$cmd' (create|setup|run|ssh|delete)" >&2; exit 2 ;;
esac
