#!/bin/sh
# valgrind-server.sh: the server under valgrind's memcheck, for the e2e tests
# (tests/run.sh valgrind).  IGN_VALGRIND_SERVER is the plain build to run,
# IGN_VALGRIND_LOGS the directory each process's report goes to.  Leaks count
# as errors when definitely or indirectly lost; threads still running at exit
# (the reaper, the spawner) hold stacks that are only "possibly lost".
exec valgrind --error-exitcode=99 --leak-check=full \
	--errors-for-leak-kinds=definite,indirect --show-leak-kinds=definite,indirect \
	--log-file="${IGN_VALGRIND_LOGS:?}/vg.%p" "${IGN_VALGRIND_SERVER:?}" "$@"
