#!/usr/bin/env bash
# tests/fence.sh NAME PIDS_MAX MEMORY_MB -- SERVER [ARGS...]: runs SERVER
# inside a second fence, for the tests that abuse a sandbox on purpose, so
# that a containment bug fails a test instead of taking the machine down:
#
#   - a cgroup NAME (pids and memory; cgroup v1, hybrid or v2) made beside
#     this script's own group, with pids.max PIDS_MAX and a memory limit of
#     MEMORY_MB; this script moves itself in, so the server, its sandboxes
#     and its QEMUs are all counted there;
#   - a pid namespace of its own (unshare --pid --fork --mount-proc): the
#     server is its PID 1, and when it dies the kernel kills everything that
#     is left in it;
#   - its own run directory: /run/ignition-mcp/fence-<this pid> (or the
#     XDG/tmp one of a non-root user) is bind-mounted over the server's run
#     directory, so the server, which sees no host pids, can neither take the
#     state directories of the host's servers for a dead server's nor mix its
#     own (named after its pid, 1) with another fenced server's.
#
# Run by a user who may not make cgroups (cgroup v1, or v2 without
# delegation), the fence is a user namespace of its own with the pid
# namespace: root there makes the mounts, then a nested user namespace maps
# the user's own uid back (the server must not think it is root), and
# RLIMIT_NPROC PIDS_MAX is set inside it: counted per user namespace, it
# bounds the server and all its sandboxes (theirs are nested) and nothing
# else of the user's.  Memory is then not fenced; the tests that need a
# memory limit skip as such a user.
#
# stdin and stdout pass through to the server.  SIGTERM and SIGINT are
# passed on to it.  When it has exited, the script removes the cgroup (after
# killing anything left in it) and the run directory, and exits with the
# server's status.  The test library (tests/e2e/lib.mjs, startServer({fence:
# true})) removes both too if this script itself is killed.
set -euo pipefail

