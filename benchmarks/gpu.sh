#!/bin/bash
# The GPU checks of issues 13, 15 and 19, for a session lent a GPU through the device tool
# (benchmarks/RESULTS.md, "The first GPU runs"). Two steps:
#
#   bash benchmarks/gpu.sh prepare              # here: the wheels the GPU machine lacks into .whl/, the data into .gpu/
#   bash benchmarks/gpu.sh run [S] [STEPS]      # there, from the repo root, carry [".whl", ".gpu", ".gq"]
#
# S: seconds for the whole run (default 480; each step's timeout is cut to what is left). STEPS: a
# comma list of those to run (default exllama,tests,kernels; `none`: the setup alone, before commands of
# one's own with PYTHONPATH=/tmp/site); they run in this order:
#   tests    the kernel tests, then tests/test_gpu.py (GPU_TESTS_S seconds, default 90) (tests.log)
#   kernels  benchmarks/kernel_bench.py; with KERNELS=DIR also with that version of quantkit/kernels/ (kernels_other.log)
#   sweep    the tile sweep (SWEEP_S seconds, default 120; SWEEP_BATCHES, SWEEP_LAYOUTS)
#   dense    the fused kernels against dequantize + torch's matmul by rows of x (kernels.DENSE_ROWS)
#   exllama  exllamav2 (its extension built in the background from the start) loads our EXL2 files of a
#            random model of SmolLM2-135M's shapes: benchmarks/exl2_consumer.py with its matmul
#            attention, then its SDPA one on one file and 2 windows
#   gptq7b   GPTQ of the 7b shape, stopped when its share is spent
#   gptqmodel  GPTQ of the 7b shape's first 8 layers against GPTQModel's (benchmarks/scale.py), 32 windows
#   devices  benchmarks/devices.py
#   progress benchmarks/progress_save.py on the random model of SmolLM2-135M's shapes: progress saved behind
#            the next layer against waited for, where a layer on the GPU takes less than its save
# Each step's log goes to $OUT (or .gpu/out), its exit status and end time to times.log. The GPU
# machine has no network: what it lacks travels as wheels.
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
  v() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
  rm -rf .whl  # one version of each: two stop the install there
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform any -d .whl "gguf==$(v gguf)" "platformdirs==$(v platformdirs)" "bitsandbytes==$(v bitsandbytes)" \
    exllamav2==0.3.2
  # GPTQModel 5.8.0 (its requirements take the GPU machine's torch 2.11; 7.7.0 asks for 2.14.1) for scale.py's gptqmodel run:
  # its source into .gq/, what it needs that the machine lacks into .whl/ (wheels built here where only
  # sources are published); pypcre builds for this machine's Python alone, so the standard re stands in for it
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform any \
    -d .whl datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  src=$(mktemp -d)
  python -m pip download -q --no-deps --no-build-isolation --no-binary=:all: -d "$src" gptqmodel==5.8.0 device-smi==0.5.7 logbar==0.4.15 \
    tokenicer==0.0.14 defuser==0.0.28
  python -m pip wheel -q --no-deps -w .whl "$src"/device_smi-* "$src"/logbar-* "$src"/tokenicer-* "$src"/defuser-*
  rm -rf .gq && mkdir -p .gq/pcre && tar xzf "$src"/gptqmodel-5.8.0.tar.gz -C "$src" && cp -r "$src"/gptqmodel-5.8.0/gptqmodel .gq/
  echo "from re import *  # noqa: F401,F403 (pypcre's stand-in)" > .gq/pcre/__init__.py
  rm -rf "$src"
  mkdir -p .gpu && cp -r ../shared/data .gpu/
  for d in /.gpu/ /.whl/ /.gq/; do grep -qx "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
  du -sh .whl .gpu .gq
  ;;
