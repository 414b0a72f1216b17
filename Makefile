# gpudeck: `make run` opens gpudeck on this host; `make test` runs the test suite.
# Both create .venv when it is missing and are fast on a second call.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: run test bench clean sshd

$(PY):
	$(PYTHON) -m venv $(VENV)

# the console and agent only: no torch
$(VENV)/.run-installed: pyproject.toml | $(PY)
	$(PIP) -e .
	@touch $@

# tests need the trainers too; constraints-dev.txt pins the CPU build of torch
$(VENV)/.test-installed: pyproject.toml constraints-dev.txt | $(PY)
	$(PIP) -c constraints-dev.txt -e '.[dev,train]'
	@touch $@ $(VENV)/.run-installed

run: $(VENV)/.run-installed
	$(VENV)/bin/gpudeck

# the SSH tests start real OpenSSH servers on loopback ports: Debian's openssh-server
sshd:
	@test -x /usr/sbin/sshd || { \
	  echo "installing openssh-server (the SSH tests run real sshd on 127.0.0.1; nothing is started system-wide)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server >/dev/null; }; }

test: $(VENV)/.test-installed sshd
	$(PY) -m pytest -q

bench: $(VENV)/.test-installed
	$(PY) bench/agent_sample.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
