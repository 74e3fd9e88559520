# Two commands on a fresh Debian machine (as root): `make demo` and `make test`.
# Both install what they need first; a second run skips what is already there.

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
APT_PACKAGES := fuse3 libfuse3-dev pkg-config rclone systemd
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

$(STAMP): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements.lock
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
