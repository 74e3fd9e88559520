# Two commands on a fresh Debian machine (as root): `make demo` and `make test`.
# Both install what they need first; a second run skips what is already there.

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# etcd-server and etcd-client: the HA tests and `quiver bench cluster --kill-coordinator`
# start a real etcd on loopback (quiverfs/bench/etcd_process.py).
APT_PACKAGES := fuse3 libfuse3-dev pkg-config gcc patch rclone systemd python3-dev \
  etcd-server etcd-client
PYTEST_ARGS ?=

.PHONY: all deps apt native sanitize demo test bench clean

all: test

deps: apt $(STAMP) native

apt:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing apt packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# pyfuse3 is built from its pinned sdist with mountd's patch (mountd/patches/README.md),
# by the Cython, setuptools and setuptools-scm pinned in requirements.lock.
PYFUSE3_PATCH := mountd/patches/pyfuse3-mountd.patch
PYFUSE3_BUILD := $(VENV)/build-pyfuse3

$(STAMP): requirements.lock pyproject.toml mountd/patches/pyfuse3.txt $(PYFUSE3_PATCH)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements.lock
	rm -rf $(PYFUSE3_BUILD) && mkdir -p $(PYFUSE3_BUILD)
	$(VENV)/bin/pip download -q --no-deps --no-binary :all: --no-build-isolation \
	  -r mountd/patches/pyfuse3.txt -d $(PYFUSE3_BUILD)
	tar -xzf $(PYFUSE3_BUILD)/pyfuse3-*.tar.gz -C $(PYFUSE3_BUILD)
	patch -d $(PYFUSE3_BUILD)/pyfuse3-3.5.0 -p1 --forward --quiet < $(PYFUSE3_PATCH)
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation $(PYFUSE3_BUILD)/pyfuse3-3.5.0
	$(VENV)/bin/pip install -q --no-deps -e .
	touch $@

# The native data plane (mountd/native/README.md): a CPython extension built here with
# Debian's gcc, against libfuse3 and the venv's Python headers. mountd serves through
# Python where it cannot load it.
NATIVE := mountd/native/_dataplane.so
NATIVE_C := $(addprefix mountd/native/,plane.c tables.c passthrough.c view.c module.c)
NATIVE_SRC := $(NATIVE_C) mountd/native/plane.h mountd/native/plane_internal.h
NATIVE_CFLAGS ?= -O2
SANITIZE_CFLAGS := -O1 -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all

native: $(NATIVE)

$(NATIVE): $(NATIVE_SRC) $(STAMP)
	gcc -shared -fPIC -std=gnu11 -pthread -g -Wall -Wextra -Werror $(NATIVE_CFLAGS) \
	  -I"$$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
	  $$(pkg-config --cflags fuse3) $(NATIVE_C) \
	  -o $@ $$(pkg-config --libs fuse3)

# The native module's tests under AddressSanitizer and UndefinedBehaviorSanitizer: the
# module is rebuilt with them (and rebuilt as usual after), and the runtime preloaded
# into Python (leaks are not checked: Python's own allocations would drown them).
sanitize: deps
	rm -f $(NATIVE) && $(MAKE) NATIVE_CFLAGS="$(SANITIZE_CFLAGS)" native
	nm -D $(NATIVE) | grep -q __asan_init
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  QUIVER_EXPECT_NATIVE=1 $(VENV)/bin/python -m pytest -ra -p no:cacheprovider \
	  tests/test_native_plane.py tests/test_native_views.py; status=$$?; rm -f $(NATIVE) && $(MAKE) native; exit $$status

demo: deps
	$(VENV)/bin/python -m quiverfs.bench.demo

test: deps
	QUIVER_EXPECT_NATIVE=1 $(VENV)/bin/python -m pytest -ra $(PYTEST_ARGS)

bench: deps
	$(VENV)/bin/quiver bench all --json bench-results.json

clean:
	rm -rf $(VENV) .pytest_cache $(NATIVE)
