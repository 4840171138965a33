#!/bin/sh
# Asks the real NVML and the fake the same protocol questions (real_probe.c)
# and compares the answers: return codes and counts must be equal; sizes,
# PIDs and timestamps may differ. Run on a GPU machine:
#
#   tests/fake_nvml/fidelity.sh PROBE_BINARY FAKE_LIBRARY
#
# PROBE_BINARY: gcc -std=gnu11 -O1 -o probe tests/fake_nvml/real_probe.c -ldl
# FAKE_LIBRARY: gcc -shared -fPIC -O2 -o libnvidia-ml-fake.so tests/fake_nvml/fake_nvml.c
# Prints both transcripts, then the differences ("none" when they agree).
set -eu
probe=$1
fake=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$probe" busy > "$dir/real.txt"
mkdir "$dir/lib"
ln -s "$(readlink -f "$fake")" "$dir/lib/libnvidia-ml.so.1"
# The fake lists the probe's CUDA child as a process using 2 GiB + context.
printf 'device 0 total_mib=81559 used_mib=2574 reserved_mib=480\nprocess 0 459 2566\nprocess_util 0 459 41 41\n' > "$dir/state"
FAKE_NVML_STATE="$dir/state" LD_LIBRARY_PATH="$dir/lib" "$probe" busy > "$dir/fake.txt" || true
# Keep what the protocol decides: the line's question, rc= and n=.
norm() { sed -E 's/\(child [0-9-]*\)//; s/\(now [0-9]*\)//; s/(pid|used|gi|ci|total|reserved|free|ts|sm|mem|enc|dec)=[^ ]*//g; s/ +/ /g' "$1"; }
echo "== real driver"; cat "$dir/real.txt"
echo "== fake"; cat "$dir/fake.txt"
echo "== differences (real < > fake)"
norm "$dir/real.txt" > "$dir/real.n"
norm "$dir/fake.txt" > "$dir/fake.n"
if diff "$dir/real.n" "$dir/fake.n"; then echo none; fi
