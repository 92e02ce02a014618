#!/usr/bin/env bash
# Type-checks the `metal` feature for Apple silicon from Linux: `cargo check --target aarch64-apple-darwin`
# with warnings denied. The C dependencies' build scripts (ring, oniguruma) cannot cross-compile for macOS
# without Apple's SDK, and `cargo check` links nothing, so their build scripts are overridden.
# Needs the target's standard library: rustup target add aarch64-apple-darwin.
set -euo pipefail
cd "$(dirname "$0")/.."
cfg=$(mktemp -d)/config.toml
cat >"$cfg" <<'TOML'
[target.aarch64-apple-darwin.ring_core_0_17_14_]
rustc-env = { RING_CORE_PREFIX = "ring_core_0_17_14_" }
[target.aarch64-apple-darwin.onig]
rustc-cfg = []
TOML
rustup target list --installed | grep -qx aarch64-apple-darwin || rustup target add aarch64-apple-darwin
RUSTFLAGS="-D warnings" cargo check --target aarch64-apple-darwin --features metal --all-targets \
  --target-dir "${CARGO_TARGET_DIR:-target}/metal-check" --config "$cfg"
