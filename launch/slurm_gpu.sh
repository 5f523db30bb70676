#!/usr/bin/env bash
# SLURM launcher for sinkjax on NVIDIA GPU nodes: one process per GPU, jax.distributed over all of them.
#
#   launch/slurm_gpu.sh [--nodes N] [--gpus-per-node G] [--partition P] [--time HH:MM:SS] [--account A]
#                       [--venv PATH] [--dry-run] -- --config configs/paper/d20_sink_aux.yaml [key=value ...]
#
# Writes a batch script and submits it with sbatch (--dry-run prints the script and the sbatch command instead).
# Each task runs `python -m sinkjax.train ...`; sinkjax.train calls jax.distributed.initialize(), which reads the
# SLURM environment (coordinator = first node, process id = SLURM_PROCID). Only process 0 writes logs; checkpoints
# go to run.dir, which must be on a shared filesystem. Requeued or restarted jobs resume from the latest checkpoint.
set -euo pipefail

usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; }

nodes=1 gpus=8 partition="" time_limit="24:00:00" account="" venv="" dry_run=0 job="sinkjax" train_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --nodes) nodes=$2; shift 2 ;;
    --gpus-per-node) gpus=$2; shift 2 ;;
    --partition) partition=$2; shift 2 ;;
    --time) time_limit=$2; shift 2 ;;
    --account) account=$2; shift 2 ;;
    --venv) venv=$2; shift 2 ;;
    --job-name) job=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; train_args=("$@"); break ;;
    *) echo "slurm_gpu.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ ${#train_args[@]} -gt 0 ]] || { echo "slurm_gpu.sh: give training arguments after --, e.g. -- --config configs/paper/d20_sink_aux.yaml" >&2; exit 2; }
[[ "$nodes" =~ ^[1-9][0-9]*$ && "$gpus" =~ ^[1-9][0-9]*$ ]] || { echo "slurm_gpu.sh: --nodes and --gpus-per-node must be positive integers" >&2; exit 2; }

args=$(printf '%q ' "${train_args[@]}")
script=$(cat <<SCRIPT
#!/usr/bin/env bash
#SBATCH --job-name=$job
#SBATCH --nodes=$nodes
#SBATCH --ntasks-per-node=$gpus
#SBATCH --gpus-per-node=$gpus
#SBATCH --time=$time_limit
#SBATCH --signal=TERM@120
#SBATCH --requeue
${partition:+#SBATCH --partition=$partition}
${account:+#SBATCH --account=$account}
set -euo pipefail
${venv:+source $venv/bin/activate}
export SINKJAX_DISTRIBUTED=1
# one GPU per process; XLA should not grab all memory up front on shared nodes
export XLA_PYTHON_CLIENT_MEM_FRACTION=\${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
srun --kill-on-bad-exit=1 python -m sinkjax.train $args
SCRIPT
)
if [[ $dry_run == 1 ]]; then
  echo "$script"
  echo "# would run: sbatch <script above>"
else
  tmp=$(mktemp "${TMPDIR:-/tmp}/sinkjax_XXXX.sbatch")
  echo "$script" > "$tmp"
  sbatch "$tmp"
fi
