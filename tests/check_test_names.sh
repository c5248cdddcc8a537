#!/usr/bin/env bash
# Fails when a Catch2 test case name holds a ';' (CMake's list handling splits such a test into
# two ctest entries that match no test case) or starts with '-' (the test binary then reads the
# name as an option); with --warn NoTests those entries fail too; this names the culprit. Also
# refuses names whose ": " would make Catch's console reporter loop when the test fails. Prints
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
    # Catch2's console reporter wraps a failing test's header at 79 columns, its continuation lines
    # indented to just after the name's first ": ". Where that indent leaves 0 or 1 columns
    # (TextFlow's calcLength: width - 1 characters a line) it prints the same line without end (62
    # GB here from a ": " ending at column 79); 2 and 3 columns are refused as well.
    if ((${#name} > 79)) && [[ $name == *': '* ]]; then
      head=${name%%': '*}
      indent=$((${#head} + 2))
      if ((indent >= 76 && indent <= 79)); then
        echo "test name in $(basename "$bin") would hang Catch's reporter on failure (': ' ending at column $indent): $name"
        bad=$((bad + 1))
      fi
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
