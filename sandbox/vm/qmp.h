/* qmp.h: a minimal, deadline-bounded QMP client (see qmp.c). */
#pragma once

#include <jansson.h>
#include <stdint.h>

struct qmp;

/* Connects (retrying until QEMU has created the socket), reads the greeting
 * and negotiates capabilities. */
int qmp_connect(const char *path, uint32_t timeout_ms, struct qmp **ret, char **ret_err);
/* The same over an already connected socket FD (taken). */
int qmp_open_fd(int fd, uint32_t timeout_ms, struct qmp **ret, char **ret_err);
/* Runs CMD with ARGS (stolen, may be NULL); *ret_result (may be NULL) gets
 * the "return" value.  -EIO with *ret_err for a QMP error. */
int qmp_command(struct qmp *q, const char *cmd, json_t *args, uint32_t timeout_ms,
                json_t **ret_result, char **ret_err);
/* Passes FD to QEMU under NAME (getfd + SCM_RIGHTS). */
int qmp_getfd(struct qmp *q, int fd, const char *name, uint32_t timeout_ms, char **ret_err);
/* Polls query-migrate until completed or failed. */
int qmp_wait_migration(struct qmp *q, uint32_t timeout_ms, char **ret_err);
void qmp_free(struct qmp *q);
