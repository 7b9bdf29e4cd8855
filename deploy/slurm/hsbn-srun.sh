#!/usr/bin/env bash
# hsbn-srun.sh — run an hsbn training job inside a Slurm allocation.
#
#   salloc --nodes=2 --gpus-per-node=8 --ntasks-per-node=8
#   /shared/hsbn/deploy/slurm/hsbn-srun.sh -- python train.py --epochs 90
# or sbatch deploy/slurm/hsbn-job.sbatch (which calls this script by its shared path: sbatch
# runs a copy of the batch script that the other nodes cannot see).
#
# Starts, with srun:
#   1. the root aggregator on the allocation's first node (only when there is more than one);
#   2. with HSBN_GROUP_TIER=1, a group aggregator on the first node of each group of
#      HSBN_GROUP_NODES consecutive nodes (docs/DEPLOY.md, "Group tier");
#   3. one sidecar (node aggregator) per node, listening on a node-local Unix socket; its
#      --upstream is the root, or its group's aggregator with the tier;
#   4. HSBN_GPUS_PER_NODE trainers per node, each with torchrun's environment (RANK, WORLD_SIZE,
#      LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
#      HSBN_JOB_ID, HSBN_ADDRESS (and HSBN_GROUP_NODES with the tier). A trainer starts once its
#      node's sidecar is ready (on a root's or a group aggregator's node, once that is too).
# When the trainers exit it stops the aggregators with SIGTERM and exits with the trainers'
# status. The same script runs on every node (srun calls it back with _root, _group, _sidecar
# or _trainer), so it must be on a path every node sees.
#
# Settings (environment):
#   HSBN_AGGREGATOR       the aggregator binary                 [hsbn-aggregator]
#   HSBN_GPUS_PER_NODE    trainers per node      [SLURM_GPUS_ON_NODE, else SLURM_NTASKS_PER_NODE, else 1]
#   HSBN_JOB_ID           the job's id at the aggregators       [slurm-$SLURM_JOB_ID]
#   HSBN_ROOT_PORT        the root's TCP port                   [7070]
#   HSBN_MASTER_PORT      torch.distributed rendezvous port     [29500]
#   HSBN_RUN_DIR          node-local socket directory  [${TMPDIR:-/tmp}/hsbn-$SLURM_JOB_ID-<node index>]
#   HSBN_READY_TIMEOUT    seconds a trainer waits for its sidecar [60]
#   HSBN_AGGREGATOR_ARGS  extra flags for every aggregator, e.g. "--round-timeout-ms=60000"
#   HSBN_ROOT_ARGS, HSBN_GROUP_ARGS, HSBN_SIDECAR_ARGS   extra flags for one role
# Optional group tier (docs/DEPLOY.md, "Group tier"): a group is HSBN_GROUP_NODES consecutive
# nodes in the allocation's order (SLURM_NODEID), so order the nodes by switch (the topology
# plugin, --switches) and make K the nodes per switch or rack:
#   HSBN_GROUP_TIER       1: start the tier                     [0]
#   HSBN_GROUP_NODES      K, nodes per group: a divisor of the node count (needed with the tier;
#                         the trainers get it; without the tier it is passed on as it is)
#   HSBN_GROUP_PORT       the group aggregators' TCP port       [7071]
# Optional security and metrics (the aggregator flags named; docs/DEPLOY.md, "Security model"):
#   HSBN_TLS_CERT, HSBN_TLS_KEY, HSBN_TLS_CLIENT_CA  root and group aggregators: --tls-cert,
#                         --tls-key, --tls-client-ca (the certificate names every host they run on)
#   HSBN_UPSTREAM_CA, HSBN_UPSTREAM_CERT, HSBN_UPSTREAM_KEY  sidecars and group aggregators:
#                         --upstream-ca/-cert/-key
#   HSBN_ROOT_TOKEN_FILE, HSBN_NODE_TOKEN_FILE       --token-file for the root and the group
#                         aggregators / the sidecars
#   HSBN_TOKEN_FILE       passed on to the trainers (the job's token)
#   HSBN_METRICS_PORT     --metrics-listen=0.0.0.0:PORT on sidecars, PORT+1 on the root, PORT+2
#                         on the group aggregators
set -euo pipefail

