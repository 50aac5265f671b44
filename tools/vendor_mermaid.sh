#!/usr/bin/env bash
# Copies mermaid's browser build (one self-contained file, MIT licence) from the npm registry into
# docs/assets/vendor/, so the site draws its diagrams without a CDN. The book pins 11.17.2:
#   bash tools/vendor_mermaid.sh 11.17.2
# sha256 of mermaid-11.17.2.min.js: 581ed7d74bd9048d0e3a91363927d72ef22942d7722546b27f7cc29e35390eb8
# A new version: run this with it, change the file name in mkdocs.yml (extra_javascript), delete the
# old file and re-run `python tools/site_check.py`.
set -euo pipefail
VERSION=${1:-11.17.2}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST="$ROOT/docs/assets/vendor"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
(cd "$TMP" && npm pack --silent "mermaid@$VERSION" >/dev/null && tar xzf "mermaid-$VERSION.tgz")
mkdir -p "$DEST"
cp "$TMP/package/dist/mermaid.min.js" "$DEST/mermaid-$VERSION.min.js"
cp "$TMP/package/LICENSE" "$DEST/mermaid-LICENSE.txt"
sha256sum "$DEST/mermaid-$VERSION.min.js"
