#!/usr/bin/env bash
# Check that the patch series applies to upstream flash-attn 2.8.3 and reproduces csrc/ byte for byte.
#   bash patches/check_series.sh [flash_attn-2.8.3.post2.tar.gz]   (downloaded with pip when not given)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sdist=${1:-}
if [ -z "$sdist" ]; then
    python3 -m pip download -q --no-deps --no-build-isolation flash-attn==2.8.3.post2 -d "$work/sdist"
    sdist=$(echo "$work"/sdist/flash_attn-*.tar.gz)
fi
tar xzf "$sdist" --no-same-owner -C "$work"
up=$(echo "$work"/flash_attn-*/)
cd "$up"
git init -q
git -c user.name=upstream -c user.email=upstream@localhost add -A
git -c user.name=upstream -c user.email=upstream@localhost commit -qm "flash-attn 2.8.3 (sdist)"
git -c user.name=check -c user.email=check@localhost am -q $(ls "$here"/patches/0*-*.patch | grep -v cover-letter)
status=0
for f in "$here"/csrc/flash_attn/flash_api_tq.cpp "$here"/csrc/flash_attn/src/*; do
    rel=${f#"$here"/}
    if ! cmp -s "$f" "$rel"; then echo "differs from the series: $rel"; status=1; fi
done
for f in csrc/flash_attn/src/tq_* csrc/flash_attn/flash_api_tq.cpp; do
    [ -e "$here/$f" ] || { echo "in the series but not in csrc/: $f"; status=1; }
done
n=$(ls "$here"/patches/0*-*.patch | grep -vc cover-letter)
[ "$status" = 0 ] && echo "patch series: $n patches apply to flash-attn 2.8.3 and reproduce csrc/"
exit "$status"
