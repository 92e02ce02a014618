# The two commands of the README: `make demo` runs the main job on the default model, `make test` the tests.
CARGO ?= cargo

.PHONY: model build demo test lint bench check-metal

model:
	./scripts/fetch-model.sh

build:
	$(CARGO) build --release

demo: model
	$(CARGO) run --release --quiet -- "What is the capital of Germany?"

test: model
	$(CARGO) test --release

lint:
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets -- -D warnings

bench: model
	$(CARGO) bench

check-metal:
	./scripts/check-metal.sh
