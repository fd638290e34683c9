/* ca.c: the certificate authority the broker signs its own certificates
 * with when it terminates a sandbox's TLS (intercept.c), and the contexts
 * of both ends of such a connection.
 *
 * The CA is the store's: <IGN_MCP_STORE>/egress-ca/ca.key (0600) and
 * ca.pem, made once (under an flock of the directory, so servers sharing a
 * store agree) and made again within 30 days of its end.  Its key never
 * enters a sandbox: a sandbox gets the certificate, in its trust store.  A
 * leaf certificate per host name is minted on first use (P-256, 7 days,
 * the name as its only subjectAltName) and kept (LEAF_MAX names).  The
 * real server is verified against the host's own trust store, plus
 * IGN_MCP_EGRESS_CA when set.
 *
 * OpenSSL (Debian's libssl): no certificate or TLS code is written here,
 * only the choices (curve, lifetimes, extensions). */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include "common/fs.h"
#include "common/log.h"
#include "common/util.h"
#include "egress/egress_int.h"

#define CA_DAYS 365
#define CA_RENEW_DAYS 30
#define LEAF_SECS (7 * 86400)
#define LEAF_MAX 256u

static struct {
  pthread_mutex_t lock;        /* the leaves */
  EVP_PKEY *key;               /* the CA's */
  X509 *cert;
  char *pem;
  EVP_PKEY *leaf_key;          /* every leaf's: one key per process */
  SSL_CTX *client;             /* toward the real servers */
  SSL_CTX *server;             /* toward the sandboxes */
  struct leaf {
    char name[EGRESS_NAME_BUF];
    X509 *cert;
    time_t until;
    uint64_t used;
  } leaves[LEAF_MAX];
  uint64_t uses;
  /* Set once everything above is: ca_pem() answers only then. */
  _Atomic bool ready;
  /* Where ca_ensure makes it (egress_init's settings). */
  pthread_mutex_t init_lock;
  char *dir, *extra;
} C = {.lock = PTHREAD_MUTEX_INITIALIZER, .init_lock = PTHREAD_MUTEX_INITIALIZER};

/* OpenSSL's first queued error as text (into BUF). */
static const char *ssl_why(char *buf, size_t n) {
  unsigned long e = ERR_get_error();
  if (!e)
    snprintf(buf, n, "(no reason given)");
  else
    ERR_error_string_n(e, buf, n);
  ERR_clear_error();
  return buf;
}

static int add_ext(X509 *cert, X509 *issuer, int nid, const char *value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, NULL, NULL, 0);
  X509_EXTENSION *ext = X509V3_EXT_conf_nid(NULL, &ctx, nid, value);
  if (!ext)
    return -1;
  int r = X509_add_ext(cert, ext, -1) ? 0 : -1;
  X509_EXTENSION_free(ext);
  return r;
}

static int random_serial(X509 *cert) {
  uint8_t b[16];
  if (getrandom(b, sizeof b, 0) != sizeof b)
    return -1;
  b[0] &= 0x7f; /* positive */
  BIGNUM *bn = BN_bin2bn(b, sizeof b, NULL);
  int r = bn && BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(cert)) ? 0 : -1;
  BN_free(bn);
  return r;
}

/* A certificate for KEY named CN, valid from an hour ago for SECS,
 * signed by ISSUER/ISSUER_KEY (NULL: itself). */
static X509 *make_cert(EVP_PKEY *key, const char *cn, long secs, X509 *issuer,
                       EVP_PKEY *issuer_key) {
  X509 *c = X509_new();
  if (!c)
    return NULL;
  X509_NAME *name = X509_NAME_new();
  bool ok = name && X509_set_version(c, 2) && random_serial(c) == 0 &&
            X509_gmtime_adj(X509_getm_notBefore(c), -3600) &&
            X509_gmtime_adj(X509_getm_notAfter(c), secs) && X509_set_pubkey(c, key) &&
            X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_UTF8, (const unsigned char *)cn, -1,
                                       -1, 0) &&
            X509_set_subject_name(c, name) &&
            X509_set_issuer_name(c, issuer ? X509_get_subject_name(issuer) : name);
  X509_NAME_free(name);
  X509 *signer = issuer ? issuer : c;
  if (ok && !issuer)
    ok = add_ext(c, signer, NID_basic_constraints, "critical,CA:TRUE,pathlen:0") == 0 &&
         add_ext(c, signer, NID_key_usage, "critical,keyCertSign,cRLSign") == 0 &&
         add_ext(c, signer, NID_subject_key_identifier, "hash") == 0;
  if (ok && issuer) {
    char san[EGRESS_NAME_BUF + 8];
    snprintf(san, sizeof san, "DNS:%s", cn);
    ok = add_ext(c, signer, NID_basic_constraints, "critical,CA:FALSE") == 0 &&
         add_ext(c, signer, NID_key_usage, "critical,digitalSignature") == 0 &&
         add_ext(c, signer, NID_ext_key_usage, "serverAuth") == 0 &&
         add_ext(c, signer, NID_subject_alt_name, san) == 0 &&
         add_ext(c, signer, NID_authority_key_identifier, "keyid:always") == 0;
  }
  if (ok)
    ok = X509_sign(c, issuer_key ? issuer_key : key, EVP_sha256()) > 0;
  if (!ok) {
    X509_free(c);
    return NULL;
  }
  return c;
}

