/* files_int.h: the file transfers' state (files.c) and what the loop
 * (agent.c) calls: WRITE / DATA / DATA_END / READ, and the shutdown. */
#pragma once

#include <limits.h>
#include <stdbool.h>
#include <stdint.h>

#include "guest/agent_core.h"

#define FILES_MAX_WRITES 16u           /* WRITE requests open at once */
#define FILES_MAX_READ (64u << 20)     /* bytes per READ */

struct file_write {
  bool used;
  uint32_t id;
  int fd;
  uint64_t size, received;
  char path[PATH_MAX];
  char tmp[PATH_MAX];
};

struct files_state {
  struct file_write writes[FILES_MAX_WRITES];
};

/* agent.c: the agent's one files_state. */
struct files_state *agent_files(struct agent *a);

void files_init(struct files_state *f);
void files_handle(struct agent *a, const struct proto_header *h, const uint8_t *payload);
bool files_id_busy(const struct files_state *f, uint32_t id);
void files_shutdown(struct files_state *f);
