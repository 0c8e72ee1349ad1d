#!/usr/bin/env bash
# Runs, watches and stops a contrastive_jax job on every worker of a Cloud TPU VM pod.
#
#   launch/tpu.sh [--dry-run] run    TPU_NAME ZONE --config=configs/X.py[:variant] --workdir=DIR \
#                                    [--config.FIELD=VALUE ...]
#   launch/tpu.sh [--dry-run] logs   TPU_NAME ZONE [--worker=N] [--lines=N] [-f]
#   launch/tpu.sh [--dry-run] status TPU_NAME ZONE
#   launch/tpu.sh [--dry-run] stop   TPU_NAME ZONE [--timeout=SECONDS]
#
# run: copies this checkout (the files git tracks, plus untracked ones it does not
#   ignore) to ~/contrastive_jax on every worker, installs it once into the virtualenv
#   ~/contrastive_jax_run/venv (again only when setup.py or the install command changed),
#   and starts `python -m contrastive_jax.main --distributed ARGS` detached from the ssh
#   session, logging to ~/contrastive_jax_run/job.log on each worker. It refuses when a
#   job is already running. Relaunching with the same --workdir resumes from its latest
#   checkpoint.
# logs: prints the last lines of one worker's log, or follows it (-f).
# status: per worker, whether the job runs and the last step its log mentions.
# stop: SIGTERM on every worker: the job checkpoints at the same step on all of them
#   (JAX's preemption sync) and exits; waits up to --timeout seconds (default 600).
# --dry-run (before the command, or right after ZONE) prints each gcloud command
#   instead of running it.
#
# Environment: GCLOUD, the gcloud binary (default: gcloud on PATH). On a worker (for
# the simulated pod in tests/fake_gcloud): CJ_PYTHON (interpreter that creates the
# virtualenv, default python3), CJ_VENV_OPTIONS (extra `python -m venv` options),
# CJ_PIP_INSTALL (what pip installs into it, word-split; empty: nothing),
# CJ_NUM_PROCESSES and CJ_PROCESS_ID (passed to main.py as --num_processes and
# --process_id when set; a real pod needs neither: jax.distributed.initialize() finds
# its peers, and JAX reads JAX_COORDINATOR_ADDRESS by itself).
set -euo pipefail

readonly SCRIPT="launch/tpu.sh"
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
readonly REPO
readonly GCLOUD="${GCLOUD:-gcloud}"
readonly TPU_VM=(compute tpus tpu-vm)
# Installed on each worker unless CJ_PIP_INSTALL says otherwise (it is word-split there).
readonly DEFAULT_PIP_INSTALL="-e . jax[tpu]==0.10.2"

DRY_RUN=0

