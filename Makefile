# Every target makes .venv on its own when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-10)
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20

.PHONY: run test bench synth layer lint clean migrate

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[local,dev,cdk]'
	@rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)

run: $(STAMP)
	@echo "Starting the platform on the embedded default (Ctrl-C stops it)."
	@echo "Then: $(VENV)/bin/aivedio admin tenant create --name acme --service-class PAID_SHARED --weight 2 --credits 10000 --json"
	@echo "      curl http://127.0.0.1:8080/healthz"
	$(VENV)/bin/aivedio serve

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup --timeout=600 $(PYTEST_ARGS)

migrate: $(STAMP)
	$(VENV)/bin/aivedio db migrate

# The shared Lambda layer, without Docker: Linux wheels for python3.12 plus shared/aivedio (layers/build.py).
layer: $(STAMP)
	$(PY) layers/build.py

# cdk.out, offline (no Docker, no AWS credentials): the app run directly, as `cdk synth` would run it.
# STAGE=dev|prod|dev,prod. Fails on cdk-nag errors, then cfn-lint checks the templates.
STAGE ?= dev
synth: layer
	rm -rf cdk.out
	CDK_OUTDIR=cdk.out CDK_CONTEXT_JSON='{"stage":"$(STAGE)"}' $(PY) -m infra_cdk.app
	$(VENV)/bin/cfn-lint --ignore-checks W3005 -- cdk.out/*.template.json

bench: $(STAMP)
	$(VENV)/bin/aivedio bench --json

clean:
	rm -rf $(VENV) .aivedio cdk.out build
