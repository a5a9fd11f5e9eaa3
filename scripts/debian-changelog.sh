#!/usr/bin/env bash
# Writes debian/changelog from CHANGELOG.md, the project's changelog and
# the package's source of truth: one entry, for the version of Cargo.toml,
# whose items are the "### " headings of CHANGELOG.md's first "## " section
# ("## Unreleased", or a heading that names the same version).
#
#   scripts/debian-changelog.sh          rewrite debian/changelog (dated now,
#                                        or SOURCE_DATE_EPOCH)
#   scripts/debian-changelog.sh --check  fail when debian/changelog says
#                                        anything else (its date aside)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

MAINTAINER="mlxcel maintainers <maintainers@users.noreply.a-seed-dc9ebab6.example>"
version="$(awk '/^\[workspace.package\]/ { s = 1; next } /^\[/ { s = 0 }
  s && $1 == "version" { gsub(/"/, "", $3); print $3; exit }' Cargo.toml)"
[[ -n "$version" ]] || { echo "no [workspace.package] version in Cargo.toml" >&2; exit 1; }

section="$(awk '/^## / { n++; if (n == 1) { sub(/^## /, ""); print } }' CHANGELOG.md)"
case "$section" in
  Unreleased|"$version"|"$version "*) ;;
  *) echo "CHANGELOG.md's first section is \"$section\", not Unreleased or $version" >&2; exit 1 ;;
esac

body() {
  echo "mlxcel ($version) unstable; urgency=medium"
  echo
  echo "  * Release $version. CHANGELOG.md (installed as"
  echo "    /usr/share/doc/mlxcel/CHANGELOG.md.gz) tells the changes; its sections:"
  awk '/^## / { n++; next } n == 1 && /^### / { sub(/^### /, ""); print }' CHANGELOG.md |
    while IFS= read -r heading; do
      echo "$heading" | fold -s -w 70 | sed '1s/^/    - /; 2,$s/^/      /; s/ *$//'
    done
  echo
}

if [[ "${1:-}" == "--check" ]]; then
  want="$(body)"
  have="$(sed '$d' debian/changelog)"
  if [[ "$want" != "$have" ]]; then
    echo "debian/changelog does not match CHANGELOG.md and Cargo.toml; run scripts/debian-changelog.sh" >&2
    diff <(echo "$want") <(echo "$have") >&2 || true
    exit 1
  fi
  echo "debian/changelog matches CHANGELOG.md ($version)"
  exit 0
fi

date="$(LC_ALL=C date -R ${SOURCE_DATE_EPOCH:+-d "@$SOURCE_DATE_EPOCH"})"
{ body; echo " -- $MAINTAINER  $date"; } > debian/changelog
echo "wrote debian/changelog ($version)"
