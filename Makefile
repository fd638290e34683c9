# ignition-mcp: one `make` builds the server and the agent, `make images`
# builds the rootfs trees, `make check` runs every test.

CC       ?= gcc
BUILD    ?= build
VERSION  := 0.1.0
WARN     := -Wall -Wextra -Werror -Wno-missing-field-initializers
CFLAGS   ?= -O2 -g
CFLAGS   += -std=gnu17 $(WARN) -D_GNU_SOURCE -DIGN_VERSION='"$(VERSION)"' -I.
SAN      := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined

SERVER_SRCS := $(wildcard mcp/*.c tools/*.c session/*.c sandbox/*.c sandbox/vm/*.c common/*.c egress/*.c) proto/proto.c $(wildcard proto/client*.c)
AGENT_SRCS  := $(wildcard guest/*.c) proto/proto.c common/tarstream.c common/tarstream_unpack.c \
               common/nft_counters.c
HEADERS     := $(wildcard */*.h */*/*.h)
SERVER_LIBS := -ljansson -lpthread -lxxhash -larchive -lmicrohttpd -lnettle -lssl -lcrypto -lnghttp2
# The agent is static: libarchive with every library it can pull in.
AGENT_LIBS  := -lseccomp -larchive -lnettle -lacl -llzma -lzstd -llz4 -lbz2 -lz -lxml2 -lm

UNIT_SRCS   := $(wildcard tests/unit/test_*.c)
UNIT_BINS   := $(patsubst tests/unit/%.c,$(BUILD)/test/%,$(UNIT_SRCS))
# Unit tests link the server's sources minus its main().
LIB_SRCS    := $(filter-out mcp/main.c,$(SERVER_SRCS))

# Hardening for the plain build: a root server and a PID 1 that parse
# hostile input.  The sanitizer builds leave it out (ASan does its own
# checking, and _FORTIFY_SOURCE hides calls from it).  The agent is linked
# static, so it gets the compile-time part only.
HARDEN_CC   := -U_FORTIFY_SOURCE -D_FORTIFY_SOURCE=3 -fstack-protector-strong \
               -fstack-clash-protection -fcf-protection
HARDEN_LD   := -pie -Wl,-z,relro -Wl,-z,now -Wl,-z,noexecstack

# Every source is compiled once per flavour into $(BUILD)/obj/<flavour>/ and
# linked from there: plain (the server, hardened, PIE), agent (static) and
# san (ASan+UBSan: the tests, the replay programs and build/san).  -MMD
# writes each object's header dependencies next to it.
OBJ         := $(BUILD)/obj
objs         = $(patsubst %.c,$(OBJ)/$(1)/%.o,$(2))
DEPFLAGS    := -MMD -MP

$(OBJ)/plain/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(HARDEN_CC) -fPIE $(DEPFLAGS) -c -o $@ $<

$(OBJ)/agent/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(HARDEN_CC) $(DEPFLAGS) -c -o $@ $<

$(OBJ)/san/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(SAN) $(DEPFLAGS) -c -o $@ $<

# The agent's main() renamed, for the fuzz target that brings its own.
$(OBJ)/san/guest/agent-nomain.o: guest/agent.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(SAN) $(DEPFLAGS) -Dmain=ign_agent_main -c -o $@ $<

-include $(shell find $(OBJ) -name '*.d' 2>/dev/null)
# Objects are kept, also those make reaches only through a pattern chain
# (a unit test's own object).
.SECONDARY:

.DEFAULT_GOAL := all
.PHONY: all images rootfs-small rootfs-tools vm-images base check check-unit check-e2e clean install

all: $(BUILD)/ignition-mcp $(BUILD)/ign-agent

$(BUILD)/ignition-mcp: $(call objs,plain,$(SERVER_SRCS)) | $(BUILD)
	$(CC) $(CFLAGS) $(HARDEN_LD) -o $@ $^ $(SERVER_LIBS)

# --gc-sections: libarchive's format table (reached from its pax writer)
# names every format it has; unused, they and their libraries (libxml2
# with ICU for xar) are dropped instead of linked.
$(BUILD)/ign-agent: $(call objs,agent,$(AGENT_SRCS)) | $(BUILD)
	$(CC) $(CFLAGS) -static -Wl,--gc-sections -o $@ $^ $(AGENT_LIBS)

# Sanitizer builds used by the tests.
# It finds the agent and the images next to itself, like the plain build.
$(BUILD)/san/ignition-mcp: $(call objs,san,$(SERVER_SRCS))
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(SAN) -o $@ $^ $(SERVER_LIBS)
	ln -sfn ../ign-agent $(BUILD)/san/ign-agent
	ln -sfn ../rootfs $(BUILD)/san/rootfs
	ln -sfn ../vm $(BUILD)/san/vm

$(BUILD)/test/%: $(OBJ)/san/tests/unit/%.o $(call objs,san,$(LIB_SRCS)) $(BUILD)/ign-agent
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(SAN) -o $@ $(filter %.o,$^) $(SERVER_LIBS)

# Unit tests of agent code link the guest sources they test.
$(BUILD)/test/test_egress_nl: $(OBJ)/san/guest/egress_nl.o
$(BUILD)/test/test_dns: $(OBJ)/san/guest/dns.o

# A guest program of the e2e tests (tests/guest/): static, copied into a
# session and run there (not in $(BUILD)/test/, whose programs are the unit
# tests).
$(BUILD)/guest/pagecheck: tests/guest/pagecheck.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -static -o $@ $<

$(BUILD):
	mkdir -p $@

# Fuzz targets (fuzz/): one per parser of outside bytes.  Each builds twice:
# with libFuzzer (clang) for `make fuzz`, and as a plain replay program (the
# ordinary compiler, ASan+UBSan) that `make check` runs over the committed
# corpus in fuzz/corpus/<target>/, crashes found so far included.
FUZZ_TARGETS := fuzz_mcp fuzz_tool_args fuzz_proto_host fuzz_proto_guest fuzz_egress_policy fuzz_dns
FUZZ_REPLAYS := $(patsubst %,$(BUILD)/replay/%,$(FUZZ_TARGETS))
FUZZ_BINS    := $(patsubst %,$(BUILD)/fuzz/%,$(FUZZ_TARGETS))
FUZZ_CC      ?= clang
FUZZ_SAN     := -fsanitize=fuzzer,address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
FUZZ_SECONDS ?= 300
comma := ,
# The sources each target links, besides fuzz/<target>.c.  The agent's
# main() is renamed: the target (or libFuzzer) has its own.
FUZZ_SRCS_fuzz_mcp         := $(LIB_SRCS)
FUZZ_SRCS_fuzz_tool_args   := $(LIB_SRCS)
FUZZ_SRCS_fuzz_proto_host  := proto/proto.c $(wildcard proto/client*.c)
FUZZ_SRCS_fuzz_proto_guest := $(filter-out guest/agent.c,$(AGENT_SRCS))
FUZZ_SRCS_fuzz_egress_policy := common/egress_policy.c common/egress_peek.c
FUZZ_SRCS_fuzz_dns         := guest/dns.c
FUZZ_OBJS_fuzz_proto_guest  = $(dir $@)agent-nomain.o
FUZZ_LIBS_fuzz_proto_guest := $(AGENT_LIBS) -lpthread

$(BUILD)/fuzz/agent-nomain.o: guest/agent.c $(HEADERS)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(CFLAGS) $(subst =fuzzer$(comma),=fuzzer-no-link$(comma),$(FUZZ_SAN)) -Dmain=ign_agent_main -c -o $@ $<

# The replay programs link the san objects (the agent's with main renamed).
REPLAY_OBJS_fuzz_proto_guest := $(OBJ)/san/guest/agent-nomain.o

.SECONDEXPANSION:
$(BUILD)/replay/%: $(OBJ)/san/fuzz/%.o $(OBJ)/san/fuzz/replay.o $$(call objs,san,$$(FUZZ_SRCS_$$*)) $$(REPLAY_OBJS_$$*)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(SAN) -o $@ $^ $(or $(FUZZ_LIBS_$*),$(SERVER_LIBS))

# `make fuzz` runs every target for FUZZ_SECONDS (make -j2 fuzz: two at a
# time); new inputs go into the corpus (named by their SHA-1), and so do
# crashes, leaks and timeouts (crash-*, leak-*, timeout-*), so that `make
# check` replays them until they are fixed and for good after.  Give a fixed
# one a name that says what it found.  `make fuzz-merge` shrinks the SHA-1
# named inputs to those that add coverage; named ones are kept, and nothing
# is removed unless the merge succeeded.
FUZZ_MAX_LEN ?= 65536
FUZZ_DICT_fuzz_mcp       := fuzz/mcp.dict
FUZZ_DICT_fuzz_tool_args := fuzz/mcp.dict
.PHONY: fuzz fuzz-merge $(patsubst %,fuzz-%,$(FUZZ_TARGETS))
fuzz: $(patsubst %,fuzz-%,$(FUZZ_TARGETS))

$(patsubst %,fuzz-%,$(FUZZ_TARGETS)): fuzz-%: $(BUILD)/fuzz/%
	@mkdir -p fuzz/corpus/$*
	nice $< -max_total_time=$(FUZZ_SECONDS) -max_len=$(FUZZ_MAX_LEN) -timeout=30 \
	  -print_final_stats=1 -artifact_prefix=fuzz/corpus/$*/ \
	  $(if $(FUZZ_DICT_$*),-dict=$(FUZZ_DICT_$*)) fuzz/corpus/$* 2>&1 | \
	  grep -v -E '^(#[0-9]+[[:space:]]+(NEW|REDUCE|pulse)|ign-agent: )'

# fuzz_proto_guest is not merged: libFuzzer merges through a shell, and the
# target's fence has none (its corpus only grows by what adds coverage).
FUZZ_MERGE := $(filter-out fuzz_proto_guest,$(FUZZ_TARGETS))
fuzz-merge: $(patsubst %,$(BUILD)/fuzz/%,$(FUZZ_MERGE))
	@set -e; for t in $(FUZZ_MERGE); do \
	  out=$(BUILD)/fuzz/merge-$$t; rm -rf $$out; mkdir -p $$out; \
	  $(BUILD)/fuzz/$$t -merge=1 -max_len=$(FUZZ_MAX_LEN) $$out fuzz/corpus/$$t > $$out.log 2>&1 || \
	    { tail -n 5 $$out.log; echo "$$t: merge failed; its corpus is left as it was"; exit 1; }; \
	  if [ -z "$$(ls -A $$out)" ]; then echo "$$t: the merge kept nothing; its corpus is left as it was"; exit 1; fi; \
	  find fuzz/corpus/$$t -type f -regextype posix-extended -regex '.*/[0-9a-f]{40}' -delete; \
	  cp -n $$out/* fuzz/corpus/$$t/; \
	  echo "$$t: $$(ls fuzz/corpus/$$t | wc -l) inputs"; \
	done

$(BUILD)/fuzz/%: fuzz/%.c $$(FUZZ_SRCS_$$*) $$(FUZZ_OBJS_$$*) $(HEADERS)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(CFLAGS) $(FUZZ_SAN) -o $@ $< $(FUZZ_SRCS_$*) $(FUZZ_OBJS_$*) \
	  $(or $(FUZZ_LIBS_$*),$(SERVER_LIBS))

images: rootfs-small rootfs-tools vm-images

# The microVM's kernel, initramfs (the agent as /init) and rootfs disk images.
VM := $(BUILD)/vm
vm-images: $(VM)/initramfs.cpio
	image/build-rootfs-image.sh $(BUILD)/rootfs/small $(VM)/rootfs-small.erofs
	image/build-rootfs-image.sh $(BUILD)/rootfs/tools $(VM)/rootfs-tools.erofs

# The module list is in the script: a change to it makes the kernel again.
$(VM)/vmlinux: image/build-kernel.sh
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

# make check: every suite (tests/run.sh all), in 35 minutes or less on 2
# cores: the unit, fuzz-replay, valgrind, conformance and client suites, then
# the ns-user pass, run beside the root e2e passes, and the vm-user pass last
# (IGN_TEST_JOBS=1: one after another); the soaks run short (IGN_TEST_SOAK=1:
# at full length); README "Testing".
check: all $(BUILD)/san/ignition-mcp $(UNIT_BINS) $(FUZZ_REPLAYS) $(VM)/initramfs.cpio \
       $(BUILD)/guest/pagecheck
	BUILD=$(BUILD) tests/run.sh

check-unit: all $(UNIT_BINS) $(FUZZ_REPLAYS)
	BUILD=$(BUILD) tests/run.sh unit

check-e2e: all $(BUILD)/san/ignition-mcp
	BUILD=$(BUILD) tests/run.sh e2e

clean:
	rm -rf $(BUILD)/ignition-mcp $(BUILD)/ign-agent $(BUILD)/san $(BUILD)/test $(BUILD)/replay $(OBJ)

# Benchmarks (bench/): `make bench` writes bench/BENCHMARKS.md and
# bench/results.json; `make bench-quick` takes fewer samples (a few minutes).
# The peer they compare against (npm @anthropic-ai/sandbox-runtime) is
# installed into bench/node_modules from bench/package-lock.json when missing;
# without it that row says why.
BENCH_NODE ?= tests/node_modules/.bin/node

.PHONY: bench bench-quick bench-deps

$(BUILD)/ign-bench: $(call objs,plain,bench/ign-bench.c $(LIB_SRCS)) | $(BUILD)
	$(CC) $(CFLAGS) $(HARDEN_LD) -o $@ $^ $(SERVER_LIBS)

bench-deps: all $(BUILD)/ign-bench
	@test -x $(BENCH_NODE) || { echo "bench: $(BENCH_NODE) is missing: run scripts/setup.sh (it installs tests/node_modules)"; exit 1; }
	@test -f bench/node_modules/@anthropic-ai/sandbox-runtime/package.json || \
	  (cd bench && PATH="$(CURDIR)/tests/node_modules/.bin:$$PATH" npm ci --no-audit --no-fund) || \
	  echo "bench: npm ci in bench/ failed; the sandbox-runtime peer will be reported as not installed"

bench: bench-deps
	BUILD=$(BUILD) $(BENCH_NODE) bench/bench.mjs

bench-quick: bench-deps
	BUILD=$(BUILD) $(BENCH_NODE) bench/bench.mjs --quick

# Install: `make install` (PREFIX=/usr/local, DESTDIR for staging) puts the
# server in $(PREFIX)/bin and what it finds next to itself (the agent, the
# rootfs trees of the ns backend, the kernel, initramfs and disk images of
# the vm backend) in $(PREFIX)/lib/ignition-mcp, where an installed server
# looks (common/config.c: <exe>/../lib/ignition-mcp); the docs and the man page
# under $(PREFIX)/share.  Images not built yet are skipped with a note
# (`ignition-mcp doctor` names what is missing).  The rootfs trees hold
# device nodes and setuid files: install as root.  `make uninstall` removes
# all of it but the warm bases in the store (/var/lib/ignition-mcp).
PREFIX  ?= /usr/local
DESTDIR ?=
INSTALL_ROOTFS ?= small tools
I_BIN   := $(DESTDIR)$(PREFIX)/bin
I_LIB   := $(DESTDIR)$(PREFIX)/lib/ignition-mcp
I_DOC   := $(DESTDIR)$(PREFIX)/share/doc/ignition-mcp
I_MAN   := $(DESTDIR)$(PREFIX)/share/man/man1
I_DOCS  := README.md $(wildcard SECURITY.md) $(wildcard docs/*.md)
I_VM    := vmlinux initramfs.cpio $(patsubst %,rootfs-%.erofs,$(INSTALL_ROOTFS))

.PHONY: install uninstall man-check

install: all
	install -d -m 0755 $(I_BIN) $(I_LIB) $(I_LIB)/rootfs $(I_LIB)/vm $(I_DOC) $(I_MAN)
	install -m 0755 $(BUILD)/ignition-mcp $(I_BIN)/ignition-mcp
	install -m 0755 $(BUILD)/ign-agent $(I_LIB)/ign-agent
	@set -e; for f in $(I_VM); do \
	  if [ -f $(VM)/$$f ]; then \
	    echo "install -m 0644 $(VM)/$$f $(I_LIB)/vm/$$f"; \
	    install -m 0644 $(VM)/$$f $(I_LIB)/vm/$$f; \
	  else \
	    echo "install: skipping $(VM)/$$f: not built (make vm-images); the vm backend needs it"; \
	  fi; \
	done
	@set -e; for r in $(INSTALL_ROOTFS); do \
	  if [ -x $(BUILD)/rootfs/$$r/bin/sh ] || [ -L $(BUILD)/rootfs/$$r/bin/sh ]; then \
	    echo "cp -a $(BUILD)/rootfs/$$r $(I_LIB)/rootfs/$$r"; \
	    rm -rf $(I_LIB)/rootfs/$$r.new; \
	    cp -a $(BUILD)/rootfs/$$r $(I_LIB)/rootfs/$$r.new; \
	    rm -rf $(I_LIB)/rootfs/$$r; \
	    mv $(I_LIB)/rootfs/$$r.new $(I_LIB)/rootfs/$$r; \
	  else \
	    echo "install: skipping $(BUILD)/rootfs/$$r: not built (make rootfs-$$r); the ns backend needs it"; \
	  fi; \
	done
	install -m 0644 $(I_DOCS) $(I_DOC)/
	install -m 0644 docs/ignition-mcp.1 $(I_MAN)/ignition-mcp.1

uninstall:
	rm -f $(I_BIN)/ignition-mcp $(I_MAN)/ignition-mcp.1
	rm -rf $(I_LIB) $(I_DOC)

# The man page renders without a warning.
man-check:
	@out=$$(LC_ALL=C.UTF-8 MANWIDTH=80 man --warnings -l docs/ignition-mcp.1 2>&1 >/dev/null); \
	  if [ -n "$$out" ]; then echo "$$out"; exit 1; fi; echo "docs/ignition-mcp.1: no warnings"
