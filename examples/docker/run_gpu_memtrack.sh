#!/bin/bash
# A GPU training job in a Docker container, with memtrack inside it.
#
#   examples/docker/run_gpu_memtrack.sh [device-level|host-proc|host-pid]
#
# The image holds the job and the memtrack binary; memtrack wraps the job
# (`memtrack run -- python3 train.py`) and writes /outputs/<run>/
# memory_usage.json into the mounted folder.
#
# What each mode gives. The NVIDIA driver lists GPU processes by their HOST
# PID, and a container has a PID namespace of its own:
#   device-level  (default, no extra privilege) memtrack cannot tell the
#                 job's processes on a GPU from others: the job's GPU figure
#                 is the used memory of the GPUs given to the container,
#                 every process on them included, labelled "device-level"
#                 (gpu_attribution in the JSON, attribution= in /metrics,
#                 memtrack report). It is the job's own use when the job has
#                 its GPUs to itself.
#   host-proc     the host's /proc mounted read-only at /host/proc and
#                 MEMTRACK_GPU_HOST_PROC pointing at it: memtrack maps
#                 NVML's host PIDs to the container's, per-process figures.
#                 The container can read every host process's /proc entry.
#   host-pid      --pid=host: the container shares the host's PID namespace,
#                 NVML's PIDs are memtrack's, per-process figures. The
#                 container sees (and as root may signal) every host process.
set -euo pipefail

MODE="${1:-device-level}"
IMAGE="${IMAGE:-ghcr.io/example/smollm-train:latest}"
OUT="${OUT:-$PWD/outputs}"
mkdir -p "${OUT}"

args=(--rm --gpus "device=${GPUS:-0}" -v "${OUT}:/outputs")
case "${MODE}" in
    device-level) ;;
    host-proc) args+=(-v /proc:/host/proc:ro -e MEMTRACK_GPU_HOST_PROC=/host/proc) ;;
    host-pid) args+=(--pid=host) ;;
    *)
        echo "usage: $0 [device-level|host-proc|host-pid]" >&2
        exit 2
        ;;
esac

# /metrics stays on the container's loopback (memtrack's default); publish
# it with --listen=<an address> and -p 127.0.0.1:9464:9464 when needed.
exec docker run "${args[@]}" "${IMAGE}" \
    memtrack run --output /outputs --interval 1s -- python3 train.py
