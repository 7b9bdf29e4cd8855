#!/usr/bin/env bash
# runtime-deps.sh — what a built hsbn binary needs at run time, read off the binary itself so
# that the runtime images cannot drift from the build.
#
#   runtime-deps.sh packages BINARY...    the Debian packages that own its shared libraries
#   runtime-deps.sh bundle DIR BINARY...  copy its shared libraries, except the C/C++ runtime
#                                         every glibc system has, into DIR (for images that are
#                                         not Debian 12, like the CUDA trainer image)
set -euo pipefail

# The C and C++ runtime: provided by any newer glibc/libstdc++ system, never bundled.
SYSTEM_LIBS='^(ld-linux.*|linux-vdso.*|libc|libm|libdl|libpthread|librt|libresolv|libgcc_s|libstdc\+\+)\.so'

libs() {
  local bin
  for bin in "$@"; do
    [[ -e "$bin" ]] || { echo "runtime-deps.sh: no such file: $bin" >&2; exit 1; }
    if ldd "$bin" | grep -q 'not found'; then
      echo "runtime-deps.sh: $bin has unresolved libraries:" >&2; ldd "$bin" | grep 'not found' >&2; exit 1
    fi
    ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }'
  done | sort -u
}

# The packages that own the given libraries, in one dpkg query. Debian 12 is merged-/usr, so
# dpkg may list a library under /lib or under /usr/lib: ask for both, then check that every
# library was found under one of them.
owners() {
  local -a libs=() pats=()
  local lib real
  while read -r lib; do
    real="$(readlink -f "$lib")"
    libs+=("$real")
    pats+=("$real" "${real#/usr}")
  done
  (( ${#libs[@]} )) || return 0
  local out
  out="$(LC_ALL=C dpkg -S "${pats[@]}" 2>/dev/null | grep -v '^diversion' || true)"
  for real in "${libs[@]}"; do
    if ! awk -v a="$real" -v b="${real#/usr}" '$NF == a || $NF == b { f = 1 } END { exit !f }' <<<"$out"; then
      echo "runtime-deps.sh: no Debian package owns $real" >&2
      return 1
    fi
  done
  sed 's/: .*//; s/, /\n/g' <<<"$out" | sed 's/:[a-z0-9]*$//' | sort -u
}

case "${1:-}" in
  packages)
    shift
    (( $# )) || { echo "usage: runtime-deps.sh packages BINARY..." >&2; exit 2; }
    libs "$@" | owners
    ;;
  bundle)
    shift
    (( $# >= 2 )) || { echo "usage: runtime-deps.sh bundle DIR BINARY..." >&2; exit 2; }
    dir="$1"; shift
    mkdir -p "$dir"
    libs "$@" | while read -r lib; do
      if ! basename "$lib" | grep -Eq "$SYSTEM_LIBS"; then cp -L "$lib" "$dir/"; fi
    done
    ;;
  *) echo "usage: runtime-deps.sh packages BINARY... | bundle DIR BINARY..." >&2; exit 2 ;;
esac
