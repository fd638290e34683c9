# ignition-mcp: one `make` builds the server and the agent, `make images`
# builds the rootfs trees, `make check` runs every test.

CC       ?= gcc
BUILD    ?= build
VERSION  := 0.1.0
WARN     := -Wall -Wextra -Werror -Wno-missing-field-initializers
CFLAGS   ?= -O2 -g
CFLAGS   += -std=gnu17 $(WARN) -D_GNU_SOURCE -DIGN_VERSION='"$(VERSION)"' -I.
SAN      := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined

SERVER_SRCS := $(wildcard mcp/*.c tools/*.c session/*.c sandbox/*.c) proto/proto.c proto/client.c
AGENT_SRCS  := $(wildcard guest/*.c) proto/proto.c
HEADERS     := $(wildcard */*.h)
SERVER_LIBS := -ljansson -lpthread
AGENT_LIBS  := -lseccomp

UNIT_SRCS   := $(wildcard tests/unit/test_*.c)
UNIT_BINS   := $(patsubst tests/unit/%.c,$(BUILD)/test/%,$(UNIT_SRCS))
# Unit tests link the server's sources minus its main().
LIB_SRCS    := $(filter-out mcp/main.c,$(SERVER_SRCS))

.PHONY: all images rootfs-small rootfs-tools vm-images base check check-unit check-e2e clean install

all: $(BUILD)/ignition-mcp $(BUILD)/ign-agent

$(BUILD)/ignition-mcp: $(SERVER_SRCS) $(HEADERS) | $(BUILD)
	$(CC) $(CFLAGS) -o $@ $(SERVER_SRCS) $(SERVER_LIBS)

$(BUILD)/ign-agent: $(AGENT_SRCS) $(HEADERS) | $(BUILD)
	$(CC) $(CFLAGS) -static -o $@ $(AGENT_SRCS) $(AGENT_LIBS)

# Sanitizer builds used by the tests.
# It finds the agent and the images next to itself, like the plain build.
$(BUILD)/san/ignition-mcp: $(SERVER_SRCS) $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(SAN) -o $@ $(SERVER_SRCS) $(SERVER_LIBS)
	ln -sfn ../ign-agent $(BUILD)/san/ign-agent
	ln -sfn ../rootfs $(BUILD)/san/rootfs
	ln -sfn ../vm $(BUILD)/san/vm

$(BUILD)/test/%: tests/unit/%.c $(LIB_SRCS) $(HEADERS) $(BUILD)/ign-agent
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(SAN) -o $@ $< $(LIB_SRCS) $(SERVER_LIBS)

$(BUILD):
	mkdir -p $@

images: rootfs-small rootfs-tools vm-images

# The microVM's kernel, initramfs (the agent as /init) and rootfs disk images.
VM := $(BUILD)/vm
vm-images: $(VM)/initramfs.cpio
	image/build-rootfs-image.sh $(BUILD)/rootfs/small $(VM)/rootfs-small.erofs
	image/build-rootfs-image.sh $(BUILD)/rootfs/tools $(VM)/rootfs-tools.erofs

$(VM)/vmlinux:
	image/build-kernel.sh $(VM)

$(VM)/initramfs.cpio: $(BUILD)/ign-agent $(VM)/vmlinux image/build-initramfs.sh
	image/build-initramfs.sh $(BUILD)/ign-agent $(VM)/modules $@

# The warm snapshot the microVM sessions are cloned from (default rootfs).
base: all vm-images
	$(BUILD)/ignition-mcp make-base

rootfs-small: $(BUILD)/ign-agent
	image/build-rootfs-small.sh $(BUILD)/rootfs/small

rootfs-tools:
	image/build-rootfs-tools.sh $(BUILD)/rootfs/tools

check: all $(BUILD)/san/ignition-mcp $(UNIT_BINS) $(VM)/initramfs.cpio
	BUILD=$(BUILD) tests/run.sh

check-unit: all $(UNIT_BINS)
	BUILD=$(BUILD) tests/run.sh unit

check-e2e: all $(BUILD)/san/ignition-mcp
	BUILD=$(BUILD) tests/run.sh e2e

clean:
	rm -rf $(BUILD)/ignition-mcp $(BUILD)/ign-agent $(BUILD)/san $(BUILD)/test

# Benchmarks (bench/): `make bench` writes bench/BENCHMARKS.md and
# bench/results.json; `make bench-quick` takes fewer samples (a few minutes).
# The peer they compare against (npm @anthropic-ai/sandbox-runtime) is
# installed into bench/node_modules from bench/package-lock.json when missing;
# without it that row says why.
BENCH_NODE ?= tests/node_modules/.bin/node

.PHONY: bench bench-quick bench-deps

$(BUILD)/ign-bench: bench/ign-bench.c $(LIB_SRCS) $(HEADERS) | $(BUILD)
	$(CC) $(CFLAGS) -o $@ bench/ign-bench.c $(LIB_SRCS) $(SERVER_LIBS)

bench-deps: all $(BUILD)/ign-bench
	@test -x $(BENCH_NODE) || { echo "bench: $(BENCH_NODE) is missing: run scripts/setup.sh (it installs tests/node_modules)"; exit 1; }
	@test -f bench/node_modules/@anthropic-ai/sandbox-runtime/package.json || \
	  (cd bench && PATH="$(CURDIR)/tests/node_modules/.bin:$$PATH" npm ci --no-audit --no-fund) || \
	  echo "bench: npm ci in bench/ failed; the sandbox-runtime peer will be reported as not installed"

bench: bench-deps
	BUILD=$(BUILD) $(BENCH_NODE) bench/bench.mjs

bench-quick: bench-deps
	BUILD=$(BUILD) $(BENCH_NODE) bench/bench.mjs --quick
