#!/usr/bin/env bash
# What launch/tpu_vm.sh runs on each worker of a TPU slice, from the copy of the checkout in ~/sinkjax (any Linux
# host will do: tests/test_launch.py runs it on its own machine).
#
#   launch/tpu_worker.sh setup  [--python python3.11] [--extras tpu]
#   launch/tpu_worker.sh start  JOB [--module sinkjax.train] [--env KEY=VALUE ...] -- ARGS...
#   launch/tpu_worker.sh status JOB        one line: "sinkjax-job JOB HOST: running | exit N | stopped N | none | no-setup"
#   launch/tpu_worker.sh stop   JOB        SIGTERM to the job (the trainer saves a checkpoint and exits)
#   launch/tpu_worker.sh logs   JOB [N]    the last N lines (50) of this worker's log, each behind [HOST]
#
# setup: a virtual environment in $SINKJAX_VENV (~/sinkjax-venv) made with PYTHON (installed with apt-get when
# missing: TPU VM images carry Python 3.10, sinkjax needs 3.11), then `pip install -c constraints.txt -e .[EXTRAS]`
# of this checkout. start: `python -m MODULE ARGS` from the checkout under nohup, in its own session (a closed SSH
# connection does not end it), and returns; its output goes to $SINKJAX_LOGS/JOB/HOST.log (~/sinkjax-logs), its pid
# to HOST.pid, its exit status, once it has ended, to HOST.rc. A job already running is not started twice.
# $SINKJAX_PYTHON replaces the environment's interpreter (tests).
set -euo pipefail

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "tpu_worker.sh: $*" >&2; exit 2; }

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${SINKJAX_VENV:-$HOME/sinkjax-venv}
logs=${SINKJAX_LOGS:-$HOME/sinkjax-logs}
host=$(hostname)
cmd=${1:-}
[[ -z "$cmd" || "$cmd" == "-h" || "$cmd" == "--help" ]] && { usage; exit 0; }
shift

job_files() {   # job_files JOB: sets $prefix, the path of this worker's files of JOB without the suffix
  [[ "${1:-}" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*$ ]] || die "a job name (letters, digits, _ . -) is required, got '${1:-}'"
  mkdir -p "$logs/$1"
  prefix="$logs/$1/$host"
}
interpreter() {
  if [[ -n "${SINKJAX_PYTHON:-}" ]]; then echo "$SINKJAX_PYTHON"; else echo "$venv/bin/python"; fi
}
alive() {   # alive: is a process of this worker's job running?
  local pid pids
  [[ -f "$prefix.pid" ]] || return 1
  read -r -a pids < "$prefix.pid" || true
  for pid in ${pids[@]+"${pids[@]}"}; do
    if kill -0 "$pid" 2> /dev/null; then return 0; fi
  done
  return 1
}

