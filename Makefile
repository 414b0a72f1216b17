# gpudeck: `make run` opens gpudeck on this host; `make test` runs the test suite.
# Both create .venv when it is missing and are fast on a second call.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# (not --no-compile: where PYTHONDONTWRITEBYTECODE is set, as on this development machine, nothing would ever write the .pyc
# files, and every test process compiled torch and transformers from source: the suite took 23 min instead of 15)
PIP    := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: run test test-under-load lint bench clean test-deps

$(PY):
	$(PYTHON) -m venv $(VENV)

# the console and agent only: no torch
$(VENV)/.run-installed: pyproject.toml | $(PY)
	$(PIP) -e '.[console]'
	@touch $@

# tests need the trainers too; constraints-dev.txt pins the CPU build of torch
$(VENV)/.test-installed: pyproject.toml constraints-dev.txt | $(PY)
	$(PIP) -c constraints-dev.txt -e '.[console,dev,train]'
	@touch $@ $(VENV)/.run-installed

run: $(VENV)/.run-installed
	$(VENV)/bin/gpudeck

# the SSH and network tests start real OpenSSH servers (loopback, network namespaces) and use iptables; the watch test runs a real
# Prometheus on loopback (Debian's prometheus package; the test is skipped, saying why, when it cannot be installed)
test-deps:
	@{ test -x /usr/sbin/sshd && command -v iptables >/dev/null; } || { \
	  echo "installing openssh-server and iptables (the SSH tests run real sshd on loopback and in network namespaces; nothing is started system-wide)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server iptables >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server iptables >/dev/null; }; }
	@command -v prometheus >/dev/null || { \
	  echo "installing prometheus (tests/e2e/test_watch_metrics.py scrapes gpudeck watch with its own prometheus process on loopback)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null; } || \
	  echo "prometheus could not be installed: its test will be skipped"; }

# two workers, each file's tests on one of them in order (a file's fixtures and its order stay as written);
# most e2e tests wait on real processes and timeouts, so two workers halve the wall time on two cores. Three were
# tried on 2026-12-02: 14 min 23 s in one run, 16 min 46 s (pytest's own count) on a fresh clone: no clear gain.
# --no-loadscope-reorder: files are handed out in collection order (tests/e2e first, the short tests/unit files
# last) instead of by their number of tests, which sent one-test files of 20-30 s (test_env_gate, test_hang_multinode,
# test_hostile_names) out last, one worker finishing 20-25 s after the other
TEST_WORKERS ?= 2
PYTEST_XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# the checkout's own modules compiled once: where PYTHONDONTWRITEBYTECODE is set, nothing writes their .pyc, and each
# of the suite's thousands of Python processes (CLI calls, agents, trainers) compiled what it imports of gpudeck
# (a `gpudeck --help` 0.21 s instead of 0.13 s on a fresh clone)
COMPILE := $(PY) -m compileall -q console agents trainers tests

test: $(VENV)/.test-installed test-deps
	$(COMPILE)
	$(PY) -m pytest -q $(PYTEST_XDIST)

# the suite while the machine is 4x oversubscribed (stress-ng --cpu 8 on 2 cores): time limits in tests are for
# hangs, never for speed. stress-ng is installed when missing; it is started and stopped by its pid.
STRESS_CPUS ?= 8
test-under-load: $(VENV)/.test-installed test-deps
	$(COMPILE)
	@command -v stress-ng >/dev/null || { \
	  echo "installing stress-ng (the load generator for test-under-load)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q stress-ng >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q stress-ng >/dev/null; }; }
	@stress-ng --cpu $(STRESS_CPUS) --timeout 0 --quiet & pid=$$!; \
	  echo "stress-ng --cpu $(STRESS_CPUS) running as pid $$pid; load: $$(cut -d' ' -f1-3 /proc/loadavg)"; \
	  trap 'kill -TERM $$pid 2>/dev/null; wait $$pid 2>/dev/null' EXIT INT TERM; \
	  $(PY) -m pytest -q $(PYTEST_XDIST); rc=$$?; \
	  echo "load at the end: $$(cut -d' ' -f1-3 /proc/loadavg)"; exit $$rc

# ruff (format check + rules), mypy on the three packages, import-linter's contracts for the rooms
# (pyproject.toml says which and why). The packages install as gpudeck.console/.agents/.trainers while
# the checkout keeps console/, agents/, trainers/ at the top: .lint/gpudeck links them for mypy and import-linter.
LINT_NS := .lint/gpudeck
lint: $(VENV)/.test-installed
	@mkdir -p $(LINT_NS) && for p in console agents trainers; do ln -sfn ../../$$p $(LINT_NS)/$$p; done
	$(VENV)/bin/ruff format --check console agents trainers tests bench
	$(VENV)/bin/ruff check console agents trainers tests bench
	$(PY) -m mypy -p gpudeck.console -p gpudeck.agents -p gpudeck.trainers
	PYTHONPATH=.lint $(VENV)/bin/lint-imports

bench: $(VENV)/.test-installed
	$(PY) bench/agent_sample.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .lint
