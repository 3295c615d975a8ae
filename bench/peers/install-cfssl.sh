#!/bin/sh
# Installs cfssl from Debian's packages into bench/peers/.cfssl (no root
# needed, nothing system-wide): downloads golang-cfssl with apt-get and
# unpacks it with dpkg-deb. Prints the path of the cfssl binary.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
dest="$here/.cfssl"
if [ ! -x "$dest/usr/bin/cfssl" ]; then
    work=$(mktemp -d)
    (cd "$work" && apt-get download golang-cfssl >/dev/null 2>&1)
    mkdir -p "$dest"
    dpkg-deb -x "$work"/golang-cfssl_*.deb "$dest"
    rm -rf "$work"
fi
echo "$dest/usr/bin/cfssl"