case "$cmd" in
  setup)
    python=python3.11 extras=tpu
    while [[ $# -gt 0 ]]; do
      case "$1" in
        --python) [[ $# -ge 2 ]] || die "--python needs a value"; python=$2; shift 2 ;;
        --extras) [[ $# -ge 2 ]] || die "--extras needs a value"; extras=$2; shift 2 ;;
        *) die "unknown argument '$1' (see --help)" ;;
      esac
    done
    [[ "$extras" =~ ^[a-z0-9,_-]+$ ]] || die "--extras must be a comma-separated list of extras, got '$extras'"
    if ! command -v "$python" > /dev/null 2>&1; then
      if ! [[ "$python" =~ ^python3\.[0-9]+$ ]] || ! command -v apt-get > /dev/null 2>&1; then
        die "$python not found; install Python >= 3.11 or give --python"
      fi
      sudo=()
      [[ $(id -u) == 0 ]] || sudo=(sudo)
      "${sudo[@]}" apt-get update -qq
      "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$python" "$python-venv"
    fi
    if ! "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2> /dev/null; then
      rm -rf "$venv"
      "$python" -m venv "$venv"
    fi
    "$venv/bin/python" -m pip install -q -U pip
    "$venv/bin/python" -m pip install -q -c "$root/constraints.txt" -e "${root}[$extras]"
    echo "tpu_worker.sh: $host: sinkjax[$extras] installed in $venv ($("$venv/bin/python" --version))" ;;
  start)
    job_files "${1:-}"
    shift
    module=sinkjax.train envs=() args=() seen_args=0
    while [[ $# -gt 0 ]]; do
      case "$1" in
        --module) [[ $# -ge 2 ]] || die "--module needs a value"; module=$2; shift 2 ;;
        --env) [[ $# -ge 2 && "$2" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env needs KEY=VALUE"; envs+=("$2"); shift 2 ;;
        --) shift; args=("$@"); seen_args=1; break ;;
        *) die "unknown argument '$1' (see --help)" ;;
      esac
    done
    [[ $seen_args == 1 ]] || die "give the program's arguments after --"
    [[ "$module" =~ ^[A-Za-z_][A-Za-z0-9_.]*$ ]] || die "--module must be a Python module name, got '$module'"
    python=$(interpreter)
    [[ -x "$python" ]] || die "$python not found: run setup first (launch/tpu_vm.sh setup)"
    if alive; then echo "sinkjax-job $(basename "$(dirname "$prefix")") $host: running (already; pids $(cat "$prefix.pid"))"; exit 0; fi
    rm -f "$prefix.rc" "$prefix.stop" "$prefix.pid"
    {
      echo "== $(date -u +%FT%TZ) $host: python -m $module ${args[*]}"
    } >> "$prefix.log"
    cd "$root"
    nohup setsid bash "${BASH_SOURCE[0]}" _run "$prefix" env ${envs[@]+"${envs[@]}"} "$python" -m "$module" \
      ${args[@]+"${args[@]}"} > /dev/null 2>&1 < /dev/null &
    for _ in $(seq 50); do [[ -s "$prefix.pid" ]] && break; sleep 0.1; done
    echo "sinkjax-job $(basename "$(dirname "$prefix")") $host: started (pids $(cat "$prefix.pid" 2> /dev/null)), log $prefix.log" ;;
  _run)   # _run PREFIX COMMAND...: COMMAND with its output in PREFIX.log, its status in PREFIX.rc; signals passed on
    prefix=$1
    shift
    "$@" >> "$prefix.log" 2>&1 < /dev/null &
    child=$!
    echo "$child $$" > "$prefix.pid"
    trap 'kill -TERM "$child" 2> /dev/null || true' TERM INT HUP
    while kill -0 "$child" 2> /dev/null; do wait "$child" || true; done
    rc=0
    wait "$child" || rc=$?
    echo "$rc" > "$prefix.rc.tmp" && mv "$prefix.rc.tmp" "$prefix.rc"
    echo "== $(date -u +%FT%TZ) $host: exit status $rc" >> "$prefix.log" ;;
  status)
    job="${1:-}"
    if [[ -z "${SINKJAX_PYTHON:-}" && ! -x "$venv/bin/python" ]]; then echo "sinkjax-job $job $host: no-setup"; exit 0; fi
    job_files "$job"
    if [[ -f "$prefix.rc" && -f "$prefix.stop" ]]; then echo "sinkjax-job $job $host: stopped $(cat "$prefix.rc")"
    elif [[ -f "$prefix.rc" ]]; then echo "sinkjax-job $job $host: exit $(cat "$prefix.rc")"
    elif alive; then echo "sinkjax-job $job $host: running"
    else echo "sinkjax-job $job $host: none"
    fi ;;
  stop)
    job_files "${1:-}"
    if alive; then
      touch "$prefix.stop"
      kill -TERM "$(cut -d' ' -f1 "$prefix.pid")" 2> /dev/null || true
      echo "sinkjax-job $1 $host: SIGTERM sent (it saves a checkpoint and exits)"
    else
      echo "sinkjax-job $1 $host: not running"
    fi ;;
  logs)
    job_files "${1:-}"
    lines=${2:-50}
    [[ "$lines" =~ ^[0-9]+$ ]] || die "the number of lines must be an integer, got '$lines'"
    if [[ -f "$prefix.log" ]]; then tail -n "$lines" "$prefix.log" | sed "s/^/[$host] /"; else echo "[$host] no log yet"; fi ;;
  *) die "unknown subcommand '$cmd' (setup|start|status|stop|logs)" ;;
esac