/* PATH (a file of DIRFD) as the euid's regular file, not readable by
 * others: its contents (malloc'd, NUL-terminated) or NULL, errno set. */
static char *read_private(int dirfd, const char *path, bool secret, char **ret_err) {
  int fd = openat(dirfd, path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0)
    return NULL;
  struct stat st;
  char *buf = NULL;
  if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
      (secret && (st.st_mode & 077)) || st.st_size > 65536) {
    *ret_err = xasprintf("%s is not a regular file of this user%s, or too big", path,
                         secret ? " that only it can read" : "");
    close(fd);
    errno = EPERM;
    return NULL;
  }
  buf = calloc(1, (size_t)st.st_size + 1);
  if (buf && read(fd, buf, (size_t)st.st_size) != st.st_size) {
    free(buf);
    buf = NULL;
    errno = EIO;
  }
  close(fd);
  return buf;
}

static int write_private(int dirfd, const char *path, const char *data, mode_t mode) {
  char tmp[64];
  snprintf(tmp, sizeof tmp, ".%s.%d", path, getpid());
  int fd = openat(dirfd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0)
    return -errno;
  size_t n = strlen(data);
  int r = write(fd, data, n) == (ssize_t)n && fsync(fd) == 0 ? 0 : -EIO;
  close(fd);
  if (r == 0 && renameat(dirfd, tmp, dirfd, path) < 0)
    r = -errno;
  if (r < 0)
    unlinkat(dirfd, tmp, 0);
  return r;
}

static char *pem_of_cert(X509 *c) {
  BIO *b = BIO_new(BIO_s_mem());
  char *out = NULL;
  if (b && PEM_write_bio_X509(b, c)) {
    char *p;
    long n = BIO_get_mem_data(b, &p);
    out = strndup(p, (size_t)n);
  }
  BIO_free(b);
  return out;
}

static char *pem_of_key(EVP_PKEY *k) {
  BIO *b = BIO_new(BIO_s_mem());
  char *out = NULL;
  if (b && PEM_write_bio_PrivateKey(b, k, NULL, NULL, 0, NULL, NULL)) {
    char *p;
    long n = BIO_get_mem_data(b, &p);
    out = strndup(p, (size_t)n);
  }
  BIO_free(b);
  return out;
}

/* The CA of DIRFD if there is a whole one, not near its end: 1, 0 (none:
 * make one), or -errno with *RET_ERR. */
static int load_ca(int dirfd, char **ret_err) {
  _cleanup_free_ char *key = read_private(dirfd, "ca.key", true, ret_err);
  if (!key)
    return *ret_err ? -EPERM : errno == ENOENT ? 0 : -errno;
  _cleanup_free_ char *pem = read_private(dirfd, "ca.pem", false, ret_err);
  if (!pem)
    return *ret_err ? -EPERM : 0;
  BIO *kb = BIO_new_mem_buf(key, -1), *cb = BIO_new_mem_buf(pem, -1);
  EVP_PKEY *k = kb ? PEM_read_bio_PrivateKey(kb, NULL, NULL, NULL) : NULL;
  X509 *c = cb ? PEM_read_bio_X509(cb, NULL, NULL, NULL) : NULL;
  BIO_free(kb);
  BIO_free(cb);
  time_t soon = time(NULL) + (time_t)CA_RENEW_DAYS * 86400;
  if (!k || !c || X509_check_private_key(c, k) != 1 ||
      X509_cmp_time(X509_get0_notAfter(c), &soon) <= 0) {
    ERR_clear_error();
    EVP_PKEY_free(k);
    X509_free(c);
    return 0; /* damaged, or near its end: a new one */
  }
  C.key = k;
  C.cert = c;
  C.pem = steal_ptr(pem);
  return 1;
}

