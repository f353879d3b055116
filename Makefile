# Two entry points: `make test` (sets up .venv and runs the fast suite) and
# `make demo` (runs the main job). Both create the virtualenv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo sim-demo long sim bench clean fuse bytecode

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	@$(MAKE) --no-print-directory fuse
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# An installed wheel has its bytecode compiled by pip. An editable install compiles on
# import and caches it, unless PYTHONDONTWRITEBYTECODE is set (it is on some CI images):
# then every `raftkv serve` process would compile the package again, about 0.2 s of CPU
# per start. compileall writes what is missing or stale and skips the rest.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q raftkv storage recovery >/dev/null

test: $(STAMP) bytecode
	$(BIN)/ruff check raftkv storage recovery benchmarks tests
	# storage/ and recovery/ install as raftkv.storage and raftkv.recovery (pyproject's
	# package-dir). mypy cannot follow that mapping, so it checks a tree of symlinks laid
	# out as installed.
	rm -rf build/typecheck && mkdir -p build/typecheck
	cp -rs $(CURDIR)/raftkv build/typecheck/raftkv
	cp -rs $(CURDIR)/storage build/typecheck/raftkv/storage
	cp -rs $(CURDIR)/recovery build/typecheck/raftkv/recovery
	cd build/typecheck && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml \
		raftkv/core raftkv/node raftkv/transport raftkv/server raftkv/kv.py raftkv/embedded.py \
		raftkv/statemachine.py raftkv/client.py raftkv/cli.py raftkv/demo.py raftkv/testing/procs.py \
		raftkv/tls.py raftkv/certs.py raftkv/testing/raw_peer.py raftkv/admin.py raftkv/log_limits.py \
		raftkv/spark raftkv/compat raftkv/storage raftkv/recovery raftkv/errors.py raftkv/placement \
		raftkv/backup.py raftkv/testing/powerloss_fs.py raftkv/testing/powerloss_daemon.py \
		raftkv/testing/powerloss_undo.py raftkv/testing/powerloss_workload.py \
		raftkv/testing/powerloss_procs.py
	$(BIN)/python -m pytest

# The power-loss tests (tests/test_powerloss_fs.py) mount a FUSE filesystem: libfuse 3 and
# fusermount3 are Debian's fuse3 package. Installed here when missing, if we are root and
# have apt-get; otherwise (or if apt fails) this only says why those tests will skip, and
# the build goes on.
fuse:
	@if command -v fusermount3 >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "fuse3 is not installed (installing it needs root and apt-get):" \
			"the power-loss tests will skip"; \
	else \
		echo "installing fuse3 for the power-loss tests"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q fuse3 >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q fuse3 >/dev/null 2>&1; } || \
		echo "could not install fuse3: the power-loss tests will skip"; \
	fi

# Opt-in long mode: thousands of simulator seeds and longer soaks.
long: $(STAMP) bytecode
	$(BIN)/python -m pytest -m long -o addopts=-q

demo: $(STAMP) bytecode
	$(BIN)/python -m raftkv.demo

# The same story on the pure core in one process, stamped with simulated ticks.
sim-demo: $(STAMP) bytecode
	$(BIN)/python -m raftkv.sim_demo

sim: $(STAMP)
	$(BIN)/python -m raftkv.sim --seeds 0:200 --nodes 5

# Benchmarks print tables, write JSON and draw PNGs under benchmarks/results/.
bench: $(STAMP) bytecode
	$(BIN)/pip install -q -e '.[dev,bench]'
	$(BIN)/python -m benchmarks.core_throughput --sweep
	$(BIN)/python -m benchmarks.log_append
	$(BIN)/python -m benchmarks.recovery
	$(BIN)/python -m benchmarks.throughput --all
	$(BIN)/python -m benchmarks.compat_pysyncobj
	$(BIN)/python -m benchmarks.heal
	$(BIN)/python -m benchmarks.kv_api
	$(BIN)/python -m benchmarks.http_vs_etcd

clean:
	rm -rf $(VENV) build *.egg-info
