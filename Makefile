# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PY := .venv/bin/python
HOST ?= 127.0.0.1
PORT ?= 8080
CONFIG ?= configs/default.toml
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: install run test models bench check clean-models

install:
	@bash scripts/bootstrap.sh

run: install
	$(PY) -m proxy.models default
	.venv/bin/statecache serve --config $(CONFIG) --host $(HOST) --port $(PORT)

# Synthetic GGUFs (deterministic) into models/, the default model and Gemma 3 270M (SWA tests).
models: install
	$(PY) -m tools.synth_gguf all --out models
	$(PY) -m proxy.models default
	$(PY) -m proxy.models gemma

test: install models
	$(PY) -m pytest $(PYTEST_ARGS)

check: install
	.venv/bin/ruff check statecache proxy tests tools bench
	.venv/bin/mypy
	$(PY) -m tools.check_imports
	$(PY) -m tools.check_sizes

# The 0.8B-class and mid hybrids are generated once (slow); skipped when present.
bench: install models
	$(PY) -m tools.synth_gguf bench bench-draft --out models
	$(PY) -m tools.synth_gguf mid mid-draft --out models
	$(PY) -m bench.run $(BENCH_ARGS)

# Claude Code, the Codex CLI and opencode (pinned, from npm into build/agents/npm) against
# statecache on SmolLM2 and Gemma 3: one row per request they make (tools/agents.py; not part
# of `make test`).
AGENTS_ARGS ?=
.PHONY: agents
agents: install
	$(PY) -m tools.agents $(AGENTS_ARGS)

clean-models:
	rm -rf models/
