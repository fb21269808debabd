#!/usr/bin/env bash
# One device call: build lna2 (+ exllamav3 incumbents), check, time. Everything lands in $OUT.
# Usage on the device machine, from the repo root:
#   scripts/lna2_device.sh [INCUMBENTS] [STEPS]
#     INCUMBENTS: comma list of 145, 165 (exllamav3 versions), or none          (default 145,165)
#     STEPS:      comma list of checkseat,smoke,parity,sanitizer,trace,bench,fit,dispatch,sweep,order,ablate,ncu,
#                 kcheck (`dsv4serve kernel check --bench`), tune (`kernel check --save-tuning` and the
#                 dispatch serving the table; TUNE_ROWS, TUNE_ALSO, TUNE_FORCE) (default all but order, tune)
# Wheels come from .whl145/ or .whl165/ (carried; every checkout starts without them). To fill them,
# and .whl/ with what dsv4serve needs there, from the repo root on the dev machine:
#   printf '/.whl145/\n/.whl165/\n/.dev/\n' >> .git/info/exclude
#   P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
#      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
#   python3 -m pip download $P -d .whl145 exllamav3==1.4.5; python3 -m pip download $P -d .whl165 exllamav3==1.6.5
#   python3 -m pip download $P -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection
#   python3 -m pip wheel -q --no-deps . -w .whl   # dsv4serve itself (rebuild it after changing src/)
# and carry [".whl145", ".whl165", ".dev", ".whl"]. A build brought home by an earlier call can be
# carried in .dev/ext<ver>/ to skip the JIT (~150 s for 1.4.5, ~300 s for 1.6.5 on 16 cores); a fresh
# JIT build is sent home as ext<ver>.so.part-* (16 MiB per returned file): copy those parts into
# .dev/ext<ver>/ as they are (either name is read).
# Each step has its own timeout and optional steps are skipped past DEADLINE seconds, so a slow
# call still returns what it measured.
# Environment: LNA2_VARIANTS (smoke, parity; the first two also get CUDA-graph cases),
# BENCH_VARIANTS, BENCH_MS, BENCH_SHAPES, SAN_VARIANTS (compute-sanitizer), TRACE_VARIANT (TRACE_BITS,
# TRACE_MS: its K and TP8 row counts; TRACE_EMPTY=1 also traces each case with nothing routed;
# TRACE_STOP=1,2,3,4 with variant 26 also traces its stop build stopping after the prologue / the
# route plan / not at all (3) / not at all with an inline zero store when nothing is routed (4)),
# SAN_TIMEOUT (per sanitizer tool; racecheck beside a JIT build needed more than 120 s on 2026-12-04),
# SWEEP_ITEMS / SWEEP_PAIR / SWEEP_CTAS / SWEEP_VARIANT / SWEEP_BITS (2, 3 or 2,3) / SWEEP_SHAPES /
# SWEEP_MS / SWEEP_TIMEOUT, BENCH_AFTER (gemm: a GEMM before each cold launch), ORDER_VARIANTS / ORDER_MS / ORDER_KS / ORDER_BEFORE / ORDER_TIMEOUT, PARITY=quick|full, PARITY_INTERS (default 256,2048), DEADLINE.
# Only $OUT/results.tgz comes home: the device tool returns at most 8 files, so do not copy more.
set -u
INCS=${1:-145,165}
STEPS=${2:-checkseat,smoke,parity,sanitizer,trace,bench,fit,dispatch,sweep,ablate,ncu,kcheck}
DEADLINE=${DEADLINE:-540}
T0=$(date +%s)
FINAL=${OUT:-$PWD/.device-out}
OUT=/tmp/lna2-work
# A warm (or reused) machine keeps /tmp: files of an earlier call would ride home in this call's
# tarball beside the new ones (2026-12-03: a bench JSON of another build did), so start empty.
rm -rf "$OUT"
mkdir -p "$OUT" "$FINAL"
export OUT
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
export DSV4SERVE_HOME=/tmp/dsv4home
LOG=$OUT/cycle.log
pack() { tar czf "$FINAL/results.tgz" -C "$OUT" . 2>/dev/null; }
step() { pack; echo "== $(date +%T) +$(( $(date +%s) - T0 ))s $*" | tee -a "$LOG"; }
has() { case ",$STEPS," in *",$1,"*) return 0;; esac; return 1; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee -a "$LOG"
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$LOG"

