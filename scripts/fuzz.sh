#!/usr/bin/env bash
# Fuzzing: builds every fuzz target in fuzz/ with the pinned nightly and
# cargo-fuzz, then runs each for a fixed time against a copy of its committed
# seeds (fuzz/seeds/<target>/; the run never writes there). One line per target
# with its executions; exits non-zero on any crash, naming the input that
# caused it (kept in fuzz/artifacts/<target>/ and printed in base64).
#
#   scripts/fuzz.sh                  every target, STRAIT_FUZZ_SECONDS (20) each
#   scripts/fuzz.sh dns jwt          only these
#   STRAIT_FUZZ_SECONDS=600 scripts/fuzz.sh policy
#
# CI runs it from scripts/test.sh. Reproduce a crash with
#   cargo +<pinned nightly> fuzz run --fuzz-dir fuzz <target> <input>
source "$(dirname "$0")/lib.sh"
cd "$STRAIT_ROOT" || exit 1

# The pins: the toolchain in fuzz/rust-toolchain.toml, cargo-fuzz here.
CARGO_FUZZ_VERSION=0.13.2
SECONDS_PER_TARGET="${STRAIT_FUZZ_SECONDS:-20}"
[[ "$SECONDS_PER_TARGET" =~ ^[1-9][0-9]*$ ]] || die "STRAIT_FUZZ_SECONDS=$SECONDS_PER_TARGET: give a whole number of seconds per target"

toolchain="$(sed -n 's/^channel *= *"\(.*\)"/\1/p' fuzz/rust-toolchain.toml)"
[[ -n "$toolchain" ]] || die "fuzz/rust-toolchain.toml names no channel"
if ! rustup run "$toolchain" rustc --version >/dev/null 2>&1; then
  say "installing the fuzz toolchain $toolchain"
  rustup toolchain install "$toolchain" --profile minimal ||
    die "cannot install $toolchain: libFuzzer needs this nightly; install it with rustup, or move the pin in fuzz/rust-toolchain.toml to an installed dated nightly"
fi

# cargo-fuzz, built once per version into the project's cache.
tools="${STRAIT_CACHE_DIR:-$HOME/.cache/strait}/tools/cargo-fuzz-$CARGO_FUZZ_VERSION"
if [[ ! -x "$tools/bin/cargo-fuzz" ]]; then
  say "installing cargo-fuzz $CARGO_FUZZ_VERSION into $tools"
  cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked --quiet --root "$tools"
fi
export PATH="$tools/bin:$PATH"
# Build outputs in the project's cache, shared by every clone (CI's is a fresh
# one each time): the dependencies (kube, quinn, … under the sanitizer) build
# once per toolchain and lock file, only Strait's own crates again.
fuzz_target_dir="${STRAIT_CACHE_DIR:-$HOME/.cache/strait}/fuzz-target/$toolchain"
# `--fuzz-dir` before the target's own arguments (after `--` they go to libFuzzer).
fuzz() {
  case "$1" in
  build | run) cargo "+$toolchain" fuzz "$1" --fuzz-dir fuzz --target-dir "$fuzz_target_dir" "${@:2}" ;;
  *) cargo "+$toolchain" fuzz "$1" --fuzz-dir fuzz "${@:2}" ;;
  esac
}

export CARGO_INCREMENTAL=0
if (($#)); then targets=("$@"); else mapfile -t targets < <(fuzz list); fi
((${#targets[@]})) || die "no fuzz target found in fuzz/Cargo.toml"
for target in "${targets[@]}"; do
  [[ -d "fuzz/seeds/$target" ]] || die "fuzz target $target has no seeds: commit a few inputs to fuzz/seeds/$target/"
done

say "fuzz: building every target with $(rustup run "$toolchain" rustc --version) and cargo-fuzz $CARGO_FUZZ_VERSION"
start=$SECONDS
fuzz build
say "fuzz: built in $((SECONDS - start)) s"

work="fuzz/target/run"
rm -rf "$work"
failed=()
for target in "${targets[@]}"; do
  corpus="$work/corpus/$target" log="$work/$target.log"
  mkdir -p "$corpus"
  cp -R "fuzz/seeds/$target/." "$corpus/"
  seeds="$(find "$corpus" -type f | wc -l)"
  status=ok
  if ! fuzz run "$target" "$corpus" -- \
    -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 >"$log" 2>&1; then
    status=FAILED
    failed+=("$target")
  fi
  execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)"
  inputs="$(find "$corpus" -type f | wc -l)"
  echo "fuzz $target: ${execs:-?} executions in ${SECONDS_PER_TARGET} s, corpus $seeds -> $inputs inputs, $status"
  if [[ "$status" != ok ]]; then
    tail -n 40 "$log" >&2
    input="$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -1)"
    if [[ -n "$input" && -f "$input" ]]; then
      echo "fuzz $target: crash input $input (base64: $(head -c 4096 "$input" | base64 -w0))" >&2
      echo "fuzz $target: reproduce with cargo +$toolchain fuzz run --fuzz-dir fuzz $target $input" >&2
    fi
  fi
done
((${#failed[@]} == 0)) || die "fuzz: ${failed[*]} failed (log above; full logs in $work/)"
say "fuzz: every target ran ${SECONDS_PER_TARGET} s without a crash"
