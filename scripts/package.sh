#!/usr/bin/env bash
# Builds the Debian package and checks it (Debian/Ubuntu only):
#
#   scripts/package.sh
#
# 1. Installs the packaging tools if missing (dpkg-dev, debhelper, lintian,
#    patchelf, libopenblas-dev; apt-get update only then; sudo when not root).
# 2. Checks that debian/changelog matches CHANGELOG.md and Cargo.toml, and
#    that debian/copyright names every Rust crate the binaries link whose
#    licenses include neither MIT nor Apache-2.0.
# 3. dpkg-buildpackage -us -uc -b. debian/rules runs `cargo build --release
#    --locked`, which reuses the release build of scripts/test.sh when it
#    ran first (CI), so the package costs no second build. The packages go
#    to $TARGET_DIR/debian/ (dpkg-buildpackage writes them next to the
#    checkout; they are moved).
# 4. dpkg-deb --contents holds the expected files; lintian reports no error
#    or warning (every override in debian/mlxcel.lintian-overrides says why).
# 5. The packaged binaries, run from the package unpacked into a temporary
#    root (dpkg-deb -x; LD_LIBRARY_PATH points at its usr/lib/mlxcel, since
#    the RUNPATH names the installed /usr/lib/mlxcel): `--version` of both,
#    then mlxcel-server with the packaged /etc/mlxcel/server.toml and the
#    test model answers one chat request and exits with status 0 on SIGTERM.
#
# Needs scripts/setup.sh to have run (MLX in .venv, the test model).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
TARGET_DIR="${CARGO_TARGET_DIR:-$REPO/target}"
OUT="$TARGET_DIR/debian"
MODEL="${MLXCEL_TEST_MODEL:-$REPO/models/SmolLM2-135M-Instruct}"
PY="$REPO/.venv/bin/python"
log() { echo "[package] $*"; }
die() { echo "[package] ERROR: $*" >&2; exit 1; }