# This script's path on every node (override when it is reached by another path there).
SELF="${HSBN_LAUNCHER:-$(readlink -f "${BASH_SOURCE[0]}")}"

die() { echo "hsbn-srun: $*" >&2; exit 2; }

# Launcher settings that must not leak into the trainers' environment.
LAUNCHER_VARS=(HSBN_LAUNCHER HSBN_AGGREGATOR HSBN_GPUS_PER_NODE HSBN_ROOT_PORT HSBN_MASTER_PORT HSBN_RUN_DIR
  HSBN_READY_TIMEOUT HSBN_AGGREGATOR_ARGS HSBN_ROOT_ARGS HSBN_SIDECAR_ARGS HSBN_TLS_CERT
  HSBN_TLS_KEY HSBN_TLS_CLIENT_CA HSBN_UPSTREAM_CA HSBN_UPSTREAM_CERT HSBN_UPSTREAM_KEY
  HSBN_ROOT_TOKEN_FILE HSBN_NODE_TOKEN_FILE HSBN_METRICS_PORT
  HSBN_GROUP_TIER HSBN_GROUP_PORT HSBN_GROUP_ARGS
  _HSBN_ROOT_HOST _HSBN_NNODES _HSBN_GPUS_PER_NODE _HSBN_JOB_ID _HSBN_GROUP_NODES _HSBN_GROUP_HOSTS)

# The node-local directory of a node's socket (same rule on every node): this node's, or node $1's.
run_dir() { echo "${HSBN_RUN_DIR:-${TMPDIR:-/tmp}/hsbn-${SLURM_JOB_ID}-${1:-${SLURM_NODEID}}}"; }

# Optional flag: "--flag=value" when value is set.
opt() { if [[ -n "${2:-}" ]]; then printf '%s=%s\n' "$1" "$2"; fi; }

task_root() {
  local args=(--role=root "--listen=0.0.0.0:${HSBN_ROOT_PORT:-7070}" --id=root)
  local dir; dir="$(run_dir)"
  mkdir -p "$dir" && chmod 0700 "$dir"
  rm -f "$dir/root.ready"
  args+=("--ready-file=$dir/root.ready")
  mapfile -t -O "${#args[@]}" args < <(
    opt --tls-cert "${HSBN_TLS_CERT:-}"; opt --tls-key "${HSBN_TLS_KEY:-}"
    opt --tls-client-ca "${HSBN_TLS_CLIENT_CA:-}"; opt --token-file "${HSBN_ROOT_TOKEN_FILE:-}"
    if [[ -n "${HSBN_METRICS_PORT:-}" ]]; then echo "--metrics-listen=0.0.0.0:$((HSBN_METRICS_PORT + 1))"; fi)
  # shellcheck disable=SC2206  # extra flags are split on blanks on purpose
  args+=(${HSBN_AGGREGATOR_ARGS:-} ${HSBN_ROOT_ARGS:-})
  exec "${HSBN_AGGREGATOR:-hsbn-aggregator}" "${args[@]}"
}

# Group aggregator $1, on the first node of its group (node $1 * K), below the root.
task_group() {
  local g="$1"
  local dir; dir="$(run_dir "$((g * _HSBN_GROUP_NODES))")"
  mkdir -p "$dir" && chmod 0700 "$dir"
  rm -f "$dir/group.ready"
  local args=(--role=group "--listen=0.0.0.0:${HSBN_GROUP_PORT:-7071}"
    "--upstream=${_HSBN_ROOT_HOST}:${HSBN_ROOT_PORT:-7070}" "--id=group-$g" "--ready-file=$dir/group.ready")
  mapfile -t -O "${#args[@]}" args < <(
    opt --tls-cert "${HSBN_TLS_CERT:-}"; opt --tls-key "${HSBN_TLS_KEY:-}"
    opt --tls-client-ca "${HSBN_TLS_CLIENT_CA:-}"
    opt --upstream-ca "${HSBN_UPSTREAM_CA:-}"; opt --upstream-cert "${HSBN_UPSTREAM_CERT:-}"
    opt --upstream-key "${HSBN_UPSTREAM_KEY:-}"; opt --token-file "${HSBN_ROOT_TOKEN_FILE:-}"
    if [[ -n "${HSBN_METRICS_PORT:-}" ]]; then echo "--metrics-listen=0.0.0.0:$((HSBN_METRICS_PORT + 2))"; fi)
  # shellcheck disable=SC2206  # extra flags are split on blanks on purpose
  args+=(${HSBN_AGGREGATOR_ARGS:-} ${HSBN_GROUP_ARGS:-})
  exec "${HSBN_AGGREGATOR:-hsbn-aggregator}" "${args[@]}"
}