usage() {
  sed -n '4,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

die() {
  echo "$SCRIPT: error: $*" >&2
  exit 1
}

# Prints a command as a line that bash would read back into the same words.
show() {
  local out
  out=$(printf ' %q' "$@")
  echo "${out# }"
}

# Runs gcloud, or with --dry-run only prints the command.
gc() {
  if ((DRY_RUN)); then
    show gcloud "$@"
  else
    "$GCLOUD" "$@"
  fi
}

# Fails with one clear message when gcloud is missing or TPU_NAME/ZONE names no TPU
# VM; all later commands would otherwise fail with ssh or API noise.
check_tpu() {
  local tpu="$1" zone="$2" state err
  if ((DRY_RUN)); then
    gc "${TPU_VM[@]}" describe "$tpu" --zone="$zone" --format='value(state)'
    return
  fi
  command -v "$GCLOUD" >/dev/null 2>&1 ||
    die "'$GCLOUD' not found: install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install) or set GCLOUD to its path"
  err=$(mktemp)
  if ! state=$("$GCLOUD" "${TPU_VM[@]}" describe "$tpu" --zone="$zone" --format='value(state)' 2>"$err"); then
    local why
    why=$(grep -m1 ERROR "$err" || head -n1 "$err")
    rm -f "$err"
    die "cannot use TPU VM '$tpu' in zone '$zone': gcloud ${TPU_VM[*]} describe says ${why:-nothing}; check the name and zone (gcloud ${TPU_VM[*]} list --zone=$zone) and your gcloud login and project"
  fi
  rm -f "$err"
  [[ "$state" == READY ]] || die "TPU VM '$tpu' in zone '$zone' is ${state:-in an unknown state}, not READY"
}

# Bash that every worker command starts with: where things are, and two helpers.
# job_pid prints the pid of this worker's job if it still runs; the command line is
# checked too, so that a stale pid file whose pid now belongs to another process (or a
# zombie) does not count. last_step prints the last training step the log mentions:
# clu's "] [STEP] metric=..." lines, "Resumed ... at step N", "Training from step N",
# "Stopped at step N". A worker prints its results as lines "cj-KIND ..." (see marked).
# The workers' login shell is bash (TPU VM images), so printf %q quoting (which may
# use $'...') is safe there.
remote_lib() {
  cat <<'EOF'
set -euo pipefail
exec 2>&1
code=~/contrastive_jax
run_dir=~/contrastive_jax_run
log=$run_dir/job.log
pid_file=$run_dir/job.pid
job_pid() {
  local pid
  pid=$(cat "$pid_file" 2>/dev/null) || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
  ps -o args= -p "$pid" 2>/dev/null | grep -q 'contrastive_jax\.main' || return 1
  echo "$pid"
}
last_step() {
  [[ -f "$log" ]] || { echo -; return; }
  local step
  step=$(tail -n 5000 "$log" | grep -oE '\] \[[0-9]+\] |at step [0-9]+|from step [0-9]+' |
         tail -n1 | grep -oE '[0-9]+' || true)
  echo "${step:--}"
}
EOF
}

# Before copying anything: is a job running? If not, clear the upload directory.
remote_preflight() {
  remote_lib
  cat <<'EOF'
if pid=$(job_pid); then echo "cj-running pid $pid"; else rm -rf ~/contrastive_jax.upload; fi
EOF
}

# Swaps in the uploaded code, installs it if needed and starts the job with the
# arguments $@. The install is redone only when what it depends on changed (setup.py,
# the pip and venv options): the package is installed in editable mode, so new code
# needs no reinstall. Ubuntu images may lack python3-venv (ensurepip), hence the
# fallback to virtualenv. setsid + nohup + no terminal: the job survives the end of the
# ssh session; in a shell without job control the background child is no
# process-group leader, so setsid execs in place and $! is the job's own pid.
remote_start() {
  remote_lib
  printf 'job_args=(%s)\n' "$(printf ' %q' "$@")"
  printf 'default_pip_install=%q\n' "$DEFAULT_PIP_INSTALL"
  cat <<'EOF'
if pid=$(job_pid); then echo "cj-running pid $pid"; exit 0; fi
if [[ ! -d ~/contrastive_jax.upload ]]; then echo 'cj-failed the upload is missing'; exit 0; fi
rm -rf "$code" && mv ~/contrastive_jax.upload "$code"
mkdir -p "$run_dir"
cd "$code"
python=${CJ_PYTHON:-python3}
venv=$run_dir/venv
pip_install=${CJ_PIP_INSTALL-$default_pip_install}
want="$(sha256sum setup.py | cut -d' ' -f1) $pip_install ${CJ_VENV_OPTIONS:-}"
if [[ -x $venv/bin/python && "$(cat "$venv/cj-installed" 2>/dev/null)" == "$want" ]]; then
  echo 'virtualenv up to date'
else
  echo "installing into $venv"
  rm -rf "$venv"
  "$python" -m venv ${CJ_VENV_OPTIONS:-} "$venv" || {
    "$python" -m pip install -q --user virtualenv && "$python" -m virtualenv ${CJ_VENV_OPTIONS:-} "$venv"; }
  if [[ -n $pip_install ]]; then "$venv/bin/python" -m pip install -q $pip_install; fi
  echo "$want" > "$venv/cj-installed"
fi
dist=()
if [[ -n ${CJ_NUM_PROCESSES:-} ]]; then dist+=(--num_processes="$CJ_NUM_PROCESSES"); fi
if [[ -n ${CJ_PROCESS_ID:-} ]]; then dist+=(--process_id="$CJ_PROCESS_ID"); fi
cmd=("$venv/bin/python" -m contrastive_jax.main --distributed "${dist[@]}" "${job_args[@]}")
if [[ -f $log ]]; then mv "$log" "$log.prev"; fi
echo "started $(date -u '+%F %T UTC'):$(printf ' %q' "${cmd[@]}")" > "$log"
setsid nohup "${cmd[@]}" >> "$log" 2>&1 < /dev/null &
echo $! > "$pid_file"
sleep 1
if pid=$(job_pid); then
  echo "cj-started started (pid $pid), log $log"
else
  echo "cj-failed the job exited at once; the end of $log:"; tail -n 20 "$log"
fi
EOF
}

# A stopped or crashed job's last log line says which it was.
remote_status() {
  remote_lib
  cat <<'EOF'
if pid=$(job_pid); then
  echo "cj-status running (pid $pid), last logged step $(last_step)"
elif [[ -f $log ]]; then
  echo "cj-status not running, last logged step $(last_step); the log ends: $(tail -n 1 "$log" | cut -c 1-160)"
else
  echo "cj-status no job started"
fi
EOF
}

# SIGTERM, then up to $1 seconds for the job to checkpoint and exit.
remote_stop() {
  remote_lib
  printf 'timeout=%q\n' "$1"
  cat <<'EOF'
if ! pid=$(job_pid); then echo "cj-none last logged step $(last_step)"; exit 0; fi
kill -TERM "$pid"
end=$((SECONDS + timeout))
while ((SECONDS < end)); do
  if ! job_pid >/dev/null; then echo "cj-stopped last logged step $(last_step)"; exit 0; fi
  sleep 0.5
done
echo "cj-timeout pid $pid still running after $timeout s"
EOF
}

# tail -n $1 [$2] of the log of worker $3.
remote_logs() {
  remote_lib
  printf 'lines=%q follow=%q worker=%q\n' "$1" "$2" "$3"
  cat <<'EOF'
if [[ ! -f $log ]]; then echo "no job log on worker $worker ($log): no job was started there"; exit 1; fi
exec tail -n "$lines" $follow "$log"
EOF
}

# Runs bash script $3 on the workers of TPU $1 (zone $2) with --worker=all, collecting
# each worker's output in a file of its own, OUT_DIR/N.log (gcloud's --output-directory),
# so that outputs do not interleave and each line is known to come from worker N.
# Sets OUT_DIR (the caller removes it).
OUT_DIR=""
ssh_all() {
  local tpu="$1" zone="$2" script="$3"
  OUT_DIR=$(mktemp -d)
  if ! gc "${TPU_VM[@]}" ssh "$tpu" --zone="$zone" --worker=all --output-directory="$OUT_DIR" \
      --command="$script"; then
    print_outputs "$OUT_DIR" >&2
    rm -rf "$OUT_DIR"
    die "gcloud ${TPU_VM[*]} ssh failed on at least one worker of '$tpu' (the workers' output is above)"
  fi
}

# Prints every worker's output from ssh_all's directory, each line as "worker N: ...".
print_outputs() {
  local dir="$1" f worker
  while IFS= read -r f; do
    worker=$(basename "$f" .log)
    sed "s/^/worker $worker: /" "$f"
  done < <(find "$dir" -name '*.log' | sort -V)
}

# The "cj-MARKER ..." lines of ssh_all's directory as "worker N: ...", one per line.
marked() {
  local dir="$1" marker="$2"
  print_outputs "$dir" | sed -n "s/^\(worker [^:]*:\) $marker /\1 /p"
}

# Joins lines with "; ", for one-line messages.
join() {
  awk 'NR > 1 { printf "; " } { printf "%s", $0 }'
}

# Copies the checkout to every worker as ~/contrastive_jax.upload. A fresh local copy
# of what git knows about (not .git, virtualenvs or build outputs) keeps the upload
# small; the caller has removed the upload directory, so scp creates it rather than
# nesting the copy inside an old one.
upload() {
  local tpu="$1" zone="$2" stage
  stage=$(mktemp -d)
  mkdir "$stage/contrastive_jax"
  if ((!DRY_RUN)); then
    if git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
      (cd "$REPO" && git ls-files -z -co --exclude-standard |
        while IFS= read -r -d '' f; do if [[ -e "$f" ]]; then printf '%s\0' "$f"; fi; done |
        tar --null -T - -cf -) | tar -xf - -C "$stage/contrastive_jax"
    else
      cp -a "$REPO/." "$stage/contrastive_jax"
    fi
  fi
  gc "${TPU_VM[@]}" scp --recurse "$stage/contrastive_jax" "$tpu:contrastive_jax.upload" \
    --zone="$zone" --worker=all
  rm -rf "$stage"
}

# A workdir that is neither absolute nor gs:// would land inside ~/contrastive_jax,
# which the next run replaces; and without --config or --workdir main.py fails on the
# workers, out of sight.
check_job_args() {
  local config=0 workdir="" i
  local -a args=("$@")
  for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
      --config=* | --config) config=1 ;;
      --workdir=*) workdir="${args[i]#--workdir=}" ;;
      --workdir) workdir="${args[i + 1]:-}" ;;
    esac
  done
  ((config)) || die "run needs --config=configs/X.py[:variant]"
  [[ -n "$workdir" ]] || die "run needs --workdir=DIR (gs://BUCKET/... or an absolute path)"
  [[ "$workdir" == gs://* || "$workdir" == /* ]] ||
    die "--workdir=$workdir: use gs://BUCKET/... or an absolute path; a relative one would be inside ~/contrastive_jax, which every run replaces"
}

cmd_run() {
  local tpu="$1" zone="$2"
  shift 2
  check_job_args "$@"
  check_tpu "$tpu" "$zone"
  local running failed started
  # Refuse before copying anything when a job runs on any worker.
  ssh_all "$tpu" "$zone" "$(remote_preflight)"
  running=$(marked "$OUT_DIR" cj-running | join)
  rm -rf "$OUT_DIR"
  [[ -z "$running" ]] || die "a job is already running on '$tpu' ($running); see \`$SCRIPT status $tpu $zone\`, or stop it with \`$SCRIPT stop $tpu $zone\`"

  upload "$tpu" "$zone"

  ssh_all "$tpu" "$zone" "$(remote_start "$@")"
  print_outputs "$OUT_DIR" | grep -v ': cj-' || true
  running=$(marked "$OUT_DIR" cj-running | join)
  failed=$(marked "$OUT_DIR" cj-failed | join)
  started=$(marked "$OUT_DIR" cj-started)
  rm -rf "$OUT_DIR"
  ((!DRY_RUN)) || return 0
  [[ -z "$running" ]] || die "a job was started on '$tpu' meanwhile ($running): this run did not start on those workers; see \`$SCRIPT status $tpu $zone\`"
  [[ -z "$failed" ]] || die "the job did not start: $failed (the end of its log is above)"
  echo "$started"
  echo "Follow a worker's log with \`$SCRIPT logs $tpu $zone [--worker=N] -f\`, see \`$SCRIPT status $tpu $zone\`, stop (checkpoint and exit) with \`$SCRIPT stop $tpu $zone\`."
}

cmd_logs() {
  local tpu="$1" zone="$2" worker=0 lines=50 follow="" arg
  shift 2
  for arg in "$@"; do
    case "$arg" in
      --worker=*) worker="${arg#--worker=}" ;;
      --lines=*) lines="${arg#--lines=}" ;;
      -f | --follow) follow="-F" ;;
      *) die "logs: unknown option $arg (--worker=N, --lines=N, -f)" ;;
    esac
  done
  [[ "$worker" =~ ^[0-9]+$ ]] || die "--worker=$worker: a worker index (0, 1, ...)"
  [[ "$lines" =~ ^[0-9]+$ ]] || die "--lines=$lines: a number of lines"
  check_tpu "$tpu" "$zone"
  local -a ssh_args=()
  # With a terminal on the worker, Ctrl-C ends the remote tail too, not only gcloud.
  if [[ -n "$follow" ]]; then ssh_args=(-- -t); fi
  gc "${TPU_VM[@]}" ssh "$tpu" --zone="$zone" --worker="$worker" \
    --command="$(remote_logs "$lines" "$follow" "$worker")" "${ssh_args[@]}"
}