# --- 1. tools ----------------------------------------------------------------
command -v dpkg-query >/dev/null 2>&1 || die "not a Debian-like system"
missing=()
for p in dpkg-dev debhelper lintian patchelf libopenblas-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if (( ${#missing[@]} )); then
  SUDO=""
  if [[ "$(id -u)" != 0 ]]; then
    command -v sudo >/dev/null 2>&1 || die "${missing[*]} missing and neither root nor sudo"
    SUDO="sudo"
  fi
  log "installing ${missing[*]} (apt-get update + install)"
  $SUDO apt-get update
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi
[[ -x "$PY" ]] || die "no $PY: run scripts/setup.sh"
[[ -f "$MODEL/config.json" ]] || die "no test model at $MODEL: run scripts/setup.sh"

# --- 2. changelog and copyright ------------------------------------------------
bash scripts/debian-changelog.sh --check
mapfile -t patterns < <(grep -o 'rust-crates/[^ ]*' debian/copyright | sed 's|^rust-crates/||' | sort -u)
unnamed=()
while IFS='|' read -r crate license; do
  [[ "$license" == *MIT* || "$license" == *Apache-2.0* ]] && continue
  read -r name version _ <<<"$crate"
  named=0
  for pattern in "${patterns[@]}"; do
    # shellcheck disable=SC2053 # a glob of debian/copyright
    [[ "$name-${version#v}" == $pattern ]] && named=1
  done
  (( named )) || unnamed+=("$name $version ($license)")
done < <(cargo tree -p mlxcel -e normal --locked --prefix none --format '{p}|{l}' | sed 's/ (\*)$//' | sort -u)
(( ${#unnamed[@]} == 0 )) || die "debian/copyright does not name: ${unnamed[*]}"
log "debian/copyright names every crate outside MIT / Apache-2.0"

# --- 3. build ------------------------------------------------------------------
version="$(dpkg-parsechangelog -S Version)"
arch="$(dpkg-architecture -qDEB_HOST_ARCH)"
changes="../mlxcel_${version}_${arch}.changes"
start=$SECONDS
log "dpkg-buildpackage -us -uc -b"
dpkg-buildpackage -us -uc -b
log "built in $((SECONDS - start)) s"
mkdir -p "$OUT"
# Move exactly what this build made: the .changes and the files it lists.
files=("$changes")
while read -r name; do files+=("../$name"); done < <(
  awk '/^Files:/ { f = 1; next } /^[^ ]/ { f = 0 } f && NF == 5 { print $5 }' "$changes")
mv -f "${files[@]}" "$OUT/"
deb="$OUT/mlxcel_${version}_${arch}.deb"
log "$(basename "$deb"): $(du -h "$deb" | cut -f1)"

# --- 4. contents and lintian -----------------------------------------------------
contents="$(dpkg-deb --contents "$deb" | awk '{ print $6 }' | sed 's|^\./|/|')"
for path in /usr/bin/mlxcel /usr/bin/mlxcel-server \
  /usr/lib/mlxcel/libmlx.so /usr/share/doc/mlxcel/LICENSE.mlx /usr/share/doc/mlxcel/copyright \
  /usr/share/doc/mlxcel/changelog.gz /usr/share/doc/mlxcel/CHANGELOG.md.gz \
  /etc/mlxcel/server.toml /lib/systemd/system/mlxcel.service /usr/lib/sysusers.d/mlxcel.conf \
  /usr/share/man/man1/mlxcel.1.gz /usr/share/man/man1/mlxcel-server.1.gz \
  /usr/share/man/man1/mlxcel-serve.1.gz /usr/share/man/man1/mlxcel-generate.1.gz \
  /usr/share/bash-completion/completions/mlxcel /usr/share/bash-completion/completions/mlxcel-server \
  /usr/share/zsh/vendor-completions/_mlxcel /usr/share/zsh/vendor-completions/_mlxcel-server \
  /usr/share/fish/vendor_completions.d/mlxcel.fish /usr/share/fish/vendor_completions.d/mlxcel-server.fish; do
  grep -qx "$path" <<<"$contents" || die "$(basename "$deb") lacks $path"
done
info="$(dpkg-deb --info "$deb")"
grep -q "^ Depends:.*libopenblas0" <<<"$info" || die "Depends does not name OpenBLAS"
rm -rf "$OUT/control"
dpkg-deb -e "$deb" "$OUT/control"
grep -qx /etc/mlxcel/server.toml "$OUT/control/conffiles" || die "server.toml is not a conffile"
log "contents, Depends and conffiles as expected"
lintian --fail-on error,warning --display-info --pedantic "$OUT/mlxcel_${version}_${arch}.changes"
log "lintian: no error or warning"

# --- 5. the unpacked package runs ------------------------------------------------
root="$(mktemp -d)"
server_pid=""
cleanup() {
  [[ -n "$server_pid" ]] && kill -KILL "$server_pid" 2>/dev/null || true
  rm -rf "$root"
}
trap cleanup EXIT
dpkg-deb -x "$deb" "$root"
export LD_LIBRARY_PATH="$root/usr/lib/mlxcel"
for bin in mlxcel mlxcel-server; do
  dynamic="$(readelf -d "$root/usr/bin/$bin")"
  grep -q "Library runpath: \[/usr/lib/mlxcel\]" <<<"$dynamic" || die "$bin's RUNPATH is not /usr/lib/mlxcel"
  libs="$(ldd "$root/usr/bin/$bin")"
  grep -q "libmlx.so => $root/usr/lib/mlxcel/libmlx.so" <<<"$libs" ||
    die "$bin does not load the packaged libmlx.so"
  "$root/usr/bin/$bin" --version
done
libs="$(env -u LD_LIBRARY_PATH ldd "$root/usr/lib/mlxcel/libmlx.so")"
grep -q "liblapack-.* => $root/usr/lib/mlxcel/" <<<"$libs" ||
  die "libmlx.so does not load its bundled libraries through \$ORIGIN"
log "--version answers; the binaries load the packaged MLX"
srv_log="$root/server.log"
"$root/usr/bin/mlxcel-server" --config "$root/etc/mlxcel/server.toml" -m "$MODEL" --port 0 \
  --alias packaged 2>"$srv_log" &
server_pid=$!
port=""
for _ in $(seq 600); do
  grep -q "ready: serving requests" "$srv_log" && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$srv_log" >&2; die "the packaged server stopped"; }
  sleep 0.1
done
port="$(grep -o 'listening on http://[^ ]*' "$srv_log" | head -n 1 | sed 's/.*://')"
[[ -n "$port" ]] && grep -q "ready: serving requests" "$srv_log" || { cat "$srv_log" >&2; die "the packaged server is not ready"; }
"$PY" - "$port" <<'EOF'
import json, sys, urllib.request
body = {"model": "packaged", "temperature": 0, "max_tokens": 16,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions",
                             data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(req, timeout=120))
text = reply["choices"][0]["message"]["content"]
assert reply["model"] == "packaged", reply
assert "Paris" in text, text
print(f"[package] chat: {text!r}")
EOF
kill -TERM "$server_pid"
stopped=$SECONDS
for _ in $(seq 100); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.1; done
kill -0 "$server_pid" 2>/dev/null && { cat "$srv_log" >&2; die "the packaged server still runs 10 s after SIGTERM"; }
status=0
wait "$server_pid" || status=$?
server_pid=""
(( status == 0 )) || { cat "$srv_log" >&2; die "the packaged server exited with $status after SIGTERM"; }
log "the packaged server served a chat and exited with 0 on SIGTERM ($((SECONDS - stopped)) s)"
log "ok: $deb"