task_sidecar() {
  local dir; dir="$(run_dir)"
  mkdir -p "$dir" && chmod 0700 "$dir"
  rm -f "$dir/hsbn.sock" "$dir/ready"
  local args=(--role=node "--listen=unix:$dir/hsbn.sock")
  if (( _HSBN_NNODES > 1 && _HSBN_GROUP_NODES > 0 )); then
    # With the tier: the aggregator on the first node of this node's group.
    local -a group_hosts
    read -r -a group_hosts <<< "$_HSBN_GROUP_HOSTS"
    args+=("--upstream=${group_hosts[SLURM_NODEID / _HSBN_GROUP_NODES]}:${HSBN_GROUP_PORT:-7071}")
  elif (( _HSBN_NNODES > 1 )); then
    args+=("--upstream=${_HSBN_ROOT_HOST}:${HSBN_ROOT_PORT:-7070}")
  fi
  args+=("--id=node-${SLURM_NODEID}" "--ready-file=$dir/ready")
  mapfile -t -O "${#args[@]}" args < <(
    if (( _HSBN_NNODES > 1 )); then
      opt --upstream-ca "${HSBN_UPSTREAM_CA:-}"; opt --upstream-cert "${HSBN_UPSTREAM_CERT:-}"
      opt --upstream-key "${HSBN_UPSTREAM_KEY:-}"
    fi
    opt --token-file "${HSBN_NODE_TOKEN_FILE:-}"
    opt --metrics-listen "${HSBN_METRICS_PORT:+0.0.0.0:${HSBN_METRICS_PORT}}")
  # shellcheck disable=SC2206  # extra flags are split on blanks on purpose
  args+=(${HSBN_AGGREGATOR_ARGS:-} ${HSBN_SIDECAR_ARGS:-})
  exec "${HSBN_AGGREGATOR:-hsbn-aggregator}" "${args[@]}"
}

task_trainer() {
  local dir; dir="$(run_dir)"
  local waited=0 timeout="${HSBN_READY_TIMEOUT:-60}"
  # Every trainer waits for its node's sidecar; on the first node of a multi-node job, where the
  # root runs too, it also waits for the root, so training never starts before the root is up;
  # on the first node of a group, with the tier, for the group aggregator too.
  local -a needs=("$dir/ready")
  if (( _HSBN_NNODES > 1 )) && [[ "$SLURM_NODEID" == 0 ]]; then needs+=("$dir/root.ready"); fi
  if (( _HSBN_NNODES > 1 && _HSBN_GROUP_NODES > 0 && SLURM_NODEID % _HSBN_GROUP_NODES == 0 )); then
    needs+=("$dir/group.ready")
  fi
  local f
  for f in "${needs[@]}"; do
    until [[ -e "$f" ]]; do
      if (( waited >= timeout * 10 )); then
        local what="sidecar"
        [[ "$f" == */root.ready ]] && what="root aggregator"
        [[ "$f" == */group.ready ]] && what="group aggregator"
        echo "hsbn-srun: rank ${SLURM_PROCID}: the $what on $(hostname) did not become ready in ${timeout}s ($f)" >&2
        exit 3
      fi
      sleep 0.1; waited=$((waited + 1))
    done
  done
  export RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS"
  export LOCAL_RANK="$SLURM_LOCALID" LOCAL_WORLD_SIZE="$_HSBN_GPUS_PER_NODE"
  export GROUP_RANK="$SLURM_NODEID" GROUP_WORLD_SIZE="$_HSBN_NNODES"
  export MASTER_ADDR="$_HSBN_ROOT_HOST" MASTER_PORT="${HSBN_MASTER_PORT:-29500}"
  export HSBN_JOB_ID="$_HSBN_JOB_ID" HSBN_ADDRESS="unix:$dir/hsbn.sock"
  if (( _HSBN_GROUP_NODES > 0 )); then export HSBN_GROUP_NODES="$_HSBN_GROUP_NODES"; fi
  unset "${LAUNCHER_VARS[@]}"
  exec "$@"
}

