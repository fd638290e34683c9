/* args.c: the agent's command line (the modes and options agent.c's header
 * comment lists), parsed into struct agent_options; every value checked
 * here, before any mode starts. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "common/util.h"
#include "guest/agent.h"

void agent_usage(FILE *f) {
  fprintf(f,
          "usage: ign-agent --serve-fd N [--egress]\n"
          "       ign-agent --ns --rootfs ABS_DIR [--rootfs-fd N]\n"
          "                 [--stage ABS_DIR --stage-inode DEV:INO | --stage-fd N]\n"
          "                 [--overlay-mb N] [--hostname NAME]\n"
          "       ign-agent --probe-egress\n"
          "Serves the ignition-mcp agent protocol (version %u) on a channel fd.\n",
          PROTO_VERSION);
}

static int parse_uint(const char *s, unsigned long max, unsigned long *ret) {
  char *end;
  errno = 0;
  unsigned long v = strtoul(s, &end, 10);
  if (errno || end == s || *end || s[0] == '-' || v > max)
    return -EINVAL;
  *ret = v;
  return 0;
}

/* "DEV:INO", two decimal numbers. */
static int parse_inode(const char *s, dev_t *ret_dev, ino_t *ret_ino) {
  char *end;
  errno = 0;
  unsigned long long dev = strtoull(s, &end, 10);
  if (errno || end == s || *end != ':' || s[0] == '-')
    return -EINVAL;
  const char *i = end + 1;
  unsigned long long ino = strtoull(i, &end, 10);
  if (errno || end == i || *end || i[0] == '-' || ino == 0)
    return -EINVAL;
  *ret_dev = (dev_t)dev;
  *ret_ino = (ino_t)ino;
  return 0;
}

int agent_parse_args(int argc, char **argv, struct agent_options *ret) {
  enum {
    OPT_SERVE_FD = 256,
    OPT_NS,
    OPT_ROOTFS,
    OPT_ROOTFS_FD,
    OPT_STAGE,
    OPT_STAGE_FD,
    OPT_STAGE_INODE,
    OPT_OVERLAY_MB,
    OPT_HOSTNAME,
    OPT_HELP,
    OPT_VERSION,
    OPT_EGRESS,
    OPT_PROBE_EGRESS,
  };
  static const struct option longopts[] = {
      {"serve-fd", required_argument, NULL, OPT_SERVE_FD},
      {"ns", no_argument, NULL, OPT_NS},
      {"rootfs", required_argument, NULL, OPT_ROOTFS},
      {"rootfs-fd", required_argument, NULL, OPT_ROOTFS_FD},
      {"stage", required_argument, NULL, OPT_STAGE},
      {"stage-fd", required_argument, NULL, OPT_STAGE_FD},
      {"stage-inode", required_argument, NULL, OPT_STAGE_INODE},
      {"overlay-mb", required_argument, NULL, OPT_OVERLAY_MB},
      {"hostname", required_argument, NULL, OPT_HOSTNAME},
      {"help", no_argument, NULL, OPT_HELP},
      {"version", no_argument, NULL, OPT_VERSION},
      {"egress", no_argument, NULL, OPT_EGRESS},
      {"probe-egress", no_argument, NULL, OPT_PROBE_EGRESS},
      {0},
  };
  struct agent_options o = {
      .mode = AGENT_MODE_FD,
      .fd = -1,
      .ns = {.rootfs_fd = -1, .stage_fd = -1, .overlay_mb = 1024, .hostname = "sandbox"},
  };
  bool ns = false;
  unsigned long v;
  int c;
  while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
    switch (c) {
    case OPT_SERVE_FD:
      if (parse_uint(optarg, INT_MAX, &v) < 0) {
        agent_log("--serve-fd wants a file descriptor number, got '%s'", optarg);
        return -EINVAL;
      }
      o.fd = (int)v;
      break;
    case OPT_NS:
      ns = true;
      break;
    case OPT_ROOTFS:
      o.ns.rootfs = optarg;
      break;
    case OPT_ROOTFS_FD:
      if (parse_uint(optarg, INT_MAX, &v) < 0 || v < 3) {
        agent_log("--rootfs-fd wants the number of an inherited mount fd (3 or more), got '%s'",
                  optarg);
        return -EINVAL;
      }
      o.ns.rootfs_fd = (int)v;
      break;
    case OPT_STAGE:
      o.ns.stage = optarg;
      break;
    case OPT_STAGE_FD:
      if (parse_uint(optarg, INT_MAX, &v) < 0 || v < 3 || v == AGENT_NS_STATE_FD) {
        agent_log("--stage-fd wants the number of an inherited mount fd (3 or more, not %d), got "
                  "'%s'",
                  AGENT_NS_STATE_FD, optarg);
        return -EINVAL;
      }
      o.ns.stage_fd = (int)v;
      break;
    case OPT_STAGE_INODE:
      if (parse_inode(optarg, &o.ns.stage_dev, &o.ns.stage_ino) < 0) {
        agent_log("--stage-inode wants the device and inode numbers of the stage's layer as "
                  "DEV:INO, got '%s'",
                  optarg);
        return -EINVAL;
      }
      break;
    case OPT_OVERLAY_MB:
      if (parse_uint(optarg, 1u << 20, &v) < 0 || v == 0) {
        agent_log("--overlay-mb wants a size in MiB (1 to 1048576), got '%s'", optarg);
        return -EINVAL;
      }
      o.ns.overlay_mb = (unsigned)v;
      break;
    case OPT_HOSTNAME:
      o.ns.hostname = optarg;
      break;
    case OPT_HELP:
      agent_usage(stdout);
      exit(0);
    case OPT_VERSION:
      printf("ign-agent %s (protocol %u)\n", IGN_VERSION, PROTO_VERSION);
      exit(0);
    case OPT_EGRESS:
      o.egress = true;
      break;
    case OPT_PROBE_EGRESS:
      exit(agent_probe_egress());
    default:
      return -EINVAL;
    }
  }
  if (optind != argc) {
    agent_log("unexpected argument '%s'", argv[optind]);
    return -EINVAL;
  }
  if (ns == (o.fd >= 0)) {
    agent_log("give exactly one of --serve-fd N and --ns");
    return -EINVAL;
  }
  if (ns && o.egress) {
    agent_log("--egress is for --serve-fd: --ns always captures the sandbox's traffic");
    return -EINVAL;
  }
  if (ns) {
    o.mode = AGENT_MODE_NS;
    if (!o.ns.rootfs) {
      agent_log("--ns needs --rootfs ABS_DIR");
      return -EINVAL;
    }
    if (o.ns.stage && o.ns.stage_fd >= 0) {
      agent_log("give at most one of --stage ABS_DIR and --stage-fd N");
      return -EINVAL;
    }
    if ((o.ns.stage != NULL) != (o.ns.stage_ino != 0)) {
      agent_log("--stage ABS_DIR and --stage-inode DEV:INO go together (the layer is bound by "
                "its name and must be the directory the server checked)");
      return -EINVAL;
    }
  }
  *ret = o;
  return 0;
}
