#!/usr/bin/env bash
# build-kernel.sh [OUTDIR]: the guest kernel and the modules its initramfs loads.
#
# Takes Debian's cloud kernel (the package linux-image-cloud-amd64 depends on,
# e.g. linux-image-6.1.0-57-cloud-amd64), downloads its .deb with
# `apt-get download` into a cache and unpacks it with dpkg-deb -x into a
# temporary directory: nothing is installed on the host. It produces, in OUTDIR
# (default build/vm):
#
#   vmlinux         the uncompressed ELF kernel. Debian ships an LZ4-compressed
#                   bzImage; the ELF inside (found at the LZ4 frame magic
#                   02 21 4c 18) has a PVH entry note, so QEMU boots it directly
#                   with -kernel, ~0.5 s faster under TCG than the bzImage.
#   modules/*.ko    just the modules the guest needs (virtio transport, block,
#                   console, rng, overlay, erofs, nf_tables, ...) and their
#                   dependencies, resolved with modinfo -F depends.
#   modules/modules.order
#                   the file names in load order (dependencies first), one a line.
#   kernel.version  the kernel release (uname -r in the guest), one line.
#
# Idempotent: OUTDIR/.kernel-stamp records the package, its version and a hash
# of this script; when it matches, nothing is done (IGN_KERNEL_FORCE=1 redoes
# it). The work happens in a temporary directory; the results are renamed into
# place and kernel.version is written last, so a half-done run never looks
# complete.
#
# Environment:
#   IGN_KERNEL_PACKAGE  the metapackage to resolve (default linux-image-cloud-amd64)
#   IGN_DEB_CACHE       where downloaded .debs are kept (default build/cache/debs
#                       in this repository)
#   IGN_KERNEL_FORCE=1  redo even when the stamp matches
#   IGN_KERNEL_EXTRA_MODULES  more module names to include (space-separated)
set -euo pipefail

