#!/usr/bin/env bash
# build-rootfs-small.sh OUTDIR: a tiny root filesystem tree for tests.
#
# Debian's static busybox with a symlink for each applet, root (and nobody) in
# /etc/passwd and /etc/group, and the empty directories a sandbox mounts over
# (proc, dev, sys, tmp, run, ...). It has no dynamic libraries, so anything in
# it runs without a loader. Builds in OUTDIR.tmp and swaps it in when complete;
# skips the build when OUTDIR already holds this script's output for the same
# busybox (the stamp in OUTDIR/.ign-rootfs-stamp).
set -euo pipefail

prog=${0##*/}
die() { printf '%s: error: %s\n' "$prog" "$*" >&2; exit 1; }

[[ $# -eq 1 && -n $1 ]] || { printf 'usage: %s OUTDIR\n' "$prog" >&2; exit 2; }
out=${1%/}
tmp=$out.tmp
old=$out.old

busybox=/bin/busybox
if ! dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q 'ok installed' || [[ ! -x $busybox ]]; then
	die "busybox-static is not installed (this needs Debian's static $busybox). Install it with: apt-get install busybox-static (or run scripts/setup.sh)"
fi

bb_version=$(dpkg-query -W -f='${Version}' busybox-static)
stamp="small v1 $(sha256sum "$0" | cut -d' ' -f1) busybox-static=$bb_version $(sha256sum "$busybox" | cut -d' ' -f1)"
if [[ -f $out/.ign-rootfs-stamp && $(<"$out/.ign-rootfs-stamp") == "$stamp" ]]; then
	printf '==> %s is up to date\n' "$out"
	exit 0
fi

printf '==> building small rootfs in %s (busybox-static %s)\n' "$out" "$bb_version"
mkdir -p "$(dirname "$out")"
rm -rf "$tmp" "$old"
trap 'rm -rf "$tmp"' EXIT

# The directory layout. tmp is world-writable and sticky; root's home is private.
mkdir -p "$tmp"
for d in bin sbin usr/bin usr/sbin etc proc dev sys run var/tmp root tmp; do
	mkdir -p "$tmp/$d"
done
chmod 0755 "$tmp"
chmod 1777 "$tmp/tmp" "$tmp/var/tmp"
chmod 0700 "$tmp/root"

install -m 0755 "$busybox" "$tmp/bin/busybox"

# One symlink per applet at its usual place (what `busybox --install -s` does,
# but pointing at /bin/busybox inside the tree rather than at the host's path).
while IFS= read -r applet; do
	[[ $applet == */* ]] || continue          # skips "linuxrc"
	[[ $applet == bin/busybox ]] && continue
	mkdir -p "$tmp/${applet%/*}"
	ln -sfn /bin/busybox "$tmp/$applet"
done < <("$busybox" --list-full)
[[ -L $tmp/bin/sh ]] || ln -sfn /bin/busybox "$tmp/bin/sh"

cat >"$tmp/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
cat >"$tmp/etc/group" <<'EOF'
root:x:0:
nogroup:x:65534:
EOF
chmod 0644 "$tmp/etc/passwd" "$tmp/etc/group"

# Sanity check: the shell must be able to run from inside the tree.
"$tmp/bin/busybox" sh -c 'exit 0' || die "the copied busybox does not run"

printf '%s\n' "$stamp" >"$tmp/.ign-rootfs-stamp"

# Swap the finished tree in.
if [[ -e $out ]]; then
	mv -T "$out" "$old"
fi
mv -T "$tmp" "$out"
rm -rf "$old"
trap - EXIT
printf '==> small rootfs ready: %s (%s, %s entries)\n' "$out" "$(du -sh "$out" | cut -f1)" "$(find "$out" | wc -l)"
