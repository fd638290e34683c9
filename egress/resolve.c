/* resolve.c: names resolved on the host for the broker.
 *
 * getaddrinfo blocks for as long as the host's resolver likes, so it runs
 * in a pool of workers fed by a queue of RESOLVE_QUEUE_MAX jobs; the broker
 * never waits for one (it answers SERVFAIL after EGRESS_RESOLVE_MS and lets
 * the worker finish alone).  getaddrinfo keeps nsswitch and /etc/hosts as
 * the operator expects.
 *
 * The pool is shared by every session, and a sandbox chooses the names: a
 * program asking for names whose servers never answer could hold every
 * worker and so every other session's resolutions.  Hence:
 *   - a session has at most EGRESS_RESOLVE_JOBS_MAX jobs out (queued or
 *     running, a job it gave up on included while a worker is stuck in it);
 *   - a job given up on before a worker took it leaves the queue;
 *   - a general worker takes the queued job of the session with the fewest
 *     jobs running, and none of a session running RESOLVE_SESSION_RUNNING
 *     already: one session holds at most that many of the general workers;
 *   - one more worker takes only connect-time resolutions (for_stream), so
 *     a flood of DNS queries never keeps a connect waiting for a worker;
 *   - names the hosts file pins are answered on the broker thread
 *     (resolve_hosts_answer), without the pool.
 * (names.c adds the cache of failures, so asking again costs no job.)
 *
 * The operator's hosts file (IGN_MCP_EGRESS_HOSTS, hosts(5) format) is
 * consulted first: it pins names for tests, or for a site.  It is read at
 * startup and again when its mtime changes (each read logged), so a change
 * takes effect at the next resolution: the connect-time one included. */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include "common/log.h"
#include "common/util.h"
#include "egress/egress_int.h"

#define RESOLVE_THREADS 4u         /* general workers; one more for connects */
#define RESOLVE_SESSION_RUNNING 2u /* general workers one session may hold */
#define RESOLVE_QUEUE_MAX 256u
#define HOSTS_MAX_BYTES (1u << 20) /* a bigger hosts file is refused */
#define HOSTS_LINE_MAX 4096u       /* a longer line is dropped (logged) */
#define HOSTS_MAX_ENTRIES 16384u
#define STOP_WAIT_MS 1000u

struct resolve_quota {
  unsigned refs;               /* the session's and its jobs' */
  unsigned out, running;
};

struct host_entry {
  char name[EGRESS_NAME_BUF];
  int family;
  uint8_t addr[16];
};

static struct {
  pthread_mutex_t lock;
  pthread_cond_t work, gone;
  bool started, stop;
  unsigned live;               /* workers still running */
  struct resolve_job *q_head, *q_tail, *done;
  size_t queued;
  void (*wake)(void);
  /* The hosts file, under hosts_lock. */
  pthread_mutex_t hosts_lock;
  char *hosts_path;
  struct timespec hosts_mtime;
  off_t hosts_size;
  bool hosts_read;             /* read at least once (ok or not) */
  struct host_entry *hosts;
  size_t n_hosts;
} rs = {.lock = PTHREAD_MUTEX_INITIALIZER, .work = PTHREAD_COND_INITIALIZER,
        .gone = PTHREAD_COND_INITIALIZER, .hosts_lock = PTHREAD_MUTEX_INITIALIZER};

/* ---- the hosts file ---- */

/* One line "ADDR NAME [ALIAS...] [# comment]" into the table. */
static void hosts_line(char *line, struct host_entry **tab, size_t *n, size_t *cap) {
  char *hash = strchr(line, '#');
  if (hash)
    *hash = '\0';
  char *save = NULL, *addr = strtok_r(line, " \t\r\n", &save);
  if (!addr)
    return;
  uint8_t a[16];
  int family = inet_pton(AF_INET, addr, a) == 1 ? AF_INET
               : inet_pton(AF_INET6, addr, a) == 1 ? AF_INET6 : 0;
  if (!family)
    return;
  for (char *name; (name = strtok_r(NULL, " \t\r\n", &save));) {
    char clean[EGRESS_NAME_BUF];
    if (!egress_name_sanitize(name, strlen(name), clean) || *n >= HOSTS_MAX_ENTRIES)
      continue;
    if (*n == *cap) {
      size_t nc = *cap ? *cap * 2 : 32;
      struct host_entry *t = realloc(*tab, nc * sizeof *t);
      if (!t)
        return;
      *tab = t;
      *cap = nc;
    }
    struct host_entry *h = &(*tab)[(*n)++];
    snprintf(h->name, sizeof h->name, "%s", clean);
    h->family = family;
    memcpy(h->addr, a, family == AF_INET ? 4 : 16);
  }
}

