#!/usr/bin/env bash
# Everything a GPU machine can tell about Tessera that the simulated node cannot, in one run.
#
# For a lent test machine or a node before it joins a cluster. Changes nothing on the GPUs: no
# compute mode, MIG mode, clock or time-slice change, no reset; the only daemon it starts is
# check-node's throwaway MPS daemon, which check-node stops, and this script then makes sure no MPS
# process is left. Writes each step's output to DIR (default ./gpu-check), prints a summary.
#
# Only with TESSERA_ALLOW_MIG_CHANGES=1 (the operator allows MIG changes on this machine) it also runs
# scripts/mig-hardware-probe.py: on the first GPU already in MIG mode with no MIG instance it creates,
# destroys and re-creates one small instance at one placement (MIG UUIDs compared), checks the capability
# nodes a container's /dev copy lacks, field 230, the event mask and remapped rows with an instance, and
# destroys what it made. MIG mode is never changed, and a GPU with instances is never touched.
#
#   bash scripts/gpu-machine-check.sh [DIR]
#   TESSERA_ALLOW_MIG_CHANGES=1 bash scripts/gpu-machine-check.sh [DIR]
set -u
out=${1:-gpu-check}
mkdir -p "$out"
py=${PYTHON:-python3}
cd "$(dirname "$0")/.."

step() {  # step NAME TIMEOUT CMD...: run one step, its output in $out/NAME.txt, its status in the summary
    local name=$1 limit=$2; shift 2
    local t0=$EPOCHREALTIME
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    printf '%-22s exit %3d  %6.1f s\n' "$name" "$rc" "$(awk "BEGIN{print $EPOCHREALTIME - $t0}")" | tee -a "$out/summary.txt"
}

{
    echo "== $(date -u +%FT%TZ) $(uname -srm)"; id
    nvidia-smi -L
    nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,compute_mode,mig.mode.current,mig.mode.pending,persistence_mode --format=csv
    command -v nvidia-smi nvidia-cuda-mps-control nvidia-cuda-mps-server nvidia-ctk
    ls -l /dev/nvidia* 2>&1; ls -l /dev/nvidia-caps 2>&1
    ls /proc/driver/nvidia/capabilities/mig 2>&1 | head
    ldconfig -p | grep -E 'libcuda\.so|libnvidia-ml\.so' ; ls /usr/local/nvidia 2>&1
    ls -l /etc/cdi /var/run/cdi 2>&1
    mount | grep -E ' /dev/shm | /proc ' ; grep -E '^(Cap|NoNewPrivs)' /proc/self/status
    $py -V; $py -c 'import grpc, google.protobuf, pydantic, kubernetes, pynvml; print("imports ok", grpc.__version__, pydantic.VERSION)'
} >"$out/facts.txt" 2>&1
before=$(nvidia-smi --query-gpu=uuid,compute_mode,mig.mode.current --format=csv,noheader)

# Without the toolkit's CDI spec on the machine, generate one into $out (a file write, nothing else):
# the driver libraries in claims' CDI specs then come from what nvidia-ctk finds, as on a real node.
spec=()
if ! ls /etc/cdi/*.yaml /etc/cdi/*.json /var/run/cdi/*.yaml /var/run/cdi/*.json >/dev/null 2>&1 \
        && command -v nvidia-ctk >/dev/null; then
    step nvidia-ctk-generate 60 nvidia-ctk cdi generate --output="$out/nvidia.yaml"
    [ -s "$out/nvidia.yaml" ] && spec=(--nvidia-cdi-spec "$out/nvidia.yaml")
fi
libs=true; ls /etc/cdi/*.yaml /etc/cdi/*.json /var/run/cdi/*.yaml /var/run/cdi/*.json "${spec[@]:1}" >/dev/null 2>&1 || libs=false
step check-node 180 $py -m driver check-node --verbose "${spec[@]}"
step check-node-json 180 $py -m driver check-node --json "${spec[@]}"
step mig-profiles 60 $py scripts/mig-profile-probe.py
# Field 230, the supported event mask (0x4000/0x8000), remapped rows, pending MIG mode, mig/monitor: read only.
step health-probe 60 $py scripts/health-probe.py
step real-node-e2e 240 $py scripts/real-node-e2e.py --driver-libraries-required "$libs" "${spec[@]}"
# A dynamic MIG plan for every GPU: a GPU in MIG mode without instances publishes its placements, any
# other GPU is published as before with the reason logged (nothing is created: no claim asks for MIG).
printf 'defaultPlan: dynamic\nplans:\n  dynamic:\n    gpus:\n    - match: {all: true}\n      dynamicMig: {}\n' >"$out/dynamic-plan.yaml"
step check-plan-dynamic 60 $py -m driver check-plan "$out/dynamic-plan.yaml"
step real-node-e2e-dynamic 240 $py scripts/real-node-e2e.py --driver-libraries-required "$libs" "${spec[@]}" \
    --sharing-plans "$out/dynamic-plan.yaml"

if [ "${TESSERA_ALLOW_MIG_CHANGES:-0}" = 1 ]; then
    # The one step that changes something: MIG instances, on a GPU in MIG mode that has none, destroyed again.
    step mig-hardware 600 $py scripts/mig-hardware-probe.py
    echo "MIG changes allowed: instances created and destroyed (see $out/mig-hardware.txt)" | tee -a "$out/summary.txt"
fi

after=$(nvidia-smi --query-gpu=uuid,compute_mode,mig.mode.current --format=csv,noheader)
left=$(pgrep -a -f 'nvidia-cuda-mps-(control|server)' || true)
{
    echo "toolkit CDI spec usable: $libs ${spec[*]}"
    [ "$before" = "$after" ] && echo "GPU settings unchanged: $after" || echo "GPU SETTINGS CHANGED: before [$before] after [$after]"
    if [ -n "$left" ]; then echo "MPS PROCESSES LEFT (stopping them): $left"; pkill -f 'nvidia-cuda-mps-(control|server)'; else echo "no MPS process left"; fi
} | tee -a "$out/summary.txt"