run)
  nvidia-smi -L > /dev/null 2>&1 || { echo "error: no NVIDIA GPU here (nvidia-smi -L fails): run this on the device machine" >&2; exit 2; }
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  out=${OUT:-.gpu/out}
  mkdir -p "$out"
  budget=${2:-480}
  steps=",${3:-exllama,tests,kernels},"
  t0=$(date +%s)
  left() { local l=$((budget - ($(date +%s) - t0))); echo $((l > 5 ? l : 5)); }  # timeout 0 would mean no limit
  upto() { local l; l=$(left); echo $(($1 < l ? $1 : l)); }  # a step's timeout, within what is left
  mark() { echo "$1 rc=$2 at $(($(date +%s) - t0)) s" | tee -a "$out/times.log"; }
  has() { [[ $steps == *",$1,"* ]]; }
  {
    nvidia-smi -L; python3 --version
    [ -d ../shared/data ] || { mkdir -p ../shared && cp -r .gpu/data ../shared/; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
      PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
  } > "$out/setup.log" 2>&1
  export PYTHONPATH=/tmp/site TORCH_CUDA_ARCH_LIST=9.0  # Hopper: one target keeps exllamav2's build short
  mark setup $?
  if has exllama; then  # its extension builds on 10 of the 16 cores (143 s with 14) while the other steps run
    (MAX_JOBS=10 timeout "$(upto 400)" python3 -c "import exllamav2.ext" > "$out/exllama_build.log" 2>&1; echo $? >> "$out/exllama_build.log") &
    build=$!
  fi
  if has tests; then
    # CPU references beside the build: 4 threads (at 16, both test files ran past 90 s there)
    OMP_NUM_THREADS=4 timeout "$(upto 90)" python3 -m pytest -p no:cacheprovider -q -rfE --tb=short tests/test_kernels.py \
      -k "not embedded and not packed_perplexity and not packed_bfloat16" > "$out/tests.log" 2>&1
    mark test_kernels $?
    OMP_NUM_THREADS=4 timeout "$(upto ${GPU_TESTS_S:-90})" python3 -m pytest -p no:cacheprovider -q -s -rfE --tb=short tests/test_gpu.py \
      >> "$out/tests.log" 2>&1
    mark test_gpu $?
  fi
  if has kernels; then
    if [ -n "${build:-}" ] && kill -0 "$build" 2> /dev/null; then  # its cores are busy: eager times suffer
      echo "exllamav2's build still running at $(($(date +%s) - t0)) s" | tee -a "$out/times.log"
    fi
    timeout "$(upto 120)" python3 benchmarks/kernel_bench.py > "$out/kernels.log" 2>&1; mark kernels $?
    if [ -n "${KERNELS:-}" ]; then  # another version of the kernels, to compare in the same run
      timeout "$(upto 120)" python3 benchmarks/kernel_bench.py --kernels "$KERNELS" > "$out/kernels_other.log" 2>&1
      mark "kernels-$KERNELS" $?
    fi
  fi
  if has sweep; then
    timeout "$(upto ${SWEEP_S:-120})" python3 benchmarks/kernel_bench.py --sweep --batches "${SWEEP_BATCHES:-1,512}" \
      --layouts "${SWEEP_LAYOUTS:-4-bit,4-bit act-order,NF4}" > "$out/sweep.log" 2>&1; mark sweep $?
  fi
  if has dense; then
    timeout "$(upto 120)" python3 benchmarks/kernel_bench.py --dense --batches 2,3,4,8,16,64,256,512 > "$out/dense.log" 2>&1
    mark dense $?
  fi
  if has exllama; then
    m=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import scale; print(scale.model_dir('135m'))" 2>> "$out/exllama.log" | tail -1)
    [ -n "$m" ]; mark model $?
    t=$(upto 150)
    for spec in 2.5: 4.125: 6.0:8; do  # widths 3/2, 4/3, 6/5 in the linears; the last one's head at 8/6; side by side
      b=${spec%:*}; h=${spec#*:}
      (OMP_NUM_THREADS=2 timeout "$t" python3 -m quantkit quantize "$m" --method gptq --format exl2 --bits "$b" ${h:+--head-bits $h} \
        --out "/tmp/exl2-$b" --calib-samples 16 --calib-data ../shared/data/wikitext-2/wiki.valid.tokens --device cuda \
        > "$out/export-$b.log" 2>&1; mark "export-$b" $?) &
    done
    wait $(jobs -p | grep -vx "$build"); cat "$out"/export-*.log >> "$out/exllama.log"; rm -f "$out"/export-*.log
    wait $build; mark exllama_build "$(tail -1 "$out/exllama_build.log")"
    timeout "$(upto 120)" python3 benchmarks/exl2_consumer.py /tmp/exl2-2.5 /tmp/exl2-4.125 /tmp/exl2-6.0 --base "$m" \
      >> "$out/exllama.log" 2>&1; mark exllama $?
    # its SDPA attention on fewer windows: only to show what it changes
    timeout "$(upto 60)" python3 benchmarks/exl2_consumer.py /tmp/exl2-4.125 --base "$m" --sdpa --windows 2 \
      >> "$out/exllama.log" 2>&1; mark exllama--sdpa $?
  fi
  if has gptq7b; then
    timeout "$(upto 90)" python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import scale; scale.model_dir('7b')" \
      > "$out/scale.log" 2>&1; mark write7b $?
    stop=$(($(left) - 60)); [ $stop -gt 300 ] && stop=300; [ $stop -lt 30 ] && stop=30
    timeout $((stop + 30)) python3 benchmarks/scale.py --shape 7b --runs gptq --device cuda --gptq-samples 32 \
      --stop-after $stop >> "$out/scale.log" 2>&1; mark gptq7b $?
  fi
  if has gptqmodel; then
    PYTHONPATH=$PWD/.gq:/tmp/site timeout "$(upto 360)" python3 benchmarks/scale.py --shape 7b-8l --device cuda \
      --runs gptq,gptq-no-mse,gptqmodel --gptq-samples 32 > "$out/gptqmodel.log" 2>&1; mark gptqmodel $?
  fi
  if has devices; then
    t=$(($(left) - 20)); [ $t -gt 130 ] && t=130; [ $t -lt 5 ] && t=5
    timeout $t python3 benchmarks/devices.py --methods rtn,gptq --samples 32 --windows 10 > "$out/devices.log" 2>&1
    mark devices $?
  fi
  if has progress; then
    m=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import scale; print(scale.model_dir('135m'))" 2>> "$out/progress.log" | tail -1)
    [ -n "$m" ]; mark progress-model $?
    [ -n "$m" ] && timeout "$(upto 240)" python3 benchmarks/progress_save.py --model "$m" --repeat 1 >> "$out/progress.log" 2>&1
    mark progress $?
  fi
  ;;
*)
  echo "error: say prepare (here) or run (on the GPU machine): bash benchmarks/gpu.sh prepare|run [seconds] [steps]" >&2
  exit 2
  ;;
esac
