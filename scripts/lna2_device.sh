#!/usr/bin/env bash
# One device call: build lna2 (+ exllamav3 for the incumbent), check, time. Everything lands in $OUT.
# Usage on the device machine, from the repo root:
#   scripts/lna2_device.sh [145|165|none] [quick]
# Wheels come from .whl145/ or .whl165/ (carried); a prebuilt exllamav3_ext.so can be carried in
# .dev/ext<ver>/ to skip the JIT build. Each step has its own timeout so a hang still returns logs.
set -u
INC=${1:-145}
MODE=${2:-full}
FINAL=${OUT:-$PWD/.device-out}
# The device returns at most 8 files: logs and JSON are packed into one tarball after every step.
OUT=/tmp/lna2-work
mkdir -p "$OUT" "$FINAL"
export OUT
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
export DSV4SERVE_HOME=/tmp/dsv4home
LOG=$OUT/cycle.log
pack() { tar czf "$FINAL/results.tgz" -C "$OUT" . 2>/dev/null; }
step() { pack; echo "== $(date +%T) $*" | tee -a "$LOG"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee -a "$LOG"
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$LOG"

EXT_PID=
if [ "$INC" != none ]; then
  SITE=/tmp/site$INC
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl$INC/*.whl 2>&1 | tail -2
  PREV=$(find /tmp/ext$INC -name 'exllamav3_ext*.so' 2>/dev/null | head -1)
  if [ -n "$PREV" ]; then
    cp "$PREV" "$SITE/exllamav3_ext.so"   # a warm machine keeps the last build; found as precompiled
    step "reusing the exllamav3 $INC build from this machine"
  else
    step "JIT-building exllamav3 $INC in the background"
    ( cd /tmp && PYTHONPATH=$SITE MAX_JOBS=12 TORCH_EXTENSIONS_DIR=/tmp/ext$INC timeout 480 \
        python3 -c "import sys, types, os; p='$SITE/exllamav3'; m=types.ModuleType('exllamav3'); m.__path__=[p]; sys.modules['exllamav3']=m; import exllamav3.ext" \
        > "$OUT/exl3_build_$INC.log" 2>&1; echo "exit $?" >> "$OUT/exl3_build_$INC.log" ) &
    EXT_PID=$!
  fi
fi

step "build lna2"
MAX_JOBS=4 timeout 300 python3 scripts/lna2_device.py build > "$OUT/lna2_build.log" 2>&1
echo "exit $?" >> "$OUT/lna2_build.log"
grep -E "registers|spill|error|built|exit" "$OUT/lna2_build.log" | tail -24 | tee -a "$LOG"

step "smoke v1 (a hang or fault here drops v1 from the rest of the run)"
export LNA2_VARIANTS=1,0 BENCH_VARIANTS=1,0
if ! LNA2_VARIANTS=1 timeout 60 python3 scripts/lna2_device.py smoke > "$OUT/smoke_v1.log" 2>&1; then
  tail -5 "$OUT/smoke_v1.log" | tee -a "$LOG"
  export LNA2_VARIANTS=0 BENCH_VARIANTS=0
  echo "v1 dropped" | tee -a "$LOG"
fi

step "parity"
Q=--quick; [ "${PARITY:-quick}" = full ] && Q=
timeout 200 python3 scripts/lna2_device.py parity $Q > "$OUT/lna2_parity.log" 2>&1; echo "exit $?" >> "$OUT/lna2_parity.log"
tail -12 "$OUT/lna2_parity.log" | tee -a "$LOG"

if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    step "compute-sanitizer $tool"
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/lna2_device.py smoke \
      > "$OUT/sanitizer_$tool.log" 2>&1; echo "exit $?" >> "$OUT/sanitizer_$tool.log"
    tail -4 "$OUT/sanitizer_$tool.log" | tee -a "$LOG"
  done
fi

if [ -n "$EXT_PID" ]; then
  step "waiting for the exllamav3 build"
  wait $EXT_PID
  tail -3 "$OUT/exl3_build_$INC.log" | tee -a "$LOG"
  SO=$(find /tmp/ext$INC -name 'exllamav3_ext*.so' | head -1)
  if [ -n "$SO" ]; then
    cp "$SO" "$SITE/exllamav3_ext.so"
    # bring the build home in pieces (16 MiB per returned file)
  fi
fi

if [ "$INC" != none ]; then
  step "reference vs exllamav3 reconstruct"
  PYTHONPATH=$SITE timeout 120 python3 scripts/lna2_device.py reconstruct --tag $INC > "$OUT/reconstruct_$INC.log" 2>&1
  tail -3 "$OUT/reconstruct_$INC.log" | tee -a "$LOG"
fi

if [ "$INC" = 145 ] && [ "$MODE" != quick ] && [ -x scripts/exl3_capture_check.sh ]; then
  # the patch's own proof, on the same pristine build: capture fails pristine, works patched
  step "exllamav3 1.4.5 capture check (pristine -> patch -> incremental rebuild -> patched)"
  BENCH_SO="$SITE/exllamav3_ext.so"; mv -f "$BENCH_SO" /tmp/exllamav3_ext_pristine.so 2>/dev/null || true
  EXL3_SITE=$SITE TORCH_EXTENSIONS_DIR=/tmp/ext$INC EXL3_WHEELS=$PWD/.whl$INC OUT=$OUT MAX_JOBS=16 \
    EXL3_CAPTURE_CASES=${EXL3_CAPTURE_CASES:-16:2,16:6,4:6} EXL3_CAPTURE_DISK=0 \
    timeout 330 bash scripts/exl3_capture_check.sh all > "$OUT/capture_check.log" 2>&1
  echo "exit $?" >> "$OUT/capture_check.log"
  tail -25 "$OUT/capture_check.log" | tee -a "$LOG"
  mv -f /tmp/exllamav3_ext_pristine.so "$BENCH_SO" 2>/dev/null || true
fi

step "bench vs $INC"
MS=1,2,4,8,16,24; [ "$MODE" = quick ] && MS=1,4,16
PYTHONPATH=${SITE:-} timeout 300 python3 scripts/lna2_device.py bench --incumbent $INC --ms $MS --variants $BENCH_VARIANTS \
  > "$OUT/bench_$INC.log" 2>&1; echo "exit $?" >> "$OUT/bench_$INC.log"
grep -E "^tp|exit|Error" "$OUT/bench_$INC.log" | tee -a "$LOG"
if command -v ncu >/dev/null && [ "${NCU:-1}" = 1 ]; then
  step "ncu (the third launch of each shape)"
  V=$(echo "$BENCH_VARIANTS" | cut -d, -f1)
  LNA2_PROFILE_VARIANT=$V timeout 150 ncu --clock-control none -k regex:moe_decode_v --launch-skip 0 --launch-count 9 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats \
    python3 scripts/lna2_device.py profile > "$OUT/ncu.log" 2>&1; echo "exit $?" >> "$OUT/ncu.log"
  grep -E "Duration|Throughput|Achieved Occupancy|Stall|exit" "$OUT/ncu.log" | tail -20 | tee -a "$LOG"
fi
step "done"
pack
