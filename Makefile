# Every target makes .venv on its own when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-10)
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20

.PHONY: run test bench synth layer lint docs clean migrate soak

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[local,dev,cdk,demo]'
	@rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)

# The platform on the embedded PostgreSQL and Redis, the demo workload with live progress and its report
# (.aivedio/demo-report.html), then serving on :8080 until Ctrl-C. DEMO=0: only serve (no tenants, no workload).
DEMO ?= 1
run: $(STAMP)
ifeq ($(DEMO),0)
	$(VENV)/bin/aivedio demo --serve --no-workload
else
	$(VENV)/bin/aivedio demo --serve
endif

# The dashboard's browser test (tests/e2e/test_dashboard_browser.py) drives Debian's chromium through
# Playwright; installed once when missing. Without it (no root, no network) the test fails and says
# why; AIVEDIO_SKIP_BROWSER=1 skips both.
CHROMIUM ?= /usr/bin/chromium
$(CHROMIUM):
	@if [ "$$AIVEDIO_SKIP_BROWSER" != 1 ] && ! command -v chromium >/dev/null 2>&1; then \
	  echo "Installing Debian's chromium for the browser test (apt-get)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
	    || echo "chromium could not be installed: tests/e2e/test_dashboard_browser.py will fail (AIVEDIO_SKIP_BROWSER=1 skips it)"; \
	fi

test: $(STAMP) $(CHROMIUM)
	$(PY) -m pytest -n 2 --dist loadgroup --timeout=600 $(PYTEST_ARGS)

migrate: $(STAMP)
	$(VENV)/bin/aivedio db migrate

# The Lambda layers, without Docker: Linux wheels for python3.12 plus shared/aivedio (core), PyAV (media) (layers/build.py).
layer: $(STAMP)
	$(PY) layers/build.py

# cdk.out, offline (no Docker, no AWS credentials): the app run directly, as `cdk synth` would run it.
# STAGE=dev|prod|dev,prod. Fails on cdk-nag errors, then cfn-lint checks the templates.
STAGE ?= dev
synth: layer
	rm -rf cdk.out
	CDK_OUTDIR=cdk.out CDK_CONTEXT_JSON='{"stage":"$(STAGE)"}' $(PY) -m infra_cdk.app
	$(VENV)/bin/cfn-lint --ignore-checks W3005 -- cdk.out/*.template.json

# Chaos seeds one after another for SOAK_SECONDS (0: until Ctrl-C), the known failing seeds first
# (tests/reliability/chaos_failing_seeds.txt); a seed that fails is added there.
SOAK_SECONDS ?= 0
soak: $(STAMP)
	$(VENV)/bin/aivedio chaos soak --seconds $(SOAK_SECONDS)

bench: $(STAMP)
	$(VENV)/bin/aivedio bench --json

# docs/configuration.md and docs/cli.md, from the config model and the CLI's parsers.
docs: $(STAMP)
	$(PY) -m aivedio_tools.docs

# The house's static rules (tests/unit/test_house.py) and the docs' freshness and links (tests/unit/test_docs.py).
lint: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/unit/test_house.py tests/unit/test_docs.py

clean:
	rm -rf $(VENV) .aivedio cdk.out build