/* Distinct names in the table. */
static size_t hosts_names(void) {
  size_t names = 0;
  for (size_t i = 0; i < rs.n_hosts; i++) {
    size_t j = 0;
    while (j < i && strcmp(rs.hosts[j].name, rs.hosts[i].name) != 0)
      j++;
    names += j == i;
  }
  return names;
}

/* Reads the file again when it changed; under hosts_lock. */
static void hosts_refresh_locked(void) {
  if (!rs.hosts_path)
    return;
  struct stat st;
  bool ok = stat(rs.hosts_path, &st) == 0;
  if (rs.hosts_read && ok && st.st_mtim.tv_sec == rs.hosts_mtime.tv_sec &&
      st.st_mtim.tv_nsec == rs.hosts_mtime.tv_nsec && st.st_size == rs.hosts_size)
    return;
  if (rs.hosts_read && !ok && !rs.hosts)
    return; /* still missing: said once */
  rs.hosts_read = true;
  free(rs.hosts);
  rs.hosts = NULL;
  rs.n_hosts = 0;
  if (!ok) {
    log_warn("egress: the hosts file %s cannot be read (%s): names resolve without it",
             rs.hosts_path, strerror(errno));
    return;
  }
  rs.hosts_mtime = st.st_mtim;
  rs.hosts_size = st.st_size;
  if (st.st_size > (off_t)HOSTS_MAX_BYTES) {
    log_warn("egress: the hosts file %s is over %u bytes and is ignored", rs.hosts_path,
             HOSTS_MAX_BYTES);
    return;
  }
  _cleanup_fclose_ FILE *f = fopen(rs.hosts_path, "re");
  if (!f) {
    log_warn("egress: the hosts file %s cannot be read (%s): names resolve without it",
             rs.hosts_path, strerror(errno));
    return;
  }
  /* Whole lines: a tail read as a line of its own could pin a name. */
  size_t cap = 0, line_cap = 0, dropped = 0;
  _cleanup_free_ char *line = NULL;
  for (ssize_t n; (n = getline(&line, &line_cap, f)) >= 0;) {
    if ((size_t)n > HOSTS_LINE_MAX)
      dropped++;
    else
      hosts_line(line, &rs.hosts, &rs.n_hosts, &cap);
  }
  if (dropped)
    log_warn("egress: the hosts file %s has %zu line%s over %u bytes; they are ignored",
             rs.hosts_path, dropped, dropped == 1 ? "" : "s", HOSTS_LINE_MAX);
  log_info("egress: hosts file %s read: %zu names", rs.hosts_path, hosts_names());
}

/* The hosts file's addresses for J's name; whether it knows the name. */
static bool hosts_lookup(struct resolve_job *j) {
  pthread_mutex_lock(&rs.hosts_lock);
  hosts_refresh_locked();
  bool found = false;
  for (size_t i = 0; i < rs.n_hosts; i++) {
    if (strcmp(rs.hosts[i].name, j->name) != 0)
      continue;
    found = true;
    if (j->n < EGRESS_ADDRS_MAX) {
      j->family[j->n] = rs.hosts[i].family;
      memcpy(j->addr[j->n], rs.hosts[i].addr, 16);
      j->n++;
    }
  }
  pthread_mutex_unlock(&rs.hosts_lock);
  return found;
}

bool resolve_hosts_answer(struct resolve_job *j) {
  j->n = 0;
  j->gai_err = 0;
  j->from_hosts = hosts_lookup(j);
  return j->from_hosts;
}

long resolve_hosts_count(void) {
  pthread_mutex_lock(&rs.hosts_lock);
  hosts_refresh_locked();
  long n = rs.hosts_path ? (long)hosts_names() : -1;
  pthread_mutex_unlock(&rs.hosts_lock);
  return n;
}

