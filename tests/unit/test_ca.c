/* test_ca.c: the broker's CA (egress/ca.c) and the operator's secrets
 * file (egress/secrets.c): the CA is made once with a key only its user can
 * read and loaded the same the next time, a directory others may use is
 * refused, a leaf for a name verifies against the CA with that name only,
 * and a secrets file is checked (owner, mode, entries) without its values
 * reaching a message. */
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509_vfy.h>

#include "common/util.h"
#include "egress/egress_int.h"
#include "test.h"

static char tmp[256];

static void ca_is_made_once_and_kept(void) {
  char dir[300];
  snprintf(dir, sizeof dir, "%s/ca", tmp);
  char *err = NULL;
  CHECK_EQ_INT(ca_init(dir, NULL, &err), 0);
  free(steal_ptr(err));
  char *first = ca_pem() ? strdup(ca_pem()) : NULL;
  CHECK(first && strstr(first, "BEGIN CERTIFICATE"));
  char key[320];
  snprintf(key, sizeof key, "%s/ca.key", dir);
  struct stat st;
  CHECK(stat(key, &st) == 0 && (st.st_mode & 0777) == 0600);
  CHECK(stat(dir, &st) == 0 && (st.st_mode & 0777) == 0700);
  /* A leaf for a name: signed by the CA, for that name only. */
  SSL *s = ca_server_ssl(ca_server_ctx(), "api.example.test");
  X509 *leaf = s ? SSL_get_certificate(s) : NULL;
  BIO *b = BIO_new_mem_buf(first, -1);
  X509 *cacert = PEM_read_bio_X509(b, NULL, NULL, NULL);
  BIO_free(b);
  X509_STORE *store = X509_STORE_new();
  X509_STORE_add_cert(store, cacert);
  X509_STORE_CTX *ctx = X509_STORE_CTX_new();
  CHECK(leaf && X509_STORE_CTX_init(ctx, store, leaf, NULL) == 1);
  X509_VERIFY_PARAM_set1_host(X509_STORE_CTX_get0_param(ctx), "api.example.test", 0);
  CHECK_EQ_INT(X509_verify_cert(ctx), 1);
  X509_STORE_CTX_free(ctx);
  ctx = X509_STORE_CTX_new();
  CHECK(leaf && X509_STORE_CTX_init(ctx, store, leaf, NULL) == 1);
  X509_VERIFY_PARAM_set1_host(X509_STORE_CTX_get0_param(ctx), "evil.example.test", 0);
  CHECK(X509_verify_cert(ctx) != 1);
  X509_STORE_CTX_free(ctx);
  X509_STORE_free(store);
  X509_free(cacert);
  SSL_free(s);
  ca_shutdown();
  /* The next start loads the same CA. */
  CHECK_EQ_INT(ca_init(dir, NULL, &err), 0);
  free(steal_ptr(err));
  CHECK(first && ca_pem() && strcmp(first, ca_pem()) == 0);
  ca_shutdown();
  /* A key others may read is refused, not used. */
  chmod(key, 0644);
  CHECK(ca_init(dir, NULL, &err) < 0);
  CHECK(err && strstr(err, "ca.key"));
  free(steal_ptr(err));
  chmod(key, 0600);
  chmod(dir, 0755);
  CHECK(ca_init(dir, NULL, &err) < 0);
  CHECK(err && strstr(err, "0700"));
  free(steal_ptr(err));
  free(first);
}

static int write_secrets(const char *name, const char *text, mode_t mode, char *path, size_t n) {
  snprintf(path, n, "%s/%s", tmp, name);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, mode);
  if (fd < 0)
    return -1;
  ssize_t w = write(fd, text, strlen(text));
  fchmod(fd, mode);
  close(fd);
  return w == (ssize_t)strlen(text) ? 0 : -1;
}

static void secrets_file_is_checked(void) {
  char p[400];
  char *err = NULL;
  CHECK_EQ_INT(write_secrets("ok.json", "{\"GH_TOKEN\": {\"value\": \"v4lue-0ne\", \"hosts\": "
                             "[\"api.github.com\", \"*.example.org:8443\"]}}", 0600, p, sizeof p), 0);
  CHECK_EQ_INT(secrets_init(p, &err), 0);
  CHECK_EQ_INT(secrets_count(), 1);
  const struct secret *s = secret_find("GH_TOKEN");
  CHECK(s && strcmp(s->value, "v4lue-0ne") == 0);
  CHECK(s && secret_for(s, "api.github.com", 14, 443) && !secret_for(s, "api.github.com", 14, 8443));
  CHECK(s && secret_for(s, "a.example.org", 13, 8443) && !secret_for(s, "example.org", 11, 8443));
  CHECK(!secret_find("OTHER"));
  char t1[SECRET_TOKEN_LEN + 1], t2[SECRET_TOKEN_LEN + 1];
  CHECK_EQ_INT(secret_token(t1), 0);
  CHECK_EQ_INT(secret_token(t2), 0);
  CHECK(strlen(t1) == SECRET_TOKEN_LEN && strncmp(t1, "ignph", 5) == 0 && strcmp(t1, t2) != 0);
  secrets_shutdown();
  struct {
    const char *text;
    mode_t mode;
    const char *says;
  } bad[] = {
      {"{\"A\": {\"value\": \"s3cret-a\", \"hosts\": [\"a.test\"]}}", 0640, "no one else"},
      {"{\"A\": {\"value\": \"s3cret-b\", \"hosts\": [\"1.2.3.4\"]}}", 0600, "entry A"},
      {"{\"A\": {\"value\": \"s3cret-c\"}}", 0600, "entry A must be"},
      {"{\"a\": {\"value\": \"s3cret-d\", \"hosts\": [\"a.test\"]}}", 0600, "not one"},
      {"{\"A\": {\"value\": \"s3cret-e\", \"hosts\": [\"a.test\"]}, \"A\": {}}", 0600, "line"},
      {"{\"A\": {\"value\": \"s3cret\\u0001f\", \"hosts\": [\"a.test\"]}}", 0600, "printable"},
  };
  for (size_t i = 0; i < ARRAY_SIZE(bad); i++) {
    CHECK_EQ_INT(write_secrets("bad.json", bad[i].text, bad[i].mode, p, sizeof p), 0);
    CHECK(secrets_init(p, &err) < 0);
    CHECK(err && strstr(err, bad[i].says));
    CHECK(err && !strstr(err, "s3cret"));
    if (err && (!strstr(err, bad[i].says) || strstr(err, "s3cret")))
      fprintf(stderr, "  case %zu: %s\n", i, err);
    free(steal_ptr(err));
    CHECK_EQ_INT(secrets_count(), 0);
  }
}

int main(void) {
  if (!test_mkdtemp(tmp, sizeof tmp, "test_ca"))
    return 1;
  struct test_case cases[] = {TEST(ca_is_made_once_and_kept), TEST(secrets_file_is_checked)};
  int r = test_run_all(cases, ARRAY_SIZE(cases));
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
  if (system(cmd) != 0)
    r = 1;
  return r;
}