# dsv4serve's own dependencies missing from the device image (pydantic, ...) and the dsv4serve wheel
# itself (its vllm.general_plugins entry point is one of check-seat's rows) travel in .whl/
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
# Every step's python sees them: the device image has no pydantic, and since 825e24d lna2's build
# imports dsv4serve.state (pydantic), so without this every step died at import (2026-12-05).
# The scripts put the repo's src/ first, so the wheel's copy of dsv4serve is not the one run.
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import pydantic; print('pydantic', pydantic.VERSION)" 2>&1 | tail -1 | tee -a "$LOG"

declare -A PID
for INC in ${INCS//,/ }; do
  [ "$INC" = none ] && continue
  SITE=/tmp/site$INC
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl$INC/*.whl 2>&1 | tail -2
  if ls .dev/ext$INC/*.so.part-* >/dev/null 2>&1; then
    cat .dev/ext$INC/*.so.part-* > "$SITE/exllamav3_ext.so"
    step "exllamav3 $INC: carried build ($(du -h "$SITE/exllamav3_ext.so" | cut -f1))"
  else
    step "exllamav3 $INC: JIT build in the background"
    ( cd /tmp && PYTHONPATH=$SITE MAX_JOBS=${EXL3_JOBS:-12} TORCH_EXTENSIONS_DIR=/tmp/ext$INC timeout 560 \
        python3 -c "import sys, types; p='$SITE/exllamav3'; m=types.ModuleType('exllamav3'); m.__path__=[p]; sys.modules['exllamav3']=m; import exllamav3.ext" \
        > "$OUT/exl3_build_$INC.log" 2>&1; echo "exit $?" >> "$OUT/exl3_build_$INC.log" ) &
    PID[$INC]=$!
  fi
done

ready_inc() {  # wait for a background build, install it, and queue it for the trip home
  local INC=$1 SITE=/tmp/site$1
  if [ -n "${PID[$INC]:-}" ]; then
    step "waiting for the exllamav3 $INC build"
    wait "${PID[$INC]}"
    tail -2 "$OUT/exl3_build_$INC.log" | tee -a "$LOG"
    local SO
    SO=$(find /tmp/ext$INC -name 'exllamav3_ext*.so' | head -1)
    if [ -n "$SO" ]; then
      cp "$SO" "$SITE/exllamav3_ext.so"
      # home in parts when small enough to carry back in (1.4.5's 170 MB build is not)
      [ "$(stat -c %s "$SO")" -lt 60000000 ] && split -b 15m -d "$SO" "$FINAL/ext$INC.so.part-"
    fi
    PID[$INC]=
  fi
  [ -f "$SITE/exllamav3_ext.so" ]
}

step "build lna2"
MAX_JOBS=4 timeout 300 python3 scripts/lna2_device.py build > "$OUT/lna2_build.log" 2>&1
echo "exit $?" >> "$OUT/lna2_build.log"
grep -E "registers|spill|error|built|exit" "$OUT/lna2_build.log" | tail -30 | tee -a "$LOG"

if has checkseat; then
  step "dsv4serve check-seat on this GPU (a one-GPU profile of the card found, over a synthetic pack, and the canon profile)"
  PYTHONPATH=/tmp/site timeout 120 python3 - > "$OUT/checkseat.log" 2>&1 <<'PY'
import json, os, subprocess, sys
import torch
from dsv4serve.testing.synthpack import write_pack
sp = write_pack("/tmp/pack")
out = os.environ["OUT"]
# the card this call landed on (the lender gives H200s or H100s), so the machine rows should pass
props = torch.cuda.get_device_properties(0)
local = ["--set", "runtime.kind=native", "--set", "gpus.ids=[0]", "--set", f"gpus.model={props.name}", "--set",
         f"gpus.memory_gib={props.total_memory // 2**30}", "--set",
         f'gpus.compute_capability="{props.major}.{props.minor}"', "--set", "vllm.tensor_parallel_size=1",
         "--set", "model.path=/tmp/pack", "--set", f"model.expect_shards={sp.expect_shards}"]
for tag, extra in (("local", local), ("canon", [])):
    r = subprocess.run([sys.executable, "-m", "dsv4serve", "check-seat", "--profile", "8x16gb-380k", "--json", *extra],
                       capture_output=True, text=True, timeout=100)
    open(f"{out}/check-seat-{tag}.json", "w").write(r.stdout)
    open(f"{out}/check-seat-{tag}.stderr", "w").write(r.stderr)
    print(tag, "exit", r.returncode)
    try:
        for row in json.loads(r.stdout)["rows"]:
            if row.get("section") == "machine" or row.get("check") in ("lna2", "lna2-abi", "plugin-entry-point", "torch-cuda-arch"):
                print(" ", row.get("section"), row.get("check"), row.get("status"), row.get("found"))
    except Exception as e:
        print("unparsable:", e, r.stdout[-400:], r.stderr[-800:])
PY
  echo "exit $?" >> "$OUT/checkseat.log"
  PYTHONPATH=/tmp/site timeout 60 python3 scripts/nvml_probe.py --out "$OUT/nvml-local.json" >> "$OUT/checkseat.log" 2>&1
  echo "nvml_probe exit $?" >> "$OUT/checkseat.log"
  cat "$OUT/checkseat.log" | tee -a "$LOG"
fi

export LNA2_VARIANTS=${LNA2_VARIANTS:-59,55,58,46,26,36,54,53,50,40,31,4,21,20,9,7,1,6,2,3,0}
if has smoke; then
  step "smoke (variants $LNA2_VARIANTS)"
  timeout 60 python3 scripts/lna2_device.py smoke > "$OUT/smoke.log" 2>&1; echo "exit $?" >> "$OUT/smoke.log"
  tail -4 "$OUT/smoke.log" | tee -a "$LOG"
  step "refusals (the binding's argument checks, one process per bad call)"
  timeout 200 python3 scripts/lna2_device.py refusals > "$OUT/refusals.log" 2>&1; echo "exit $?" >> "$OUT/refusals.log"
  tail -8 "$OUT/refusals.log" | tee -a "$LOG"
fi

if has parity; then
  step "parity"
  Q=--quick; [ "${PARITY:-quick}" = full ] && Q=
  timeout 260 python3 scripts/lna2_device.py parity $Q ${PARITY_INTERS:+--inters $PARITY_INTERS} > "$OUT/lna2_parity.log" 2>&1
  echo "exit $?" >> "$OUT/lna2_parity.log"
  grep -E "FAIL|parity:|cases, worst|Error|exit" "$OUT/lna2_parity.log" | tail -24 | tee -a "$LOG"
fi

if has sanitizer && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    [ "$(left)" -lt 200 ] && { echo "skip sanitizer $tool: $(left)s left" | tee -a "$LOG"; continue; }
    step "compute-sanitizer $tool"
    LNA2_VARIANTS=${SAN_VARIANTS:-40,26} timeout ${SAN_TIMEOUT:-120} compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/lna2_device.py smoke \
      > "$OUT/sanitizer_$tool.log" 2>&1; echo "exit $?" >> "$OUT/sanitizer_$tool.log"
    tail -4 "$OUT/sanitizer_$tool.log" | tee -a "$LOG"
  done
fi

TRACE_VARIANT=${TRACE_VARIANT:-4}
if has trace && [ "$(left)" -gt 240 ]; then
  for TV in ${TRACE_VARIANT//,/ }; do  # one variant (default 4) or a comma list
    step "event trace of variant $TV"
    timeout 90 python3 scripts/lna2_device.py trace --variant $TV ${TRACE_BITS:+--bits $TRACE_BITS} ${TRACE_MS:+--ms $TRACE_MS} ${TRACE_EMPTY:+--empty} \
      > "$OUT/trace-v$TV.log" 2>&1; echo "exit $?" >> "$OUT/trace-v$TV.log"
    tail -16 "$OUT/trace-v$TV.log" | tee -a "$LOG"
    # TRACE_STOP=1,2,3 (v26, K2): the same cases by its stop build (after the prologue / the plan / none)
    if [ "$TV" = 26 ] && [ "${TRACE_BITS:-2}" = 2 ]; then  # the stop builds are K2 MCG only
      STOPS=${TRACE_STOP:-}
      for TS in ${STOPS//,/ }; do
        [ "$(left)" -gt 100 ] || { echo "trace stop $TS skipped: past the deadline" | tee -a "$LOG"; break; }
        step "event trace of variant 26 stopped at stage $TS"
        timeout 90 python3 scripts/lna2_device.py trace --variant 26 --stop $TS ${TRACE_MS:+--ms $TRACE_MS} ${TRACE_EMPTY:+--empty} \
          > "$OUT/trace-v26-stop$TS.log" 2>&1; echo "exit $?" >> "$OUT/trace-v26-stop$TS.log"
        tail -8 "$OUT/trace-v26-stop$TS.log" | tee -a "$LOG"
      done
    fi
  done
fi

BV=${BENCH_VARIANTS:-59,55,58,46,26,36,54,53,50,40,31,4,21,20,9,7,1,6,2,3,0}
MS=${BENCH_MS:-1,2,4,8,16,24}
SWEEP_BITS=${SWEEP_BITS:-2}
if has sweep && [ "$(left)" -gt 240 ]; then
  for b in ${SWEEP_BITS//,/ }; do  # one process per K (SWEEP_TIMEOUT each)
    step "tuning sweep (v2 family), K$b"
    timeout ${SWEEP_TIMEOUT:-150} python3 scripts/lna2_device.py sweep ${SWEEP_ITEMS:+--items $SWEEP_ITEMS} ${SWEEP_PAIR:+--pair $SWEEP_PAIR} \
      ${SWEEP_CTAS:+--ctas $SWEEP_CTAS} ${SWEEP_VARIANT:+--variant $SWEEP_VARIANT} --bits "$b" \
      ${SWEEP_SHAPES:+--shapes $SWEEP_SHAPES} ${SWEEP_MS:+--ms $SWEEP_MS} > "$OUT/sweep-k$b.log" 2>&1
    echo "exit $?" >> "$OUT/sweep-k$b.log"
    grep -E "^tp|exit|Error|FAIL" "$OUT/sweep-k$b.log" | tee -a "$LOG"
  done
fi

if has order && [ "$(left)" -gt 60 ]; then
  step "launch order: series / interleaved / after another build / after a GEMM / fp16 out"
  OT=${ORDER_TIMEOUT:-150}
  timeout $(( $(left) > OT ? OT : $(left) )) python3 scripts/lna2_device.py order ${ORDER_VARIANTS:+--variants $ORDER_VARIANTS} \
    ${ORDER_MS:+--ms $ORDER_MS} ${ORDER_KS:+--ks $ORDER_KS} ${ORDER_BEFORE:+--before $ORDER_BEFORE} > "$OUT/order.log" 2>&1
  echo "exit $?" >> "$OUT/order.log"
  grep -E "^K|exit|Error" "$OUT/order.log" | tee -a "$LOG"
fi

if has ablate && [ "$(left)" -gt 120 ]; then
  step "timing ablations of variant 4"
  timeout 120 python3 scripts/lna2_device.py ablate > "$OUT/ablate.log" 2>&1; echo "exit $?" >> "$OUT/ablate.log"
  grep -E "^tp|exit|Error" "$OUT/ablate.log" | tee -a "$LOG"
fi

if has bench; then
  for INC in ${INCS//,/ }; do
    if [ "$INC" != none ] && ! ready_inc "$INC"; then
      echo "exllamav3 $INC did not build: bench without it" | tee -a "$LOG"; INC=none
    fi
    [ "$(left)" -lt 60 ] && { echo "skip bench vs $INC: $(left)s left" | tee -a "$LOG"; continue; }
    step "bench vs $INC"
    PYTHONPATH=/tmp/site$INC:$PYTHONPATH timeout $(( $(left) > 280 ? 280 : $(left) )) python3 scripts/lna2_device.py bench \
      --incumbent $INC --ms $MS --variants $BV ${BENCH_SHAPES:+--shapes $BENCH_SHAPES} ${BENCH_AFTER:+--after $BENCH_AFTER} \
      > "$OUT/bench_$INC.log" 2>&1; echo "exit $?" >> "$OUT/bench_$INC.log"
    grep -E "^tp|exit|Error" "$OUT/bench_$INC.log" | tee -a "$LOG"
  done
fi
if has ncu && command -v ncu >/dev/null && [ "$(left)" -gt 90 ]; then
  # the full section set (stall reasons, pipe utilisation, source-level counters) into a report,
  # then its details, raw metrics and per-SASS-line source page as text for the trip home
  V=$(echo "$BV" | cut -d, -f1)
  NCU_N=$(( 3 * $(echo "${LNA2_PROFILE_SHAPES:-tp8:1+16,tp1:8}" | tr ',+' '\n\n' | wc -l) ))
  step "ncu --set full, variant $V, $NCU_N launches"
  LNA2_PROFILE_VARIANT=$V timeout ${NCU_TIMEOUT:-150} ncu --clock-control none --set full --import-source yes \
    -k regex:moe_decode_v --launch-count $NCU_N -o "$OUT/ncu" -f python3 scripts/lna2_device.py profile > "$OUT/ncu.log" 2>&1
  echo "exit $?" >> "$OUT/ncu.log"
  if [ -f "$OUT/ncu.ncu-rep" ]; then
    timeout 60 ncu -i "$OUT/ncu.ncu-rep" --page details --print-details all > "$OUT/ncu-details.txt" 2>&1
    timeout 60 ncu -i "$OUT/ncu.ncu-rep" --page raw --csv > "$OUT/ncu-raw.csv" 2>&1
    timeout 90 ncu -i "$OUT/ncu.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-sass.csv" 2>&1
    ls -la "$OUT"/ncu* | tee -a "$LOG"
  fi
  grep -E "Duration|Issue Slots Busy|Achieved Occupancy|Issued Warp|No Eligible|Registers|exit" "$OUT/ncu-details.txt" "$OUT/ncu.log" 2>/dev/null | tail -30 | tee -a "$LOG"
fi

for INC in ${INCS//,/ }; do [ "$INC" != none ] && [ -n "${PID[$INC]:-}" ] && ready_inc "$INC" >/dev/null; done

if has fit; then
  step "lna2_moe_fit: the rows each served build fits, on this card and at an sm_120 card's 99 KB a block"
  timeout 120 python3 scripts/lna2_device.py fit > "$OUT/fit.log" 2>&1; echo "exit $?" >> "$OUT/fit.log"
  tail -20 "$OUT/fit.log" | tee -a "$LOG"
fi

if has dispatch; then
  DI=none; case ",$INCS," in *",145,"*) ready_inc 145 && DI=145;; esac
  step "moe_dispatch.Runtime on this GPU vs exllamav3 $DI"
  PYTHONPATH=/tmp/site$DI:$PYTHONPATH timeout 240 python3 scripts/lna2_device.py dispatch > "$OUT/dispatch.log" 2>&1
  echo "exit $?" >> "$OUT/dispatch.log"
  grep -E "prepared|calls, worst|graph:|graph record|timing|dispatch:|FAIL|FAULT|Error|exit|ACTIVE|parity" "$OUT/dispatch.log" | tail -30 | tee -a "$LOG"
fi

if has kcheck && [ "$(left)" -gt 60 ]; then
  # the product's own command, as a seat operator runs it (the repo's src/, the extension built above)
  step "dsv4serve kernel check --bench (the policy's picks against the fp64 reference, then timed)"
  PYTHONPATH=$PWD/src:$PYTHONPATH timeout 240 python3 -m dsv4serve kernel check --bench --json \
    > "$OUT/kernel-check.json" 2> "$OUT/kernel-check.log"
  echo "exit $?" >> "$OUT/kernel-check.log"
  python3 - "$OUT/kernel-check.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
d = json.load(open(sys.argv[1]))
print("kernel check ok", d.get("ok"), d.get("device"), "aborted:", d.get("aborted"))
for c in d.get("cases", []):
    p = c["pick"]
    print(f" K{c['K']} {c['rows']:2} rows v{c['variant']} err {p['worst_rel']} / {p['worst_rel_x']}"
          f" graph {p['graph_worst_rel']} {p['graph_error'] or ''} ok {c['ok']} {p['error'] or ''}"
          f" fastest {c['fastest']} {c['timings_us']} off {c['failed_variants']}")
PY
  tail -3 "$OUT/kernel-check.log" | tee -a "$LOG"
fi

if has tune && [ "$(left)" -gt 90 ]; then
  # this card's tuning table by the product's command, then the dispatch serving it: the saved table,
  # and a copy whose picks are forced off the built-in policy (TUNE_FORCE, "K2/mcg:1=55,4=53"), so
  # the dispatch is seen serving builds the policy would not pick, each call checked as above
  step "dsv4serve kernel check --bench --save-tuning, then moe_dispatch serving the table"
  PYTHONPATH=$PWD/src:$PYTHONPATH timeout 300 python3 -m dsv4serve kernel check --bench \
    --rows "${TUNE_ROWS:-1,2,4,8,16}" --also "${TUNE_ALSO:-53}" --save-tuning "$OUT/tuning.json" --json \
    > "$OUT/tune-check.json" 2> "$OUT/tune-check.log"
  echo "exit $?" >> "$OUT/tune-check.log"
  python3 - "$OUT/tune-check.json" "$OUT/tuning.json" "$OUT/tuning-forced.json" "${TUNE_FORCE:-K2/mcg:1=55,4=53,16=53;K3/mcg:2=55}" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
d = json.load(open(sys.argv[1]))
print("tune check ok", d.get("ok"), d.get("device"), "tuning:", d.get("tuning"))
for c in d.get("cases", []):
    print(f" K{c['K']} {c['rows']:2} rows pick v{c['variant']} fastest v{c['fastest']} graph {c.get('fastest_graph_ok')}"
          f" {c['timings_us']}")
t = json.load(open(sys.argv[2]))
print("table picks", t["picks"])
for part in sys.argv[4].split(";"):
    key, _, pairs = part.partition(":")
    for pr in pairs.split(","):
        r, _, v = pr.partition("=")
        if v not in t["timings_us"].get(key, {}).get(r, {}):  # a table may name only builds it timed there
            print(f"not forced: {key} {r} rows v{v} (not timed at that point)")
            continue
        t["picks"].setdefault(key, {})[r] = int(v)
json.dump(t, open(sys.argv[3], "w"), indent=1)
print("forced picks", t["picks"])
PY
  tail -3 "$OUT/tune-check.log" | tee -a "$LOG"
  # check-seat's lna2-tuning row on this machine: the table's torch device name against NVML's
  [ -f "$OUT/tuning.json" ] && PYTHONPATH=$PWD/src:$PYTHONPATH timeout 120 python3 -m dsv4serve check-seat \
    --profile 8x16gb-380k --set runtime.kind=native --set 'gpus.ids=[0]' --set vllm.tensor_parallel_size=1 \
    --set "moe.tuning=$OUT/tuning.json" --json > "$OUT/check-seat-tuning.json" 2> "$OUT/check-seat-tuning.stderr"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print('check-seat', r['check'], r['status'], r['found']) for r in d['rows'] if r['section'] == 'machine' or r['check'] in ('lna2', 'lna2-tuning')]" \
    "$OUT/check-seat-tuning.json" 2>&1 | tee -a "$LOG"
  for T in "" -forced; do
    [ -f "$OUT/tuning$T.json" ] || continue
    DISPATCH_TAG="-tuned$T" DISPATCH_TUNING="$OUT/tuning$T.json" PYTHONPATH=/tmp/site${DI:-none}:$PYTHONPATH \
      timeout 240 python3 scripts/lna2_device.py dispatch > "$OUT/dispatch-tuned$T.log" 2>&1
    echo "exit $?" >> "$OUT/dispatch-tuned$T.log"
    grep -E "prepared|calls, worst|graph:|dispatch:|FAIL|FAULT|Error|exit|ACTIVE|tuning" "$OUT/dispatch-tuned$T.log" \
      | tail -20 | tee -a "$LOG"
  done
fi

step "done"
pack
ls -la "$FINAL" | tee -a "$LOG"