/* ---- the pool ---- */

static void resolve_one(struct resolve_job *j) {
  if (resolve_hosts_answer(j))
    return; /* pinned since the broker asked */
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_ADDRCONFIG}, *res = NULL;
  int r = getaddrinfo(j->name, NULL, &hints, &res);
  if (r) {
    j->gai_err = r;
    return;
  }
  for (struct addrinfo *a = res; a && j->n < EGRESS_ADDRS_MAX; a = a->ai_next) {
    const void *p = a->ai_family == AF_INET ? (const void *)&((struct sockaddr_in *)a->ai_addr)->sin_addr
                    : a->ai_family == AF_INET6 ? (const void *)&((struct sockaddr_in6 *)a->ai_addr)->sin6_addr
                    : NULL;
    if (!p)
      continue;
    size_t len = a->ai_family == AF_INET ? 4 : 16, k = 0;
    while (k < j->n && !(j->family[k] == a->ai_family && memcmp(j->addr[k], p, len) == 0))
      k++;
    if (k < j->n)
      continue; /* the same address for another socket type */
    j->family[j->n] = a->ai_family;
    memset(j->addr[j->n], 0, 16);
    memcpy(j->addr[j->n], p, len);
    j->n++;
  }
  freeaddrinfo(res);
  if (!j->n)
    j->gai_err = EAI_NONAME;
}

/* Under rs.lock. */
static void quota_put_locked(struct resolve_quota *q) {
  if (q && !--q->refs)
    free(q);
}

static void queue_unlink_locked(struct resolve_job *j) {
  struct resolve_job *prev = NULL;
  for (struct resolve_job *x = rs.q_head; x; prev = x, x = x->next)
    if (x == j) {
      if (prev)
        prev->next = j->next;
      else
        rs.q_head = j->next;
      if (rs.q_tail == j)
        rs.q_tail = prev;
      rs.queued--;
      return;
    }
}

/* The job a worker takes next (out of the queue), or NULL: see the top
 * comment.  FOR_CONNECTS: the worker kept for connect-time resolutions. */
static struct resolve_job *pick_locked(bool for_connects) {
  struct resolve_job *best = NULL;
  for (struct resolve_job *j = rs.q_head; j; j = j->next) {
    if (for_connects ? !j->for_stream : j->quota->running >= RESOLVE_SESSION_RUNNING)
      continue;
    if (!best || j->quota->running < best->quota->running)
      best = j; /* the first of the least busy session: the oldest */
  }
  if (best)
    queue_unlink_locked(best);
  return best;
}

static void *worker_main(void *arg) {
  bool for_connects = arg != NULL;
  pthread_mutex_lock(&rs.lock);
  for (;;) {
    struct resolve_job *j = NULL;
    while (!rs.stop && !(j = pick_locked(for_connects)))
      pthread_cond_wait(&rs.work, &rs.lock);
    if (!j)
      break; /* stopping */
    j->state = JOB_RUNNING;
    j->started_ms = mono_ms();
    j->quota->running++;
    pthread_mutex_unlock(&rs.lock);
    resolve_one(j);
    pthread_mutex_lock(&rs.lock);
    j->quota->running--;
    j->quota->out--;
    quota_put_locked(j->quota);
    j->quota = NULL;
    j->state = JOB_DONE;
    j->next = rs.done;
    rs.done = j;
    /* The session runs one fewer: a job passed over may go now. */
    pthread_cond_broadcast(&rs.work);
    void (*wake)(void) = rs.wake;
    pthread_mutex_unlock(&rs.lock);
    if (wake)
      wake();
    pthread_mutex_lock(&rs.lock);
  }
  rs.live--;
  pthread_cond_broadcast(&rs.gone);
  pthread_mutex_unlock(&rs.lock);
  return NULL;
}

