/* names_wild.c: the names a session looks up under its wildcard rules
 * (*.suffix), counted against IGN_MCP_EGRESS_WILDCARD_NAMES per rule, and
 * what a change of policy does to those counts (names_set_policy): a
 * suffix keeps its count for the whole session.  The broker thread's; it
 * changes them under synth_lock, which copies take (names.c). */
#include <errno.h>
#include <nettle/sha2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "egress/egress_int.h"

/* The rule NAME counts under: the first wildcard rule of E's policy that
 * admits it, when no rule names it exactly (an exact name is the
 * operator's choice, not the sandbox's); -1 otherwise. */
static long wild_rule(const struct egress *e, const char *name) {
  size_t len = strlen(name);
  long first = -1;
  for (size_t i = 0; i < e->pol.n; i++) {
    const struct egress_rule *r = &e->pol.rules[i];
    size_t sl = strlen(r->name);
    if (!r->wildcard && strcmp(r->name, name) == 0)
      return -1;
    if (r->wildcard && first < 0 && len > sl + 1 && name[len - sl - 1] == '.' &&
        memcmp(name + len - sl, r->name, sl) == 0)
      first = (long)i;
  }
  return first;
}

/* NAME's place in the set: a hash salted per session, so no name can be
 * made up to pass for one looked up before.  Never 0 (an empty slot). */
static uint64_t wild_hash(const struct egress *e, const char *name) {
  struct sha256_ctx c;
  uint8_t d[SHA256_DIGEST_SIZE];
  sha256_init(&c);
  sha256_update(&c, sizeof e->wild_salt, e->wild_salt);
  sha256_update(&c, strlen(name), (const uint8_t *)name);
  sha256_digest(&c, sizeof d, d);
  uint64_t h;
  memcpy(&h, d, sizeof h);
  return h ? h : 1;
}

/* The slot of H in E's set (wild_slots a power of two): where it is, or
 * the empty one where it goes. */
static uint32_t wild_slot(const struct egress *e, uint64_t h) {
  uint32_t mask = e->wild_slots - 1, i = (uint32_t)h & mask;
  while (e->wild_set[i] && e->wild_set[i] != h)
    i = (i + 1) & mask;
  return i;
}

static int wild_grow(struct egress *e) {
  uint32_t old_slots = e->wild_slots, slots = old_slots ? old_slots * 2 : 64;
  uint64_t *set = calloc(slots, sizeof *set), *old = e->wild_set;
  if (!set)
    return -ENOMEM;
  e->wild_set = set;
  e->wild_slots = slots;
  for (uint32_t i = 0; i < old_slots; i++)
    if (old[i])
      e->wild_set[wild_slot(e, old[i])] = old[i];
  free(old);
  return 0;
}

/* Whether E may look NAME up as far as the wildcard rules go: a name under
 * one is counted against IGN_MCP_EGRESS_WILDCARD_NAMES the first time (a
 * name asked again, of any type, costs nothing).  False with the reason
 * in WHY. */
bool names_wild_admit(struct egress *e, const char *name, char why[EGRESS_REASON_MAX]) {
  long rule = e->mode == EGRESS_MODE_ALLOW ? wild_rule(e, name) : -1;
  if (rule < 0)
    return true;
  /* Changes under synth_lock: egress_clone copies the set. */
  if (!e->wild_count) {
    uint32_t *count = calloc(e->pol.n, sizeof *count);
    uint8_t salt[sizeof e->wild_salt];
    if (!count || getrandom(salt, sizeof salt, 0) != sizeof salt) {
      free(count);
      snprintf(why, EGRESS_REASON_MAX, "cannot count the names under a wildcard rule");
      return false;
    }
    pthread_mutex_lock(&e->synth_lock);
    memcpy(e->wild_salt, salt, sizeof salt);
    e->wild_count = count;
    pthread_mutex_unlock(&e->synth_lock);
  }
  uint64_t h = wild_hash(e, name);
  if (e->wild_slots && e->wild_set[wild_slot(e, h)])
    return true;
  if (e->wild_count[rule] >= egress_cfg.wildcard_names) {
    snprintf(why, EGRESS_REASON_MAX,
             "over %u names under one wildcard rule (IGN_MCP_EGRESS_WILDCARD_NAMES)",
             egress_cfg.wildcard_names);
    return false;
  }
  pthread_mutex_lock(&e->synth_lock);
  bool room = (e->wild_n + 1) * 2 <= e->wild_slots || wild_grow(e) == 0;
  if (room) {
    e->wild_set[wild_slot(e, h)] = h;
    e->wild_n++;
    e->wild_count[rule]++;
  }
  pthread_mutex_unlock(&e->synth_lock);
  if (!room)
    snprintf(why, EGRESS_REASON_MAX, "out of memory");
  return room;
}

/* E's counts under its wildcard rules now, into its history (the most of
 * each suffix it ever had a rule for).  -ENOMEM. */
