#!/bin/bash
# A GPU pipeline under SLURM, with memtrack on every node.
#
#   sbatch examples/slurm/run_gpu_memtrack.sh
#
# One memtrack per node (one task per node) follows every process the
# pipeline starts there. SLURM_JOB_ID, SLURM_PROCID and SLURM_NODEID, the host
# name and a `rank` label (= SLURM_PROCID) go into run.labels and onto every
# metric; each node writes outputs/<job>.rank<N>/memory_usage.json, so nodes
# sharing a file system never collide. At the end the per-node files are
# merged into one job-level report that names the node with the worst peak.
#
#SBATCH --job-name=pabbo-gpu
#SBATCH --partition=gpu
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=32
#SBATCH --mem=64G
#SBATCH --time=12:00:00
#SBATCH --output=logs/%x-%j.out

# No `set -e`: the merge and the report below matter most when the job
# fails, so a failed srun must not skip them; the script exits with its status.
set -uo pipefail
module load cuda/12.2 2>/dev/null || true

JOB="pabbo-${SLURM_JOB_ID}"
OUT="${SLURM_SUBMIT_DIR}/outputs"
# Optional: upload each node's file to S3/MinIO; ranks get their own names
# under s3://…/runs/$JOB/artifacts/memory_usage/.
# export MEMTRACK_S3_URL=s3://clearml-artifacts/runs
# export AWS_ENDPOINT_URL=http://minio.internal:9000

# The pipeline marks its stages (SUCCESS or FAILED per stage):
#   with memtrack.stage("train_small"): ...
# /metrics stays on each node's loopback (memtrack's default), out of reach
# of other hosts. For a Prometheus that scrapes the nodes, export
# MEMTRACK_LISTEN=<the node's address on the monitoring network>:9464 before
# srun (one address, not 0.0.0.0: the node's other networks stay closed).
status=0
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
    memtrack run --name "${JOB}" --output "${OUT}" --interval 1s \
                 --label partition="${SLURM_JOB_PARTITION:-gpu}" \
    -- python3 for_klaster_gpu.py || status=$?

# One job-level file: peaks per node and for the job, the worst node named,
# whether the job succeeded or not.
memtrack merge "${OUT}/${JOB}".rank*/memory_usage.json -o "${OUT}/${JOB}/memory_usage.json" &&
    memtrack report "${OUT}/${JOB}/memory_usage.json"
exit "${status}"
