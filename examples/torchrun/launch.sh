#!/bin/bash
# A multi-node torchrun job with one memtrack per node.
#
# On every node (NODE_RANK 0 … NNODES-1):
#   NODE_RANK=0 NNODES=2 MASTER_ADDR=node0 examples/torchrun/launch.sh train.py
#
# memtrack wraps torchrun, so it follows the launcher and every local rank it
# spawns (and their DataLoader workers). torchrun sets RANK, LOCAL_RANK and
# WORLD_SIZE for the ranks, not for the launcher: the node's rank is given to
# memtrack as a label instead, which names the node's run directory
# (outputs/<job>.rank<node>) and its S3 file.
#
# Inside train.py each rank can mark its phases; every rank's marks carry
# its PID, and `--label`s added by the client show up in the log:
#   import memtrack, os
#   with memtrack.span("model", "forward", labels={"rank": os.environ["RANK"]}): ...

set -euo pipefail
JOB="${JOB:-ddp-$(date -u +%Y%m%d-%H%M%S)}"
NODE_RANK="${NODE_RANK:-0}"
NNODES="${NNODES:-1}"
NPROC="${NPROC_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}"

exec memtrack run --name "${JOB}" --output outputs \
    --label rank="${NODE_RANK}" --label world_nodes="${NNODES}" \
    -- torchrun --nnodes="${NNODES}" --node-rank="${NODE_RANK}" \
                --nproc-per-node="${NPROC}" \
                --master-addr="${MASTER_ADDR:-127.0.0.1}" --master-port="${MASTER_PORT:-29500}" \
                "$@"
