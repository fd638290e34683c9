/* agent.h: ign-agent, the process that serves the host <-> agent protocol
 * (proto/proto.h) inside a sandbox: its modes, its command line, and the
 * state the loop owns.
 *
 * The agent is single-threaded: agent.c owns the event loop and the channel,
 * and hands each request to the module that serves it:
 *   exec.c      EXEC / STDIN / STDIN_END / KILL, output pipes, reaping
 *               (guest/exec_int.h)
 *   files.c     WRITE / DATA / DATA_END / READ (guest/files_int.h)
 *   tree.c      UNPACK / PACK / CREDIT (and their DATA, DATA_END, KILL):
 *               tar streams, each in a forked child (common/tarstream.h,
 *               guest/tree_int.h)
 *   egress.c    the sandbox's TCP connections and DNS queries as streams
 *               and lookups (STREAM_*, LOOKUP, LOOKUP_END): egress_stream.c
 *               the relay, egress_dns.c the queries, dns.c their codec
 *               (guest/egress_int.h)
 *   machine.c   SETUP, hostname, loopback, resolv.conf and hosts
 *   egress_nl.c the capture of the sandbox's traffic (nftables, routes)
 *   ns_setup.c  the namespace sandbox's mounts (mode --ns)
 *   vm_init.c   PID 1 of a microVM: modules, root disk, overlay, channel
 *   confine.c   the privilege drop: open files, capabilities, no_new_privs,
 *               seccomp (its deny list: confine.h)
 * The modules see the agent only through guest/agent_core.h (the log, the
 * frame sender, the id table) and the accessor of their own state. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "guest/agent_core.h"
#include "guest/egress_int.h"
#include "guest/exec_int.h"
#include "guest/files_int.h"
#include "guest/ns_setup.h"
#include "guest/tree_int.h"
#include "proto/proto.h"

#ifndef IGN_VERSION
#define IGN_VERSION "0.1.0"
#endif

#define AGENT_MAX_IGNORED 64u          /* failed multi-frame requests remembered */

enum agent_mode {
  AGENT_MODE_FD, /* --serve-fd N: no setup, for tests and benchmarks */
  AGENT_MODE_NS, /* --ns: PID 1 of a namespace sandbox */
  AGENT_MODE_VM, /* PID 1 of a microVM, started by the kernel (vm_init.c) */
};

/* A failed multi-frame request: frames for ID are dropped until END_TYPE. */
struct agent_ignored {
  uint32_t id;
  uint8_t end_type;
};

struct agent {
  enum agent_mode mode;
  int chan;
  bool chan_ok;     /* false once the channel hit EOF or an error */
  int exit_status;  /* process exit status once the loop ends */
  int sigfd;
  struct proto_buf out;
  uint8_t chunk[PROTO_CHUNK]; /* scratch for output and file reads */
  struct agent_ignored ignored[AGENT_MAX_IGNORED];
  size_t n_ignored;
  bool setup_failed; /* the last SETUP (or HELLO's) failed: requests are refused */
  struct exec_state exec;
  struct files_state files;
  struct tree_state trees;
  struct egress_state egress;
};

/* agent.c */
/* SIGCHLD (and in fd mode the stop signals) to a->sigfd. */
int agent_signals_init(struct agent *a);
/* The event loop: serves a->chan until EOF or a fatal error, then ends every
 * command and closes the channel.  Returns the exit status.  main() and the
 * fuzz target call it. */
int agent_serve(struct agent *a);

/* args.c: the agent's command line. */
struct agent_options {
  enum agent_mode mode;
  int fd;
  bool egress; /* --serve-fd with --egress */
  struct ns_options ns;
};
/* Parses ARGV into *RET: 0, or -EINVAL with a line on stderr (--help and
 * --version print and exit, --probe-egress runs and exits). */
int agent_parse_args(int argc, char **argv, struct agent_options *ret);
void agent_usage(FILE *f);
/* agent.c: tries the egress capture in namespaces of our own: the exit
 * status. */
int agent_probe_egress(void);