static int make_ca(int dirfd, char **ret_err) {
  char why[256];
  EVP_PKEY *k = EVP_EC_gen("P-256");
  char host[64] = "";
  gethostname(host, sizeof host - 1);
  char cn[128];
  snprintf(cn, sizeof cn, "ignition-mcp egress CA (%s)", host);
  X509 *c = k ? make_cert(k, cn, (long)CA_DAYS * 86400, NULL, NULL) : NULL;
  if (!c) {
    *ret_err = xasprintf("cannot make the egress CA: %s", ssl_why(why, sizeof why));
    EVP_PKEY_free(k);
    return -EIO;
  }
  _cleanup_free_ char *kp = pem_of_key(k);
  char *cp = pem_of_cert(c);
  int r = kp && cp ? write_private(dirfd, "ca.key", kp, 0600) : -ENOMEM;
  if (r == 0)
    r = write_private(dirfd, "ca.pem", cp, 0644);
  if (kp)
    explicit_bzero(kp, strlen(kp));
  if (r < 0) {
    *ret_err = xasprintf("cannot write the egress CA: %s", strerror(-r));
    EVP_PKEY_free(k);
    X509_free(c);
    free(cp);
    return r;
  }
  C.key = k;
  C.cert = c;
  C.pem = cp;
  return 0;
}

/* HTTP/2 where the sandbox offers it (intercept_h2.c), else HTTP/1.1: a
 * client that offers only something else gets no protocol chosen. */
static int alpn_select(SSL *s, const unsigned char **out, unsigned char *outlen,
                       const unsigned char *in, unsigned int inlen, void *arg) {
  (void)s;
  (void)arg;
  static const unsigned char ours[] = "\x02h2\x08http/1.1";
  unsigned char *o;
  if (SSL_select_next_proto(&o, outlen, ours, sizeof ours - 1, in, inlen) != OPENSSL_NPN_NEGOTIATED)
    return SSL_TLSEXT_ERR_NOACK;
  *out = o;
  return SSL_TLSEXT_ERR_OK;
}

int ca_init(const char *dir, const char *extra_ca, char **ret_err) {
  if (atomic_load(&C.ready))
    return 0;
  if (mkdir(dir, 0700) < 0 && errno != EEXIST) {
    *ret_err = xasprintf("cannot make %s: %s", dir, strerror(errno));
    return -errno;
  }
  int dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  struct stat st;
  if (dirfd < 0 || fstat(dirfd, &st) < 0 || st.st_uid != geteuid() || (st.st_mode & 077)) {
    *ret_err = xasprintf("%s must be a directory of this user that only it can use (mode 0700)",
                         dir);
    if (dirfd >= 0)
      close(dirfd);
    return -EPERM;
  }
  flock(dirfd, LOCK_EX);
  int r = load_ca(dirfd, ret_err);
  if (r == 0)
    r = make_ca(dirfd, ret_err);
  flock(dirfd, LOCK_UN);
  close(dirfd);
  if (r < 0) {
    if (!*ret_err)
      *ret_err = xasprintf("cannot read the egress CA in %s: %s", dir, strerror(-r));
    return r;
  }
  char why[256];
  C.leaf_key = EVP_EC_gen("P-256");
  C.client = SSL_CTX_new(TLS_client_method());
  if (!C.leaf_key || !C.client || !SSL_CTX_set_min_proto_version(C.client, TLS1_2_VERSION) ||
      !SSL_CTX_set_default_verify_paths(C.client) ||
      (extra_ca && !SSL_CTX_load_verify_locations(C.client, extra_ca, NULL))) {
    *ret_err = xasprintf("cannot set up TLS toward the real servers%s%s: %s",
                         extra_ca ? " with IGN_MCP_EGRESS_CA=" : "", extra_ca ? extra_ca : "",
                         ssl_why(why, sizeof why));
    ca_shutdown();
    return -EIO;
  }
  SSL_CTX_set_verify(C.client, SSL_VERIFY_PEER, NULL);
  SSL_CTX_set_session_cache_mode(C.client, SSL_SESS_CACHE_OFF);
  SSL_CTX_set_options(C.client, SSL_OP_NO_RENEGOTIATION); /* RFC 9113 §9.2.1 */
  static const unsigned char protos[] = "\x02h2\x08http/1.1";
  SSL_CTX_set_alpn_protos(C.client, protos, sizeof protos - 1);
  C.server = SSL_CTX_new(TLS_server_method());
  if (!C.server || !SSL_CTX_set_min_proto_version(C.server, TLS1_2_VERSION)) {
    *ret_err = xasprintf("cannot set up TLS toward the sandboxes: %s", ssl_why(why, sizeof why));
    ca_shutdown();
    return -EIO;
  }
  SSL_CTX_set_session_cache_mode(C.server, SSL_SESS_CACHE_OFF);
  SSL_CTX_set_options(C.server, SSL_OP_NO_TICKET);
  SSL_CTX_set_alpn_select_cb(C.server, alpn_select, NULL);
  atomic_store(&C.ready, true);
  return 0;
}

