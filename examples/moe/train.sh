#!/usr/bin/env bash
# MoE GPT pretraining launcher: one script for Slurm clusters and for a local CPU smoke run.
#
#   bash examples/moe/train.sh                                        # local: torchrun, tiny_cpu
#   sbatch --ntasks-per-node=4 examples/moe/train.sh                  # tiny_cpu on a Slurm cluster
#   RECIPE=mixtral_8x7b_pp sbatch --nodes=4 --gpus-per-node=8 examples/moe/train.sh   # 4 x 8 GPUs
#   bash examples/moe/train.sh --list                                 # recipe names
#   DRY_RUN=1 RECIPE=qwen3_30b_a3b_fsdp bash examples/moe/train.sh    # check layout, no training
#
# Environment: RECIPE (default tiny_cpu), DATA_PATH (megatron --data-path value, blends allowed;
# unset -> mock data), TOKENIZER_MODEL (with DATA_PATH: the local tokenizer folder it was
# tokenized with), RUN_DIR (the run's folder, default runs/$RECIPE: megatron's argument dump
# goes to $RUN_DIR/megatron_arguments.txt, named in the log, and its rejected results to
# $RUN_DIR/rejected_results.txt), CKPT_DIR (default $RUN_DIR/ckpt),
# WANDB_PROJECT, WANDB_EXP_NAME,
# EXTRA_ARGS (extra megatron flags, appended last, so they override the recipe), NPROC (local
# ranks, default the recipe's GPUS_PER_NODE), PYTHON (default .venv/bin/python if present, else
# python), NODES / GPUS_PER_NODE (override the recipe's size), LOG_INTERVAL (default the
# recipe's: 10 on GPU recipes, 1 on CPU ones), DRY_RUN=1, CONTAINER_IMAGE (pyxis/enroot image
# for srun), CONTAINER_MOUNTS (extra src:dst[,...] mounts), MASTER_ADDR (default the job's first node), MASTER_PORT. A recipe's
# RUN_ENV (e.g. CUDA_DEVICE_MAX_CONNECTIONS=1 for TP without FSDP) is exported for every rank
# unless the variable is already set. Arguments other than --list, --dry-run and --help are
# passed to pretrain_moe.py after everything else.
#
# Under Slurm the job must have as many tasks as the recipe has ranks (NODES x GPUS_PER_NODE);
# account, partition and GPUs are the cluster's: give them on the sbatch command line. SIGTERM
# (scancel, scontrol requeue, the time limit) makes every rank save a checkpoint at the end of
# its iteration; USR1, sent --signal's lead time before the time limit, does the same and then
# requeues the job, which resumes from that checkpoint. A requeued job appends to its log.
# A NaN/Inf loss that megatron reproduces (exit 16) holds the job, printing the command that
# reruns it on another node; reproduced there too (exit 17; 16 again under Megatron-FSDP), the
# job requeues itself and skips that batch ($RUN_DIR/rejected_results.txt, megatron's
# --result-rejected-tracker-filename).
# Without Slurm, exit 16 says which --iterations-to-skip to add to EXTRA_ARGS to skip the batch.
#
#SBATCH --job-name=moe-pretrain
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --time=04:00:00
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@300
set -euo pipefail

die() { echo "train.sh: $*" >&2; exit 2; }

# sbatch runs a copy of this script from its spool directory, so fall back to the submit dir.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ -n "${MOE_ROOT:-}" ]]; then
  ROOT=$MOE_ROOT
elif [[ -f "$here/plan.py" ]]; then
  ROOT=$(cd "$here/../.." && pwd)
elif [[ -n "${SLURM_SUBMIT_DIR:-}" && -f "$SLURM_SUBMIT_DIR/examples/moe/plan.py" ]]; then
  ROOT=$SLURM_SUBMIT_DIR
else
  die "cannot find the repository: submit from its root or set MOE_ROOT=/path/to/checkout"
fi
cd "$ROOT"
RECIPE_DIR=$ROOT/examples/moe/recipes

