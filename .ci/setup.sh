#!/usr/bin/env bash
# One-command install of mpsync on a bare Debian 12 machine (run as root, idempotent).
#
#   make setup            # what users and CI run
#
# Steps, each skipped when already done:
#   1. Open MPI 4.1 (+ headers, cmake, a C++ compiler) from Debian's packages.
#   2. A virtualenv in .venv with the pinned runtime and test dependencies.
#   3. mpi4py compiled against that Open MPI (not a generic binary wheel).
#   4. Horovod 0.28.1 from its PyPI source, patched to C++17 (see build_horovod below).
#   5. mpsync itself, editable, with --no-deps and only after Horovod: registered any earlier,
#      every later pip install would report its unmet horovod==0.28.1 pin as an ERROR.
#   6. Numba's cache filled with every policy's kernels (mpsync doctor --warm), so that no
#      first run compiles them; again after mpsync's sources or Numba change.
# A final check fails loudly unless Horovod reports PyTorch, MPI and Gloo support.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
STAMP_DIR=$VENV/.mpsync-setup
HOROVOD_VERSION=0.28.1
TORCH_VERSION=2.13.0

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

# -- 1. system packages ------------------------------------------------------
need_apt=()
for pkg in openmpi-bin libopenmpi-dev cmake g++ make iproute2; do  # iproute2: ip, tc, ss (mpsync cluster)
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  [ "$(id -u)" = 0 ] || die "need root to apt-get install: ${need_apt[*]}"
  log "apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
command -v mpirun >/dev/null || die "mpirun not found after installing openmpi-bin"

# -- 2. virtualenv and pinned dependencies -----------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
mkdir -p "$STAMP_DIR"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

# The requirement set is hashed so that editing setup.cfg re-runs the install, and an unchanged
# one is skipped (a second `make setup` must finish in seconds).
req_hash=$(cat "$ROOT/setup.cfg" "$ROOT/.ci/setup.sh" | sha256sum | cut -c1-16)
if [ "$(cat "$STAMP_DIR/deps" 2>/dev/null)" != "$req_hash" ]; then
  log "installing pinned dependencies into $VENV"
  "${PIP[@]}" install --upgrade pip setuptools wheel
  # torch is pinned exactly: this machine has the CPU build of 2.13.0 on disk, while any other
  # spec may resolve to a multi-GB CUDA build.
  "${PIP[@]}" install "torch==$TORCH_VERSION"
  # mpi4py is compiled from source so it links the system Open MPI that mpirun launches.
  MPICC=$(command -v mpicc) "${PIP[@]}" install --no-binary mpi4py "mpi4py==4.1.2"
  # The rest of the pins live in setup.cfg (install_requires + the [test] extra), read from
  # the file so that mpsync is not registered before Horovod is in (step 5).
  "$VENV/bin/python" - "$ROOT/setup.cfg" > "$STAMP_DIR/requirements.txt" <<'PYEOF'
import configparser, sys
cfg = configparser.ConfigParser()
cfg.read(sys.argv[1])
reqs = cfg["options"]["install_requires"].split("\n")
reqs += cfg["options.extras_require"]["test"].split("\n")
print("\n".join(r.strip() for r in reqs if r.strip() and not r.strip().startswith("horovod")))
PYEOF
  "${PIP[@]}" install -r "$STAMP_DIR/requirements.txt"
  echo "$req_hash" > "$STAMP_DIR/deps"
fi

# -- 4. Horovod --------------------------------------------------------------
horovod_ok() {
  "$VENV/bin/python" - <<'PYEOF' 2>/dev/null
import horovod, horovod.torch as hvd
ok = horovod.__version__ == "0.28.1" and hvd.mpi_built() and hvd.gloo_built()
raise SystemExit(0 if ok else 1)
PYEOF
}

