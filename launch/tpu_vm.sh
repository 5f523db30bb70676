#!/usr/bin/env bash
# Cloud TPU launcher for sinkjax (single host and pod slices), through gcloud.
#
#   launch/tpu_vm.sh create  --name N --zone Z [--project P] [--type v5litepod-8] [--version RUNTIME] [--spot] [--queued]
#   launch/tpu_vm.sh setup   --name N --zone Z [--project P] [--python python3.11] [--extras tpu] [--include PATH ...]
#   launch/tpu_vm.sh run     --name N --zone Z [--project P] [--job J] [--module M] [--env K=V] [--worker-local-paths]
#                            -- ARGS...
#   launch/tpu_vm.sh babysit (create's, setup's and run's options) [--interval 300] [--max-failures 3]
#                            [--delete-when-done] -- ARGS...
#   launch/tpu_vm.sh status | stop | logs [--lines N] | ssh | delete   --name N --zone Z [--project P] [--job J]
#
# setup copies this checkout's code to ~/sinkjax on every worker (gcloud scp): its tracked files as they are in the
# working tree (uncommitted edits included), plus each --include PATH (a file or directory of the checkout, relative
# to its root); never an untracked file otherwise, so data/ and runs/ stay here (it names the untracked files it
# leaves behind that git does not ignore).
# It installs the copy with constraints.txt into ~/sinkjax-venv (launch/tpu_worker.sh setup).
# run starts `python -m M ARGS` (M = sinkjax.train; sinkjax.eval, sinkjax.lm_eval, sinkjax.convert.hf ... work the
# same) on every worker under nohup and returns: the job outlives the SSH session; each worker logs to
# ~/sinkjax-logs/J/HOSTNAME.log (J = train); `logs` shows their ends, `status` each worker's state, `stop` sends
# SIGTERM (the trainer saves a checkpoint). Before it launches, run (and babysit) checks with python -m
# sinkjax.pod_paths that the data, tokenizer and run paths the job resolves (a train job's config included) are in
# a bucket: a relative path is one line and exit 2 (an absolute one passes with --worker-local-paths).
# --queued asks for the slice as a queued resource; --spot for spot chips.
# babysit (run it under nohup or tmux) creates the slice if needed, sets it up and starts the run; then every
# --interval seconds it checks the slice and the job: a preempted or lost slice is deleted, re-created and set up, and
# the same run is started again, which resumes from the latest checkpoint in run.dir (a gs:// run.dir outlives the
# slice); a job that failed is started again at most --max-failures times; it ends when every worker's job has
# finished (status 0) or was stopped. --dry-run, anywhere on the line (after -- too; never passed on), prints the
# commands instead of running them. --project is passed to every gcloud command.
set -euo pipefail

usage() { sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "tpu_vm.sh: $*" >&2; exit 2; }
say() { echo "tpu_vm.sh: $(date -u +%FT%TZ) $*" >&2; }

cmd=${1:-}
[[ -z "$cmd" || "$cmd" == "-h" || "$cmd" == "--help" ]] && { usage; exit 0; }
shift
case "$cmd" in
  create|setup|run|babysit|status|stop|logs|ssh|delete) ;;
  *) die "unknown subcommand '$cmd' (create|setup|run|babysit|status|stop|logs|ssh|delete)" ;;
esac

name="" zone="" project="" type="v5litepod-8" version="v2-alpha-tpuv5-lite" spot=0 queued=0 dry_run=0
python="python3.11" extras="tpu" job="train" module="sinkjax.train" envs=() interval=300 max_failures=3
delete_when_done=0 lines=50 prog_args=() seen_args=0 includes=() worker_local=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --name|--zone|--project|--type|--version|--python|--extras|--job|--module|--env|--interval|--max-failures|--lines|\
    --include)
      [[ $# -ge 2 ]] || die "$1 needs a value (see --help)"
      case "$1" in
        --name) name=$2 ;; --zone) zone=$2 ;; --project) project=$2 ;; --type) type=$2 ;; --version) version=$2 ;;
        --python) python=$2 ;; --extras) extras=$2 ;; --job) job=$2 ;; --module) module=$2 ;; --env) envs+=("$2") ;;
        --interval) interval=$2 ;; --max-failures) max_failures=$2 ;; --lines) lines=$2 ;;
        --include) includes+=("$2") ;;
      esac
      shift 2 ;;
    --spot) spot=1; shift ;;
    --queued) queued=1; shift ;;
    --delete-when-done) delete_when_done=1; shift ;;
    --worker-local-paths) worker_local=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; seen_args=1
        for a in "$@"; do   # the launcher's --dry-run is honoured after -- too, and never reaches the program
          if [[ "$a" == "--dry-run" ]]; then dry_run=1; else prog_args+=("$a"); fi
        done
        break ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ -n "$name" ]] || die "--name is required (the TPU VM's name)"
