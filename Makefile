# Set-up is part of every target: a fresh machine needs only python3 (3.11+), make and apt.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DATA = $(shell $(BIN)/python scripts/fetch_test_data.py --print-dir)
DEMO_MODEL = $(DATA)/models/ppocrv4_det_int8.onnx
DEMO_SHAPE = x=1x3x640x640

.PHONY: run demo-bench test data venv lint system-deps clean

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
	$(BIN)/edgectl backends --model $(DEMO_MODEL) --shape $(DEMO_SHAPE)
	$(BIN)/edgectl bench $(DEMO_MODEL) --backend all --shape $(DEMO_SHAPE) --runs 100

test: data system-deps
	$(BIN)/pytest -q

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
