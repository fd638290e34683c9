/* vm_init.h: the agent as PID 1 of a microVM (vm_init.c): the early
 * devices, the root filesystem, the channel, and waiting for a host. */
#pragma once

#include "guest/agent_core.h"

/* Before anything else as PID 1 of a VM: /dev and the console as fds 0-2. */
void vm_early_init(void);
/* Load modules, mount the root, capture the guest's traffic
 * (egress_capture), open the channel into *RET_CHAN.  Logs on failure. */
int vm_setup(struct agent *a, int *ret_chan);
/* After EOF on the port: wait until a host is connected again. */
void vm_wait_host(int chan);
/* Power off after a fatal error (PID 1 must not exit). */
__attribute__((noreturn)) void vm_fatal(void);
