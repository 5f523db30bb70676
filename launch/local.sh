#!/usr/bin/env bash
# Several sinkjax processes on this machine, joined by jax.distributed on 127.0.0.1: a pod or cluster in miniature.
#
#   launch/local.sh --processes N [--devices-per-process D] [--port P] [--module M] [--platform cpu|cuda]
#                   [--grace S] [--dry-run] -- --config configs/tiny.yaml [key=value ...]
#
# Starts N processes of `python -m M ARGS` (M = sinkjax.train by default; $PYTHON picks the interpreter) with
# SINKJAX_COORDINATOR=127.0.0.1:P (a free port by default), SINKJAX_NUM_PROCESSES=N and SINKJAX_PROCESS_ID=i, which
# sinkjax.distributed reads. Each process sees D devices: D CPU devices (XLA_FLAGS
# --xla_force_host_platform_device_count=D, JAX_PLATFORMS=cpu) or D GPUs (its slice of CUDA_VISIBLE_DEVICES; the
# default platform is cuda when nvidia-smi lists GPUs, D then defaults to GPUs / N). Output lines are prefixed [pI];
# each process' whole output, library chatter included (shown: everything but gloo's connection reports), is kept in
# $TMPDIR/sinkjax_local.*/pI.log, named in the first line.
# SIGTERM / SIGINT / SIGHUP to the launcher send SIGTERM to every process (they agree on a step, save it, stop).
# Once a process has ended (failed, killed or done), the others get S seconds (default 60) to end too, then they are
# killed; the launcher exits with the first failing status (0 when all succeed). --dry-run prints the commands.
set -euo pipefail

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "local.sh: $*" >&2; exit 2; }
exec 3>&2        # the launcher's own messages; bash's job reports ("Killed ...") are silenced below
say() { echo "local.sh: $*" >&3; }

procs="" devices="" port="" module="sinkjax.train" platform="" grace=60 dry_run=0 args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --processes|--devices-per-process|--port|--module|--platform|--grace)
      [[ $# -ge 2 ]] || die "$1 needs a value (see --help)"
      case "$1" in
        --processes) procs=$2 ;; --devices-per-process) devices=$2 ;; --port) port=$2 ;;
        --module) module=$2 ;; --platform) platform=$2 ;; --grace) grace=$2 ;;
      esac
      shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; args=("$@"); break ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
