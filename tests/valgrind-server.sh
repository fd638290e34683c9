#!/bin/sh
# valgrind-server.sh: the server under valgrind's memcheck, for the e2e tests
# (tests/run.sh valgrind).  IGN_VALGRIND_SERVER is the plain build to run,
# IGN_VALGRIND_LOGS the directory each process's report goes to.  Leaks count
# as errors when definitely or indirectly lost; threads still running at exit
# (the reaper, the spawner) hold stacks that are only "possibly lost".
# Children are silent: each execs at once (the agent, QEMU), and an ns
# sandbox's first process could not even open a log file of its own, being
# in a user namespace that does not map its uid until the server has written
# the map.
exec valgrind --error-exitcode=99 --leak-check=full --child-silent-after-fork=yes \
	--errors-for-leak-kinds=definite,indirect --show-leak-kinds=definite,indirect \
	--log-file="${IGN_VALGRIND_LOGS:?}/vg.%p" "${IGN_VALGRIND_SERVER:?}" "$@"
