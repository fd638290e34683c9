/* doctor_int.h: what the pieces of `ignition-mcp doctor` share: a check's
 * status and record, the report checks are added to, and the checks that
 * run_checks (doctor.c) calls in order: the install's (doctor_install.c),
 * the host's (doctor_host.c) and the trial sessions (doctor_trial.c).
 * Private to mcp/doctor*.c. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>

enum status { ST_OK, ST_WARN, ST_MISSING, ST_FAIL };

/* Which backend a check matters to. */
enum { FOR_VM = 1, FOR_NS = 2 };

struct check {
  unsigned for_backends;
  const char *name;
  enum status status;
  char *found;
  char *fix;                /* NULL when there is nothing to do */
};

#define MAX_CHECKS 24

struct report {
  struct check c[MAX_CHECKS];
  size_t n;
  bool vm_ready, ns_ready;
  const char *accel;        /* what microVMs would run under, or NULL */
  char *accel_why;          /* why not KVM, when not */
  bool vm_tried;            /* a trial session ran (see doctor_check_session) */
};

/* Takes FOUND and FIX (either may be NULL). */
static inline void add(struct report *r, unsigned for_backends, const char *name,
                       enum status st, char *found, char *fix) {
  if (r->n == MAX_CHECKS) {
    free(found);
    free(fix);
    return;
  }
  r->c[r->n++] = (struct check){.for_backends = for_backends, .name = name, .status = st,
                                .found = found, .fix = fix};
}

/* How long doctor lets a helper program run (proc_run_capture). */
#define DOCTOR_RUN_MS 10000

/* ---- doctor_install.c: what is built and installed ---- */

void doctor_check_qemu(struct report *r);
/* One data file of the vm backend (VAR overrides PATH): whether it is there. */
bool doctor_check_vm_file(struct report *r, const char *label, const char *path, const char *var);
bool doctor_check_vm_image(struct report *r);
void doctor_check_store(struct report *r);
/* INPUTS_OK: QEMU and the vm backend's images are there. */
void doctor_check_base(struct report *r, bool inputs_ok);
void doctor_check_agent(struct report *r);
void doctor_check_rootfs(struct report *r);

/* ---- doctor_host.c: this host's kernel and settings ---- */

/* Sets r->accel and r->accel_why. */
void doctor_check_kvm(struct report *r);
void doctor_check_landlock(struct report *r);
void doctor_check_namespaces(struct report *r);
void doctor_check_cgroups(struct report *r);
void doctor_check_seccomp(struct report *r);
void doctor_check_egress(struct report *r);

/* ---- doctor_trial.c: the trial sessions ---- */

/* PARTS_OK: the agent, the rootfs and the namespaces checks passed. */
void doctor_check_sandbox(struct report *r, bool parts_ok);
/* WANTED: the configured backend may be vm; sets r->vm_tried. */
void doctor_check_session(struct report *r, bool wanted);