list_recipes() {
  local f name
  for f in "$RECIPE_DIR"/*.sh; do
    name=$(basename "$f" .sh)
    [[ $name == _* ]] || echo "$name"
  done
}

DRY_RUN=${DRY_RUN:-0}
CLI_ARGS=()
for arg in "$@"; do
  case $arg in
    --list) list_recipes; exit 0 ;;
    --dry-run) DRY_RUN=1 ;;
    --print-args) DRY_RUN=print ;;  # the resolved megatron flags, NUL-separated (for tests)
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | grep -v '^set' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) CLI_ARGS+=("$arg") ;;
  esac
done

RECIPE=${RECIPE:-tiny_cpu}
if [[ $RECIPE == _* || ! -f "$RECIPE_DIR/$RECIPE.sh" ]]; then
  echo "train.sh: unknown RECIPE '$RECIPE'; available recipes:" >&2
  list_recipes >&2
  exit 2
fi

# Environment overrides win over the recipe's values.
env_nodes=${NODES:-}
env_gpus=${GPUS_PER_NODE:-}
NODES=1
GPUS_PER_NODE=8
VOCAB_SIZE=
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
TOKENIZER_HUB_ID=  # a GPU recipe's published tokenizer, named in the download hint
TOKENIZER_HUB_FILES="'tokenizer*'"  # the files of it that the hint downloads (--include)
TOKENIZER_HUB_NOTE=  # what else the published tokenizer needs, said after the hint
IMPL_ARGS=()
MODEL_ARGS=()
LAYOUT_ARGS=()
TRAIN_ARGS=()
RUN_ENV=()  # NAME=VALUE pairs the recipe's layout needs in the environment of every rank
RECIPE_LOG_INTERVAL=1  # the recipe's --log-interval; LOG_INTERVAL overrides it
# shellcheck source=/dev/null
source "$RECIPE_DIR/$RECIPE.sh"
NODES=${env_nodes:-$NODES}
GPUS_PER_NODE=${env_gpus:-$GPUS_PER_NODE}

# DATA_PATH's tokens come from a local tokenizer folder (prepare_data's --tokenizer), which every
# rank loads: megatron's HuggingFaceTokenizer would download anything else from the Hugging Face
# hub, on every rank. In a container the path is the container's: there pretrain_moe.py's
# preflight checks it, on every rank, before any work.
check_tokenizer_model() {
  local fix="set TOKENIZER_MODEL to the local tokenizer folder that DATA_PATH was tokenized with (prepare_data's --tokenizer)"
  if [[ -n $TOKENIZER_HUB_ID ]]; then
    fix+="; recipe $RECIPE's tokenizer is published as $TOKENIZER_HUB_ID: \`hf download $TOKENIZER_HUB_ID --include $TOKENIZER_HUB_FILES --local-dir DIR\` makes that folder"
    [[ -z $TOKENIZER_HUB_NOTE ]] || fix+=" ($TOKENIZER_HUB_NOTE)"
  fi
  [[ -n $TOKENIZER_MODEL ]] || die "DATA_PATH is set but TOKENIZER_MODEL is not; fix: $fix"
  [[ -z ${CONTAINER_IMAGE:-} ]] || return 0
  [[ -d $TOKENIZER_MODEL ]] ||
    die "TOKENIZER_MODEL=$TOKENIZER_MODEL is not a local folder (megatron would download a hub id on every rank); fix: $fix"
  [[ -f $TOKENIZER_MODEL/tokenizer.json || -f $TOKENIZER_MODEL/tokenizer_config.json ]] ||
    die "TOKENIZER_MODEL=$TOKENIZER_MODEL has neither tokenizer.json nor tokenizer_config.json; fix: $fix"
}

data_path=()
if [[ -n "${DATA_PATH:-}" ]]; then
  check_tokenizer_model
  read -ra data_path <<< "$DATA_PATH"
  DATA_ARGS=(--data-path "${data_path[@]}" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
else
  DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$VOCAB_SIZE")
fi

RUN_DIR=${RUN_DIR:-runs/$RECIPE}
CKPT_DIR=${CKPT_DIR:-$RUN_DIR/ckpt}
# megatron's 800-line argument dump goes to a file (pretrain_moe.py writes it on rank 0).
export MEGATRON_ARGUMENTS_FILE=${MEGATRON_ARGUMENTS_FILE:-$RUN_DIR/megatron_arguments.txt}
# --exit-signal-handler: on SIGTERM every rank finishes its iteration, saves and exits 0.
CKPT_ARGS=(--save "$CKPT_DIR" --load "$CKPT_DIR" --exit-signal-handler)
# megatron's rerun state machine checks every loss and gradient; each result it rejects is
# appended here, and a start skips an iteration one rank failed twice. One file for every
# attempt of the run: without it, a batch that fails wherever it runs is never got past.
RERUN_ARGS=(--result-rejected-tracker-filename "$RUN_DIR/rejected_results.txt")
LOG_ARGS=(--log-interval "${LOG_INTERVAL:-$RECIPE_LOG_INTERVAL}" --log-throughput)
if [[ -n "${WANDB_PROJECT:-}" ]]; then
  LOG_ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "${WANDB_EXP_NAME:-$RECIPE-${SLURM_JOB_ID:-local}}")
fi
read -ra extra <<< "${EXTRA_ARGS:-}"

ARGS=("${MODEL_ARGS[@]}" "${IMPL_ARGS[@]}" "${LAYOUT_ARGS[@]}" "${TRAIN_ARGS[@]}"
      "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "${RERUN_ARGS[@]}" "${LOG_ARGS[@]}" "${extra[@]}"
      "${CLI_ARGS[@]}")

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -z "${CONTAINER_IMAGE:-}" && -x "$ROOT/.venv/bin/python" ]]; then
    PYTHON=$ROOT/.venv/bin/python
  else
    PYTHON=python
  fi
fi

show() { printf '%q ' "$@" | sed 's/ $//'; echo; }

# The value megatron's parser will see for a flag: its last occurrence in ARGS.
flag_value() {
  local value="" i
  for ((i = 0; i < ${#ARGS[@]}; i++)); do
    case ${ARGS[i]} in
      "$1") value=${ARGS[i + 1]:-} ;;
      "$1="*) value=${ARGS[i]#*=} ;;
    esac
  done
  echo "$value"
}

# True when --load holds a checkpoint at (or past) --train-iters: megatron would load it and
# exit 0 without training.
run_finished() {
  local load iters tracker
  load=$(flag_value --load)
  iters=$(flag_value --train-iters)
  tracker=$load/latest_checkpointed_iteration.txt
  [[ -n $load && $iters =~ ^[0-9]+$ && -f $tracker ]] || return 1
  SAVED_ITERATION=$(<"$tracker")
  [[ $SAVED_ITERATION =~ ^[0-9]+$ ]] && (( SAVED_ITERATION >= iters ))
}

exit_if_finished() {
  run_finished || return 0
  echo "[train.sh] nothing to train: $(flag_value --load) holds iteration $SAVED_ITERATION and" \
       "--train-iters is $(flag_value --train-iters), so this run is finished. To train further," \
       "raise TRAIN_ITERS (or --train-iters in EXTRA_ARGS) and add --override-opt_param-scheduler" \
       "to EXTRA_ARGS, so that megatron takes the learning-rate schedule from the new flags" \
       "instead of refusing the checkpoint's; for a new run, set another CKPT_DIR."
  exit 0
}

# The tracker of rejected results (RERUN_ARGS, or the one EXTRA_ARGS names), made before the
# ranks start: every rank opens it and fails when its folder is missing, and megatron's first
# start logs an error when the file is not there yet.
TRACKER=$(flag_value --result-rejected-tracker-filename)
make_tracker() {
  [[ -z $TRACKER ]] || { mkdir -p "$(dirname "$TRACKER")" && touch "$TRACKER"; }
}
tracker_lines() { if [[ -n $TRACKER ]]; then wc -l < "$TRACKER"; else echo 0; fi; }

# megatron's rerun state machine stops every rank after a NaN/Inf loss it rejected: with 16 where
# a rerun in place reproduced it (it saved a checkpoint; the step must be rerun on another GPU),
# 17 where it was reproduced on a second node. Neither torchrun nor srun passes that code on.
# rejected_verdict reads it from the tracker lines this attempt appended (rejected_results.awk):
# sets VERDICT, ITERATION and NODE (megatron's host name), after a 17 FIRST_NODE (the host that
# gave the 16), after a 16 FIRST_NODE where an earlier attempt gave a 16 for it too (Megatron-FSDP:
# its checkpoints keep no rerun state, so the rerun on another node gives 16, not 17), and fails
# where there is none.
rejected_verdict() {
  [[ -n $TRACKER && -f $TRACKER ]] || return 1
  FIRST_NODE=
  read -r VERDICT ITERATION NODE FIRST_NODE < <(awk -v verdict_after="$TRACKER_LINES_BEFORE" \
                                                  -f examples/moe/rejected_results.awk \
                                                  "$TRACKER") || true
  [[ -n ${VERDICT:-} ]]
}
# True where megatron's reading of the tracker at its next start skips iteration $1.
megatron_skips() { awk -f examples/moe/rejected_results.awk "$TRACKER" | grep -qx "$1"; }
# True where a 16 for iteration $1 follows one an earlier attempt gave for it on another node:
# two GPUs reproduced the NaN/Inf, so its batch is at fault, as megatron's 17 would say; and
# megatron's next start skips it.
reproduced_on_two_nodes() {
  [[ -n $FIRST_NODE && $FIRST_NODE != "$NODE" ]] && megatron_skips "$1"
}
# Waits for background job $1 through the signals this shell traps (each ends a wait); sets
# status to its exit status.
wait_for_exit() {
  while kill -0 "$1" 2>/dev/null; do wait "$1" || true; done
  status=0
  wait "$1" || status=$?
}

# On one machine there is no other node to rerun a batch on: say how to get past it; the exit
# status becomes megatron's.
after_local_result_validation() {
  rejected_verdict || return 0
  if [[ $VERDICT == FIRST_RERUN_REPRODUCIBLE ]] && reproduced_on_two_nodes "$ITERATION"; then
    status=16
    echo "[train.sh] iteration $ITERATION gave a NaN/Inf again when megatron reran it (exit 16)," \
         "as it did on $FIRST_NODE: its batch, not a GPU. Run again: the next start skips" \
         "iteration $ITERATION ($TRACKER) and trains on from $(flag_value --load)"
    return 0
  fi
  if [[ $VERDICT == FIRST_RERUN_REPRODUCIBLE ]]; then
    status=16
    echo "[train.sh] iteration $ITERATION gave a NaN/Inf again when megatron reran it (exit 16);" \
         "megatron saved a checkpoint to rerun it on another GPU, and on this one it would exit 16" \
         "again. To skip that batch, run again with --iterations-to-skip $ITERATION added to" \
         "EXTRA_ARGS: it resumes from $(flag_value --load) and trains on"
    return 0
  fi
  status=17
  if megatron_skips "$ITERATION"; then
    echo "[train.sh] iteration $ITERATION gave a NaN/Inf on a second node ($NODE) too: its batch," \
         "not a GPU (exit 17). Run again: the next start skips iteration $ITERATION ($TRACKER)" \
         "and trains on from $(flag_value --load)"
  else
    echo "[train.sh] iteration $ITERATION gave a NaN/Inf on a second node ($NODE) too (exit 17)," \
         "and megatron does not skip it (several ranks of a job failed it, see $TRACKER): run" \
         "again with --iterations-to-skip $ITERATION added to EXTRA_ARGS to skip it"
  fi
}

WORLD=$((NODES * GPUS_PER_NODE))
SUBMIT="RECIPE=$RECIPE sbatch --nodes=$NODES --ntasks-per-node=$GPUS_PER_NODE examples/moe/train.sh"
# The job must hold exactly the recipe's ranks: more would change the data-parallel size and
# the layout; fewer cannot run it. srun without a task count starts one task per node.
check_job_size() {
  local tasks=${SLURM_NTASKS:-${SLURM_JOB_NUM_NODES:-1}}
  (( tasks == WORLD )) && return 0
  die "recipe $RECIPE runs $WORLD ranks ($NODES node(s) x $GPUS_PER_NODE), but job $SLURM_JOB_ID" \
      "has $tasks task(s) on ${SLURM_JOB_NUM_NODES:-?} node(s); fix: submit it as '$SUBMIT'" \
      "(with --gpus-per-node=$GPUS_PER_NODE where the ranks use GPUs), or set NODES and" \
      "GPUS_PER_NODE to the job's size after checking that size with DRY_RUN=1"
}

if [[ "$DRY_RUN" == print ]]; then
  printf '%s\0' "${ARGS[@]}"
  exit 0
fi
# Exported before Python starts, so CUDA reads them when it initialises (srun and torchrun pass
# the environment to every rank); a value already in the environment wins.
for pair in "${RUN_ENV[@]}"; do
  name=${pair%%=*}
  if [[ -z "${!name+set}" ]]; then
    export "${name}=${pair#*=}"
    echo "[train.sh] recipe $RECIPE: $pair"
  fi
done

if [[ "$DRY_RUN" == 1 ]]; then
  if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    check_job_size
    size="job $SLURM_JOB_ID: $SLURM_JOB_NUM_NODES node(s), tasks per node ${SLURM_TASKS_PER_NODE:-1}"
  else
    size="$NODES node(s) x $GPUS_PER_NODE"
  fi
  echo "[train.sh] recipe $RECIPE: dry run for $WORLD ranks ($size)"
  echo "[train.sh] command: $(show "$PYTHON" pretrain_moe.py "${ARGS[@]}")"
  if [[ -z "${SLURM_JOB_ID:-}" ]]; then
    echo "[train.sh] submit with: $SUBMIT (add --gpus-per-node=$GPUS_PER_NODE where the ranks" \
         "use GPUs, and your cluster's --account/--partition if it needs them)"
  fi
  exec "$PYTHON" examples/moe/plan.py --world-size "$WORLD" ${VOCAB_SIZE:+--vocab-size-hint "$VOCAB_SIZE"} \
    ${GPU_MEMORY_GIB:+--gpu-memory-gib "$GPU_MEMORY_GIB"} -- "${ARGS[@]}"
fi
[[ -f pretrain_moe.py ]] || die "pretrain_moe.py not found in $ROOT"

if [[ -z "${SLURM_JOB_ID:-}" ]]; then
  if (( NODES > 1 )); then
    die "recipe $RECIPE assumes $NODES nodes: submit it with '$SUBMIT' (or DRY_RUN=1 to check it here)"
  fi
  exit_if_finished
  make_tracker
  NPROC=${NPROC:-$GPUS_PER_NODE}
  LAUNCH=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node="$NPROC")
  echo "[train.sh] recipe $RECIPE on this machine (no Slurm): torchrun with $NPROC ranks"
  echo "[train.sh] command: $(show "${LAUNCH[@]}" pretrain_moe.py "${ARGS[@]}")"
  # Not exec'd: torchrun exits 1 whatever its ranks' exit codes were, and megatron's verdict on a
  # NaN/Inf loss is read afterwards from the tracker. torchrun runs in a process group of its own
  # (set -m; its ranks have sessions of their own) and gets what this shell gets, once, as if
  # exec'd. It passes the signal on to the ranks: on SIGTERM they save (--exit-signal-handler);
  # on Ctrl-C (SIGINT) they stop without saving, as before.
  TRACKER_LINES_BEFORE=$(tracker_lines)
  set -m
  "${LAUNCH[@]}" pretrain_moe.py "${ARGS[@]}" &  # torch.distributed.run takes the script itself
  torchrun_pid=$!
  set +m
  trap 'kill -INT "$torchrun_pid" 2>/dev/null || true' INT
  trap 'kill -TERM "$torchrun_pid" 2>/dev/null || true' TERM
  wait_for_exit "$torchrun_pid"
  (( status == 0 )) || after_local_result_validation
  exit "$status"
fi

# ---- Under Slurm: one srun task per rank ----------------------------------------------------
check_job_size
first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
if [[ -n "${MASTER_ADDR:-}" ]]; then
  addr_origin="set by you"
else
  MASTER_ADDR=$first_node
  addr_origin="the job's first node"
fi
# Every rank connects to MASTER_ADDR; a name that does not resolve would wait there until the
# rendezvous times out.
if ! command -v getent >/dev/null; then
  echo "[train.sh] no getent on $(hostname): MASTER_ADDR=$MASTER_ADDR is used unchecked"
elif ! getent ahosts "$MASTER_ADDR" >/dev/null; then
  die "MASTER_ADDR=$MASTER_ADDR ($addr_origin) does not resolve on $(hostname); fix: set" \
      "MASTER_ADDR to an address of $first_node that every node of the job can reach"
fi
# Below Linux's ephemeral range (32768-60999), where a port may already be taken by a connection.
MASTER_PORT=${MASTER_PORT:-$((10000 + SLURM_JOB_ID % 20000))}
export MASTER_ADDR MASTER_PORT
exit_if_finished

SRUN=(srun --kill-on-bad-exit=1)
# Whether PATH lies in a destination of the src:dst[:flags],... mounts in $2.
mounted() {
  local entry destination
  local -a entries
  IFS=, read -ra entries <<< "$2"
  for entry in "${entries[@]}"; do
    destination=${entry#*:}
    destination=${destination%%:*}
    [[ $1 == "$destination" || $1 == "$destination"/* ]] && return 0
  done
  return 1
}
if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
  # The checkout is mounted at the same path, so code, runs/ and relative paths match. What the
  # job writes elsewhere (RUN_DIR, CKPT_DIR) is mounted too: written inside the container, it
  # would be lost with it.
  mounts="$ROOT:$ROOT${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}"
  for written in "$RUN_DIR" "$CKPT_DIR" ${TRACKER:+"$(dirname "$TRACKER")"}; do
    written=$(realpath -m "$written")
    mounted "$written" "$mounts" && continue
    mkdir -p "$written"  # the container runtime mounts only what exists
    mounts+=",$written:$written"
    echo "[train.sh] $written is mounted into the container: the job writes there"
  done
  # What it reads from this node's filesystems (DATA_PATH's folders, TOKENIZER_MODEL) is mounted
  # read-only the same way. A path that is not here is left to the image or CONTAINER_MOUNTS
  # (pretrain_moe.py's preflight checks it inside the container, on every rank, before work).
  read_folders=()
  for entry in "${data_path[@]}"; do
    [[ $entry =~ ^[0-9.eE+-]+$ ]] || read_folders+=("$(dirname "$entry")")  # not a blend weight
  done
  [[ -z ${DATA_PATH:-} ]] || read_folders+=("$TOKENIZER_MODEL")
  for read_folder in "${read_folders[@]}"; do
    read_folder=$(realpath -m "$read_folder")
    mounted "$read_folder" "$mounts" && continue
    if [[ -d $read_folder ]]; then
      mounts+=",$read_folder:$read_folder:ro"
      echo "[train.sh] $read_folder is mounted into the container read-only: the job reads there"
    else
      echo "[train.sh] $read_folder is not on this node nor under CONTAINER_MOUNTS: it must be" \
           "in the image (pretrain_moe.py checks it there before work)"
    fi
  done
  SRUN+=(--container-image="$CONTAINER_IMAGE" --container-workdir="$ROOT"
         --container-mounts="$mounts")
fi
# One task per rank; each sets its rank variables from Slurm's before starting Python, and one
# OpenMP thread unless told otherwise, as torchrun does.
# shellcheck disable=SC2016
LAUNCH=("${SRUN[@]}" bash -c 'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; exec "$@"' rank)
echo "[train.sh] recipe $RECIPE, job $SLURM_JOB_ID attempt $((${SLURM_RESTART_COUNT:-0} + 1)):" \
     "$SLURM_JOB_NUM_NODES node(s), $WORLD ranks, MASTER_ADDR=$MASTER_ADDR ($addr_origin)" \
     "MASTER_PORT=$MASTER_PORT"
echo "[train.sh] command: $(show "${LAUNCH[@]}" "$PYTHON" pretrain_moe.py "${ARGS[@]}")"

# srun's status does not carry megatron's 16/17 either: --kill-on-bad-exit ends the ranks still
# exiting after the first, and srun then returns 143 (rejected_verdict reads it).
# The Slurm name of host $1 (megatron names uname's) among the nodes of hostlist $2 (default: the
# job's), or $1 itself.
slurm_node_of() {
  local n
  for n in $(scontrol show hostnames "${2:-$SLURM_JOB_NODELIST}"); do
    if [[ $n == "$1" || $n == "${1%%.*}" ]] ||
       scontrol show node -o "$n" 2>/dev/null | grep -q " NodeHostName=$1 "; then
      echo "$n"
      return
    fi
  done
  echo "$1"
}
# The job's excluded nodes (sbatch --exclude, scontrol update ExcNodeList), one per line.
excluded_nodes() {
  local list
  list=$(scontrol show job -o "$SLURM_JOB_ID" | grep -o ' ExcNodeList=[^ ]*' | cut -d= -f2)
  [[ -z $list || $list == "(null)" ]] || scontrol show hostnames "$list"
}
# After a 17 the host that gave the 16 ($1) is cleared: the NaN/Inf was the batch's. Where the
# job excludes its node (train.sh's advice at the 16), that exclusion is lifted, the others kept,
# as the job requeues (a running job's ExcNodeList cannot change: it is held, updated, released).
# Returns non-zero where it requeued nothing.
requeue_without_exclusion_of() {
  local excluded node kept
  excluded=$(excluded_nodes)
  [[ -n $1 && -n $excluded ]] || return 1
  node=$(slurm_node_of "$1" "$(paste -sd, - <<< "$excluded")")
  grep -qx "$node" <<< "$excluded" || return 1
  kept=$(grep -vx "$node" <<< "$excluded" | paste -sd, -)
  scontrol requeuehold "$SLURM_JOB_ID" || return 1
  if scontrol update jobid="$SLURM_JOB_ID" ExcNodeList="$kept"; then
    echo "[train.sh] $node gave that NaN/Inf too and is not at fault: the job no longer excludes" \
         "it (ExcNodeList=${kept:-(none)})"
  else
    echo "train.sh: scontrol update jobid=$SLURM_JOB_ID ExcNodeList=$kept failed: the job" \
         "still excludes $node" >&2
  fi
  scontrol release "$SLURM_JOB_ID" ||
    echo "train.sh: scontrol release $SLURM_JOB_ID failed: the job is held; release it with" \
         "scontrol release $SLURM_JOB_ID" >&2
  return 0
}
after_result_validation() {  # on a stop of the ranks; returns when the job is not held or requeued
  local verdict iteration node excluded
  rejected_verdict || return 0
  verdict=$VERDICT iteration=$ITERATION node=$(slurm_node_of "$NODE")
  # Holding or requeueing the job sends this shell SIGTERM: no rank is left to save.
  trap '' TERM
  # status: the job's exit code, megatron's again
  if [[ $verdict == FIRST_RERUN_REPRODUCIBLE ]] && ! reproduced_on_two_nodes "$iteration"; then
    status=16
    excluded=$( (excluded_nodes; echo "$node") | paste -sd, -)  # keeps the job's own exclusions
    echo "[train.sh] iteration $iteration gave a NaN/Inf again when megatron reran it on $node" \
         "(exit 16): to tell a faulty GPU from a bad batch it must run again on another node," \
         "from the checkpoint just saved. The job is held; rerun it elsewhere with: scontrol" \
         "update jobid=$SLURM_JOB_ID ExcNodeList=$excluded && scontrol release $SLURM_JOB_ID" \
         "(with no other node, where megatron would exit 16 again: scancel $SLURM_JOB_ID and" \
         "submit again with EXTRA_ARGS='--iterations-to-skip $iteration', which skips the batch)"
    scontrol requeuehold "$SLURM_JOB_ID" ||
      echo "train.sh: scontrol requeuehold $SLURM_JOB_ID failed: resubmit the job with sbatch" \
           "--exclude=$node; it reruns iteration $iteration from $(flag_value --load)" >&2
    return 0
  fi
  if [[ $verdict == FIRST_RERUN_REPRODUCIBLE ]]; then  # a 16 after another node's 16
    status=16
    echo "[train.sh] iteration $iteration gave a NaN/Inf again when megatron reran it on $node" \
         "(exit 16), as it did on $(slurm_node_of "$FIRST_NODE" "$(excluded_nodes | paste -sd, -)")" \
         "(a checkpoint without rerun state, as fsdp_dtensor's, gives 16 on the second node" \
         "too): its batch, not a GPU. Requeueing job $SLURM_JOB_ID: the next attempt skips" \
         "iteration $iteration ($TRACKER) and trains on from $(flag_value --load)"
  else
    status=17
    if ! megatron_skips "$iteration"; then
      echo "[train.sh] iteration $iteration gave a NaN/Inf on a second node ($node) too, but" \
           "megatron does not skip it (several ranks of a job failed it, see $TRACKER): the job" \
           "stops (exit 17)"
      return 0
    fi
    echo "[train.sh] iteration $iteration gave a NaN/Inf on a second node ($node) too: its" \
         "batch, not a GPU (exit 17). Requeueing job $SLURM_JOB_ID: the next attempt skips" \
         "iteration $iteration ($TRACKER) and trains on from $(flag_value --load)"
  fi
  if requeue_without_exclusion_of "$FIRST_NODE" || scontrol requeue "$SLURM_JOB_ID"; then
    exit 0
  fi
  echo "train.sh: scontrol requeue $SLURM_JOB_ID failed: resubmit the job; it skips iteration" \
       "$iteration" >&2
}
# Slurm sends SIGTERM to every task on scancel, scontrol requeue and at the time limit: the
# ranks save (--exit-signal-handler) within the cluster's KillWait. USR1 comes --signal's lead
# time before the time limit (header: 300 s): the ranks are told to save and stop now, and the
# job then requeues itself. This shell waits for srun in both cases, so the save is not cut off.
REQUEUE=0
# shellcheck disable=SC2317  # called by the USR1 trap
on_time_limit() {
  echo "[train.sh] time limit ahead (USR1): every rank saves a checkpoint and stops;" \
       "then the job requeues itself"
  REQUEUE=1
  scancel --signal=TERM "$SLURM_JOB_ID"  # all job steps, not this batch shell
}
trap on_time_limit USR1
# shellcheck disable=SC2317  # called by the TERM trap
on_term() {
  echo "[train.sh] SIGTERM (scancel, requeue or time limit): every rank saves a checkpoint" \
       "after its current iteration"
}
trap on_term TERM
make_tracker
TRACKER_LINES_BEFORE=$(tracker_lines)
"${LAUNCH[@]}" "$PYTHON" pretrain_moe.py "${ARGS[@]}" &
wait_for_exit $!
if (( REQUEUE )) && ! run_finished; then
  echo "[train.sh] requeueing job $SLURM_JOB_ID (ranks exited $status): the next attempt" \
       "resumes from $(flag_value --load)"
  scontrol requeue "$SLURM_JOB_ID" ||
    die "scontrol requeue $SLURM_JOB_ID failed: resubmit the job; it resumes from $(flag_value --load)"
  exit 0
fi
(( status == 0 )) || after_result_validation
exit "$status"
