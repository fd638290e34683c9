/* proc.h: running a helper program to read what it prints (doctor's checks,
 * the vm backend's probe of what its QEMU supports). */
#pragma once

#include <stddef.h>

/* Runs ARGV (ARGV[0] a path) with stdin from /dev/null and stdout and
 * stderr into OUT (NUL-terminated, truncated to SIZE); returns its wait
 * status, or a negative errno.  Killed after TIMEOUT_MS. */
int proc_run_capture(char *const argv[], char *out, size_t size, int timeout_ms);