build_horovod() {
  # Horovod 0.28.1 is the last release and does not build against torch >= 2.1 as published:
  #  - torch >= 2.1 headers require C++17 ("#error C++17 or later compatible compiler is
  #    required to use PyTorch"), but Horovod's CMakeLists pin CMAKE_CXX_STANDARD 14 and its
  #    bundled gloo forces -std=c++11 (upstream issues #3996/#4014; fixed on master by PR #3998,
  #    never released). We patch the unpacked sdist to C++17.
  #  - Its bundled gloo's cmake_minimum_required is rejected by cmake >= 4; we build with
  #    Debian's cmake 3.25 and also set CMAKE_POLICY_VERSION_MINIMUM in case a newer one is on PATH.
  #  - --no-build-isolation so the build sees the torch in the venv (an isolated build env
  #    would fetch a different torch).
  local work
  work=$(mktemp -d)
  trap 'rm -rf "$work"' RETURN
  log "building Horovod $HOROVOD_VERSION from source (takes a few minutes)"
  "${PIP[@]}" download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
  tar -xzf "$work"/horovod-"$HOROVOD_VERSION".tar.gz -C "$work"
  local src=$work/horovod-$HOROVOD_VERSION
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
      "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  sed -i 's/-std=c++11/-std=c++17/g' "$src/third_party/gloo/CMakeLists.txt"
  grep -q 'CMAKE_CXX_STANDARD 17' "$src/CMakeLists.txt" || die "Horovod patch did not apply (CMakeLists.txt)"
  grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" || die "Horovod patch did not apply (torch/CMakeLists.txt)"
  "${PIP[@]}" install cloudpickle psutil pyyaml packaging cffi
  CMAKE_POLICY_VERSION_MINIMUM=3.5 \
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
  HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
  MAKEFLAGS="-j$(nproc)" \
    "${PIP[@]}" install --no-build-isolation --no-deps "$src"
}

if ! horovod_ok; then
  build_horovod
  horovod_ok || die "Horovod $HOROVOD_VERSION was built but does not report PyTorch + MPI + Gloo support; see the build log above"
fi

# -- 5. mpsync itself (editable, so the console script `mpsync` is on the venv's PATH) ---------
# Registered again whenever setup.cfg changed (entry points, metadata), and last: its pins are
# all installed by now, so pip finds nothing to report.
if [ ! -x "$VENV/bin/mpsync" ] || [ "$(cat "$STAMP_DIR/self" 2>/dev/null)" != "$req_hash" ]; then
  "${PIP[@]}" install --no-deps --no-build-isolation -e "$ROOT"
  echo "$req_hash" > "$STAMP_DIR/self"
fi
log "ok: $("$VENV/bin/python" -c 'import horovod, torch, mpi4py, numba; print("horovod", horovod.__version__, "torch", torch.__version__, "mpi4py", mpi4py.__version__, "numba", numba.__version__)')"

# -- 6. Numba's cache filled with every policy's kernels ------------------------------------
# One short `mpsync train` per policy (`mpsync doctor --warm`, about 90 s the first time), so
# that a user's first run loads its compiled kernels instead of compiling them, some of them
# while it trains.  Again whenever mpsync's sources or Numba changed (the cache is keyed on
# both).  A failure is reported, not fatal: the install itself is complete, and the doctor's
# lines say what broke.
warm_hash=$(cd "$ROOT" && { find mpsync -name '*.py' -print0 | sort -z | xargs -0 cat;
                            "$VENV/bin/python" -c 'import numba; print(numba.__version__)'; } \
            | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP_DIR/warm" 2>/dev/null)" != "$warm_hash" ]; then
  log "filling Numba's cache: one short run per policy (mpsync doctor --warm)"
  if (cd "$ROOT" && "$VENV/bin/python" -m mpsync.cli doctor --warm); then
    echo "$warm_hash" > "$STAMP_DIR/warm"
  else
    log "WARNING: mpsync doctor --warm failed (above); a first run will compile its kernels"
  fi
fi