cmd_status() {
  local tpu="$1" zone="$2"
  shift 2
  (($# == 0)) || die "status takes no options"
  check_tpu "$tpu" "$zone"
  ssh_all "$tpu" "$zone" "$(remote_status)"
  marked "$OUT_DIR" cj-status
  rm -rf "$OUT_DIR"
}

cmd_stop() {
  local tpu="$1" zone="$2" timeout=600 arg none stopped timed_out
  shift 2
  for arg in "$@"; do
    case "$arg" in
      --timeout=*) timeout="${arg#--timeout=}" ;;
      *) die "stop: unknown option $arg (--timeout=SECONDS)" ;;
    esac
  done
  [[ "$timeout" =~ ^[0-9]+$ ]] || die "--timeout=$timeout: a number of seconds"
  check_tpu "$tpu" "$zone"
  # Every worker gets SIGTERM at about the same time; JAX's preemption sync picks one
  # step at which all of them checkpoint, so each worker waits for its own job only.
  ssh_all "$tpu" "$zone" "$(remote_stop "$timeout")"
  none=$(marked "$OUT_DIR" cj-none | join)
  stopped=$(marked "$OUT_DIR" cj-stopped | join)
  timed_out=$(marked "$OUT_DIR" cj-timeout | join)
  rm -rf "$OUT_DIR"
  ((!DRY_RUN)) || return 0
  if [[ -z "$stopped" && -z "$timed_out" ]]; then
    echo "No job is running on '$tpu': nothing to stop."
    return
  fi
  [[ -z "$stopped" ]] || echo "Stopped: $stopped"
  [[ -z "$none" ]] || echo "Not running before the stop: $none"
  [[ -z "$timed_out" ]] ||
    die "the job did not exit within $timeout s on: $timed_out; see \`$SCRIPT logs $tpu $zone --worker=N\`, stop again, or raise --timeout"
}

main() {
  while [[ "${1:-}" == --dry-run ]]; do DRY_RUN=1; shift; done
  (($# >= 3)) || usage
  local command="$1" tpu="$2" zone="$3"
  shift 3
  while [[ "${1:-}" == --dry-run ]]; do DRY_RUN=1; shift; done
  if [[ "${1:-}" == -- ]]; then shift; fi
  case "$command" in
    run) cmd_run "$tpu" "$zone" "$@" ;;
    logs) cmd_logs "$tpu" "$zone" "$@" ;;
    status) cmd_status "$tpu" "$zone" "$@" ;;
    stop) cmd_stop "$tpu" "$zone" "$@" ;;
    *) echo "$SCRIPT: unknown command '$command'" >&2; usage ;;
  esac
}

main "$@"
