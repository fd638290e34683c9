#!/usr/bin/env bash
# build-initramfs.sh AGENT MODULES_DIR OUT: the guest's initramfs.
#
# A newc cpio archive with:
#   /init                     AGENT (the static ign-agent), mode 0755: the
#                             kernel runs it as PID 1
#   /lib/modules/*.ko         the .ko files named in MODULES_DIR/modules.order
#   /lib/modules/modules.order  the load order, one file name a line
#   /dev/console              char 5:1, so PID 1 starts with stdin/out/err open
#                             (the kernel opens it before it runs /init)
#   /dev /proc /sys /run /tmp /mnt/lower /mnt/rw /mnt/root  empty mount points
#
# What /init does with them is the agent's business (docs/vm-recipe.md): mount
# devtmpfs, proc, sysfs; insmod the modules in order; mount /dev/vda read-only
# on /mnt/lower; a tmpfs on /mnt/rw; an overlay on /mnt/root; switch root.
#
# Uncompressed by default: measured under TCG it boots faster than gzip (the
# kernel's inflate runs at emulated speed; see docs/vm-recipe.md).
# IGN_INITRAMFS_COMPRESS=gzip makes a gzip-compressed archive instead.
#
# The archive is reproducible: owners 0:0, fixed mtimes (SOURCE_DATE_EPOCH,
# default 0), sorted names, no inode numbers. It is written to OUT.tmp and
# renamed over OUT. The /dev/console node is written by hand as a second newc
# archive (the kernel unpacks concatenated archives), so no mknod and no root
# is needed.
set -euo pipefail

prog=${0##*/}
die() { printf '%s: error: %s\n' "$prog" "$*" >&2; exit 1; }
say() { printf '==> %s\n' "$*"; }

[[ $# -eq 3 ]] || { printf 'usage: %s AGENT MODULES_DIR OUT\n' "$prog" >&2; exit 2; }
agent=$1 moddir=${2%/} out=$3
compress=${IGN_INITRAMFS_COMPRESS:-none}
epoch=${SOURCE_DATE_EPOCH:-0}

command -v cpio >/dev/null || die "cpio is not installed (apt-get install cpio, or run scripts/setup.sh)"
[[ -f $agent && -x $agent ]] || die "agent $agent is not an executable file (build it first: make)"
[[ -f $moddir/modules.order ]] || die "$moddir/modules.order is missing (run image/build-kernel.sh first)"
case $compress in
none | gzip) ;;
*) die "IGN_INITRAMFS_COMPRESS must be none or gzip, not '$compress'" ;;
esac

stage=$(mktemp -d "${TMPDIR:-/tmp}/ign-initramfs.XXXXXX")
trap 'rm -rf "$stage"; rm -f "$out.tmp"' EXIT
root=$stage/root

mkdir -p "$root"/{dev,proc,sys,run,tmp,lib/modules,mnt/lower,mnt/rw,mnt/root}
chmod 0755 "$root" "$root"/{dev,proc,sys,run,lib,lib/modules,mnt,mnt/lower,mnt/rw,mnt/root}
chmod 1777 "$root/tmp"
install -m 0755 "$agent" "$root/init"

n=0
: >"$root/lib/modules/modules.order"
while IFS= read -r ko || [[ -n $ko ]]; do
	[[ -z $ko || $ko == \#* ]] && continue
	[[ $ko == */* ]] && die "modules.order names '$ko': expected bare file names"
	[[ -f $moddir/$ko ]] || die "$moddir/modules.order names $ko, which is not in $moddir"
	install -m 0644 "$moddir/$ko" "$root/lib/modules/$ko"
	printf '%s\n' "$ko" >>"$root/lib/modules/modules.order"
	n=$((n + 1))
done <"$moddir/modules.order"
chmod 0644 "$root/lib/modules/modules.order"

# Fixed timestamps, then the archive in sorted order with owners 0:0.
find "$root" -exec touch -h -d "@$epoch" {} +
(cd "$root" && find . -mindepth 1 -print0 | LC_ALL=C sort -z |
	cpio --quiet -o -0 -H newc -R 0:0 --reproducible) >"$stage/main.cpio"

# A newc header: magic, then 13 fields of 8 hex digits (ino, mode, uid, gid,
# nlink, mtime, filesize, devmajor, devminor, rdevmajor, rdevminor, namesize,
# check), the NUL-terminated name, padding to a multiple of 4.
newc_entry() { # name mode(octal) rdevmajor rdevminor
	local name=$1 mode=$((8#$2)) hdr pad
	hdr=$(printf '070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X' \
		0 "$mode" 0 0 1 "$epoch" 0 0 0 "$3" "$4" $((${#name} + 1)) 0)
	printf '%s%s\0' "$hdr" "$name"
	pad=$(((4 - (110 + ${#name} + 1) % 4) % 4))
	head -c "$pad" /dev/zero
}
{
	newc_entry dev/console 020600 5 1
	newc_entry 'TRAILER!!!' 0 0 0
} >"$stage/console.cpio"

mkdir -p "$(dirname "$out")"
case $compress in
none) cat "$stage/main.cpio" "$stage/console.cpio" >"$out.tmp" ;;
gzip) cat "$stage/main.cpio" "$stage/console.cpio" | gzip -n -9 >"$out.tmp" ;;
esac
mv -f "$out.tmp" "$out"
say "initramfs $out: $(du -h --apparent-size "$out" | cut -f1) ($compress), /init = $agent, $n modules"