int resolve_init(const char *hosts_file, void (*wake)(void), char **ret_err) {
  pthread_mutex_lock(&rs.hosts_lock);
  free(rs.hosts_path);
  free(rs.hosts);
  rs.hosts = NULL;
  rs.n_hosts = 0;
  rs.hosts_read = false;
  rs.hosts_path = hosts_file && *hosts_file ? strdup(hosts_file) : NULL;
  hosts_refresh_locked();
  pthread_mutex_unlock(&rs.hosts_lock);
  pthread_mutex_lock(&rs.lock);
  rs.stop = false;
  rs.wake = wake;
  /* Worker 0 is the connects' own. */
  for (unsigned i = 0; i < RESOLVE_THREADS + 1; i++) {
    pthread_t t;
    int r = pthread_create(&t, NULL, worker_main, i == 0 ? (void *)1 : NULL);
    if (r) {
      pthread_mutex_unlock(&rs.lock);
      resolve_shutdown();
      *ret_err = xasprintf("cannot start the egress resolver: %s", strerror(r));
      return -r;
    }
    pthread_detach(t); /* a worker stuck in getaddrinfo is not waited for */
    rs.live++;
  }
  rs.started = true;
  pthread_mutex_unlock(&rs.lock);
  return 0;
}

/* Under rs.lock. */
static void jobs_free_locked(struct resolve_job *j) {
  while (j) {
    struct resolve_job *next = j->next;
    if (j->quota) {
      j->quota->out--;
      quota_put_locked(j->quota);
    }
    free(j);
    j = next;
  }
}

void resolve_shutdown(void) {
  pthread_mutex_lock(&rs.lock);
  rs.stop = true;
  rs.wake = NULL;
  pthread_cond_broadcast(&rs.work);
  struct timespec until = timespec_in(CLOCK_REALTIME, STOP_WAIT_MS);
  while (rs.live)
    if (pthread_cond_timedwait(&rs.gone, &rs.lock, &until) == ETIMEDOUT)
      break;
  jobs_free_locked(rs.q_head);
  rs.q_head = rs.q_tail = NULL;
  rs.queued = 0;
  if (!rs.live) {
    jobs_free_locked(rs.done);
    rs.done = NULL;
  } /* else a worker still owns its job and will put it on `done` */
  rs.started = false;
  pthread_mutex_unlock(&rs.lock);
  pthread_mutex_lock(&rs.hosts_lock);
  free(rs.hosts);
  rs.hosts = NULL;
  rs.n_hosts = 0;
  free(rs.hosts_path);
  rs.hosts_path = NULL;
  pthread_mutex_unlock(&rs.hosts_lock);
}

struct resolve_quota *resolve_quota_new(void) {
  struct resolve_quota *q = calloc(1, sizeof *q);
  if (q)
    q->refs = 1;
  return q;
}

void resolve_quota_put(struct resolve_quota *q) {
  pthread_mutex_lock(&rs.lock);
  quota_put_locked(q);
  pthread_mutex_unlock(&rs.lock);
}

int resolve_submit(struct resolve_job *j, struct resolve_quota *q) {
  pthread_mutex_lock(&rs.lock);
  int r = !rs.started || rs.stop || rs.queued >= RESOLVE_QUEUE_MAX ? -EAGAIN
          : q->out >= EGRESS_RESOLVE_JOBS_MAX                    ? -EBUSY
                                                                 : 0;
  if (r < 0) {
    pthread_mutex_unlock(&rs.lock);
    return r;
  }
  j->quota = q;
  q->refs++;
  q->out++;
  j->state = JOB_QUEUED;
  j->next = NULL;
  if (rs.q_tail)
    rs.q_tail->next = j;
  else
    rs.q_head = j;
  rs.q_tail = j;
  rs.queued++;
  /* Every worker looks: the one woken might be one that may not take it. */
  pthread_cond_broadcast(&rs.work);
  pthread_mutex_unlock(&rs.lock);
  return 0;
}

bool resolve_cancel(struct resolve_job *j, uint64_t *ret_ran_ms) {
  pthread_mutex_lock(&rs.lock);
  bool queued = j->state == JOB_QUEUED;
  *ret_ran_ms = j->state == JOB_RUNNING ? mono_ms() - j->started_ms : 0;
  if (queued) {
    queue_unlink_locked(j);
    j->next = NULL;
    jobs_free_locked(j);
  }
  pthread_mutex_unlock(&rs.lock);
  return queued;
}

struct resolve_job *resolve_take_done(void) {
  pthread_mutex_lock(&rs.lock);
  struct resolve_job *d = rs.done;
  rs.done = NULL;
  pthread_mutex_unlock(&rs.lock);
  return d;
}
