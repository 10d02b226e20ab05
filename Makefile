# Two entry points: `make demo` (the main job) and `make test` (the full suite).
# Both bootstrap a fresh Debian machine: the kernel tools, a virtual environment, the package.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
APT_TOOLS := iptables:iptables nft:nftables ipset:ipset conntrack:conntrack ip:iproute2 modprobe:kmod sysctl:procps linux.uml:user-mode-linux ipvsadm:ipvsadm flex:flex bison:bison bc:bc

.PHONY: demo test unit kernel lint bench tools venv uml-kernel clean

tools:
	@missing=""; for pair in $(APT_TOOLS); do \
	  cmd=$${pair%%:*}; pkg=$${pair##*:}; \
	  command -v $$cmd >/dev/null 2>&1 || PATH=$$PATH:/usr/sbin:/sbin command -v $$cmd >/dev/null 2>&1 || missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: tools venv
	$(BIN)/kproxy demo

# The UML guest kernel of the ipvs tests: built once per machine, only where Debian's cannot
# boot (README "UML on hosts where Debian's kernel cannot boot").
uml-kernel: tools venv
	-$(BIN)/kproxy lab uml-kernel --if-needed

test: tools venv uml-kernel
	$(BIN)/ruff check src tests bench
	$(BIN)/python -m pytest -q

unit: venv
	$(BIN)/python -m pytest -q -m "not kernel"

kernel: tools venv uml-kernel
	$(BIN)/python -m pytest -q -m kernel

bench: tools venv
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
