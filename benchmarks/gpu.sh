#!/bin/bash
# The GPU checks of issues 13, 15 and 19 in one run, for a session lent a GPU through the device tool
# (benchmarks/RESULTS.md, "The first GPU runs"). Two steps:
#
#   bash benchmarks/gpu.sh prepare     # here: the wheels the GPU machine lacks into .whl/, the data into .gpu/
#   bash benchmarks/gpu.sh run [S]     # there, from the repo root, carry [".whl", ".gpu"]; S: seconds (default 580)
#
# "run" installs quantkit, then runs each check with a timeout and its log in $OUT (or .gpu/out):
# the kernels, the GPU tests and the kernel tests, GPTQ of the 7b shape (stopped when its share of S
# is spent), the GPU against the CPU, and the tile sweep with what is left. Each check's exit status and end time go to
# times.log. The GPU machine has no network: what it lacks travels as wheels.
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
  v() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
  rm -rf .whl  # one version of each: two stop the install there
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform any -d .whl "gguf==$(v gguf)" "platformdirs==$(v platformdirs)" "bitsandbytes==$(v bitsandbytes)"
  mkdir -p .gpu && cp -r ../shared/data .gpu/
  grep -qx "/.gpu/" .git/info/exclude || echo "/.gpu/" >> .git/info/exclude
  du -sh .whl .gpu
  ;;
run)
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  out=${OUT:-.gpu/out}
  mkdir -p "$out"
  budget=${2:-580}
  t0=$(date +%s)
  left() { local l=$((budget - ($(date +%s) - t0))); echo $((l > 5 ? l : 5)); }  # timeout 0 would mean no limit
  mark() { echo "$1 rc=$2 at $(($(date +%s) - t0)) s" | tee -a "$out/times.log"; }
  {
    nvidia-smi -L; python3 --version
    [ -d ../shared/data ] || { mkdir -p ../shared && cp -r .gpu/data ../shared/; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
      PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
  } > "$out/setup.log" 2>&1
  export PYTHONPATH=/tmp/site
  mark setup $?
  timeout 90 python3 benchmarks/kernel_bench.py > "$out/kernels.log" 2>&1; mark kernels $?
  timeout 90 python3 -m pytest -p no:cacheprovider -q -s -rfE --tb=short tests/test_gpu.py > "$out/tests_gpu.log" 2>&1
  mark test_gpu $?
  timeout 60 python3 -m pytest -p no:cacheprovider -q -rfE --tb=line tests/test_kernels.py \
    -k "not embedded and not packed_perplexity and not packed_bfloat16" > "$out/tests_kernels.log" 2>&1
  mark test_kernels $?
  timeout 90 python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import scale; scale.model_dir('7b')" \
    > "$out/scale.log" 2>&1; mark write7b $?
  stop=$(($(left) - 200)); [ $stop -gt 300 ] && stop=300; [ $stop -lt 30 ] && stop=30
  timeout $((stop + 30)) python3 benchmarks/scale.py --shape 7b --runs gptq --device cuda --gptq-samples 32 \
    --stop-after $stop >> "$out/scale.log" 2>&1; mark gptq7b $?
  t=$(($(left) - 40)); [ $t -gt 130 ] && t=130; [ $t -lt 5 ] && t=5
  timeout $t python3 benchmarks/devices.py --methods rtn,gptq --samples 32 --windows 10 > "$out/devices.log" 2>&1
  mark devices $?
  timeout "$(left)" python3 benchmarks/kernel_bench.py --sweep --batches 1,512 > "$out/sweep.log" 2>&1; mark sweep $?
  ;;
*)
  echo "error: say prepare (here) or run (on the GPU machine): bash benchmarks/gpu.sh prepare|run [seconds]" >&2
  exit 2
  ;;
esac