[[ "$name" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] || die "--name must be lower-case letters, digits and -, got '$name'"
[[ -n "$zone" ]] || die "--zone is required (e.g. us-central2-b)"
[[ "$job" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*$ ]] || die "--job must be letters, digits, _ . -, got '$job'"
[[ "$module" =~ ^[A-Za-z_][A-Za-z0-9_.]*$ ]] || die "--module must be a Python module name, got '$module'"
[[ "$interval" =~ ^[0-9]+$ ]] || die "--interval must be a number of seconds, got '$interval'"
[[ "$max_failures" =~ ^[0-9]+$ ]] || die "--max-failures must be a non-negative integer, got '$max_failures'"
[[ "$lines" =~ ^[0-9]+$ ]] || die "--lines must be a non-negative integer, got '$lines'"
for e in ${envs[@]+"${envs[@]}"}; do [[ "$e" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env needs KEY=VALUE, got '$e'"; done
if [[ $cmd == run || $cmd == babysit ]]; then
  [[ ${#prog_args[@]} -gt 0 ]] \
    || die "$cmd needs the program's arguments after --, e.g. -- --config configs/paper/d20_sink_aux.yaml"
elif [[ $seen_args == 1 && ${#prog_args[@]} -gt 0 ]]; then
  die "$cmd takes no program arguments (only run and babysit do)"
fi
if [[ $cmd == babysit ]]; then
  for a in "${prog_args[@]}"; do
    if [[ "$a" == run.dir=* && "$a" != run.dir=gs://* ]]; then
      die "babysit needs a gs:// run.dir (got ${a#run.dir=}): a re-created slice has new disks, the run must resume from a bucket"
    fi
  done
fi

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
for inc in ${includes[@]+"${includes[@]}"}; do
  [[ "$inc" != /* && "/$inc/" != */../* ]] \
    || die "--include takes a path inside the checkout, relative to its root, got '$inc'"
  [[ -e "$root/$inc" ]] || die "--include $inc: no such file or directory in $root"
done
if [[ $cmd == run || $cmd == babysit ]]; then   # the job's paths are the bucket's, before anything is launched
  launch_python=${SINKJAX_LAUNCH_PYTHON:-python3}
  "$launch_python" -c 'import yaml' 2> /dev/null \
    || die "checking the job's paths needs $launch_python with pyyaml here (pip install pyyaml;" \
           "SINKJAX_LAUNCH_PYTHON picks the interpreter)"
  local_flag=()
  [[ $worker_local == 0 ]] || local_flag=(--worker-local-paths)
  bad=$(cd "$root" && PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" SINKJAX_CHECKOUT="$root" "$launch_python" \
        -m sinkjax.pod_paths ${local_flag[@]+"${local_flag[@]}"} "$module" -- "${prog_args[@]}" 2>&1) \
    || die "$(tail -n 1 <<< "$bad")"
fi
project_flag=()
[[ -z "$project" ]] || project_flag=("--project=$project")

show() { printf '%q ' "$@" | sed 's/ $//'; echo; }
run() {   # run COMMAND...: runs it, or prints it with --dry-run
  if [[ $dry_run == 1 ]]; then show "$@"; else "$@"; fi
}
gc() { run gcloud "$@" "${project_flag[@]+"${project_flag[@]}"}"; }
remote() {   # remote COMMAND: the same shell command on every worker of the slice
  gc compute tpus tpu-vm ssh "$name" --zone="$zone" --worker=all --command="$1"
}
quoted() { local q; q=$(printf '%q ' "$@"); echo "${q% }"; }

create_slice() {
  local spot_flag=()
  [[ $spot == 0 ]] || spot_flag=(--spot)
  if [[ $queued == 1 ]]; then
    gc compute tpus queued-resources create "$name" --node-id="$name" --zone="$zone" --accelerator-type="$type" \
      --runtime-version="$version" ${spot_flag[@]+"${spot_flag[@]}"}
  else
    gc compute tpus tpu-vm create "$name" --zone="$zone" --accelerator-type="$type" --version="$version" \
      ${spot_flag[@]+"${spot_flag[@]}"}
  fi
}
delete_slice() {
  if [[ $queued == 1 ]]; then
    gc compute tpus queued-resources delete "$name" --zone="$zone" --force --quiet
  else
    gc compute tpus tpu-vm delete "$name" --zone="$zone" --quiet
  fi
}
slice_state() {   # one word: the VM's state (READY, PREEMPTED, CREATING, ...), the queued resource's while it is not
                  # ACTIVE (WAITING_FOR_RESOURCES, SUSPENDED, FAILED, ...), or MISSING
  local s
  if [[ $queued == 1 ]]; then
    s=$(gcloud compute tpus queued-resources describe "$name" --zone="$zone" --format='value(state.state)' \
        "${project_flag[@]+"${project_flag[@]}"}" 2> /dev/null) || { echo MISSING; return; }
    if [[ "$s" != ACTIVE ]]; then echo "${s:-MISSING}"; return; fi
  fi
  s=$(gcloud compute tpus tpu-vm describe "$name" --zone="$zone" --format='value(state)' \
      "${project_flag[@]+"${project_flag[@]}"}" 2> /dev/null) || { echo MISSING; return; }
  echo "${s:-MISSING}"
}
wait_ready() {   # until the slice is READY (a queued resource may wait for capacity for hours)
  local s
  if [[ $dry_run == 1 ]]; then
    echo "# until the slice is READY, every 30 s:"
    if [[ $queued == 1 ]]; then
      gc compute tpus queued-resources describe "$name" --zone="$zone" --format='value(state.state)'
    fi
    gc compute tpus tpu-vm describe "$name" --zone="$zone" --format='value(state)'
    return
  fi
  while true; do
    s=$(slice_state)
    case "$s" in
      READY) return 0 ;;
      MISSING|PREEMPTED|TERMINATED|SUSPENDED|SUSPENDING|FAILED|DELETING) say "slice $name is $s"; return 1 ;;
    esac
    say "slice $name is $s; waiting"
    sleep 30
  done
}
shipped() {   # NUL-separated: the tracked files that exist, and every file under each --include, once each
  { git -C "$root" ls-files -z --cached
    for inc in ${includes[@]+"${includes[@]}"}; do (cd "$root" && find "$inc" -type f -print0); done
  } | (cd "$root" && while IFS= read -r -d '' f; do if [[ -e "$f" ]]; then printf '%s\0' "${f#./}"; fi; done) \
    | LC_ALL=C sort -zu
}
left_behind() {   # NUL-separated: the untracked, not-ignored files that shipped() leaves out
  LC_ALL=C comm -z -23 <(git -C "$root" ls-files -z --others --exclude-standard | LC_ALL=C sort -zu) <(shipped)
}
summary() {   # summary: "N files, X MB" of a NUL-separated list on stdin
  (cd "$root" && xargs -0 -r stat -c %s --) | awk '{n++; b+=$1} END {printf "%d files, %.1f MB", n, b/1e6}'
}
copy_and_setup() {   # the checkout's code to ~/sinkjax on every worker, then tpu_worker.sh setup there
  local tmp archive behind
  git -C "$root" rev-parse --git-dir > /dev/null 2>&1 \
    || die "setup copies a git checkout (its tracked files and --include); $root is not one"
  behind=$(left_behind | tr '\0' '\n')
  if [[ -n "$behind" ]]; then
    say "setup leaves behind $(left_behind | summary) that git does not track (e.g. $(head -n 3 <<< "$behind" \
| paste -sd ' ' -)); git add the code among them or name it with --include"
  fi
  if [[ $dry_run == 1 ]]; then
    archive=/tmp/sinkjax-checkout.tar.gz
    echo "# the checkout's code, $(shipped | summary): $(quoted git -C "$root" ls-files -z --cached)" \
      "$(for inc in ${includes[@]+"${includes[@]}"}; do printf '+ %q ' "$inc"; done)|" \
      "$(quoted tar -C "$root" --null -T - -czf "$archive")"
  else
    tmp=$(mktemp -d "${TMPDIR:-/tmp}/sinkjax_tpu.XXXXXX")
    archive=$tmp/sinkjax-checkout.tar.gz
    shipped | tar -C "$root" --null -T - -czf "$archive"
  fi
  local copied=0
  gc compute tpus tpu-vm scp "$archive" "$name:sinkjax-checkout.tar.gz" --zone="$zone" --worker=all || copied=$?
  [[ -z "${tmp:-}" ]] || rm -rf "$tmp"
  [[ $copied == 0 ]] || return "$copied"
  remote "set -e; rm -rf ~/sinkjax.new; mkdir ~/sinkjax.new; tar -xzf ~/sinkjax-checkout.tar.gz -C ~/sinkjax.new; \
rm -rf ~/sinkjax; mv ~/sinkjax.new ~/sinkjax; bash ~/sinkjax/launch/tpu_worker.sh setup $(quoted --python "$python" \
--extras "$extras")"
}
start_job() {
  local env_args=() e
  for e in ${envs[@]+"${envs[@]}"}; do env_args+=(--env "$e"); done
  remote "bash ~/sinkjax/launch/tpu_worker.sh start $(quoted "$job" --module "$module" \
${env_args[@]+"${env_args[@]}"} -- "${prog_args[@]}")"
}
status_command() {
  echo "if [ -f ~/sinkjax/launch/tpu_worker.sh ]; then bash ~/sinkjax/launch/tpu_worker.sh status $job; \
else echo \"sinkjax-job $job \$(hostname): no-setup\"; fi"
}
job_state() {   # one word from every worker's status line: running, done, stopped, interrupted, failed, setup, start,
                # or unreachable (no answer)
  local out states
  out=$(remote "$(status_command)" 2> /dev/null) || { echo unreachable; return; }
  states=$(grep -o 'sinkjax-job .*: .*' <<< "$out" | sed 's/^[^:]*: //') || true
  if [[ -z "$states" ]]; then echo unreachable
  elif grep -q '^running' <<< "$states"; then echo running
  elif grep -q '^no-setup' <<< "$states"; then echo setup
  elif grep -q '^none' <<< "$states"; then echo start
  elif grep -q '^stopped' <<< "$states"; then echo stopped
  elif ! grep -qv '^exit 0$' <<< "$states"; then echo "done"
  elif ! grep -v '^exit 0$' <<< "$states" | grep -qvE '^exit (130|143)$'; then echo interrupted
  else echo failed
  fi
}

babysit() {
  local failures=0 state
  if [[ $dry_run == 1 ]]; then
    echo "# babysit: create the slice if it is missing, then set it up and start the job:"
    create_slice; wait_ready; copy_and_setup; start_job
    echo "# every ${interval} s, the slice's state:"
    if [[ $queued == 1 ]]; then
      gc compute tpus queued-resources describe "$name" --zone="$zone" --format='value(state.state)'
    fi
    gc compute tpus tpu-vm describe "$name" --zone="$zone" --format='value(state)'
    echo "# when it is READY, the job's state on every worker (running: wait; finished with 0 on every worker:" \
      "done$([[ $delete_when_done == 0 ]] || echo ', the slice deleted'); stopped: done; interrupted: start again;" \
      "failed: start again, at most ${max_failures} times):"
    remote "$(status_command)"
    start_job
    echo "# when it is PREEMPTED, SUSPENDED, FAILED or gone: delete, re-create, set up, start again (resumes):"
    delete_slice; create_slice; wait_ready; copy_and_setup; start_job
    return 0
  fi
  say "babysitting $name ($type, $module ${prog_args[*]}), every ${interval} s"
  while true; do
    state=$(slice_state)
    case "$state" in
      READY)
        case "$(job_state)" in
          running) ;;
          done)
            say "the job $job finished on every worker"
            if [[ $delete_when_done == 1 ]]; then delete_slice || say "deleting $name failed; delete it by hand"; fi
            return 0 ;;
          stopped) say "the job $job was stopped (launch/tpu_vm.sh stop); not restarting it"; return 0 ;;
          setup) say "setting up $name"; { copy_and_setup && start_job; } || say "setup or start failed; retrying" ;;
          start|interrupted)
            say "starting the job $job (it resumes from its latest checkpoint)"
            start_job || say "starting the job failed; retrying" ;;
          failed)
            failures=$(( failures + 1 ))
            if [[ $failures -gt $max_failures ]]; then
              say "the job $job failed $failures times; giving up (its logs: launch/tpu_vm.sh logs ...)"
              return 1
            fi
            say "the job $job failed on a worker (failure $failures of at most $max_failures); starting it again"
            start_job || say "starting the job failed; retrying" ;;
          unreachable) say "no answer from the workers of $name; trying again" ;;
        esac ;;
      MISSING)
        say "slice $name does not exist; creating it"
        if create_slice && wait_ready; then { copy_and_setup && start_job; } || say "setup or start failed; retrying"; fi ;;
      PREEMPTED|TERMINATED|SUSPENDED|FAILED)
        say "slice $name is $state; deleting and re-creating it"
        delete_slice || say "deleting $name failed; retrying"
        if create_slice && wait_ready; then { copy_and_setup && start_job; } || say "setup or start failed; retrying"; fi ;;
      *) say "slice $name is $state; waiting" ;;
    esac
    sleep "$interval"
  done
}

case "$cmd" in
  create) create_slice; if [[ $queued == 1 ]]; then wait_ready; fi ;;
  setup) copy_and_setup ;;
  run) start_job ;;
  babysit) babysit ;;
  status) remote "$(status_command)" ;;
  stop) remote "bash ~/sinkjax/launch/tpu_worker.sh stop $(quoted "$job")" ;;
  logs) remote "bash ~/sinkjax/launch/tpu_worker.sh logs $(quoted "$job" "$lines")" ;;
  ssh) gc compute tpus tpu-vm ssh "$name" --zone="$zone" --worker=0 ;;
  delete) delete_slice ;;
esac
