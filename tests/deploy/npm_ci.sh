#!/usr/bin/env bash
# Installs tests/deploy's npm packages (package-lock.json, exact versions) into DEST/node_modules,
# outside the source tree. Skips the install when DEST already holds this very lock file.
set -euo pipefail
src="$(cd "$(dirname "$0")" && pwd)"
dest="$1"
mkdir -p "$dest"
if [[ -d "$dest/node_modules" ]] && cmp -s "$src/package-lock.json" "$dest/package-lock.json"; then
  echo "npm packages up to date in $dest"
  exit 0
fi
cp "$src/package.json" "$src/package-lock.json" "$dest/"
cd "$dest"
npm ci --no-audit --no-fund --loglevel=error
