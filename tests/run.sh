#!/usr/bin/env bash
# tests/run.sh [unit|e2e|e2e-ns|e2e-vm|e2e-user|e2e-ns-user|e2e-vm-user|valgrind|conformance|clients|all]
# [test files...]: the test runner behind `make check`.
#
#   unit         tests/layering.sh (the include arrows between the source
#                folders point down their floors only: layering), every
#                executable in $BUILD/test/ (C unit tests; each prints
#                "ok - name" / "not ok - name" and ends with "N passed, N failed"),
#                then every fuzz target's replay build over its corpus in
#                fuzz/corpus/ (fuzz-replay)
#   e2e          node --test over tests/e2e/*.test.mjs, against the real server,
#                twice: on the ns backend (e2e-ns) and on the vm backend
#                (e2e-vm: QEMU microVMs; skipped, and counted as skipped, when
#                QEMU or the VM images are missing)
#   e2e-ns       only the ns pass;  e2e-vm  only the vm pass
#   e2e-user     both passes again as an ordinary user (IGN_TEST_USER,
#                default ignition-test, made when missing), the way most
#                people run the server: a run as root only (e2e-ns-user,
#                e2e-vm-user: one of them).  Only the files listed for the
#                pass in tests/user-passes.txt run there (those whose
#                behaviour depends on who runs the server; the reason is on
#                each line): the others run in the root passes only, are
#                named, and each counts as skipped
#   valgrind     the server's end-to-end path once under valgrind: the plain
#                build on the ns backend, through the e2e files of the
#                protocol and the session tools (e2e-valgrind), and every
#                server process's report must have no error (valgrind)
#   conformance  tests/conformance.sh: the official MCP conformance suite against
#                the server's HTTP endpoint, plus the Inspector CLI's strict check
#   clients      tests/clients: Claude Code, Codex and Gemini CLI (installed
#                into clients/ by scripts/setup.sh) register the server and
#                connect to it
#   all          all of them (the default)
#
# After e2e, e2e-ns or e2e-vm (or a user pass), test files may be named to run
# only those, e.g. tests/run.sh e2e-vm tests/e2e/vm.test.mjs; a file named
# runs in the user passes too, listed in tests/user-passes.txt or not.
#
# all runs in two lanes (IGN_TEST_JOBS=1: one part after another, in the
# order above): e2e-ns then e2e-vm, and beside them, in a process group of
# its own, unit, fuzz-replay, valgrind, conformance and clients, then
# e2e-ns-user once e2e-ns has ended, whose output is kept in a file each and
# printed whole after e2e-vm (one line says when each starts and how it
# ended); then e2e-vm-user, alone.  The vm-user pass starts from a copy of
# the warm bases the vm pass booted.
#
# Each suite's output is shown as it runs. At the end come the time of
# each pass and the ten slowest e2e files (with the pass they ran in); the
# counts of all suites are added up and the very last line is
# "N passed, N failed, N skipped". Exits
# non-zero when anything failed or a suite could not run.
#
# Environment: BUILD (default build); IGN_TEST_NODE (the node to run tests
# with; default tests/node_modules/.bin/node, the Node 22 that npm ci brings);
# IGN_TEST_JOBS (2, the default: all runs in two lanes as above; 1: one part
# at a time); IGN_TEST_SOAK (1: the soaks run at full length, e.g.
# sandbox_run's 100 calls and a 200 MiB log, instead of the short versions);
# IGN_TEST_E2E_TIMEOUT (seconds for one e2e pass, default 1800);
# IGN_TEST_TIMEOUT_MS (milliseconds for one e2e test, default 600000);
# IGN_TEST_UNIT_TIMEOUT (seconds for one unit test binary, default 300);
# IGN_TEST_VM_STORE (the warm-base store of the vm pass; default a fresh
# directory per run, removed afterwards, so the pass neither uses nor
# disturbs the bases in /var/lib/ignition-mcp; "default": the server's own);
# IGN_TEST_VM_SEED (a store whose warm bases the vm-user pass's fresh store
# starts with a copy of; default the vm pass's store in all, else none);
# IGN_TEST_USER_PASSES (the list of files the user passes run, default
# tests/user-passes.txt; "all": the user passes run every file).
set -euo pipefail
# Under pipefail a reader that stops early (head, grep -q) kills its writer
# with SIGPIPE and fails the whole line: take the first lines with sed -n or
# awk, which read to the end.

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

what=${1:-all}
[[ $# -gt 0 ]] && shift
e2e_args=("$@")
case $what in
unit | e2e | e2e-ns | e2e-vm | e2e-user | e2e-ns-user | e2e-vm-user | valgrind | conformance | clients | all) ;;
-h | --help)
	sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
	exit 0
	;;
*)
	printf 'usage: tests/run.sh [unit|e2e|e2e-ns|e2e-vm|e2e-user|e2e-ns-user|e2e-vm-user|valgrind|conformance|clients|all] [test files...]\n' >&2
	exit 2
	;;