prog=${0##*/}
die() { printf '%s: error: %s\n' "$prog" "$*" >&2; exit 1; }
say() { printf '==> %s\n' "$*"; }

[[ $# -le 1 ]] || { printf 'usage: %s [OUTDIR]\n' "$prog" >&2; exit 2; }
out=${1:-build/vm}
out=${out%/}
meta=${IGN_KERNEL_PACKAGE:-linux-image-cloud-amd64}

# The modules the guest needs, by module name. Their dependencies are added
# automatically. microvm's devices sit on virtio-mmio; virtio_pci is kept for
# machines with a PCI bus (q35). No guest has a NIC (its traffic leaves only
# through the agent), so there is no virtio_net: nf_tables and the parts the
# agent's capture uses (guest/egress_nl.c: the nat chain type, redirect,
# reject in the inet family) take nfnetlink, conntrack, nat, defrag and
# nf_reject along as dependencies. The root image is EROFS
# (build-rootfs-image.sh); ext4 is built into the kernel.
# IGN_KERNEL_EXTRA_MODULES adds more (e.g. squashfs, for measurements).
read -r -a extra <<<"${IGN_KERNEL_EXTRA_MODULES:-}"
wanted=(
	virtio_mmio virtio_pci
	virtio_blk virtio_console virtio_rng
	overlay erofs
	nf_tables nft_chain_nat nft_redir nft_reject_inet
	${extra[@]+"${extra[@]}"}
)

for c in apt-get apt-cache dpkg-deb lz4 sha256sum; do
	command -v "$c" >/dev/null || die "$c is not installed (apt-get install apt dpkg lz4 coreutils, or run scripts/setup.sh)"
done

mkdir -p "$out"
out=$(cd "$out" && pwd)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${IGN_DEB_CACHE:-$repo/build/cache/debs}
mkdir -p "$cache"

# Resolve the versioned package behind the metapackage, e.g.
# linux-image-cloud-amd64 -> linux-image-6.1.0-57-cloud-amd64. Without apt
# lists (offline, no apt-get update) the newest .deb in the cache is used.
pkg=$(apt-cache depends "$meta" 2>/dev/null | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -n1 || true)
pkgver=
[[ -n $pkg ]] && pkgver=$(apt-cache policy "$pkg" 2>/dev/null | sed -n 's/^ *Candidate: //p' || true)
if [[ -z $pkg || -z $pkgver || $pkgver == '(none)' ]]; then
	cached=$(find "$cache" -maxdepth 1 -name 'linux-image-[0-9]*.deb' -printf '%f\n' 2>/dev/null | sort -V | tail -n1)
	[[ -n $cached ]] || die "cannot resolve the kernel package behind $meta with apt-cache depends, and $cache has no cached kernel .deb. Run apt-get update (the Debian mirror must be reachable), and check that $meta exists for this architecture"
	pkg=$(dpkg-deb -f "$cache/$cached" Package)
	pkgver=$(dpkg-deb -f "$cache/$cached" Version)
	printf '%s: warning: apt cannot resolve %s; using the cached %s\n' "$prog" "$meta" "$cached" >&2
fi
release=${pkg#linux-image-}

stamp="kernel v1 $pkg=$pkgver $(sha256sum "$0" | cut -d' ' -f1) modules=${wanted[*]}"
if [[ -z ${IGN_KERNEL_FORCE:-} && -f $out/.kernel-stamp && $(<"$out/.kernel-stamp") == "$stamp" &&
	-f $out/kernel.version && -f $out/vmlinux && -f $out/modules/modules.order ]]; then
	say "kernel $release ($pkg $pkgver) is up to date in $out"
	exit 0
fi

say "kernel package: $meta -> $pkg $pkgver"

# Download (or reuse) the .deb. apt-get download names it pkg_version_arch.deb,
# with the epoch's ':' escaped as %3a.
arch=$(dpkg --print-architecture)
debname="${pkg}_${pkgver//:/%3a}_${arch}.deb"
deb=$cache/$debname
if [[ -s $deb ]] && dpkg-deb --info "$deb" >/dev/null 2>&1; then
	say "using cached $deb"
else
	say "downloading $pkg $pkgver into $cache"
	dl=$(mktemp -d "$cache/.dl.XXXXXX")
	# _apt cannot write into a root-owned mktemp dir: apt then warns and
	# downloads as root, which is what we want here anyway.
	(cd "$dl" && apt-get download -q "$pkg=$pkgver" 2>&1 | grep -v 'Download is performed unsandboxed' >&2) || true
	f=$(find "$dl" -maxdepth 1 -name '*.deb' -print -quit)
	[[ -n $f && -s $f ]] || { rm -rf "$dl"; die "apt-get download $pkg=$pkgver failed (is the Debian mirror reachable?)"; }
	dpkg-deb --info "$f" >/dev/null || { rm -rf "$dl"; die "the downloaded $f is not a valid .deb"; }
	mv -f "$f" "$deb"
	rm -rf "$dl"
fi

rm -rf "$out"/.kernel.tmp.* # left behind by a run that was killed
work=$(mktemp -d "$out/.kernel.tmp.XXXXXX")
trap 'rm -rf "$work"' EXIT

say "unpacking $debname"
dpkg-deb -x "$deb" "$work/deb"
bz=$work/deb/boot/vmlinuz-$release
moddir=$work/deb/lib/modules/$release
[[ -f $bz ]] || die "$debname has no boot/vmlinuz-$release"
[[ -d $moddir/kernel ]] || die "$debname has no lib/modules/$release/kernel"

# --- vmlinux: the ELF inside the bzImage -----------------------------------
# The payload is an LZ4 legacy frame (magic 02 21 4c 18). lz4 -dc stops at the
# end of the frame and may complain about the bytes after it, so its exit
# status is not trusted: the result is checked instead. Every occurrence of the
# magic is tried until one decompresses to an ELF.
say "extracting vmlinux from the LZ4 bzImage"
found=
while IFS=: read -r off _; do
	rm -f "$work/vmlinux"
	tail -c +$((off + 1)) "$bz" | lz4 -dc >"$work/vmlinux" 2>/dev/null || true
	if [[ -s $work/vmlinux && $(head -c 4 "$work/vmlinux" | od -An -tx1 | tr -d ' \n') == 7f454c46 ]]; then
		found=$off
		break
	fi
done < <(LC_ALL=C grep -obUaP '\x02\x21\x4c\x18' "$bz" || true)
[[ -n $found ]] || die "no LZ4 frame in $bz decompresses to an ELF (is this kernel LZ4-compressed? grep CONFIG_KERNEL_ $work/deb/boot/config-$release)"
if command -v readelf >/dev/null; then
	# Xen's note type 18 (XEN_ELFNOTE_PHYS32_ENTRY) is the PVH entry point
	# QEMU's -kernel needs for an ELF.
	readelf -n "$work/vmlinux" 2>/dev/null | grep -Eq '^ *Xen .*(PHYS32_ENTRY|note type: \(0x00000012\))' ||
		die "the extracted vmlinux has no PVH entry note (Xen note 0x12); QEMU cannot boot it with -kernel"
else
	printf '%s: warning: readelf not found (binutils); not checking the PVH note\n' "$prog" >&2
fi
say "  vmlinux: $(du -h "$work/vmlinux" | cut -f1) (LZ4 frame at byte $found)"

# --- modules ----------------------------------------------------------------
# Index every .ko by module name ('-' and '_' are the same in module names).
declare -A path_of=()
while IFS= read -r -d '' ko; do
	name=${ko##*/}
	name=${name%.ko}
	path_of[${name//-/_}]=$ko
done < <(find "$moddir/kernel" -name '*.ko' -print0)
((${#path_of[@]} > 0)) || die "no .ko files in $debname (compressed modules are not handled)"

deps_of() { # the module names a .ko depends on, comma-separated
	if command -v modinfo >/dev/null; then
		modinfo -F depends "$1"
	else
		# Without kmod: the .modinfo section is NUL-separated key=value strings.
		tr '\0' '\n' <"$1" | sed -n 's/^depends=//p' | sed -n 1p
	fi
}

# Depth-first, dependencies first: the order insmod must follow.
declare -A state=() # 1 = visiting, 2 = done
order=()
visit() {
	local m=${1//-/_} d deps
	[[ ${state[$m]:-} == 2 ]] && return 0
	[[ ${state[$m]:-} == 1 ]] && die "dependency cycle at module $m"
	if [[ -z ${path_of[$m]:-} ]]; then
		grep -q "/${m}.ko\$\|/${m//_/-}.ko\$" "$moddir/modules.builtin" 2>/dev/null && { state[$m]=2; return 0; }
		die "module $m is neither in $debname nor built in"
	fi
	state[$m]=1
	deps=$(deps_of "${path_of[$m]}")
	local IFS=,
	for d in $deps; do
		[[ -n $d ]] && visit "$d"
	done
	state[$m]=2
	order+=("$m")
}
for m in "${wanted[@]}"; do
	visit "$m"
done

mkdir "$work/modules"
: >"$work/modules/modules.order"
for m in "${order[@]}"; do
	f=${path_of[$m]##*/}
	install -m 0644 "${path_of[$m]}" "$work/modules/$f"
	printf '%s\n' "$f" >>"$work/modules/modules.order"
done
say "  modules (load order): $(tr '\n' ' ' <"$work/modules/modules.order")"

# --- swap in ------------------------------------------------------------------
# kernel.version and the stamp go first out and last in: they mark a complete set.
rm -f "$out/kernel.version" "$out/.kernel-stamp"
rm -rf "$out/modules.old"
[[ -e $out/modules ]] && mv -T "$out/modules" "$out/modules.old"
mv -T "$work/modules" "$out/modules"
rm -rf "$out/modules.old"
mv -f "$work/vmlinux" "$out/vmlinux"
printf '%s\n' "$release" >"$work/kernel.version"
mv -f "$work/kernel.version" "$out/kernel.version"
printf '%s\n' "$stamp" >"$work/stamp"
mv -f "$work/stamp" "$out/.kernel-stamp"

say "kernel $release ready in $out (vmlinux, modules/, kernel.version)"
