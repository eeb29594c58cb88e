#!/bin/bash
# A GPU session on a machine without network (docs/benchmarks.md, "On a lent H200").
#
#   bash benchmarks/gpu_session.sh fetch WHEELS      # here, with the package index: the wheels
#   bash benchmarks/gpu_session.sh run WHEELS OUT    # there: install beside its torch, run the checks
#
# The GPU machine brings its own CUDA torch and triton; what dlm needs beyond them travels as
# wheels (versions from constraints.txt), installed with --target and put first on PYTHONPATH.
# `run` gives each section of benchmarks/gpu_check.py its own process under `timeout`, so a
# crash or a hang in one leaves the others' figures, all written under OUT (log.txt, *.json).
set -u
here=$(cd "$(dirname "$0")/.." && pwd)

pin() {  # NAME -> NAME==VERSION as constraints.txt pins it
    local line
    line=$(grep -i -E "^$1==" "$here/constraints.txt" | head -1)
    [ -n "$line" ] || { echo "gpu_session: $1 is not pinned in constraints.txt" >&2; exit 2; }
    echo "${line%% *}"
}

case "${1:-}" in
fetch)
    wheels=${2:?usage: gpu_session.sh fetch WHEELS}
    # torchao and transformers (DiffusionGemma needs 5.24+), and the dependencies of theirs
    # an older CUDA image may lack or hold too old
    names="torchao transformers huggingface_hub kernels httpx2 httpcore2 hf-xet regex tomlkit click truststore idna"
    specs=$(for n in $names; do pin "$n"; done)
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$wheels" $specs
    ;;
run)
    wheels=${2:?usage: gpu_session.sh run WHEELS OUT}
    out=${3:?usage: gpu_session.sh run WHEELS OUT}
    mkdir -p "$out"
    export PYTHONUNBUFFERED=1
    site=$(mktemp -d)  # the wheels' install, beside the machine's own packages; gone with the machine
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$wheels"/*.whl > "$site.log" 2>&1 || { tail -20 "$site.log"; exit 1; }
    export PYTHONPATH=$site
    log=$out/log.txt
    python3 -c "import torch, triton, transformers, torchao; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, 'torchao', torchao.__version__, \
torch.cuda.get_device_name(), torch.cuda.get_device_capability())" 2>&1 | tee -a "$log"
    section() {  # SECONDS SECTIONS [ARGS...]; files OUT/<first section>*.json (8 in all)
        local seconds=$1 only=$2 name=${2%%,*}
        shift 2
        echo "=== $only ($(date +%T))" | tee -a "$log"
        timeout "$seconds" python3 "$here/benchmarks/gpu_check.py" --only "$only" --json "$out/$name.json" "$@" 2>&1 \
            | grep -v Warning | tee -a "$log"
        echo "=== $only: exit ${PIPESTATUS[0]} ($(date +%T))" | tee -a "$log"
    }
    section 150 quantization
    section 150 kernels,memory
    section 120 engine
    section 110 step --batches 1,8 --steps 10
    section 60 bench
    ;;
*)
    sed -n '2,10p' "$0"
    exit 2
    ;;
esac
