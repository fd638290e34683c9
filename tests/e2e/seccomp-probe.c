/* seccomp-probe.c: calls every entry of the ns sandbox's seccomp deny list
 * (guest/confine.h) with its probe arguments and prints one line per entry:
 *
 *     <syscall>[(<arguments>)] <errno the filter answers> <errno got>
 *
 * e.g. "socket(AF_VSOCK) EPERM EPERM"; "OK" when the call succeeded.  The
 * probe arguments make every call fail harmlessly where the filter lets it
 * through, so running this outside a sandbox does nothing either.
 *
 * "seccomp-probe i386" and "seccomp-probe x32" make one getpid() through the
 * other x86 syscall ABIs, which the filter does not know: it must kill the
 * process (SIGSYS) rather than let it through with numbers of its own.
 * isolation.test.mjs builds it (static, with the host's compiler), writes it
 * into a session and runs it there. */
#include <stdio.h>
#include <string.h>

#include "guest/confine.h"

static const char *errname(int err) {
  if (err == 0)
    return "OK";
  const char *s = strerrorname_np(err);
  return s ? s : "E?";
}

static int other_abi(const char *abi) {
#if defined(__x86_64__)
  long rc;
  if (strcmp(abi, "i386") == 0)
    __asm__ volatile("int $0x80" : "=a"(rc) : "a"(20L /* getpid */) : "memory");
  else if (strcmp(abi, "x32") == 0)
    rc = syscall(0x40000000L | __NR_getpid);
  else
    return 2;
  printf("survived the %s syscall (%ld)\n", abi, rc);
  return 0;
#else
  printf("no %s ABI on this architecture\n", abi);
  return 3;
#endif
}

int main(int argc, char **argv) {
  if (argc == 2)
    return other_abi(argv[1]);
  struct confine_rule rules[CONFINE_MAX_RULES];
  size_t n = confine_rules(rules, CONFINE_MAX_RULES);
  if (n > CONFINE_MAX_RULES) {
    fprintf(stderr, "seccomp-probe: %zu rules, over CONFINE_MAX_RULES\n", n);
    return 2;
  }
  /* No controlling terminal: vhangup's probe must not hang one up. */
  setsid();
  for (size_t i = 0; i < n; i++) {
    const struct confine_rule *r = &rules[i];
    int got = confine_probe(r);
    printf("%s%s%s%s %s %s\n", r->name, r->what ? "(" : "", r->what ? r->what : "",
           r->what ? ")" : "", errname(r->err), errname(got));
  }
  return 0;
}