esac

BUILD=${BUILD:-build}
abs() { [[ $1 == /* ]] && printf '%s\n' "$1" || printf '%s\n' "$root/$1"; }
build=$(abs "$BUILD")

# The node that runs the tests: Node 22 from tests/node_modules when npm ci has
# run, first on PATH so that the tools' own `node` shebangs get it too.
if [[ -x tests/node_modules/.bin/node ]]; then
	PATH=$root/tests/node_modules/.bin:$PATH
fi
export PATH
node=${IGN_TEST_NODE:-$(command -v node || true)}

# What the e2e tests (and any other test) find the parts by.
export IGN_TEST_SERVER=${IGN_TEST_SERVER:-$build/san/ignition-mcp}
export IGN_TEST_AGENT=${IGN_TEST_AGENT:-$build/ign-agent}
export IGN_TEST_ROOTFS_SMALL=${IGN_TEST_ROOTFS_SMALL:-$build/rootfs/small}
export IGN_TEST_ROOTFS_TOOLS=${IGN_TEST_ROOTFS_TOOLS:-$build/rootfs/tools}
export BUILD
# A test's server that ends closes its sessions rather than leaving them
# hibernated on the store the tests share (a test that wants that says so).
export IGN_MCP_SHUTDOWN_ACTION=${IGN_MCP_SHUTDOWN_ACTION:-close}

logdir=$(mktemp -d "${TMPDIR:-/tmp}/ign-tests.XXXXXX")
# The vm pass keeps its store in here, which the QEMUs (unprivileged uids
# when we run as root) must be able to reach.
chmod 0711 "$logdir"
e2e_group= side_group=
cleanup() {
	[[ -z $e2e_group ]] || kill -TERM -- "-$e2e_group" 2>/dev/null || true
	if [[ -n $side_group ]]; then
		kill -TERM -- "-$side_group" 2>/dev/null || true
		wait "$side_group" 2>/dev/null || true
	fi
	rm -rf "$logdir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Each part of the run (unit, fuzz-replay, e2e-ns, ... clients) leaves its
# summary rows in $logdir/rows.PART ("P F S<tab>row" a line) and its time in
# $logdir/time.PART, so that the parts run beside each other (each in a shell
# of its own) still add up at the end, in the order of the parts.
cur_part=main

# add SUITE PASS FAIL SKIP [NOTE]: one row of the summary, for the part
# running now.
add() {
	printf '%d %d %d\t%s\n' "$2" "$3" "$4" \
		"$(printf '%-12s %4d passed, %4d failed, %4d skipped%s' "$1" "$2" "$3" "$4" "${5:+  ($5)}")" \
		>>"$logdir/rows.$cur_part"
}

banner() { printf '\n======== %s ========\n' "$*"; }

# last_counts FILE: print "P F S" from the last "N passed, N failed[, N skipped]"
# line of FILE (a word and a colon may stand before it), or nothing.
last_counts() {
	sed -nE 's/^([A-Za-z0-9_-]+: )?([0-9]+) passed, ([0-9]+) failed(, ([0-9]+) skipped)?[[:space:]]*$/\2 \3 \5/p' "$1" |
		tail -n 1 | awk '{ print $1, $2, ($3 == "" ? 0 : $3) }'
}

# tap_counts FILE: "P F S" from the result lines of node's TAP output.
tap_counts() {
	awk '
		function flush() { if (cur != "") n[cur]++; cur = "" }
		/^[ ]*(not )?ok [0-9]+/ {
			flush()
			cur = ($0 ~ /^[ ]*not ok/) ? "fail" : "pass"
			if ($0 ~ /# (SKIP|TODO)/) cur = "skip"
			next
		}
		/^[ ]*type: .suite./ { cur = ""; next }
		END { flush(); print n["pass"] + 0, n["fail"] + 0, n["skip"] + 0 }
	' "$1" 2>/dev/null || echo 0 0 0
}

# run_script SUITE SCRIPT TITLE: runs SCRIPT, which ends with "N passed, N
# failed[, N skipped]", and counts its results under SUITE.
run_script() {
	local suite=$1 script=$2 log=$logdir/$1.log rc=0 counts p f s
	banner "$3 ($script)"
	"$script" 2>&1 | tee "$log" || rc=${PIPESTATUS[0]}
	counts=$(last_counts "$log")
	if [[ -z $counts ]]; then
		printf 'not ok - %s: %s ended (exit %d) without a count\n' "$suite" "$script" "$rc"
		add "$suite" 0 1 0
		return
	fi
	read -r p f s <<<"$counts"
	if ((rc != 0 && f == 0)); then
		printf 'not ok - %s: exit status %d although it counted no failure\n' "$suite" "$rc"
		f=1
	fi
	add "$suite" "$p" "$f" "$s"
}

# The include arrows between the source folders; it reads the sources only
# and needs no build.
run_layering() { run_script layering tests/layering.sh "include layering"; }

run_unit() {
	banner "unit tests ($BUILD/test)"
	local p=0 f=0 s=0 t name log rc counts tp tf ts tests=() fence t0
	if [[ -d $build/test ]]; then
		for t in "$build"/test/*; do
			[[ -f $t && -x $t ]] && tests+=("$t")
		done
	fi
	if ((${#tests[@]} == 0)); then
		printf 'no unit test binaries in %s (make check builds them from tests/unit/test_*.c)\n' "$BUILD/test"
		add unit 0 0 0
		return
	fi
	for t in "${tests[@]}"; do
		name=${t##*/}
		log=$logdir/unit-$name.log
		printf -- '--- %s\n' "$name"
		rc=0 t0=$SECONDS
		# The agent tests run kill -9 -1 and the like in real sandboxes: as
		# root, each binary runs inside the second fence (tests/fence.sh: a
		# pid namespace and a pids+memory cgroup of its own).
		fence=()
		((EUID != 0)) || fence=(tests/fence.sh "unit-$name-$$" 4096 4096 --)
		timeout --foreground --kill-after=10 "${IGN_TEST_UNIT_TIMEOUT:-300}" "${fence[@]}" "$t" 2>&1 | tee "$log" || rc=${PIPESTATUS[0]}
		((rc == 124 || rc == 137)) && printf '%s timed out after %ss (IGN_TEST_UNIT_TIMEOUT)\n' "$name" "${IGN_TEST_UNIT_TIMEOUT:-300}"
		printf -- '--- %s took %d s\n' "$name" $((SECONDS - t0))
		counts=$(last_counts "$log")
		if [[ -z $counts ]]; then
			printf 'not ok - %s: ended (exit %d) without its "N passed, N failed" line\n' "$name" "$rc"
			f=$((f + 1))
			continue
		fi
		read -r tp tf ts <<<"$counts"
		if ((rc != 0 && tf == 0)); then
			printf 'not ok - %s: exit status %d although it reported no failure\n' "$name" "$rc"
			tf=1
		fi
		p=$((p + tp)) f=$((f + tf)) s=$((s + ts))
	done
	add unit "$p" "$f" "$s"
}

# vm_missing: why the vm backend cannot run here (nothing when it can).
# The server finds its images next to itself (build/san/vm -> build/vm) and
# QEMU in PATH.
vm_missing() {
	local vmdir f
	vmdir=$(dirname "$IGN_TEST_SERVER")/vm
	command -v qemu-system-x86_64 >/dev/null 2>&1 ||
		{ printf 'qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)\n'; return; }
	for f in vmlinux initramfs.cpio rootfs-small.erofs; do
		[[ -f $vmdir/$f ]] || { printf 'no %s in %s (build the VM images with: make vm-images)\n' "$f" "$vmdir"; return; }
	done
}

# The ordinary user the unprivileged passes run as (root only): most people
# register the server in their own client, without root.  It is made when
# missing, with a home directory (the server's store goes to ~/.cache).
test_user=${IGN_TEST_USER:-ignition-test}

# ensure_test_user: makes $test_user when it does not exist; prints why not.
ensure_test_user() {
	id -u "$test_user" >/dev/null 2>&1 && return
	useradd --create-home --user-group --shell /bin/bash "$test_user" >/dev/null 2>&1 ||
		printf 'cannot create the user %s (useradd failed)\n' "$test_user"
}

# As root, the root passes also start a server as that user here and there
# (tests/e2e/userns.test.mjs): they find it in IGN_TEST_USER.
if ((EUID == 0)) && [[ $what == @(e2e|e2e-ns|e2e-vm|all) ]] && [[ -z $(ensure_test_user) ]]; then
	export IGN_TEST_USER=$test_user
fi

# The e2e files that run in the user passes too (FILE PASSES # why): every
# other file runs as root only.
user_passes_list=${IGN_TEST_USER_PASSES-tests/user-passes.txt}

# user_passes ROW: the files that run in the user pass ROW (e2e-ns-user,
# e2e-vm-user), one "FILE WHY" line each; "* all" when every file runs there.
# What is wrong with the list comes out as "? WHAT": a line that names no
# pass of ours or gives no reason runs its file in both user passes, and a
# list that cannot be read runs every file (a list misread must not lose
# tests).
user_passes() {
	local pass=${1#e2e-} line f passes why
	if [[ -z $user_passes_list || $user_passes_list == all ]]; then
		printf '* all\n'
		return
	fi
	if [[ ! -r $user_passes_list ]]; then
		printf '? cannot read %s (IGN_TEST_USER_PASSES): every file runs\n' "$user_passes_list"
		printf '* all\n'
		return
	fi
	while IFS= read -r line || [[ -n $line ]]; do
		[[ $line =~ ^[[:space:]]*(#|$) ]] && continue
		read -r f passes why <<<"$line"
		if [[ ! $passes =~ ^(ns-user|vm-user)(,(ns-user|vm-user))?$ || ! $why =~ ^#[[:space:]]*[^[:space:]] ]]; then
			printf '? %s: "%s" names no pass (ns-user, vm-user, or both with a comma) or gives no "# why": %s runs in both\n' \
				"$user_passes_list" "$line" "$f"
			printf '%s %s\n' "$f" "(a line of the list that cannot be read)"
			continue
		fi
		why=${why#\#}
		[[ ,$passes, != *,$pass,* ]] || printf '%s %s\n' "$f" "${why# }"
	done <"$user_passes_list"
}

# seed_store FROM TO USER: makes the store TO for USER with a copy of each
# warm base of the store FROM (each <name>-<16 hex digits> directory with its
# meta; not the stages, the lock, nor a base being made), so that the
# vm-user pass starts from the bases the vm pass booted instead of booting
# them again; the copies are USER's own files, and the stages of each pass
# stay its own.  The tests that make a base as the user do so in stores of
# their own (tempStore in tests/e2e/lib.mjs).  FROM empty or missing: TO
# starts empty.
vm_seed=
seed_store() {
	local from=$1 to=$2 user=$3 d n=0
	mkdir -m 0755 "$to"
	if [[ -n $from && -d $from ]]; then
		for d in "$from"/*-????????????????; do
			[[ -d $d && -f $d/meta && ${d##*/} =~ -[0-9a-f]{16}$ ]] || continue
			cp -a --reflink=auto "$d" "$to/" && n=$((n + 1))
		done
	fi
	chown -R "$user:" "$to"
	((n == 0)) || printf 'the store starts with a copy of the %d warm base(s) in %s\n' "$n" "$from"
}

# run_e2e BACKEND [ROW [user]]: one pass of the e2e suite with
# IGN_TEST_BACKEND=BACKEND; its summary row is ROW (default e2e-BACKEND).
# With "user", the pass runs as $test_user (the test runner, and so every
# server it starts).  The abusive tests fence their servers as that user can
# (tests/fence.sh: a user and pid namespace and a process limit, no cgroup),
# and the whole pass runs inside one more fence made as root around it (a
# pid namespace and a pids and memory cgroup).
run_e2e() {
	local backend=$1 row=${2:-e2e-$1} as=${3:-}
	banner "end-to-end tests (tests/e2e), backend $backend${as:+, as the ordinary user $test_user}"
	local files=() f tap rc group left why t0 secs runner=() outdir=$logdir
	local root_only_n=0 list_bad=0
	if ((${#e2e_args[@]} > 0)); then
		files=("${e2e_args[@]}")
	else
		for f in tests/e2e/*.test.mjs; do
			[[ -f $f ]] && files+=("$f")
		done
	fi
	if ((${#files[@]} == 0)); then
		printf 'no tests/e2e/*.test.mjs yet\n'
		add "$row" 0 0 0
		return
	fi
	if [[ -z $node ]]; then
		printf 'cannot run the e2e tests: no node. Run scripts/setup.sh\n'
		add "$row" 0 1 0
		return
	fi
	if [[ ! -d tests/node_modules/@modelcontextprotocol/sdk ]]; then
		printf 'cannot run the e2e tests: tests/node_modules is missing. Run scripts/setup.sh (or: cd tests && npm ci)\n'
		add "$row" 0 1 0
		return
	fi
	if [[ ! -x $IGN_TEST_SERVER ]]; then
		printf 'cannot run the e2e tests: no server at %s. Build it with: make %s\n' "$IGN_TEST_SERVER" "${IGN_TEST_SERVER#"$root"/}"
		add "$row" 0 1 0
		return
	fi
	local store=
	if [[ $backend == vm ]]; then
		why=$(vm_missing)
		if [[ -n $why ]]; then
			printf 'skipping the vm pass: %s\n' "$why"
			add "$row" 0 0 1 "not run: $why"
			return
		fi
		store=${IGN_TEST_VM_STORE:-$logdir/vm-store}
		[[ $store != default ]] || store=
	fi
	if [[ -n $as ]]; then
		if ((EUID != 0)); then
			printf 'skipping %s: this run is not root, so the passes above already ran as %s\n' "$row" "$(id -un)"
			add "$row" 0 0 1 "not run: not root"
			return
		fi
		why=$(ensure_test_user)
		if [[ -z $why ]] && ! runuser -u "$test_user" -- test -x "$IGN_TEST_SERVER"; then
			why="$test_user cannot run $IGN_TEST_SERVER: make the checkout readable by others (chmod o+rx on it and its parents)"
		fi
		if [[ -n $why ]]; then
			printf 'not ok - %s: %s\n' "$row" "$why"
			add "$row" 0 1 0
			return
		fi
		outdir=$logdir/$row
		mkdir -m 0700 "$outdir" "$outdir/tmp"
		chown "$test_user:" "$outdir" "$outdir/tmp"
		if [[ -n $store ]]; then
			store=$outdir/vm-store
			seed_store "${IGN_TEST_VM_SEED:-$vm_seed}" "$store" "$test_user"
		fi
		# The user's own environment: no XDG directory of root's, its home;
		# a TMPDIR of the pass's own, so that what its tests make there
		# cannot look like a leftover to a pass beside it (whose checks read
		# /tmp).
		runner=(tests/fence.sh "e2e-user-$$-$backend" 16384 12288 --
			runuser -u "$test_user" -- env -u XDG_RUNTIME_DIR -u XDG_CACHE_HOME -u XDG_CONFIG_HOME
			"TMPDIR=$outdir/tmp")
		# Files named on the command line run whatever the list says.
		((${#e2e_args[@]} > 0)) || keep_user_files "$row"
		if ((${#files[@]} == 0)); then
			# node --test given no file would look for tests all over the checkout.
			printf '%s: no file of tests/e2e is listed for it in %s\n' "$row" "$user_passes_list"
			add "$row" 0 "$list_bad" "$root_only_n" "$root_only_n files in the root passes only"
			return
		fi
	fi
	printf 'node %s; IGN_TEST_SERVER=%s; IGN_TEST_BACKEND=%s%s%s\n' "$("$node" --version)" "$IGN_TEST_SERVER" "$backend" "${store:+; IGN_TEST_VM_STORE=$store}" "${as:+; as $test_user (uid $(id -u "$test_user"))}"
	tap=$outdir/$row.tap
	rc=0
	t0=$SECONDS
	# timeout puts the suite in a process group of its own (its pid), so that
	# whatever a test leaves running can be found and ended afterwards.
	IGN_TEST_BACKEND=$backend IGN_TEST_VM_STORE=$store \
		timeout --kill-after=30 "${IGN_TEST_E2E_TIMEOUT:-1800}" \
		"${runner[@]}" "$node" --test --test-concurrency=1 --test-timeout="${IGN_TEST_TIMEOUT_MS:-600000}" \
		--test-reporter=spec --test-reporter-destination=stdout \
		--test-reporter=tap --test-reporter-destination="$tap" \
		--test-reporter=./tests/file-times.mjs --test-reporter-destination="$tap.times" \
		"${files[@]}" &
	group=$!
	e2e_group=$group
	wait "$group" || rc=$?
	e2e_group=
	secs=$((SECONDS - t0))
	printf '%s took %d s\n' "$row" "$secs"
	((rc == 124 || rc == 137)) && printf 'the %s pass timed out after %ss (IGN_TEST_E2E_TIMEOUT)\n' "$row" "${IGN_TEST_E2E_TIMEOUT:-1800}"
	left=$(pgrep -g "$group" -d ' ' || true)
	if [[ -n $left ]]; then
		printf 'the %s pass left processes running; killing them:\n' "$row"
		ps -o pid=,args= -p "${left// /,}" | cut -c1-200 | sed 's/^/    /' || true
		kill -KILL -- "-$group" 2>/dev/null || true
	fi
	if [[ -n $store && -z ${IGN_TEST_VM_STORE:-} ]]; then
		# The vm pass's bases seed the vm-user pass's store when it follows.
		if [[ -z $as && $what == all ]]; then vm_seed=$store; else rm -rf "$store"; fi
	fi
	[[ ! -f $tap.times ]] || sed "s|\$| ($row)|" "$tap.times" >>"$logdir/file-times"
	local note="$secs s"
	((root_only_n == 0)) || note+="; $root_only_n files in the root passes only"
	add_tap "$row" "$tap" "$rc" "$note" "$list_bad" "$root_only_n"
}

# keep_user_files ROW: keeps of run_e2e's files those user_passes lists
# for ROW, saying which run and why; the others are left to the root passes,
# named on one line.  Sets root_only_n (how many were left) and list_bad (1
# when the list has a line it cannot read).
keep_user_files() {
	local row=$1 f why kept=() left=() n all=0
	local -A why_of=()
	while read -r f why; do
		case $f in
		'?')
			printf 'not ok - %s\n' "$why"
			list_bad=1
			;;
		'*') all=1 ;;
		*) why_of[$f]=$why ;;
		esac
	done < <(user_passes "$row")
	((all == 0)) || return 0
	for f in "${files[@]}"; do
		n=${f#tests/e2e/}
		if [[ -n ${why_of[$n]+set} ]]; then
			printf -- '+ %s: %s\n' "$n" "${why_of[$n]}"
			kept+=("$f")
			unset 'why_of[$n]'
		else
			left+=("$n")
		fi
	done
	for n in "${!why_of[@]}"; do
		printf 'note: %s lists %s for %s, which is not in tests/e2e\n' "$user_passes_list" "$n" "$row"
	done
	root_only_n=${#left[@]}
	((root_only_n == 0)) || printf '%s: %d of %d files run here (%s); %d run as root only, counted as skipped (IGN_TEST_USER_PASSES=all runs them here too): %s\n' \
		"$row" "${#kept[@]}" "${#files[@]}" "$user_passes_list" "$root_only_n" "${left[*]}"
	files=("${kept[@]}")
}

# add_tap ROW TAP RC [NOTE [FAIL SKIP]]: adds the counts of a node --test run
# that wrote TAP and exited RC, and FAIL failures and SKIP skips of the
# runner's own.  node's TAP reporter ends with "# pass N", "# fail N",
# "# cancelled N", "# skipped N" and "# todo N".
add_tap() {
	local row=$1 tap=$2 rc=$3 note=${4:-} xf=${5:-0} xs=${6:-0} p fl sk cancelled
	# node may die before it writes any TAP (then sed's missing file would end
	# the runner under pipefail): count it from an empty one.
	[[ -f $tap ]] || : >"$tap"
	p=$(sed -nE 's/^# pass ([0-9]+)$/\1/p' "$tap" 2>/dev/null | tail -n 1)
	fl=$(sed -nE 's/^# fail ([0-9]+)$/\1/p' "$tap" 2>/dev/null | tail -n 1)
	cancelled=$(sed -nE 's/^# cancelled ([0-9]+)$/\1/p' "$tap" 2>/dev/null | tail -n 1)
	sk=$(sed -nE 's/^# (skipped|todo) ([0-9]+)$/\2/p' "$tap" 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
	if [[ -z $p || -z $fl ]]; then
		# No summary (the suite was killed): count the results it did report,
		# leaving out describe() blocks, and one failure for the incomplete run.
		read -r p fl sk < <(tap_counts "$tap")
		printf 'not ok - %s: node --test ended (exit %d) without a summary; counted the %d results it reported\n' "$row" "$rc" $((p + fl + sk))
		add "$row" "$p" $((fl + 1 + xf)) $((sk + xs)) "$note"
		return
	fi
	fl=$((fl + ${cancelled:-0}))
	if ((rc != 0 && fl == 0)); then
		printf 'not ok - %s: node --test exited %d although it counted no failure\n' "$row" "$rc"
		fl=1
	fi
	add "$row" "$p" $((fl + xf)) $((sk + xs)) "$note"
}

run_conformance() { run_script conformance tests/conformance.sh "MCP conformance"; }

# run_fuzz_replay: every fuzz target's replay build ($BUILD/replay/NAME, the
# ordinary compiler with ASan+UBSan) over its committed corpus
# fuzz/corpus/NAME, crashes found by fuzzing included; one test per target.
run_fuzz_replay() {
	banner "fuzz corpus replay ($BUILD/replay)"
	local p=0 f=0 t name log rc
	local targets=()
	for t in "$build"/replay/fuzz_*; do
		[[ -f $t && -x $t ]] && targets+=("$t")
	done
	if ((${#targets[@]} == 0)); then
		printf 'not ok - no replay programs in %s (make check builds them from fuzz/*.c)\n' "$BUILD/replay"
		add fuzz-replay 0 1 0
		return
	fi
	for t in "${targets[@]}"; do
		name=${t##*/}
		log=$logdir/replay-$name.log
		rc=0
		if [[ ! -d fuzz/corpus/$name ]]; then
			printf 'not ok - %s: fuzz/corpus/%s is missing\n' "$name" "$name"
			f=$((f + 1))
			continue
		fi
		timeout --foreground --kill-after=10 "${IGN_TEST_UNIT_TIMEOUT:-300}" "$t" "fuzz/corpus/$name" >"$log" 2>&1 || rc=$?
		if ((rc == 0)) && grep -q '^replay: [0-9]* inputs, no crash' "$log"; then
			printf 'ok - %s: %s\n' "$name" "$(sed -n 's/^replay: \([0-9]* inputs, no crash\)/\1/p' "$log")"
			p=$((p + 1))
		else
			tail -n 40 "$log"
			printf 'not ok - %s: replaying fuzz/corpus/%s failed (exit %d); the input is named above\n' "$name" "$name" "$rc"
			f=$((f + 1))
		fi
	done
	add fuzz-replay "$p" "$f" 0
}

# run_clients: the real MCP clients (Claude Code, Codex, Gemini CLI from
# clients/node_modules, which scripts/setup.sh installs) register and reach
# the plain build of the server; a client that is not installed is skipped,
# and says why.
run_clients() {
	banner "MCP clients (tests/clients)"
	local tap=$logdir/clients.tap rc=0
	if [[ -z $node ]]; then
		printf 'cannot run the client tests: no node. Run scripts/setup.sh\n'
		add clients 0 1 0
		return
	fi
	IGN_TEST_CLIENT_SERVER=${IGN_TEST_CLIENT_SERVER:-$build/ignition-mcp} \
		timeout --kill-after=30 "${IGN_TEST_CLIENTS_TIMEOUT:-900}" \
		"$node" --test --test-concurrency=1 --test-timeout="${IGN_TEST_TIMEOUT_MS:-600000}" \
		--test-reporter=spec --test-reporter-destination=stdout \
		--test-reporter=tap --test-reporter-destination="$tap" \
		tests/clients/clients.test.mjs || rc=$?
	add_tap clients "$tap" "$rc"
}

# run_valgrind: the server's end-to-end path once under valgrind (the plain
# build, not the sanitizer one): the ns backend, with the e2e files of the
# protocol and the session tools (open_session, run, write_file, read_file,
# list_sessions, reset, close; not copy_in, copy_out, the stage tools,
# sandbox_run nor HTTP).  A pass needs every server process's report to say
# "ERROR SUMMARY: 0 errors".
valgrind_files=(tests/e2e/protocol.test.mjs tests/e2e/tools.test.mjs tests/e2e/exec.test.mjs
	tests/e2e/files.test.mjs tests/e2e/sessions.test.mjs)
run_valgrind() {
	if ! command -v valgrind >/dev/null; then
		banner "end-to-end tests under valgrind"
		printf 'not ok - valgrind is not installed; run scripts/setup.sh (or: apt-get install valgrind)\n'
		add e2e-valgrind 0 1 0
		return
	fi
	local logs=$logdir/valgrind f n bad=0 reports=0
	mkdir -p "$logs"
	local saved_server=$IGN_TEST_SERVER
	local saved_args=("${e2e_args[@]}")
	export IGN_VALGRIND_SERVER=$build/ignition-mcp IGN_VALGRIND_LOGS=$logs IGN_TEST_VALGRIND=1
	IGN_TEST_SERVER=$root/tests/valgrind-server.sh
	((${#e2e_args[@]} > 0)) || e2e_args=("${valgrind_files[@]}")
	run_e2e ns e2e-valgrind
	IGN_TEST_SERVER=$saved_server
	unset IGN_TEST_VALGRIND
	e2e_args=("${saved_args[@]}")
	for f in "$logs"/vg.*; do
		[[ -f $f ]] || continue
		n=$(sed -nE 's/^==[0-9]+== ERROR SUMMARY: ([0-9]+) errors.*/\1/p' "$f")
		[[ -n $n ]] || continue # a child that went on to exec the agent
		reports=$((reports + 1))
		if ((n > 0)); then
			printf 'not ok - valgrind found %d errors in a server process:\n' "$n"
			sed 's/^/    /' "$f" | sed -n 1,80p
			bad=$((bad + 1))
		fi
	done
	if ((reports == 0)); then
		printf 'not ok - no valgrind report was written (did the server run under valgrind?)\n'
		reports=1 bad=1
	else
		printf '%s %d server processes under valgrind: %d with errors\n' "$( ((bad == 0)) && echo ok || echo 'not ok')" "$reports" "$bad"
	fi
	add valgrind "$((reports - bad))" "$bad" 0
}

# run_part PART: one part of the run, timed.
run_part() {
	local part=$1 t0=$SECONDS
	cur_part=$part
	case $part in
	layering) run_layering ;;
	unit) run_unit ;;
	fuzz-replay) run_fuzz_replay ;;
	e2e-ns) run_e2e ns ;;
	e2e-vm) run_e2e vm ;;
	e2e-ns-user) run_e2e ns e2e-ns-user user ;;
	e2e-vm-user) run_e2e vm e2e-vm-user user ;;
	valgrind) run_valgrind ;;
	conformance) run_conformance ;;
	clients) run_clients ;;
	esac
	printf '%-14s %6d s\n' "$part" $((SECONDS - t0)) >"$logdir/time.$part"
	: >"$logdir/ended.$part"
	cur_part=main
}