static int wild_hist_note(struct egress *e) {
  for (size_t i = 0; e->wild_count && i < e->pol.n; i++) {
    if (!e->pol.rules[i].wildcard)
      continue;
    struct wild_hist *h = NULL;
    for (size_t k = 0; k < e->n_wild_hist && !h; k++)
      if (strcmp(e->wild_hist[k].name, e->pol.rules[i].name) == 0)
        h = &e->wild_hist[k];
    if (!h) {
      struct wild_hist *m = realloc(e->wild_hist, (e->n_wild_hist + 1) * sizeof *m);
      if (!m)
        return -ENOMEM;
      e->wild_hist = m;
      h = &m[e->n_wild_hist++];
      snprintf(h->name, sizeof h->name, "%s", e->pol.rules[i].name);
      h->count = 0;
    }
    if (e->wild_count[i] > h->count)
      h->count = e->wild_count[i];
  }
  return 0;
}

/* The names counted under each wildcard rule of NEW: what the session
 * counted under the same suffix, now or under any earlier policy (a rule
 * dropped and given again goes on from its count).  NULL when E counted
 * none yet; -ENOMEM. */
static int wild_remap(struct egress *e, const struct egress_policy *new, uint32_t **ret) {
  *ret = NULL;
  if (!e->wild_count)
    return 0;
  if (wild_hist_note(e) < 0)
    return -ENOMEM;
  /* Never NULL once counting began: the salt was made with it. */
  uint32_t *count = calloc(new->n ? new->n : 1, sizeof *count);
  if (!count)
    return -ENOMEM;
  for (size_t j = 0; j < new->n; j++)
    for (size_t k = 0; new->rules[j].wildcard && k < e->n_wild_hist; k++)
      if (strcmp(e->wild_hist[k].name, new->rules[j].name) == 0)
        count[j] = e->wild_hist[k].count;
  *ret = count;
  return 0;
}

int names_set_policy(struct egress *e, enum egress_mode *mode_io, struct egress_policy *pol,
                     struct binding **bind, size_t *n_bind) {
  enum egress_mode mode = *mode_io;
  uint32_t *count;
  pthread_mutex_lock(&e->synth_lock);
  int r = wild_remap(e, pol, &count);
  if (r < 0) {
    pthread_mutex_unlock(&e->synth_lock);
    return r;
  }
  struct egress_policy old = e->pol;
  enum egress_mode old_mode = e->mode;
  uint32_t *old_count = e->wild_count;
  struct binding *old_bind = e->bind;
  size_t old_n = e->n_bind;
  e->mode = mode;
  e->pol = *pol;
  e->wild_count = count;
  e->bind = *bind;
  e->n_bind = *n_bind;
  pthread_mutex_unlock(&e->synth_lock);
  *pol = old;
  *mode_io = old_mode;
  *bind = old_bind;
  *n_bind = old_n;
  free(old_count);
  return 0;
}

int names_restore_wild(struct egress *e, const uint32_t *counts, size_t n) {
  if (e->mode != EGRESS_MODE_ALLOW || !e->pol.n)
    return 0;
  uint32_t *count = calloc(e->pol.n, sizeof *count);
  if (!count || getrandom(e->wild_salt, sizeof e->wild_salt, 0) != sizeof e->wild_salt) {
    free(count);
    return -ENOMEM;
  }
  e->wild_count = count;
  /* The names it was given addresses for are known again (asked again,
   * they cost nothing); each rule's count is at least what was saved (the
   * names that failed to resolve counted too). */
  for (uint32_t i = 0; i < e->n_synth; i++) {
    long rule = wild_rule(e, e->synth[i]);
    if (rule < 0)
      continue;
    uint64_t h = wild_hash(e, e->synth[i]);
    if ((e->wild_n + 1) * 2 > e->wild_slots && wild_grow(e) < 0)
      return -ENOMEM;
    if (!e->wild_set[wild_slot(e, h)]) {
      e->wild_set[wild_slot(e, h)] = h;
      e->wild_n++;
      count[rule]++;
    }
  }
  for (size_t i = 0; i < n && i < e->pol.n; i++)
    if (counts[i] > count[i])
      count[i] = counts[i];
  return 0;
}

void names_wild_free(struct egress *e) {
  free(e->wild_set);
  free(e->wild_count);
  free(e->wild_hist);
  e->wild_hist = NULL;
  e->n_wild_hist = 0;
  e->wild_set = NULL;
  e->wild_count = NULL;
  e->wild_slots = e->wild_n = 0;
}

int names_wild_copy(struct egress *dst, const struct egress *src) {
  if (src->n_wild_hist) {
    dst->wild_hist = malloc(src->n_wild_hist * sizeof *dst->wild_hist);
    if (!dst->wild_hist)
      return -ENOMEM;
    memcpy(dst->wild_hist, src->wild_hist, src->n_wild_hist * sizeof *dst->wild_hist);
    dst->n_wild_hist = src->n_wild_hist;
  }
  if (!src->wild_count)
    return 0;
  dst->wild_count = malloc((src->pol.n ? src->pol.n : 1) * sizeof *dst->wild_count);
  dst->wild_set = src->wild_slots ? malloc(src->wild_slots * sizeof *dst->wild_set) : NULL;
  if (!dst->wild_count || (src->wild_slots && !dst->wild_set))
    return -ENOMEM;
  memcpy(dst->wild_count, src->wild_count, src->pol.n * sizeof *dst->wild_count);
  if (src->wild_slots)
    memcpy(dst->wild_set, src->wild_set, src->wild_slots * sizeof *dst->wild_set);
  memcpy(dst->wild_salt, src->wild_salt, sizeof dst->wild_salt);
  dst->wild_slots = src->wild_slots;
  dst->wild_n = src->wild_n;
  return 0;
}