launch() {
  [[ "${1:-}" == "--" ]] && shift
  (( $# > 0 )) || die "usage: hsbn-srun.sh -- TRAIN_COMMAND [ARGS...] (inside sbatch or salloc)"
  [[ -n "${SLURM_JOB_ID:-}" ]] || die "not inside a Slurm allocation (SLURM_JOB_ID is not set)"
  local -a hosts
  mapfile -t hosts < <(scontrol show hostnames "${SLURM_JOB_NODELIST}")
  (( ${#hosts[@]} > 0 )) || die "no nodes in SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST:-}"
  local nnodes=${#hosts[@]}
  local gpn="${HSBN_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-${SLURM_NTASKS_PER_NODE:-1}}}"
  [[ "$gpn" =~ ^[1-9][0-9]*$ ]] || die "HSBN_GPUS_PER_NODE must be a positive integer, not '$gpn'"
  export _HSBN_ROOT_HOST="${hosts[0]}" _HSBN_NNODES="$nnodes" _HSBN_GPUS_PER_NODE="$gpn"
  export _HSBN_JOB_ID="${HSBN_JOB_ID:-slurm-${SLURM_JOB_ID}}"
  # The group tier: K nodes per group, the group aggregators on the first node of each group.
  local k=0 g
  local -a group_hosts=()
  [[ "${HSBN_GROUP_TIER:-0}" =~ ^[01]$ ]] || die "HSBN_GROUP_TIER must be 0 or 1, not '${HSBN_GROUP_TIER}'"
  if [[ "${HSBN_GROUP_TIER:-0}" == 1 ]] && (( nnodes > 1 )); then
    k="${HSBN_GROUP_NODES:-}"
    [[ "$k" =~ ^[1-9][0-9]*$ ]] \
      || die "HSBN_GROUP_TIER=1 needs HSBN_GROUP_NODES, the nodes per group (a divisor of the $nnodes nodes), not '$k'"
    (( nnodes % k == 0 )) || die "HSBN_GROUP_NODES=$k does not divide the allocation's $nnodes nodes"
    for (( g = 0; g < nnodes / k; g++ )); do group_hosts+=("${hosts[g * k]}"); done
  fi
  export _HSBN_GROUP_NODES="$k" _HSBN_GROUP_HOSTS="${group_hosts[*]}"

  local -a pids=()
  stop_aggregators() {
    if (( ${#pids[@]} )); then
      kill -TERM "${pids[@]}" 2>/dev/null || true
      wait "${pids[@]}" 2>/dev/null || true
      pids=()
    fi
  }
  trap 'stop_aggregators; exit 143' TERM INT
  if (( nnodes > 1 )); then
    srun --nodes=1 --ntasks=1 --nodelist="${hosts[0]}" --overlap --kill-on-bad-exit=0 \
      --job-name=hsbn-root "$SELF" _root &
    pids+=($!)
  fi
  for (( g = 0; g < ${#group_hosts[@]}; g++ )); do
    srun --nodes=1 --ntasks=1 --nodelist="${group_hosts[g]}" --overlap --kill-on-bad-exit=0 \
      --job-name="hsbn-group-$g" "$SELF" _group "$g" &
    pids+=($!)
  done
  srun --nodes="$nnodes" --ntasks="$nnodes" --ntasks-per-node=1 --overlap --kill-on-bad-exit=0 \
    --job-name=hsbn-sidecar "$SELF" _sidecar &
  pids+=($!)

  local rc=0
  srun --nodes="$nnodes" --ntasks="$((nnodes * gpn))" --ntasks-per-node="$gpn" --kill-on-bad-exit=1 \
    --job-name=hsbn-train "$SELF" _trainer "$@" || rc=$?
  stop_aggregators
  trap - TERM INT
  return "$rc"
}

case "${1:-}" in
  _root) shift; task_root "$@" ;;
  _group) shift; task_group "$@" ;;
  _sidecar) shift; task_sidecar "$@" ;;
  _trainer) shift; task_trainer "$@" ;;
  -h|--help) sed -n '2,/^set -euo/p' "$SELF" | sed '$d; s/^# \{0,1\}//' ;;
  *) launch "$@" ;;
esac