# part_counts PART: "P F S" of the rows PART has written so far.
part_counts() {
	[[ -f $logdir/rows.$1 ]] || { echo 0 0 0; return; }
	awk -F '\t' '{ split($1, c, " "); p += c[1]; f += c[2]; s += c[3] } END { print p + 0, f + 0, s + 0 }' "$logdir/rows.$1"
}

# The parts of `all`, in the order of the summary.
all_parts=(layering unit fuzz-replay e2e-ns e2e-vm e2e-ns-user e2e-vm-user valgrind conformance clients)
# With two jobs (IGN_TEST_JOBS, default 2), `all` runs in two lanes and then
# one pass alone.  The main lane runs the root e2e passes (e2e-ns, then
# e2e-vm); the side lane, beside it, the parts that need no host of their
# own (the unit tests, the fuzz replays, the valgrind pass, conformance and
# the clients), then e2e-ns-user, once e2e-ns has ended.  The ns pass waits on
# its sandboxes far more than it computes (about a fifth of a core), so the
# side parts take the other core while it runs; the ns-user pass then runs
# beside the vm pass, which it shares no user, run directory, TMPDIR nor
# memory cgroup with (the leftover checks of tests/e2e/lib.mjs pass over
# what another uid made, and abuse.test.mjs counts a user's OOM kills in the
# pass's own memory cgroup).  Not beside e2e-ns, whose userns.test.mjs starts
# servers as the same user.  Then e2e-vm-user, alone: it starts from a copy
# of the vm pass's warm bases, and it would share the user's run directory
# (its QEMUs' state directories are named after server pids, which repeat
# from one pass's pid namespace to another's) with e2e-ns-user.
side_parts=(layering unit fuzz-replay valgrind conformance clients e2e-ns-user)
main_parts=(e2e-ns e2e-vm)
late_parts=(e2e-vm-user)
# A side part that starts only once a main part has ended (run_part leaves
# $logdir/ended.PART).
declare -A side_after=([e2e-ns-user]=e2e-ns)
jobs=${IGN_TEST_JOBS:-2}
[[ $jobs =~ ^[1-9][0-9]*$ ]] || { printf 'IGN_TEST_JOBS must be a positive number, not "%s"\n' "$jobs" >&2; exit 2; }

