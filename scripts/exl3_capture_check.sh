#!/usr/bin/env bash
# Prove the exllamav3-1.4.5 capture fix on the GPU device: a never-tuned EXL3 GEMM captured into a
# CUDA graph dies on the pristine build and works, equal to the eager run, on the patched one.
#
# Runs on the device machine (H200, torch 2.11 cu130, Python 3.12, no network), from the repo root,
# with the wheels carried in .whl/ (run tool: carry [".whl"]). Fill .whl/ on the dev machine with:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl exllamav3==1.4.5 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection PyYAML
#
# (pydantic and PyYAML are for dsv4serve.patches, which applies the patch set; filelock and
# typing_extensions come with torch.) Keep one exllamav3 version in .whl/.
#
#   bash scripts/exl3_capture_check.sh            # everything (about 450 s: 150 s JIT build, ~100 s rebuild)
#   bash scripts/exl3_capture_check.sh pristine   # or in two calls on a warm machine, if 600 s is tight:
#   bash scripts/exl3_capture_check.sh patched    #   /tmp keeps the build and the first phase's results
#
# Writes $OUT/capture.json: {pristine: {...}, patched: {...}, patch_apply: {...}, verdict: {...}}.
# Exit 0 when the phases run completed and (if the patched phase ran) every patched capture worked.
set -euo pipefail

PHASE="${1:-all}"
case "$PHASE" in all|pristine|patched) ;; *) echo "usage: $0 [all|pristine|patched]" >&2; exit 2 ;; esac

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/out}"
SITE="${EXL3_SITE:-/tmp/site}"
STATE="${EXL3_CAPTURE_STATE:-/tmp/exl3_capture}"
CASES="${EXL3_CAPTURE_CASES:-4:2,4:6,16:2,16:6}"
PY="${PYTHON:-python3}"
WHEELS="${EXL3_WHEELS:-$REPO/.whl}"
read -r -a PROBE_EXTRA <<< "${EXL3_PROBE_ARGS:-}"   # tests: --dry-cpu --k 256 --n 128
mkdir -p "$OUT" "$STATE"

export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/ext}"   # the same dir for both builds: ninja
export DSV4SERVE_HOME="${DSV4SERVE_HOME:-/tmp/dsv4serve-home}"     # recompiles only the changed units
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

