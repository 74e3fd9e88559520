# Two commands on a fresh Debian machine (as root): `make demo` and `make test`.
# Both install what they need first; a second run skips what is already there.

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
APT_PACKAGES := fuse3 libfuse3-dev pkg-config gcc patch rclone systemd
PYTEST_ARGS ?=

.PHONY: all deps apt demo test bench clean

all: test

deps: apt $(STAMP)

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
PYFUSE3_PATCH := mountd/patches/pyfuse3-read-with-inode.patch
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

demo: deps
	$(VENV)/bin/python -m quiverfs.bench.demo

test: deps
	$(VENV)/bin/python -m pytest -ra $(PYTEST_ARGS)

bench: deps
	$(VENV)/bin/quiver bench all --json bench-results.json

clean:
	rm -rf $(VENV) .pytest_cache