# run_side PART...: the side lane (a process group of its own, which the
# runner's cleanup ends).  Each part's output goes to $logdir/out.PART,
# printed whole after the root passes; one line says when it starts and how
# it ended.
run_side() {
	local part t0 counts after
	# A TMPDIR of the lane's own (the unit tests and node make their
	# directories there): nothing it makes in /tmp can look like a leftover
	# of the e2e pass beside it, whose checks read /tmp.
	export TMPDIR=$logdir/tmp
	mkdir -p "$TMPDIR"
	chmod 0711 "$TMPDIR"
	trap '[[ -z $e2e_group ]] || kill -TERM -- "-$e2e_group" 2>/dev/null; exit 143' TERM
	trap '[[ -z $e2e_group ]] || kill -TERM -- "-$e2e_group" 2>/dev/null; exit 130' INT
	for part in "$@"; do
		after=${side_after[$part]:-}
		if [[ -n $after && ! -e $logdir/ended.$after ]]; then
			printf -- '-- beside the e2e passes: %s waits for %s to end\n' "$part" "$after"
			while [[ ! -e $logdir/ended.$after ]]; do sleep 2; done
		fi
		printf -- '-- beside the e2e passes: %s started (its output comes after e2e-vm)\n' "$part"
		t0=$SECONDS
		run_part "$part" >"$logdir/out.$part" 2>&1 </dev/null || true
		read -r counts <<<"$(part_counts "$part")"
		printf -- '-- beside the e2e passes: %s ended after %d s: %s passed, %s failed, %s skipped\n' \
			"$part" $((SECONDS - t0)) $counts
	done
}

