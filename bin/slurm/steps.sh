# shellcheck shell=bash
# The steps of GLM-5's post-training sequence, as shell functions; sourced by bin/pipeline (one
# machine, steps in order) and by every bin/slurm/*.sbatch job (one step per job).
#
# Every step is one glmpost command reading its options from the recipe section named after it
# (`--config "$PIPELINE_RECIPE"`), with inputs and outputs taken from the plan that
#   python -m glmpost.pipeline RECIPE --shell
# prints (PIPELINE_* variables: see glmpost/pipeline/). Each step writes its own output folder
# and every stage skips what it already finished (existing shards, published versions), so a rerun
# of any step, or of the whole chain, only does the missing work.
#
# Variables the caller may set:
#   GLMPOST_ROOT        the glmpost repository (default: two levels above this file)
#   GLMPOST_PYTHON      the Python with glmpost installed (default: $GLMPOST_ROOT/.venv/bin/python)
#   GLMPOST_RANK_LAUNCH how multi-rank steps start their ranks: torchrun (one machine; bin/pipeline)
#                       or srun (inside a Slurm allocation; the sbatch templates set it)

GLMPOST_ROOT="${GLMPOST_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
GLMPOST_PYTHON="${GLMPOST_PYTHON:-$GLMPOST_ROOT/.venv/bin/python}"
GLMPOST_RANK_LAUNCH="${GLMPOST_RANK_LAUNCH:-torchrun}"
export TQDM_DISABLE="${TQDM_DISABLE:-1}"

glmpost() { "$GLMPOST_PYTHON" -m glmpost.commands.app "$@"; }

say() { printf '%s\n' "$*" >&2; }

# --- the environment of the recipe's launcher (cpu | cuda | npu) -------------------------------
launcher_env() {
  case "$PIPELINE_LAUNCHER" in
    cpu)
      # DeepSpeed on CPU (gloo): no accelerator; one OpenMP thread per allotted core.
      export DS_ACCELERATOR=cpu
      export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"
      ;;
    cuda)
      # Slurm's gres plugin sets CUDA_VISIBLE_DEVICES to the allocated GPUs; every rank sees the
      # node's GPUs and takes cuda:$LOCAL_RANK. NCCL picks the interconnect itself; on a cluster
      # whose default interface is wrong set NCCL_SOCKET_IFNAME (e.g. ib0) in the environment.
      export DS_ACCELERATOR=cuda
      export NCCL_ASYNC_ERROR_HANDLING="${NCCL_ASYNC_ERROR_HANDLING:-1}"
      ;;
    npu)
      # Ascend: CANN's environment (compiler, runtime, HCCL) comes from set_env.sh of the toolkit;
      # ASCEND_TOOLKIT_HOME is where the admin installed it (default CANN path below).
      local toolkit="${ASCEND_TOOLKIT_HOME:-/usr/local/Ascend/ascend-toolkit/latest}"
      if [[ ! -f "$toolkit/set_env.sh" ]]; then
        say "glmpost pipeline: launcher npu: $toolkit/set_env.sh not found; set ASCEND_TOOLKIT_HOME to the CANN toolkit"
        return 2
      fi
      # shellcheck disable=SC1091
      set +u; source "$toolkit/set_env.sh"; set -u
      export DS_ACCELERATOR=npu
      # Every rank sees all NPUs of its node and takes npu:$LOCAL_RANK (torch_npu numbers the
      # visible ones from 0). Without a Slurm gres for NPUs, list them here (8 per Atlas node).
      export ASCEND_RT_VISIBLE_DEVICES="${ASCEND_RT_VISIBLE_DEVICES:-$(seq -s, 0 $((PIPELINE_TRAIN_RANKS - 1)))}"
      # HCCL: generous timeouts for the first all-reduce of a large model (seconds); the interface
      # HCCL uses between nodes (set HCCL_SOCKET_IFNAME / HCCL_IF_IP if the default is wrong).
      export HCCL_CONNECT_TIMEOUT="${HCCL_CONNECT_TIMEOUT:-1200}"
      export HCCL_EXEC_TIMEOUT="${HCCL_EXEC_TIMEOUT:-1800}"
      export HCCL_BUFFSIZE="${HCCL_BUFFSIZE:-200}"  # MiB per communication buffer
      ;;
    *)
      say "glmpost pipeline: unknown launcher '$PIPELINE_LAUNCHER' (cpu, cuda, npu)"
      return 2
      ;;
  esac
}

