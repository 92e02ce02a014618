# The two commands of the README: `make demo` runs the main job on the default model, `make test` the tests.
CARGO ?= cargo

.PHONY: model openai build demo test lint bench check-metal gpu-check-cpu

model:
	./scripts/fetch-model.sh

# The official `openai` Python client, which tests/serve_openai.rs drives against `probespec serve`.
openai:
	@python3 -c 'import openai' 2>/dev/null || python3 -m pip install --quiet openai || \
		{ echo "cannot install the openai Python package: run 'python3 -m pip install openai'" >&2; exit 1; }

build:
	$(CARGO) build --release

demo: model
	$(CARGO) run --release --quiet -- "What is the capital of Germany?"

test: model openai
	$(CARGO) test --release

lint:
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets -- -D warnings

bench: model
	$(CARGO) bench

check-metal:
	./scripts/check-metal.sh

# scripts/gpu-check.sh's steps on the CPU through a GPU device's code path (about 4 minutes once `make test` built the tests; CI runs it).
gpu-check-cpu: model
	./scripts/gpu-check.sh --device cpu