case $what in
unit) parts=(layering unit fuzz-replay) ;;
e2e) parts=(e2e-ns e2e-vm) ;;
e2e-user) parts=(e2e-ns-user e2e-vm-user) ;;
all) parts=("${all_parts[@]}") ;;
*) parts=("$what") ;;
esac

if [[ $what == all ]] && ((jobs >= 2)); then
	set -m # the side lane gets a process group of its own
	run_side "${side_parts[@]}" &
	side_group=$!
	set +m
	for part in "${main_parts[@]}"; do
		run_part "$part"
	done
	wait "$side_group" || true
	side_group=
	printf '\n-- the parts that ran beside e2e-ns and e2e-vm, each whole: %s\n' "${side_parts[*]}"
	for part in "${side_parts[@]}"; do
		[[ ! -f $logdir/out.$part ]] || cat "$logdir/out.$part"
	done
	for part in "${late_parts[@]}"; do
		run_part "$part"
	done
else
	for part in "${parts[@]}"; do
		run_part "$part"
	done
fi

# A part that wrote no row (its shell died on the way) counts as a failure.
for part in "${parts[@]}"; do
	[[ -s $logdir/rows.$part ]] ||
		cur_part=$part add "$part" 0 1 0 "ended without its counts; see its output above"
done

# Where the time went: each pass, then the ten slowest test files of all
# the e2e passes (a file's time: its top-level tests, tests/file-times.mjs).
banner "time"
for part in "${parts[@]}"; do
	[[ ! -f $logdir/time.$part ]] || cat "$logdir/time.$part"
done
printf '%-14s %6d s%s\n' total "$SECONDS" "$( [[ $what == all ]] && ((jobs >= 2)) && printf '  (with %s beside e2e-ns and e2e-vm)' "${side_parts[*]}")"
if [[ -s $logdir/file-times ]]; then
	printf '\nthe ten slowest test files:\n'
	sort -rn "$logdir/file-times" | awk 'NR <= 10 { printf "%8.1f s  %s %s\n", $1, $2, $3 }'
fi

banner summary
total_pass=0 total_fail=0 total_skip=0
for part in "${parts[@]}"; do
	[[ -f $logdir/rows.$part ]] || continue
	cut -f 2- "$logdir/rows.$part"
	read -r tp tf ts <<<"$(part_counts "$part")"
	total_pass=$((total_pass + tp)) total_fail=$((total_fail + tf)) total_skip=$((total_skip + ts))
done
if ((total_skip > 0)); then
	printf '%d passed, %d failed, %d skipped\n' "$total_pass" "$total_fail" "$total_skip"
else
	printf '%d passed, %d failed\n' "$total_pass" "$total_fail"
fi
((total_fail == 0))