# --- ranks --------------------------------------------------------------------------------------
# launch_ranks NPROC_PER_NODE NODES GLMPOST_ARGS...: run one glmpost command as NODES x NPROC ranks.
# glmpost's TrainingSession reads the torchrun variables (RANK, LOCAL_RANK, WORLD_SIZE,
# MASTER_ADDR, MASTER_PORT) and starts DeepSpeed ZeRO with hccl / nccl / gloo for the device.
launch_ranks() {
  local per_node=$1 nodes=$2
  shift 2
  local world=$((per_node * nodes))
  if ((world == 1)); then
    glmpost "$@"
    return
  fi
  case "$GLMPOST_RANK_LAUNCH" in
    torchrun)
      if ((nodes > 1)); then
        say "glmpost pipeline: train-nodes $nodes needs Slurm (bin/slurm/submit-pipeline); bin/pipeline runs on one machine"
        return 2
      fi
      "$GLMPOST_PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$per_node" \
        -m glmpost.commands.app "$@"
      ;;
    srun)
      # One Slurm task per rank (the job asked for --ntasks-per-node=NPROC --nodes=NODES). The
      # rendezvous is torch's env:// one: rank 0's node (its NodeAddr from slurm.conf, which other
      # nodes reach it by, else its host name) and a port free on it now: the batch script runs on
      # that node (a port derived from the job id collided when two jobs, or two clusters' jobs
      # with the same id, shared a node).
      local first
      first="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
      # (GLMPOST_MASTER_ADDR / GLMPOST_MASTER_PORT override them; a MASTER_* the submitting shell
      # exported is not trusted: it may belong to another job.)
      MASTER_ADDR="${GLMPOST_MASTER_ADDR:-$(scontrol -o show node "$first" | sed -n 's/.* NodeAddr=\([^ ]*\).*/\1/p')}"
      MASTER_ADDR="${MASTER_ADDR:-$first}"
      MASTER_PORT="${GLMPOST_MASTER_PORT:-$("$GLMPOST_PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}"
      export MASTER_ADDR MASTER_PORT
      srun --nodes="$nodes" --ntasks="$world" --ntasks-per-node="$per_node" --kill-on-bad-exit=1 \
        "$GLMPOST_ROOT/bin/slurm/rank-env" "$GLMPOST_PYTHON" -m glmpost.commands.app "$@"
      ;;
    *)
      say "glmpost pipeline: GLMPOST_RANK_LAUNCH must be torchrun or srun, not '$GLMPOST_RANK_LAUNCH'"
      return 2
      ;;
  esac
}

# resume_flags ROOT VERSION_DIR: what a training step passes when an earlier attempt was killed
# after it began VERSION_DIR: --resume where it saved resumable state, else --overwrite (start the
# update over), nothing when no attempt is pending.
resume_flags() {
  local staging="$1/.staging-$(basename "$2")"
  [[ -d "$2" || ! -d "$staging" ]] && return 0
  local flag=--overwrite
  [[ -f "$staging/trainer_state/resume.pt" ]] && flag=--resume
  say "glmpost pipeline: an interrupted attempt left $staging; this attempt passes $flag"
  echo "$flag"
}

# already_published DIR STEP: a step whose whole output directory is published by one atomic rename
# (init-model, quantize, and the version a training step writes) is done when DIR/glmpost.json
# exists, exactly as the stage itself decides; say so instead of starting it (or its ranks) again.
already_published() {
  [[ -f "$1/glmpost.json" ]] || return 1
  say "glmpost pipeline: $2: $1 is already published; skipped"
}

runs_stage() { [[ " ${PIPELINE_STAGES[*]} " == *" $1 "* ]]; }

# --- the steps ----------------------------------------------------------------------------------
# The plan lists every step (glmpost/pipeline/steps.py): PIPELINE_STEP_NAME[i], _STAGE[i], _LABEL[i],
# _RANKS[i] (1: train-nodes x train-ranks processes), _TASKS[i] (>0: tasks splitting the work),
# _PUBLISHED[i] (done when it holds glmpost.json), _RESUME_ROOT[i] and the argv PIPELINE_STEP_ARGV_i.

