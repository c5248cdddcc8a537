#!/usr/bin/env bash
# Fails when a Catch2 test case name holds a ';' (CMake's list handling splits such a test into
# two ctest entries that match no test case) or starts with '-' (the test binary then reads the
# name as an option); with --warn NoTests those entries fail too; this names the culprit. Prints
# how many names it checked.
set -euo pipefail
bad=0
total=0
for bin in "$@"; do
  while IFS= read -r name; do
    [[ -z $name ]] && continue
    total=$((total + 1))
    if [[ $name == *';'* ]]; then
      echo "test name in $(basename "$bin") holds ';': $name"
      bad=$((bad + 1))
    fi
    if [[ $name == -* ]]; then
      echo "test name in $(basename "$bin") starts with '-' (read as an option): $name"
      bad=$((bad + 1))
    fi
  done < <("$bin" --list-test-names-only)
done
if ((total == 0)); then echo "no test names listed"; exit 1; fi
if ((bad)); then exit 1; fi
echo "$total test names, all whole"