python=${PYTHON:-python}
positive() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }
positive "$procs" || die "--processes must be a positive integer, e.g. --processes 2"
[[ ${#args[@]} -gt 0 ]] || die "give the program's arguments after --, e.g. -- --config configs/tiny.yaml"
[[ -z "$port" ]] || { positive "$port" && [[ $port -lt 65536 ]]; } || die "--port must be in 1..65535, got '$port'"
positive "$grace" || die "--grace must be a positive number of seconds, got '$grace'"
[[ "$module" =~ ^[A-Za-z_][A-Za-z0-9_.]*$ ]] || die "--module must be a Python module name, got '$module'"

gpu_list() {   # the GPUs this launcher may hand out, comma-separated
  if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then echo "$CUDA_VISIBLE_DEVICES"; return; fi
  command -v nvidia-smi > /dev/null 2>&1 || return 0
  nvidia-smi -L 2> /dev/null | awk -F'[ :]' '/^GPU /{printf "%s%s", sep, $2; sep=","}'
}
if [[ -z "$platform" ]]; then
  if [[ -n "$(gpu_list)" ]]; then platform=cuda; else platform=cpu; fi
fi
case "$platform" in
  cpu) devices=${devices:-1} ;;
  cuda)
    IFS=, read -r -a gpus <<< "$(gpu_list)"
    [[ ${#gpus[@]} -gt 0 ]] || die "--platform cuda: no GPU visible (nvidia-smi -L or CUDA_VISIBLE_DEVICES)"
    devices=${devices:-$(( ${#gpus[@]} / procs ))}
    [[ $(( procs * devices )) -le ${#gpus[@]} && $devices -ge 1 ]] \
      || die "$procs processes x ${devices} GPUs each need more than the ${#gpus[@]} GPUs visible" ;;
  *) die "--platform must be cpu or cuda, got '$platform'" ;;
esac
positive "$devices" || die "--devices-per-process must be a positive integer, got '$devices'"
if [[ -z "$port" ]]; then
  if [[ $dry_run == 1 ]]; then port=PORT
  else port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])') \
    || die "could not find a free port with $python (set --port or PYTHON)"
  fi
fi

env_of() {   # env_of I: the environment assignments of process I, one per line
  echo "SINKJAX_COORDINATOR=127.0.0.1:$port"
  echo "SINKJAX_NUM_PROCESSES=$procs"
  echo "SINKJAX_PROCESS_ID=$1"
  echo "SINKJAX_LAUNCHER_PID=$$"
  if [[ $platform == cpu ]]; then
    local flags
    flags=$(sed -E 's/--xla_force_host_platform_device_count=[^ ]*//g; s/^ +//; s/ +$//' <<< "${XLA_FLAGS:-}")
    echo "XLA_FLAGS=${flags:+$flags }--xla_force_host_platform_device_count=$devices"
    echo "JAX_PLATFORMS=cpu"
  else
    local slice=("${gpus[@]:$(( $1 * devices )):$devices}")
    echo "CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${slice[*]}")"
  fi
}

command_of() {   # command_of I: the full command of process I, as an array in $cmd
  local env_lines
  mapfile -t env_lines < <(env_of "$1")
  cmd=(env "${env_lines[@]}" "$python" -m "$module" "${args[@]}")
}

if [[ $dry_run == 1 ]]; then
  for (( i = 0; i < procs; i++ )); do
    command_of "$i"
    line=$(printf '%q ' "${cmd[@]}")
    echo "[p$i] ${line% }"
  done
  exit 0
fi

# Library chatter that says nothing to a user (gloo's connection reports, "[Gloo] Rank 1 is connected to 1 peer ranks.
# Expected number of connected peer ranks is : 1", one per rank and collective group); it goes to the process's log
# file only. gloo writes a report in pieces from several threads, so the pieces arrive cut and mixed: a line that holds
# nothing but the report's words and numbers (a lone "1") is noise too when it follows noise.
noise='\[Gloo\]|peer ranks'
shopt -s extglob
gloo_piece() {   # gloo_piece LINE: true where LINE is made of the report's words, numbers and spaces only
  [[ -z "${1//@(Rank|is|connected|to|peer|ranks|Expected|number|of|[0-9]|[.:]|[[:space:]])/}" ]]
}
prefix() {   # prefix TAG LOG: every line of stdin into LOG; to stdout behind TAG unless it is noise (a progress bar's
             # \r updates: the last one)
  trap '' INT TERM HUP
  local line after_noise=0
  while IFS= read -r line || [[ -n "$line" ]]; do
    printf '%s\n' "$line" >> "$2"
    if [[ "$line" =~ $noise ]] || { [[ $after_noise == 1 ]] && gloo_piece "$line"; }; then
      after_noise=1
    else
      after_noise=0
      printf '%s %s\n' "$1" "${line##*$'\r'}"
    fi
  done
}

fifo_dir=$(mktemp -d "${TMPDIR:-/tmp}/sinkjax_local.XXXXXX")   # the pipes, and each process' whole output (pI.log)
pids=() printers=() alive=()
signal_all() {   # signal_all SIG [group]: SIG to every running process (with "group": to its whole process group)
  local i
  for i in "${!pids[@]}"; do
    if [[ ${alive[$i]} == 1 ]]; then
      if [[ ${2:-} == group ]] && kill "-$1" -- "-${pids[$i]}" 2> /dev/null; then continue; fi
      kill "-$1" "${pids[$i]}" 2> /dev/null || true
    fi
  done
}
trap 'signal_all KILL group; rm -f "$fifo_dir"/out* "$fifo_dir"/err*' EXIT

status=0 deadline="" killed=0
# shellcheck disable=SC2329  # called by the traps below
forward() {   # forward SIG: SIGTERM to every running process, which then has --grace seconds to save and end
  say "got SIG$1: passing SIGTERM on to the processes (they save and stop)"
  if [[ $status == 0 ]]; then status=$(( 128 + $(kill -l "$1") )); fi
  signal_all TERM
  deadline=${deadline:-$(( SECONDS + grace ))}
}
trap 'forward TERM' TERM
trap 'forward INT' INT
trap 'forward HUP' HUP

# Each process gets its own process group (and session), so that a terminal's Ctrl-C reaches it once, through the
# launcher, and killing the group also ends the processes it started (data loader workers).
own_group=()
if command -v setsid > /dev/null 2>&1; then own_group=(setsid); else set -m; fi
for (( i = 0; i < procs; i++ )); do
  [[ -z "$deadline" ]] || break      # a signal came while starting: start no more
  mkfifo "$fifo_dir/out$i" "$fifo_dir/err$i"
  prefix "[p$i]" "$fifo_dir/p$i.log" < "$fifo_dir/out$i" &
  printers+=($!)
  prefix "[p$i]" "$fifo_dir/p$i.log" < "$fifo_dir/err$i" >&2 &
  printers+=($!)
  command_of "$i"
  "${own_group[@]}" "${cmd[@]}" > "$fifo_dir/out$i" 2> "$fifo_dir/err$i" &
  pids+=($!)
  alive+=(1)
done
set +m
running=${#pids[@]}
say "started ${#pids[@]} processes of $module ($devices $platform device(s) each, coordinator 127.0.0.1:$port)," \
  "pids ${pids[*]}, whole output in $fifo_dir/p*.log"

reap() {   # notes the processes that ended; the first one to end starts the --grace countdown for the others
  local i rc
  for i in "${!pids[@]}"; do
    if [[ ${alive[$i]} == 0 ]] || kill -0 "${pids[$i]}" 2> /dev/null; then continue; fi
    alive[i]=0
    running=$(( running - 1 ))
    rc=0
    wait "${pids[$i]}" || rc=$?
    if [[ $rc != 0 && $status == 0 ]]; then
      status=$rc
      say "process $i exited with status $rc (its whole output: $fifo_dir/p$i.log); the others get ${grace}s to" \
        "end before they are killed"
    fi
    deadline=${deadline:-$(( SECONDS + grace ))}   # processes of one job end together (jax.distributed's shutdown)
  done
}

while [[ $running -gt 0 ]]; do
  reap
  if [[ -n "$deadline" && $killed == 0 && $running -gt 0 && $SECONDS -ge $deadline ]]; then
    say "killing the $running process(es) still running after ${grace}s"
    signal_all KILL group
    killed=1
  fi
  sleep 0.2 || true    # a signal to our process group may end the sleep early
done 2> /dev/null
wait "${printers[@]}" 2> /dev/null || true
if [[ $status == 0 ]]; then say "all $procs processes finished"; else say "exit status $status"; fi
exit "$status"
