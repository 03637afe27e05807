#!/usr/bin/env bash
# MoE GPT pretraining launcher: one script for Slurm clusters and for a local CPU smoke run.
#
#   RECIPE=mixtral_8x7b_pp sbatch --nodes=4 examples/moe/train.sh   # cluster (srun, 8 GPUs/node)
#   bash examples/moe/train.sh                                        # local: torchrun, tiny_cpu
#   bash examples/moe/train.sh --list                                 # recipe names
#   DRY_RUN=1 RECIPE=qwen3_30b_a3b_fsdp bash examples/moe/train.sh    # check layout, no training
#
# Environment: RECIPE (default tiny_cpu), DATA_PATH (megatron --data-path value, blends allowed;
# unset -> mock data), TOKENIZER_MODEL, CKPT_DIR (default runs/$RECIPE/ckpt), WANDB_PROJECT,
# WANDB_EXP_NAME, EXTRA_ARGS (extra megatron flags, appended last, so they override the recipe),
# NPROC (local ranks, default the recipe's GPUS_PER_NODE), PYTHON (default .venv/bin/python if
# present, else python), NODES / GPUS_PER_NODE (override the recipe's, e.g. to dry-run another
# size), LOG_INTERVAL (default 1), DRY_RUN=1, CONTAINER_IMAGE (pyxis/enroot image for srun),
# CONTAINER_MOUNTS (extra src:dst[,...] mounts), MASTER_PORT. A recipe's RUN_ENV (e.g.
# CUDA_DEVICE_MAX_CONNECTIONS=1 for TP without FSDP) is exported for every rank unless the
# variable is already set. Arguments other than --list, --dry-run and --help are passed to
# pretrain_moe.py after everything else.
#
#SBATCH --job-name=moe-pretrain
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --time=04:00:00
#SBATCH --account=YOUR_ACCOUNT
#SBATCH --partition=YOUR_PARTITION
#SBATCH --exclusive
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
IMPL_ARGS=()
MODEL_ARGS=()
LAYOUT_ARGS=()
TRAIN_ARGS=()
RUN_ENV=()  # NAME=VALUE pairs the recipe's layout needs in the environment of every rank
# shellcheck source=/dev/null
source "$RECIPE_DIR/$RECIPE.sh"
NODES=${env_nodes:-$NODES}
GPUS_PER_NODE=${env_gpus:-$GPUS_PER_NODE}

if [[ -n "${DATA_PATH:-}" ]]; then
  [[ -n "$TOKENIZER_MODEL" ]] || die "DATA_PATH is set but recipe $RECIPE names no tokenizer; set TOKENIZER_MODEL"
  read -ra data_path <<< "$DATA_PATH"
  DATA_ARGS=(--data-path "${data_path[@]}" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
else
  DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$VOCAB_SIZE")
fi

CKPT_DIR=${CKPT_DIR:-runs/$RECIPE/ckpt}
CKPT_ARGS=(--save "$CKPT_DIR" --load "$CKPT_DIR")
LOG_ARGS=(--log-interval "${LOG_INTERVAL:-1}" --log-throughput)
if [[ -n "${WANDB_PROJECT:-}" ]]; then
  LOG_ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "${WANDB_EXP_NAME:-$RECIPE-${SLURM_JOB_ID:-local}}")
fi
read -ra extra <<< "${EXTRA_ARGS:-}"

ARGS=("${MODEL_ARGS[@]}" "${IMPL_ARGS[@]}" "${LAYOUT_ARGS[@]}" "${TRAIN_ARGS[@]}"
      "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "${LOG_ARGS[@]}" "${extra[@]}" "${CLI_ARGS[@]}")

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -z "${CONTAINER_IMAGE:-}" && -x "$ROOT/.venv/bin/python" ]]; then
    PYTHON=$ROOT/.venv/bin/python
  else
    PYTHON=python
  fi
fi

show() { printf '%q ' "$@" | sed 's/ $//'; echo; }

if [[ "$DRY_RUN" == print ]]; then
  printf '%s\0' "${ARGS[@]}"
  exit 0
fi
# Exported before Python starts, so CUDA reads them when it initialises (srun and torchrun pass
# the environment to every rank); a value already in the environment wins.
for pair in "${RUN_ENV[@]}"; do
  name=${pair%%=*}
  if [[ -z "${!name+set}" ]]; then
    export "$pair"
    echo "[train.sh] recipe $RECIPE: $pair"
  fi
done

if [[ "$DRY_RUN" == 1 ]]; then
  world=${SLURM_NTASKS:-$((NODES * GPUS_PER_NODE))}
  echo "[train.sh] recipe $RECIPE: dry run for $world ranks ($NODES node(s) x $GPUS_PER_NODE)"
  echo "[train.sh] command: $(show "$PYTHON" pretrain_moe.py "${ARGS[@]}")"
  exec "$PYTHON" examples/moe/plan.py --world-size "$world" ${VOCAB_SIZE:+--vocab-size-hint "$VOCAB_SIZE"} -- "${ARGS[@]}"
fi

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  if [[ -n "${SLURM_JOB_NUM_NODES:-}" && "$SLURM_JOB_NUM_NODES" != "$NODES" ]]; then
    echo "train.sh: WARNING: recipe $RECIPE assumes $NODES node(s), the job has $SLURM_JOB_NUM_NODES" >&2
  fi
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
  export MASTER_ADDR MASTER_PORT
  SRUN=(srun --kill-on-bad-exit=1)
  if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
    # The checkout is mounted at the same path, so code, runs/ and relative paths match.
    SRUN+=(--container-image="$CONTAINER_IMAGE" --container-workdir="$ROOT"
           --container-mounts="$ROOT:$ROOT${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}")
  fi
  # One task per GPU; each sets its rank variables from Slurm's before starting Python.
  # shellcheck disable=SC2016
  LAUNCH=("${SRUN[@]}" bash -c 'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS; exec "$@"' rank)
  PYTHON_CMD=("$PYTHON")
  echo "[train.sh] recipe $RECIPE on $SLURM_JOB_NUM_NODES node(s), ${SLURM_NTASKS:-?} ranks, MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"
else
  if (( NODES > 1 )); then
    die "recipe $RECIPE assumes $NODES nodes: submit it with 'RECIPE=$RECIPE sbatch --nodes=$NODES examples/moe/train.sh' (or DRY_RUN=1 to check it here)"
  fi
  NPROC=${NPROC:-$GPUS_PER_NODE}
  LAUNCH=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node="$NPROC")
  echo "[train.sh] recipe $RECIPE on this machine (no Slurm): torchrun with $NPROC ranks"
  PYTHON_CMD=()  # torch.distributed.run takes the script itself
fi

echo "[train.sh] command: $(show "${LAUNCH[@]}" "${PYTHON_CMD[@]}" pretrain_moe.py "${ARGS[@]}")"
[[ -f pretrain_moe.py ]] || die "pretrain_moe.py not found in $ROOT"
exec "${LAUNCH[@]}" "${PYTHON_CMD[@]}" pretrain_moe.py "${ARGS[@]}"