name=$1 pids_max=$2 memory_mb=$3
shift 3
[[ ${1:-} == -- ]] && shift
(($# > 0)) || { echo "usage: $0 NAME PIDS_MAX MEMORY_MB -- SERVER [ARGS...]" >&2; exit 2; }

say() { printf 'fence: %s\n' "$*" >&2; }
cg=/sys/fs/cgroup
mem_bytes=$((memory_mb << 20))
dirs=()

# own_group CONTROLLER: this process's group of CONTROLLER (v1), or of the
# unified hierarchy when CONTROLLER is empty (v2), as a path under $cg.
own_group() {
	local want=$1 line ids ctrls path
	while IFS= read -r line; do
		ids=${line%%:*} line=${line#*:}
		ctrls=${line%%:*} path=${line#*:}
		[[ $path == / ]] && path=
		if [[ -z $want ]]; then
			[[ $ids == 0 && -z $ctrls ]] && { printf '%s%s\n' "$cg" "$path"; return; }
		elif [[ ,$ctrls, == *,$want,* ]]; then
			printf '%s/%s%s\n' "$cg" "$want" "$path"
			return
		fi
	done </proc/self/cgroup
	return 1
}

# can_fence_cgroups: may we make the fence's groups here?
can_fence_cgroups() {
	((EUID == 0)) && return 0
	if [[ -f $cg/cgroup.controllers ]]; then
		[[ -w $(own_group '') ]]
	else
		[[ -w $(own_group pids) && -w $(own_group memory) ]]
	fi
}
userns=()
if ! can_fence_cgroups; then
	userns=(--user --map-root-user)
# The script's own moves must not be blocked by its own limits; they come
# after the groups are made.
elif [[ -f $cg/cgroup.controllers ]]; then
	# v2: a group with processes cannot hand controllers to its children,
	# so the fence is NAME (limits) with the processes in NAME/server.
	parent=$(own_group '')
	if ! grep -qw pids "$parent/cgroup.subtree_control" 2>/dev/null ||
		! grep -qw memory "$parent/cgroup.subtree_control" 2>/dev/null; then
		echo '+pids +memory' >"$parent/cgroup.subtree_control" 2>/dev/null || parent=$cg
	fi
	top=$parent/$name
	mkdir "$top"
	dirs=("$top")
	echo "$pids_max" >"$top/pids.max"
	echo "$mem_bytes" >"$top/memory.max"
	[[ ! -f $top/memory.swap.max ]] || echo 0 >"$top/memory.swap.max"
	mkdir "$top/server"
	dirs=("$top/server" "$top")
	echo $$ >"$top/server/cgroup.procs"
else
	for c in pids memory; do
		parent=$(own_group "$c") || { say "no $c controller in /proc/self/cgroup"; exit 1; }
		mkdir "$parent/$name"
		dirs+=("$parent/$name")
	done
	echo "$pids_max" >"${dirs[0]}/pids.max"
	echo "$mem_bytes" >"${dirs[1]}/memory.limit_in_bytes"
	[[ ! -f ${dirs[1]}/memory.memsw.limit_in_bytes ]] || echo "$mem_bytes" >"${dirs[1]}/memory.memsw.limit_in_bytes"
	for d in "${dirs[@]}"; do echo $$ >"$d/cgroup.procs"; done
fi

# The server's run directory (see sandbox/vm.c), and the fence's own.
if ((EUID == 0)); then
	run=/run/ignition-mcp
elif [[ -n ${XDG_RUNTIME_DIR:-} ]]; then
	run=$XDG_RUNTIME_DIR/ignition-mcp
else
	run=/tmp/ignition-mcp-$EUID
fi
mine=$run/fence-$$
mkdir -p "$run"
mkdir -m 0711 "$mine"

# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
	local d pid _
	# Out of the fence first: a group with a process in it cannot go.
	for d in "${dirs[@]}"; do
		[[ -d $d ]] || continue
		{ echo $$ >"$(dirname "$d")/cgroup.procs"; } 2>/dev/null || true
	done
	for d in "${dirs[@]}"; do
		[[ -d $d ]] || continue
		[[ ! -f $d/cgroup.kill ]] || echo 1 >"$d/cgroup.kill"
		for _ in $(seq 100); do
			rmdir "$d" 2>/dev/null && break
			while read -r pid; do kill -KILL "$pid" 2>/dev/null || true; done <"$d/cgroup.procs"
			sleep 0.05
		done
		[[ -d $d ]] && say "cannot remove $d"
	done
	rm -rf "$mine"
}
trap cleanup EXIT
child=
trap '[[ -n $child ]] && kill -TERM "$child" 2>/dev/null' TERM
trap '[[ -n $child ]] && kill -INT "$child" 2>/dev/null' INT

# unshare forwards nothing, so the signals go to the server (its child, PID 1
# inside, which handles them) by its pid in our namespace.  The explicit <&0
# keeps stdin: a background job's stdin would be /dev/null.
# shellcheck disable=SC2016 # expanded by the inner sh
unshare "${userns[@]}" --pid --fork --mount-proc --kill-child=SIGKILL -- \
	/bin/sh -c 'mount --bind "$1" "$2" && n=$3 && u=$4 && g=$5 && shift 5 && if [ -n "$n" ]; then exec unshare --map-user="$u" --map-group="$g" -- prlimit --nproc="$n" -- "$@"; fi; exec "$@"' \
	fence "$mine" "$run" "${userns:+$pids_max}" "$(id -u)" "$(id -g)" "$@" <&0 &
ushare=$!
# The server: unshare's child.
for _ in $(seq 200); do
	child=$(awk '{print $1}' "/proc/$ushare/task/$ushare/children" 2>/dev/null)
	[[ -n $child ]] && break
	sleep 0.01
done
rc=0
while :; do
	wait "$ushare" && rc=0 || rc=$?
	# A trapped signal interrupts wait (status > 128) while unshare runs on.
	kill -0 "$ushare" 2>/dev/null || break
done
# A server that shut down cleanly removed its QEMUs' state directories and
# its sessions' cgroups; say what it left (the tests fail on this line).
left=$(find "$mine" -mindepth 1 -maxdepth 1 -printf '%f ' 2>/dev/null)
[[ -z $left ]] || say "the server (exit $rc) left in its run directory: $left"
for d in "${dirs[@]}"; do
	left=$(find "$d" -mindepth 1 -type d -name 'ign*' 2>/dev/null | tr '\n' ' ')
	[[ -z $left ]] || say "the server (exit $rc) left cgroups: $left"
done
exit "$rc"
