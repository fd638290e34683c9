#!/usr/bin/env bash
# tests/layering.sh: checks the include arrows of the product's C files
# against the floors of the source tree, from the `#include "..."` lines of
# every .c and .h in the product folders (whatever files they hold today).
#
# The floors, from the ground up: common, proto, sandbox, egress, session,
# tools, mcp.  A file may include the headers of its own folder and of the
# floors below; a folder inside a floor's folder (sandbox/vm) stands on that
# floor.  guest/ is the agent, a program of its own: it may include common/
# and proto/ only, and nothing else includes guest/.  On top of the floors,
# no two folders may include each other, directly or round a circle (sandbox
# and sandbox/vm share a floor: only this catches them).  tests/, fuzz/ and
# bench/ are not the product and may include what they test; any other
# folder holding C files has no floor and fails until it is given one here.
#
# Prints "ok - FOLDER" or "not ok - FOLDER" with each offending file and line,
# then "N passed, N failed"; exits non-zero when anything failed.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

floors=(common proto sandbox egress session tools mcp)
# What guest/ may include besides itself.
guest_may=(common proto)
# Top folders that are not the product (and what make and npm put there).
not_product=(tests fuzz bench build clients)

# floor_of FOLDER: sets floor to the index of FOLDER's floor in floors, to
# "guest", or to nothing.
floor_of() {
	local i
	floor=
	for i in "${!floors[@]}"; do
		[[ $1 == "${floors[i]}" || $1 == "${floors[i]}"/* ]] && { floor=$i; return; }
	done
	[[ $1 != guest && $1 != guest/* ]] || floor=guest
}

prune=(-name .git -prune -o -name node_modules -prune -o)
for d in "${not_product[@]}"; do
	prune+=(-path "./$d" -prune -o)
done
mapfile -t files < <(find . "${prune[@]}" -type f -name '*.[ch]' -print | sed 's#^\./##' | LC_ALL=C sort)
mapfile -t folders < <(printf '%s\n' "${files[@]}" | sed -E 's#^[^/]*$#.#; s#/[^/]*$##' | LC_ALL=C sort -u)

declare -A bad=()   # folder -> its offending lines, one a line
edges=()            # "from to file:line: text" for the circle check
for f in "${files[@]}"; do
	dir=.
	[[ $f != */* ]] || dir=${f%/*}
	floor_of "$dir"
	from=$floor
	if [[ -z $from ]]; then
		bad[$dir]+="    $f: the folder $dir/ stands on no floor (give it one in tests/layering.sh)"$'\n'
		continue
	fi
	while IFS=: read -r line text; do
		[[ $text =~ \"([^\"]+)\" ]] || continue
		inc=${BASH_REMATCH[1]}
		# Quoted includes are looked up next to the file first, then from the
		# top of the tree (-I.).
		target=$inc
		[[ $inc == */* && (! -e $dir/$inc || -e $inc) ]] || target=$dir/$inc
		[[ $target != *./* ]] || target=$(realpath -m --relative-to=. "$target")
		to=.
		[[ $target != */* ]] || to=${target%/*}
		[[ $to != "$dir" ]] || continue
		edges+=("$dir $to $f:$line: $text")
		floor_of "$to"
		why=
		if [[ -z $floor ]]; then
			why="$to/ is not a product folder with a floor"
		elif [[ $from == guest ]]; then
			[[ $floor == guest || " ${guest_may[*]} " == *" $to "* ]] ||
				why="guest/ (the agent) may include ${guest_may[*]/%//} only"
		elif [[ $floor == guest ]]; then
			why="only guest/ includes guest/ (the agent is a program of its own)"
		elif ((floor > from)); then
			why="$to/ is on floor ${floors[floor]}, above $dir/'s floor ${floors[from]}: arrows point down only"
		fi
		[[ -z $why ]] || bad[$dir]+="    $f:$line: $text: $why"$'\n'
	done < <(grep -n -E '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$f" || true)
done

pass=0 fail=0
for d in "${folders[@]}"; do
	if [[ -n ${bad[$d]:-} ]]; then
		printf 'not ok - %s/ includes only its own folder and the floors below\n%s' "$d" "${bad[$d]}"
		fail=$((fail + 1))
	else
		printf 'ok - %s/ includes only its own folder and the floors below\n' "$d"
		pass=$((pass + 1))
	fi
done

# The circle check: an include from A to B closes a circle when B's
# includes lead back to A.
declare -A next=()  # folder -> the folders it includes, space-separated
for e in "${edges[@]}"; do
	read -r a b _ <<<"$e"
	[[ " ${next[$a]:-} " == *" $b "* ]] || next[$a]+=" $b"
done
# reaches A B: whether the includes of A lead to B.
reaches() {
	local -A seen=([$1]=1)
	local todo=("$1") cur n
	while ((${#todo[@]})); do
		cur=${todo[0]}
		todo=("${todo[@]:1}")
		for n in ${next[$cur]:-}; do
			[[ $n == "$2" ]] && return 0
			[[ -n ${seen[$n]:-} ]] || { seen[$n]=1; todo+=("$n"); }
		done
	done
	return 1
}
circle=
for e in "${edges[@]}"; do
	read -r a b rest <<<"$e"
	! reaches "$b" "$a" || circle+="    $rest: $b/ includes lead back to $a/"$'\n'
done
if [[ -n $circle ]]; then
	printf 'not ok - no include circle between folders\n%s' "$circle"
	fail=$((fail + 1))
else
	printf 'ok - no include circle between folders\n'
	pass=$((pass + 1))
fi

printf '%d passed, %d failed\n' "$pass" "$fail"
((fail == 0))