# step_index STAGE KEY: the index of the step of STAGE with KEY (the argument of its sbatch template).
step_index() {
  local i
  for ((i = 0; i < PIPELINE_STEP_COUNT; i++)); do
    if [[ "${PIPELINE_STEP_STAGE[$i]}" == "$1" && "${PIPELINE_STEP_KEY[$i]}" == "$2" ]]; then echo "$i"; return 0; fi
  done
  say "glmpost pipeline: the plan has no $1 step${2:+ for '$2'} (stages: ${PIPELINE_STAGES[*]})"
  return 2
}

# run_pipeline_step INDEX [TASK TASKS]: run step INDEX (as task TASK of TASKS when it splits its work).
run_pipeline_step() {
  local i=$1 task=${2:-0} tasks=${3:-1} extra=()
  local -n argv="PIPELINE_STEP_ARGV_$i"
  local published="${PIPELINE_STEP_PUBLISHED[$i]}" root="${PIPELINE_STEP_RESUME_ROOT[$i]}"
  if [[ -n "$published" ]]; then already_published "$published" "${PIPELINE_STEP_STAGE[$i]}" && return 0; fi
  ((PIPELINE_STEP_TASKS[i] > 0)) && extra+=(--shard-index "$task" --num-shards "$tasks")
  if [[ -n "$root" ]]; then
    local flag
    flag="$(resume_flags "$root" "$published")"
    [[ -n "$flag" ]] && extra+=("$flag")
  fi
  if ((PIPELINE_STEP_RANKS[i])); then
    launch_ranks "$PIPELINE_TRAIN_RANKS" "$PIPELINE_TRAIN_NODES" "${argv[@]}" "${extra[@]}"
  else
    glmpost "${argv[@]}" "${extra[@]}"
  fi
}

# --- inside a Slurm job -------------------------------------------------------------------------
# slurm_job_start: load the plan bin/slurm/submit-pipeline wrote (PIPELINE_PLAN) and the launcher's
# environment; multi-rank steps start their ranks with srun inside this job's allocation.
slurm_job_start() {
  : "${PIPELINE_PLAN:?submit with bin/slurm/submit-pipeline (it exports PIPELINE_PLAN)}"
  # shellcheck disable=SC1090
  source "$PIPELINE_PLAN"
  GLMPOST_RANK_LAUNCH=srun
  launcher_env
  say "glmpost pipeline: job ${SLURM_JOB_ID:-?} on $(hostname -s) (${SLURM_JOB_NODELIST:-}), launcher $PIPELINE_LAUNCHER, recipe $PIPELINE_RECIPE"
}

# slurm_run_step NAME FUNCTION ARGS...: run one step; on failure say in this job's log (and in
# RUN_DIR/slurm/failed.log) what failed and how to resume. Slurm then cancels every job that
# depends on this one (they were submitted with --kill-on-invalid-dep=yes).
slurm_run_step() {
  local name=$1 rc=0 t0=$SECONDS
  shift
  say "== $name"
  "$@" || rc=$?
  if ((rc != 0)); then
    local job="${SLURM_JOB_ID:-?}"
    [[ -n "${SLURM_ARRAY_JOB_ID:-}" ]] && job="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
    local message="glmpost pipeline: step '$name' (job $job) failed with exit $rc; the jobs after it are cancelled. Fix the cause (see this job's log), then resume with: ${PIPELINE_RESUME:-bin/slurm/submit-pipeline $PIPELINE_RECIPE} (finished steps are skipped)"
    say "$message"
    mkdir -p "$PIPELINE_RUN_DIR/slurm"
    printf '%s\n' "$message" >>"$PIPELINE_RUN_DIR/slurm/failed.log"
    return "$rc"
  fi
  say "-- $name: done in $((SECONDS - t0)) s"
}

# slurm_step INDEX: run step INDEX as this job (a split step: as this array task of the array).
slurm_step() {
  local i=$1 label="${PIPELINE_STEP_LABEL[$1]}" task=0 tasks=1
  if ((PIPELINE_STEP_TASKS[i] > 0)); then
    task="${SLURM_ARRAY_TASK_ID:-0}" tasks="${SLURM_ARRAY_TASK_COUNT:-1}"
    label+=", task $task of $tasks"
  fi
  slurm_run_step "$label" run_pipeline_step "$i" "$task" "$tasks"
}
