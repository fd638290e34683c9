/* nft_counters.h: the capture's refusal counters (docs/egress-design.md,
 * section (e)).  The capture's refusal rules (guest/egress_nl.c) carry a
 * comment each that names what they refuse; a dump of table inet
 * ign_egress's filter_out chain finds them by it and sums their counters.
 *
 * Two readers share this code: a vm's agent (and --serve-fd), which keeps
 * its capabilities and dumps on a socket of its own, and the server for an
 * ns sandbox, which dumps on the socket the agent opened before it gave up
 * every capability (sandbox/ns.c, guest/egress_nl.h AGENT_NS_COUNTERS_FD).  The
 * kernel answers nf_tables requests only when the sender has CAP_NET_ADMIN
 * over the socket's network namespace, and, for a message sent without a
 * destination address (as the dump is), the socket's opener had it too
 * (netlink_net_capable; NETLINK_SKB_DST skips the second check). */
#pragma once

#include <stddef.h>
#include <stdint.h>

#define NFT_EGRESS_TABLE "ign_egress"

/* What the refusal rules count: UDP other than DNS, ICMP and ICMPv6, the
 * rest. */
enum egress_refused_kind { EGRESS_REFUSED_UDP, EGRESS_REFUSED_ICMP, EGRESS_REFUSED_OTHER,
                           EGRESS_REFUSED_N };

/* The comment of a refusal rule of KIND, as nft stores one in
 * NFTA_RULE_USERDATA: a udata TLV {u8 type NFTNL_UDATA_RULE_COMMENT (0), u8
 * length, the string and its NUL}.  Its size, or 0 for an unknown kind. */
#define NFT_REFUSED_UDATA_MAX 16u
size_t nft_refused_udata(int kind, uint8_t out[NFT_REFUSED_UDATA_MAX]);

/* Dumps the refusal rules on FD, a NETLINK_NETFILTER socket in the
 * sandbox's network namespace, waiting up to TIMEOUT_MS for the kernel's
 * answer, and sums their packet counts into RET.  Answers left on FD by an
 * earlier dump that timed out are read and dropped first, and only the
 * answers to this dump's sequence number are taken: FD may be used again.
 * 0, or a negative errno with ERR saying what failed: -ENOENT, the rules
 * are gone (or there is no capture); -EPERM, the opener of FD or this
 * process lacks CAP_NET_ADMIN over its network namespace; -ETIMEDOUT. */
int nft_refused_dump(int fd, unsigned timeout_ms, uint64_t ret[EGRESS_REFUSED_N], char *err,
                     size_t err_size);
