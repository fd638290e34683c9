/* egress_nl.h: the capture of a sandbox's traffic (egress_nl.c): the
 * nftables rules and routes that send it to the agent's listeners
 * (egress.c), the refusal counters, and the socket an ns sandbox's agent
 * keeps for the server to read them on. */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "common/nft_counters.h"

/* As PID 1 of a sandbox, with CAP_NET_ADMIN over its network namespace and
 * lo up: the nftables ruleset (table inet ign_egress, docs/egress-design.md
 * section (a)) that sends every TCP connection to a non-loopback address to
 * EGRESS_TCP_PORT and every DNS query (UDP and TCP port 53, any server) to
 * EGRESS_DNS_PORT, and refuses other UDP and everything else; then the
 * default routes through lo (v4 with source 127.0.0.1, v6).  Raw netlink,
 * no library.  0, or a negative errno with ERR (ERR_SIZE bytes) saying what
 * failed; on failure no route was added, so the sandbox has no way out. */
#define EGRESS_TCP_PORT 15001
#define EGRESS_DNS_PORT 15353
int egress_capture_setup(char *err, size_t err_size);
/* The packets the capture's refusal rules counted since it was set up
 * (EGRESS_STATS), by enum egress_refused_kind (common/nft_counters.h): UDP
 * other than DNS, ICMP and ICMPv6, the rest.  Reads them by a dump of table
 * inet ign_egress (NFT_MSG_GETRULE) on a socket of its own, which needs
 * CAP_NET_ADMIN over the network namespace: a vm's agent and --serve-fd.
 * 0, or a negative errno with ERR saying what failed (-ENOENT: the rules
 * are gone). */
int egress_refused_read(uint64_t ret[EGRESS_REFUSED_N], char *err, size_t err_size);
/* An ns sandbox's agent gives up every capability (confine.c), and the
 * kernel answers nf_tables requests, dumps too, only when both the socket's
 * opener and its sender hold CAP_NET_ADMIN over the network namespace
 * (netlink_net_capable).  So before the drop the agent opens a
 * NETLINK_NETFILTER socket (close-on-exec) and keeps it on this fd without
 * ever using it; the server takes a copy with pidfd_getfd once the sandbox
 * is ready and dumps the counters on it itself (sandbox/ns.c): it opened
 * as the capable agent, and the server sends as root, or as the user who
 * owns the sandbox's user namespace.  Left open in the agent it is
 * harmless: after the drop the agent lacks the capability, so the kernel
 * refuses what it would send; no command inherits it, and the agent is not
 * dumpable, so no process of the sandbox can take it. */
#define AGENT_NS_COUNTERS_FD 7
/* Opens that socket on AGENT_NS_COUNTERS_FD (which must be free).  0, or a
 * negative errno with ERR saying what failed. */
int egress_counters_keep_socket(char *err, size_t err_size);
