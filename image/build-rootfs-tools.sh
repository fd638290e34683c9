#!/usr/bin/env bash
# build-rootfs-tools.sh OUTDIR: the default "tools" root filesystem tree.
#
# Debian bookworm (variant apt: the essential set plus apt) with a compiler,
# python3, git, curl and a few everyday tools, built by mmdebstrap from Debian's
# mirror (the only network this needs). Documentation, man pages and
# translations are left out, apt's lists and caches are dropped, and the files
# mmdebstrap copies from the host (/etc/resolv.conf, /etc/hostname) are
# removed so nothing of the build machine ends up in a sandbox.
#
# Idempotent: OUTDIR/.ign-rootfs-stamp records a hash of this script, the
# package list and the mirrors; a matching stamp skips the build (set
# IGN_ROOTFS_FORCE=1 to rebuild anyway). The tree is built in OUTDIR.tmp and
# swapped in only when complete.
#
# Environment:
#   IGN_DEBIAN_MIRROR           default http://deb.debian.org/debian
#   IGN_DEBIAN_SECURITY_MIRROR  default http://deb.debian.org/debian-security
#   IGN_ROOTFS_FORCE=1          rebuild even when the stamp matches
set -euo pipefail

prog=${0##*/}
die() { printf '%s: error: %s\n' "$prog" "$*" >&2; exit 1; }
say() { printf '==> %s\n' "$*"; }

[[ $# -eq 1 && -n $1 ]] || { printf 'usage: %s OUTDIR\n' "$prog" >&2; exit 2; }
out=${1%/}
tmp=$out.tmp
old=$out.old

suite=bookworm
variant=apt
mirror=${IGN_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${IGN_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

# What a sandbox offers. The first line is the contract (DESIGN.md); the rest
# makes a shell pleasant without making the image big.
packages=(
	python3 git gcc make libc6-dev curl ca-certificates socat
	procps less xz-utils bzip2 file patch unzip jq
)

sources=(
	"deb $mirror $suite main"
	"deb $mirror $suite-updates main"
	"deb $security $suite-security main"
)

command -v mmdebstrap >/dev/null ||
	die "mmdebstrap is not installed. Install it with: apt-get install mmdebstrap (or run scripts/setup.sh)"
[[ -r /usr/share/keyrings/debian-archive-keyring.gpg ]] ||
	die "Debian's archive keyring is missing. Install it with: apt-get install debian-archive-keyring"

stamp=$(
	{
		printf 'tools v1\nsuite=%s variant=%s\n' "$suite" "$variant"
		printf 'pkg %s\n' "${packages[@]}"
		printf 'src %s\n' "${sources[@]}"
		cat "$0"
	} | sha256sum | cut -d' ' -f1
)
if [[ -z ${IGN_ROOTFS_FORCE:-} && -f $out/.ign-rootfs-stamp && $(<"$out/.ign-rootfs-stamp") == "$stamp" ]]; then
	say "$out is up to date (stamp $stamp; IGN_ROOTFS_FORCE=1 rebuilds)"
	exit 0
fi

if [[ $EUID -eq 0 ]]; then
	mode=root
else
	mode=unshare # needs unprivileged user namespaces and subuid/subgid ranges
fi

say "building tools rootfs in $out"
say "  Debian $suite, variant $variant, mode $mode, mirror $mirror"
say "  packages: ${packages[*]}"
start=$(date +%s)

mkdir -p "$(dirname "$out")"
rm -rf "$tmp" "$old"
trap 'rm -rf "$tmp"' EXIT

# Hooks run on the host with the tree as $1.
# - Host files that mmdebstrap copies in for the build: drop them.
# - /etc/hosts so that "localhost" resolves; an empty machine-id.
# - Logs and caches that only record the build.
# shellcheck disable=SC2016 # $1 is expanded by mmdebstrap's hook shell, not here
customize='set -e
	rm -f "$1/etc/resolv.conf" "$1/etc/hostname"
	printf "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n" >"$1/etc/hosts"
	: >"$1/etc/machine-id"
	rm -f "$1/var/lib/dbus/machine-id"
	rm -f "$1"/var/cache/debconf/*-old "$1"/var/lib/dpkg/*-old
	find "$1/var/log" -type f -delete
	rm -rf "$1"/usr/share/doc/*/examples "$1"/usr/share/info/* "$1"/usr/share/man/* "$1"/usr/share/lintian/*
	mkdir -p "$1/root" "$1/tmp" "$1/var/tmp"
	chmod 0700 "$1/root"
	chmod 1777 "$1/tmp" "$1/var/tmp"'

mmdebstrap \
	--mode="$mode" \
	--variant="$variant" \
	--format=directory \
	--include="$(IFS=,; echo "${packages[*]}")" \
	--aptopt='APT::Install-Recommends "false"' \
	--aptopt='APT::Install-Suggests "false"' \
	--aptopt='Acquire::Languages "none"' \
	--dpkgopt='path-exclude=/usr/share/man/*' \
	--dpkgopt='path-exclude=/usr/share/info/*' \
	--dpkgopt='path-exclude=/usr/share/locale/*' \
	--dpkgopt='path-include=/usr/share/locale/locale.alias' \
	--dpkgopt='path-exclude=/usr/share/doc/*' \
	--dpkgopt='path-include=/usr/share/doc/*/copyright' \
	--dpkgopt='path-exclude=/usr/share/lintian/*' \
	--customize-hook="$customize" \
	"$suite" "$tmp" "${sources[@]}" ||
	die "mmdebstrap failed (see its messages above). It needs Debian's mirror $mirror to be reachable."

# Check the result before anything uses it.
for f in usr/bin/python3 usr/bin/git usr/bin/gcc usr/bin/make usr/bin/curl usr/bin/socat usr/include/stdio.h etc/ssl/certs/ca-certificates.crt; do
	[[ -e $tmp/$f ]] || die "the built tree lacks /$f"
done
for f in etc/resolv.conf etc/hostname; do
	[[ ! -e $tmp/$f ]] || die "host file /$f leaked into the tree"
done
[[ ! -s $tmp/etc/machine-id ]] || die "/etc/machine-id is not empty"

printf '%s\n' "$stamp" >"$tmp/.ign-rootfs-stamp"

if [[ -e $out ]]; then
	mv -T "$out" "$old"
fi
mv -T "$tmp" "$out"
trap - EXIT
rm -rf "$old"

secs=$(($(date +%s) - start))
say "tools rootfs ready: $out ($(du -sh "$out" | cut -f1), $(find "$out" | wc -l) files, ${secs}s)"
