# Set-up is part of every target: a fresh machine needs only python3 (3.11+), make and apt.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DATA = $(shell $(BIN)/python scripts/fetch_test_data.py --print-dir)
DEMO_MODEL = $(DATA)/models/ppocrv4_det.onnx
DEMO_VARIANT = $(DATA)/models/ppocrv4_det_int8.onnx
DEMO_SHAPE = x=1x3x640x640

.PHONY: run demo-bench test test-fast test-isa-avx2 data venv lint system-deps clean

# Debian's python3 has no venv/ensurepip without python3-venv: installed here when we are root
# (system-deps runs later, after the venv exists).
$(BIN)/.installed: pyproject.toml
	@$(PY) -c "import ensurepip, venv" 2>/dev/null || { [ "$$(id -u)" = 0 ] && \
	  apt-get update -q >/dev/null && apt-get install -y -q python3-venv >/dev/null; } || \
	  { echo "make: $(PY) cannot make a venv: apt-get install python3-venv (as root)"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/pip install -q --disable-pip-version-check -e ".[test]"
	touch $@

venv: $(BIN)/.installed

# dtc checks our device-tree parser, mosquitto is the broker the telemetry tests start,
# python3-venv gives Debian's python3 its venv/ensurepip; installed when we are root, else
# those tests skip with the reason.
SYSTEM_PKGS = device-tree-compiler mosquitto mosquitto-clients debootstrap python3-venv
system-deps:
	@{ command -v dtc >/dev/null && [ -x /usr/sbin/mosquitto ] && command -v mosquitto_sub >/dev/null && command -v debootstrap >/dev/null && $(PY) -c "import ensurepip, venv" 2>/dev/null; } || \
	  { [ "$$(id -u)" = 0 ] && \
	  { apt-get update -q >/dev/null; apt-get install -y -q $(SYSTEM_PKGS) >/dev/null; } || \
	  echo "make: not root: apt-get install $(SYSTEM_PKGS) for the tests that need them"; }

data: venv
	$(BIN)/python scripts/fetch_test_data.py

# The daemon in the foreground on the demo config (Ctrl-C stops it): http://127.0.0.1:8000
run: data
	$(BIN)/edged --config examples/edged.toml

demo-bench: data
	$(BIN)/edgectl backends --model $(DEMO_MODEL) --variant $(DEMO_VARIANT) --shape $(DEMO_SHAPE)
	$(BIN)/edgectl bench $(DEMO_VARIANT) --backend all --shape $(DEMO_SHAPE) --runs 100

# The normal suite, with the isa-avx2 lane alongside it (CI runs only `make test`, so both run
# there): the lane is one emulated thread, and the suite leaves a core idle for much of its
# time (daemons, brokers and outages it waits on), so side by side they take about the
# suite's time instead of the sum. The lane's output is printed after the suite's; either
# failing fails the target.
# The suite runs in TEST_WORKERS processes (pytest-xdist), each taking a whole test file at a
# time (--dist loadfile: a file's fixtures are made once, the aarch64 lane's file runs beside
# the others). Much of the suite waits (daemons, brokers, outages), so three keep 2 cores busy.
# The tests marked `alone` (the tuning loop's, which judge a change by the latencies it
# leaves) run last, by themselves: beside the suite, its other workers on the inference core
# drown the effect they verify.
TEST_WORKERS ?= 3
test: data system-deps
	@$(BIN)/python scripts/qemu_user.py --print-path x86_64 >/dev/null  # fetched before, not by both
	@lane_log=$$(mktemp); \
	( $(ISA_AVX2_LANE_SH) ) >"$$lane_log" 2>&1 & lane=$$!; \
	trap 'pkill -TERM -P $$lane 2>/dev/null; kill $$lane 2>/dev/null; rm -f "$$lane_log"; exit 130' INT TERM HUP; \
	echo "isa-avx2 lane: running alongside the suite (its output follows the suite's)"; \
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not alone" --durations=25; suite=$$?; \
	wait $$lane; lane_rc=$$?; cat "$$lane_log"; rm -f "$$lane_log"; \
	echo "alone: the tests that judge latencies, on the machine the suite and lane have left"; \
	$(BIN)/pytest -q -m alone --durations=5; alone=$$?; [ $$alone -ne 5 ] || alone=0; \
	[ $$suite -eq 0 ] && [ $$lane_rc -eq 0 ] && [ $$alone -eq 0 ]

# The unit tests alone, in about a minute: no data fetch, no daemon, broker or emulator (markers: pyproject.toml).
test-fast: venv
	$(BIN)/pytest -q -m "not slow and not integration and not isa and not needs_data and not timing"

# The isa-avx2 lane: the tests marked `isa` once more under QEMU's user-mode x86_64 emulator
# as a Haswell (AVX2 and FMA, no AVX-512, no VNNI), so INT8 bugs of AVX2-only x86 CPUs show
# whatever CPU this machine has. CPUID is the emulated CPU's, /proc/cpuinfo the host's;
# EDGED_ISA_LANE tells the tests which CPU they are on. The emulator is Debian trixie's static
# qemu-user, fetched into the test-data cache by scripts/qemu_user.py (bookworm's 7.2 crashes
# on onnxruntime). -hle,-rtm: TCG has no TSX, and plain Haswell warns so on every start.
# qemu-user does not follow exec: tests start their Python children through EDGED_ISA_QEMU
# (tests/support/daemon_harness.py python_argv), so those run emulated too.
# pytest's exit 5 (no test selected) is no failure here: the lane may have nothing to run.
# The emulator's path is asked for in the recipe, not with $(shell), so `make -n` fetches nothing
# and a failed fetch stops the lane with the script's message and exit code.
ISA_AVX2_CPU = Haswell,-hle,-rtm
define ISA_AVX2_LANE_SH
QEMU_X86=$$($(BIN)/python scripts/qemu_user.py --print-path x86_64) || exit 1; \
echo "isa-avx2 lane: $$QEMU_X86 -cpu $(ISA_AVX2_CPU)"; \
EDGED_ISA_LANE=avx2 EDGED_ISA_QEMU="$$QEMU_X86 -cpu $(ISA_AVX2_CPU)" \
  "$$QEMU_X86" -cpu $(ISA_AVX2_CPU) $(BIN)/python -m pytest -q -m isa --durations=15 \
  -p no:cacheprovider; \
rc=$$?; [ $$rc -ne 5 ] || { echo "isa-avx2 lane: no isa test was selected"; rc=0; }; exit $$rc
endef

test-isa-avx2: data
	@$(ISA_AVX2_LANE_SH)

# The aarch64 lane's root: bookworm arm64 + aarch64 wheels for qemu-user, pinned and cached.
# `make test` runs the lane as part of the suite (tests/lanes/test_arm64*.py, marked arm64: the
# host's pytest runs edged's programs in the root under qemu-aarch64 -cpu cortex-a76); this runs
# it alone.
.PHONY: arm64-root test-arm64
arm64-root: data
	$(BIN)/python scripts/arm64_root.py

test-arm64: data system-deps
	$(BIN)/pytest -q -m arm64 --durations=10

# ruff (lint and the formatter's check) on everything; mypy on the three packages.
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
