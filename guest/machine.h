/* machine.h: the sandbox's identity and kernel state (machine.c): hostname,
 * loopback, the name files, and the SETUP request. */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "guest/agent_core.h"

int machine_set_hostname(const char *name, size_t len);
int machine_loopback_up(void);
/* /etc/resolv.conf naming 127.0.0.1 (where the capture sends DNS) and an
 * /etc/hosts with the localhost lines, each unless the tree has one.  Best
 * effort: a failure is logged. */
void machine_name_files(void);
/* Sets what a SETUP's TLVs in PAYLOAD ask (HELLO may carry them too; none
 * is nothing to do): 0, or a negative errno once an ERROR for ID was sent
 * (the caller answers OK). */
int machine_setup(struct agent *a, uint32_t id, const uint8_t *payload, size_t len);
