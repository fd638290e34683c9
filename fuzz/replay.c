/* replay.c: the main() of a fuzz target built without libFuzzer.  It runs
 * every file named on the command line (directories: every file in them,
 * sorted) through the target once, so `make check` replays the committed
 * corpora under ASan and UBSan with the ordinary compiler.
 *
 * All inputs are read before LLVMFuzzerInitialize() runs: a target may fence
 * itself into a namespace where the corpus paths no longer exist. */
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

struct input {
  char *name;
  uint8_t *data;
  size_t size;
};

static struct input *inputs;
static size_t n_inputs, cap_inputs;

static int cmp_names(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static int read_input(const char *path) {
  _cleanup_fclose_ FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "replay: cannot open %s: %m\n", path);
    return -1;
  }
  uint8_t *buf = NULL;
  size_t len = 0, cap = 0;
  for (;;) {
    if (len == cap) {
      cap = cap ? cap * 2 : 4096;
      uint8_t *n = realloc(buf, cap);
      if (!n) {
        free(buf);
        return -1;
      }
      buf = n;
    }
    size_t r = fread(buf + len, 1, cap - len, f);
    len += r;
    if (r == 0)
      break;
  }
  if (ferror(f)) {
    fprintf(stderr, "replay: cannot read %s\n", path);
    free(buf);
    return -1;
  }
  if (n_inputs == cap_inputs) {
    cap_inputs = cap_inputs ? cap_inputs * 2 : 64;
    struct input *n = realloc(inputs, cap_inputs * sizeof *inputs);
    if (!n) {
      free(buf);
      return -1;
    }
    inputs = n;
  }
  inputs[n_inputs++] = (struct input){.name = strdup(path), .data = buf, .size = len};
  return 0;
}

static int read_dir(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) {
    fprintf(stderr, "replay: cannot open %s: %m\n", dir);
    return -1;
  }
  char **names = NULL;
  size_t n = 0, cap = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.')
      continue;
    if (n == cap) {
      cap = cap ? cap * 2 : 64;
      char **nn = realloc(names, cap * sizeof *names);
      if (!nn)
        break;
      names = nn;
    }
    names[n++] = xasprintf("%s/%s", dir, e->d_name);
  }
  closedir(d);
  if (n)
    qsort(names, n, sizeof *names, cmp_names);
  int r = 0;
  for (size_t i = 0; i < n; i++) {
    if (r == 0 && read_input(names[i]) < 0)
      r = -1;
    free(names[i]);
  }
  free(names);
  return r;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s FILE-OR-DIR...\n"
                    "Runs each input through the fuzz target once.\n", argv[0]);
    return 2;
  }
  for (int i = 1; i < argc; i++) {
    struct stat st;
    if (stat(argv[i], &st) < 0) {
      fprintf(stderr, "replay: %s: %m\n", argv[i]);
      return 2;
    }
    if ((S_ISDIR(st.st_mode) ? read_dir(argv[i]) : read_input(argv[i])) < 0)
      return 2;
  }
  /* Tells a target that the inputs are already read. */
  setenv("IGN_FUZZ_REPLAY", "1", 1);
  if (LLVMFuzzerInitialize)
    LLVMFuzzerInitialize(&argc, &argv);
  for (size_t i = 0; i < n_inputs; i++) {
    /* Named first, so that a crash report follows the input's name. */
    fprintf(stderr, "replay: running %s\n", inputs[i].name);
    LLVMFuzzerTestOneInput(inputs[i].data, inputs[i].size);
    free(inputs[i].data);
    free(inputs[i].name);
  }
  free(inputs);
  fprintf(stderr, "replay: %zu inputs, no crash\n", n_inputs);
  return 0;
}