void ca_configure(const char *dir, const char *extra_ca) {
  free(C.dir);
  free(C.extra);
  C.dir = dir ? strdup(dir) : NULL;
  C.extra = extra_ca ? strdup(extra_ca) : NULL;
}

int ca_ensure(char **ret_err) {
  if (atomic_load(&C.ready))
    return 0;
  pthread_mutex_lock(&C.init_lock);
  int r = 0;
  if (!atomic_load(&C.ready)) {
    if (!C.dir) {
      *ret_err = strdup("egress is off, or the broker has no place for its CA");
      r = -EINVAL;
    } else {
      /* The store may not exist yet: its parents are made as the store's. */
      _cleanup_free_ char *parent = strdup(C.dir);
      char *slash = parent ? strrchr(parent, '/') : NULL;
      if (slash && slash != parent) {
        *slash = 0;
        fs_mkdir_p(parent, 0755, 0755);
      }
      r = ca_init(C.dir, C.extra, ret_err);
    }
  }
  pthread_mutex_unlock(&C.init_lock);
  return r;
}

const char *ca_pem(void) { return atomic_load(&C.ready) ? C.pem : NULL; }

SSL_CTX *ca_client_ctx(void) { return C.client; }
SSL_CTX *ca_server_ctx(void) { return C.server; }

/* A leaf for NAME, minted or from the cache (a reference the caller
 * frees), or NULL. */
static X509 *leaf_for(const char *name) {
  time_t now = time(NULL);
  pthread_mutex_lock(&C.lock);
  struct leaf *slot = &C.leaves[0];
  for (size_t i = 0; i < LEAF_MAX; i++) {
    struct leaf *l = &C.leaves[i];
    if (l->cert && strcmp(l->name, name) == 0 && l->until > now + 3600) {
      l->used = ++C.uses;
      X509_up_ref(l->cert);
      pthread_mutex_unlock(&C.lock);
      return l->cert;
    }
    if (!l->cert || l->used < slot->used)
      slot = !slot->cert ? slot : l;
  }
  X509 *c = make_cert(C.leaf_key, name, LEAF_SECS, C.cert, C.key);
  if (c) {
    X509_free(slot->cert);
    snprintf(slot->name, sizeof slot->name, "%s", name);
    slot->cert = c;
    slot->until = now + LEAF_SECS;
    slot->used = ++C.uses;
    X509_up_ref(c);
  }
  pthread_mutex_unlock(&C.lock);
  return c;
}

SSL *ca_server_ssl(SSL_CTX *ctx, const char *name) {
  X509 *c = leaf_for(name);
  SSL *s = c ? SSL_new(ctx) : NULL;
  if (s && (!SSL_use_certificate(s, c) || !SSL_use_PrivateKey(s, C.leaf_key) ||
            !SSL_add1_chain_cert(s, C.cert))) {
    SSL_free(s);
    s = NULL;
  }
  X509_free(c);
  return s;
}

void ca_shutdown(void) {
  atomic_store(&C.ready, false);
  for (size_t i = 0; i < LEAF_MAX; i++) {
    X509_free(C.leaves[i].cert);
    C.leaves[i].cert = NULL;
  }
  SSL_CTX_free(C.client);
  SSL_CTX_free(C.server);
  C.server = NULL;
  EVP_PKEY_free(C.leaf_key);
  EVP_PKEY_free(C.key);
  X509_free(C.cert);
  free(C.pem);
  C.client = NULL;
  C.leaf_key = C.key = NULL;
  C.cert = NULL;
  C.pem = NULL;
}
