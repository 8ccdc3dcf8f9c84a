# Each target creates or reuses .venv; `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TRITON_VENV := .venv-triton
TRITON_STAMP := $(TRITON_VENV)/.installed
PERF_VENV := .venv-perf
PERF_STAMP := $(PERF_VENV)/.installed
LIBB64 := .tools/libb64/usr/lib/x86_64-linux-gnu/libb64.so.0d
MODEL_DIR ?= models/default
ARGS ?=

.PHONY: install install-parts node-client serve test export lint proto bench bench-servers deploy-gen clean

PROMETHEUS := .tools/prometheus/usr/bin/prometheus
NGINX := .tools/nginx/usr/sbin/nginx
NODE_CLIENT := .tools/node/node_modules/.package-lock.json
NODE_SKIPPED := the Node.js client's test (tests/e2e/test_node_client.py) will be skipped

# The environments and tools install side by side (on CI's 2 CPUs about 2 minutes, against 3 one
# after another): most of it is downloading and unpacking. Their lines interleave, each whole.
install:
	@$(MAKE) --no-print-directory -j4 --output-sync=line install-parts

install-parts: $(STAMP) $(TRITON_STAMP) $(PERF_STAMP) $(LIBB64) $(PROMETHEUS) $(NGINX) node-client

# Prometheus and promtool from Debian's package, unpacked (no service starts): the tests run both.
$(PROMETHEUS):
	mkdir -p .tools/deb
	cd .tools/deb && (apt-get download prometheus || (apt-get update -q && apt-get download prometheus))
	dpkg -x .tools/deb/prometheus_*.deb .tools/prometheus
	test -x $@

# nginx from Debian's package, unpacked (no service starts): the balancer tests run it in front of
# several `mha serve` replicas (deploy/nginx/mha-serve.conf).
# (after Prometheus's, and libb64 after it: a missing package list is fetched by `apt-get update`,
# which two at once would contend for)
$(NGINX): | $(PROMETHEUS)
	mkdir -p .tools/deb
	cd .tools/deb && (apt-get download nginx || (apt-get update -q && apt-get download nginx))
	dpkg -x .tools/deb/nginx_*.deb .tools/nginx
	test -x $@

# Triton's perf_analyzer (tritonclient 2.40.0's wheel, its own venv) and Debian's libb64, which it
# needs: the tests drive the server with it in every mode.
$(PERF_STAMP): constraints-perf.txt
	test -x $(PERF_VENV)/bin/python || $(PYTHON) -m venv $(PERF_VENV)
	$(PERF_VENV)/bin/python -m pip install -q -r constraints-perf.txt
	touch $@

$(LIBB64): | $(NGINX)
	mkdir -p .tools/deb
	cd .tools/deb && (apt-get download libb64-0d || (apt-get update -q && apt-get download libb64-0d))
	dpkg -x .tools/deb/libb64-0d_*.deb .tools/libb64
	test -f $@

# gRPC for Node.js, pinned by tests/e2e/node/package-lock.json: the test of docs/api.md's Node.js
# client (tests/e2e/test_node_client.py), which Python's tests do not need.
# Where npm is missing, or cannot reach its registry, that test is skipped and says why.
node-client:
	@if ! command -v npm > /dev/null; then echo "npm not found: $(NODE_SKIPPED)"; \
	else $(MAKE) -s --no-print-directory $(NODE_CLIENT) || echo "npm ci failed (above): $(NODE_SKIPPED)"; fi

$(NODE_CLIENT): tests/e2e/node/package.json tests/e2e/node/package-lock.json
	mkdir -p .tools/node
	cp tests/e2e/node/package.json tests/e2e/node/package-lock.json .tools/node/
	npm ci --prefix .tools/node --ignore-scripts --no-audit --no-fund --loglevel=error

$(STAMP): pyproject.toml constraints.txt
	@echo "installing into $(VENV) (pinned by constraints.txt; the first time takes a few minutes)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored: it is neither" || true
	@$(PY) -m pip install -q -c constraints.txt -e '.[dev,gpu]' > $(VENV)/install.log 2>&1 \
		|| { cat $(VENV)/install.log; exit 1; }
	@touch $@

$(TRITON_STAMP): constraints-triton.txt
	test -x $(TRITON_VENV)/bin/python || $(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/python -m pip install -q -r constraints-triton.txt
	touch $@

serve: $(STAMP)
	@$(VENV)/bin/mha serve $(ARGS)

export: $(STAMP)
	$(VENV)/bin/mha export --out $(MODEL_DIR) --force $(ARGS)  # the default model, made again in place

# Two test processes (pytest-xdist), each file's tests in one of them: most of the suite's time is
# spent waiting for servers it starts, so CI's 2 CPUs finish it in about 0.6x the time of one.
TEST_PROCESSES ?= 2
test: install
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist loadfile $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

proto: $(STAMP)
	$(PY) protos/generate.py

deploy-gen: $(STAMP)
	$(PY) deploy/generate.py

# The default model, exported where `make serve` leaves it, if it is not there yet: the benchmarks
# serve it (`make export` makes it again, in place)
$(MODEL_DIR)/manifest.json: | $(STAMP)
	$(VENV)/bin/mha export --out $(MODEL_DIR)

bench: $(STAMP) $(MODEL_DIR)/manifest.json
	$(PY) bench/onnx_graphs.py
	$(PY) bench/batching.py

# KServe and MLServer, each in its own environment (their pins: bench/constraints/), for
# bench/compare.py; not needed by the tests.
bench-servers: .venv-kserve/.installed .venv-mlserver/.installed .venv-tritonserver/.installed $(MODEL_DIR)/manifest.json

.venv-%/.installed: bench/constraints/%.txt
	test -x .venv-$*/bin/python || $(PYTHON) -m venv .venv-$*
	.venv-$*/bin/python -m pip install -q -r $<
	touch $@

clean:
	rm -rf $(VENV) $(TRITON_VENV) $(PERF_VENV) .venv-kserve .venv-mlserver .venv-tritonserver models .tools
