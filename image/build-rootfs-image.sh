#!/usr/bin/env bash
# build-rootfs-image.sh ROOTFS_DIR OUT_IMAGE: a read-only disk image of a rootfs tree.
#
# The VM backend attaches OUT_IMAGE as a read-only virtio-blk disk (/dev/vda);
# the guest mounts it read-only as the lower layer of a tmpfs overlay.
#
# Format: uncompressed EROFS by default. It was measured against ext4,
# compressed EROFS and squashfs (docs/vm-recipe.md has the numbers): under TCG
# every byte a compressed image saves costs guest CPU time to decompress at
# emulated speed, and uncompressed EROFS reads as fast as ext4 while being
# smaller, quicker to build and read-only by construction. Other formats stay
# available for measurements (IGN_IMAGE_FORMAT):
#
#   erofs          mkfs.erofs, no compression (default; guest needs erofs.ko)
#   erofs-lz4      mkfs.erofs -zlz4
#   erofs-lz4hc    mkfs.erofs -zlz4hc
#   ext4           mkfs.ext4 -d, no journal, shrunk with resize2fs -M (built in)
#   squashfs-lz4   mksquashfs -comp lz4 (guest needs squashfs.ko)
#   squashfs-zstd  mksquashfs -comp zstd
#
# Idempotent: OUT_IMAGE.stamp records the format, a hash of this script and a
# hash of the tree's listing (names, sizes, mtimes, modes, owners, link
# targets); a matching stamp skips the build (IGN_IMAGE_FORCE=1 rebuilds). The
# image is written to OUT_IMAGE.tmp and renamed over OUT_IMAGE when complete.
#
# Environment:
#   IGN_IMAGE_FORMAT   one of the formats above (default erofs)
#   IGN_IMAGE_FORCE=1  rebuild even when the stamp matches
#   SOURCE_DATE_EPOCH  when set, every timestamp in the image is set to it
set -euo pipefail

prog=${0##*/}
die() { printf '%s: error: %s\n' "$prog" "$*" >&2; exit 1; }
say() { printf '==> %s\n' "$*"; }

[[ $# -eq 2 && -n $1 && -n $2 ]] || { printf 'usage: %s ROOTFS_DIR OUT_IMAGE\n' "$prog" >&2; exit 2; }
src=${1%/}
out=$2
format=${IGN_IMAGE_FORMAT:-erofs}

[[ -d $src ]] || die "$src is not a directory (build it with image/build-rootfs-small.sh or image/build-rootfs-tools.sh)"
[[ -x $src/bin/sh || -L $src/bin/sh ]] || die "$src has no /bin/sh: is it a root filesystem tree?"

need() { command -v "$1" >/dev/null || die "$1 is not installed (apt-get install $2, or run scripts/setup.sh)"; }
case $format in
erofs | erofs-lz4 | erofs-lz4hc) need mkfs.erofs erofs-utils ;;
ext4) need mkfs.ext4 e2fsprogs; need resize2fs e2fsprogs; need e2fsck e2fsprogs ;;
squashfs-lz4 | squashfs-zstd) need mksquashfs squashfs-tools ;;
*) die "unknown IGN_IMAGE_FORMAT '$format' (erofs, erofs-lz4, erofs-lz4hc, ext4, squashfs-lz4, squashfs-zstd)" ;;
esac

tree_hash=$(cd "$src" && find . -printf '%p %s %T@ %m %U:%G %l\n' | LC_ALL=C sort | sha256sum | cut -d' ' -f1)
stamp="rootfs-image v1 format=$format script=$(sha256sum "$0" | cut -d' ' -f1) tree=$tree_hash epoch=${SOURCE_DATE_EPOCH:-}"
if [[ -z ${IGN_IMAGE_FORCE:-} && -f $out && -f $out.stamp && $(<"$out.stamp") == "$stamp" ]]; then
	say "$out is up to date ($format of $src)"
	exit 0
fi

mkdir -p "$(dirname "$out")"
tmp=$out.tmp
rm -f "$tmp" "$out.stamp"
trap 'rm -f "$tmp"' EXIT

say "building $format image of $src -> $out"
start=$(date +%s%N)
case $format in
erofs* )
	args=(--quiet)
	[[ $format == erofs-lz4 ]] && args+=(-zlz4)
	[[ $format == erofs-lz4hc ]] && args+=(-zlz4hc)
	[[ -n ${SOURCE_DATE_EPOCH:-} ]] && args+=("-T$SOURCE_DATE_EPOCH")
	mkfs.erofs "${args[@]}" "$tmp" "$src" >/dev/null
	;;
ext4)
	# Size it generously, fill it, then shrink it to (nearly) the minimum.
	bytes=$(du -s --apparent-size -B1 "$src" | cut -f1)
	inodes=$(find "$src" | wc -l)
	blocks=$((bytes * 12 / 10 / 4096 + inodes * 2 + 16384))
	inodes=$((inodes + inodes / 10 + 64))
	[[ -n ${SOURCE_DATE_EPOCH:-} ]] && export E2FSPROGS_FAKE_TIME=$SOURCE_DATE_EPOCH
	mkfs.ext4 -q -F -t ext4 -b 4096 -I 256 -N "$inodes" -m 0 -L ign-root \
		-O ^has_journal,^resize_inode -E root_owner=0:0 -d "$src" "$tmp" "$blocks" >/dev/null ||
		die "mkfs.ext4 -d failed"
	e2fsck -fy "$tmp" >/dev/null 2>&1 || [[ $? -le 1 ]] || die "e2fsck found errors in the new image"
	resize2fs -M "$tmp" >/dev/null 2>&1 || die "resize2fs -M failed"
	;;
squashfs-*)
	comp=${format#squashfs-}
	args=(-noappend -comp "$comp" -quiet -no-progress)
	[[ -n ${SOURCE_DATE_EPOCH:-} ]] && args+=(-mkfs-time "$SOURCE_DATE_EPOCH" -all-time "$SOURCE_DATE_EPOCH")
	mksquashfs "$src" "$tmp" "${args[@]}" >/dev/null
	;;
esac
ms=$((($(date +%s%N) - start) / 1000000))

[[ -s $tmp ]] || die "the $format image came out empty"
chmod 0644 "$tmp"
mv -f "$tmp" "$out"
printf '%s\n' "$stamp" >"$out.stamp"
trap - EXIT
say "$out: $format, $(du -h --apparent-size "$out" | cut -f1) (tree $(du -sh --apparent-size "$src" | cut -f1)), built in ${ms} ms"