install_wheels() {
  if [ -f "$SITE/exllamav3/ext.py" ]; then return; fi
  ls "$WHEELS"/exllamav3-*.whl >/dev/null 2>&1 || { echo "no exllamav3 wheel in $WHEELS (see the header)" >&2; exit 2; }
  log "installing $WHEELS/*.whl into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$SITE" "$WHEELS"/*.whl
}

build() {  # $1: label
  log "JIT-building exllamav3_ext ($1)"
  timeout 900 "$PY" "$REPO/scripts/exl3_capture_probe.py" --build-only ${PROBE_EXTRA[@]+"${PROBE_EXTRA[@]}"} | tee "$STATE/build_$1.json" >&2
}

probe() {  # $1: label
  log "probing $CASES ($1)"
  DISK_FLAG=(); [ "${EXL3_CAPTURE_DISK:-1}" = 1 ] && DISK_FLAG=(--disk-cache)
  "$PY" "$REPO/scripts/exl3_capture_probe.py" --cases "$CASES" ${DISK_FLAG[@]+"${DISK_FLAG[@]}"} --label "$1" \
    --json-out "$STATE/probe_$1.json" --timeout 300 ${PROBE_EXTRA[@]+"${PROBE_EXTRA[@]}"} >&2
}

marker() {  # $1: label. check-seat's exl3-extension row on the build just made, under the image's module name
  log "check-seat's exl3-extension row on the $1 build"
  PYTHONPATH="$REPO/src:$PYTHONPATH" "$PY" - "$TORCH_EXTENSIONS_DIR" > "$STATE/marker_$1.json" <<'EOF'
import json, shutil, sys
from pathlib import Path
from dsv4serve import checks
from dsv4serve.profile import load_profile
built = sorted(Path(sys.argv[1]).rglob("exllamav3_ext*.so"))
if not built:  # the CPU test's dry build compiles nothing
    print(json.dumps({"so": None, "status": "no build", "found": f"no exllamav3_ext*.so under {sys.argv[1]}"}))
    sys.exit(0)
so = built[0]
dst = Path("/tmp/exl3-ext-check/exllamav3_ext.cpython-312-x86_64-linux-gnu.so")
dst.parent.mkdir(parents=True, exist_ok=True)
shutil.copyfile(so, dst)
p = load_profile("8x16gb-380k", [f"runtime.exl3_extension={dst}"])
rep = checks.Report(p.name)
checks._exl3_extension(rep, checks.Ctx(profile=p))
row = rep.row("software", "exl3-extension")
print(json.dumps({"so": str(so), "bytes": so.stat().st_size, "status": row.status, "found": row.found}))
EOF
  cat "$STATE/marker_$1.json" >&2
}

apply_patch() {
  log "applying patch set exllamav3-1.4.5 to $SITE"
  PYTHONPATH="$REPO/src:$PYTHONPATH" "$PY" - "$SITE" > "$STATE/patch_apply.json" <<'EOF'
import json, sys
from pathlib import Path
from dsv4serve import patches
pset = patches.load_set("exllamav3-1.4.5")
res = patches.apply_set(pset, Path(sys.argv[1]))
print(json.dumps(res.as_json(), indent=1))
bad = [r.file for r in res.rows if r.state not in patches.OK_PATCHED]
sys.exit(1 if bad else 0)
EOF
}

ensure_pristine() {  # a tree left patched by an earlier `patched` phase goes back first (no-op if pristine)
  PYTHONPATH="$REPO/src:$PYTHONPATH" "$PY" - "$SITE" >&2 <<'EOF'
import sys
from pathlib import Path
from dsv4serve import patches
res = patches.revert_set(patches.load_set("exllamav3-1.4.5"), Path(sys.argv[1]))
print(f"revert: {len(res.changed)} file(s) restored" if res.changed else "tree is pristine")
EOF
}

summarize() {
  "$PY" - "$STATE" "$OUT/capture.json" <<'EOF'
import json, sys
from pathlib import Path
state, out = Path(sys.argv[1]), Path(sys.argv[2])
doc = {}
for key, name in (("pristine", "probe_pristine.json"), ("patched", "probe_patched.json"),
                  ("patch_apply", "patch_apply.json"), ("build_pristine", "build_pristine.json"),
                  ("build_patched", "build_patched.json"), ("marker_pristine", "marker_pristine.json"),
                  ("marker_patched", "marker_patched.json")):
    p = state / name
    if p.is_file():
        text = p.read_text().strip().splitlines()
        doc[key] = json.loads(p.read_text()) if not key.startswith("build") else json.loads(text[-1])
verdict = {}
if "pristine" in doc:
    rows = doc["pristine"]["cases"]
    verdict["pristine_capture_failed"] = [f"{r['case']}/{r['tune_cache']}" for r in rows if not r["capture_ok"]]
    verdict["pristine_capture_ok"] = [f"{r['case']}/{r['tune_cache']}" for r in rows if r["capture_ok"]]
if "patched" in doc:
    rows = doc["patched"]["cases"]
    verdict["patched_all_ok"] = all(r["eager_ok"] and r["capture_ok"] and r["replay_matches_eager"] for r in rows)
    verdict["patched_failed"] = [f"{r['case']}/{r['tune_cache']}: {r['error']}" for r in rows
                                 if not (r["capture_ok"] and r["replay_matches_eager"])]
    verdict["patched_warned"] = [f"{r['case']}/{r['tune_cache']}" for r in rows if r["warned_untuned_in_capture"]]
# check-seat's exl3-extension row: a build of the pristine sources fails it, one of the patched passes
for key, want in (("marker_pristine", "fail"), ("marker_patched", "ok")):
    if key in doc and doc[key]["status"] != "no build":
        verdict[f"{key}_row_as_expected"] = doc[key]["status"] == want
doc["verdict"] = verdict
out.write_text(json.dumps(doc, indent=1))
print(json.dumps(verdict, indent=1))
sys.exit(0 if verdict.get("patched_all_ok", True) and all(v for k, v in verdict.items() if k.endswith("as_expected"))
         else 1)
EOF
}

install_wheels
if [ "$PHASE" = all ] || [ "$PHASE" = pristine ]; then
  rm -f "$STATE"/probe_*.json "$STATE"/patch_apply.json "$STATE"/build_*.json "$STATE"/marker_*.json
  ensure_pristine
  build pristine
  marker pristine
  probe pristine
fi
if [ "$PHASE" = all ] || [ "$PHASE" = patched ]; then
  apply_patch
  build patched
  marker patched
  probe patched
fi
summarize
