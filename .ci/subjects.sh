#!/usr/bin/env bash
# Every commit after BASE has a subject of at most 72 characters (the house habit, held by CI
# from BASE on: older commits are history). In a clone that lacks BASE (a shallow one), HEAD alone is checked.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=0f5bcb160fbc3a6ae3b7fd969a94866e2088bdbc
MAX=72
if git cat-file -e "$BASE^{commit}" 2>/dev/null; then
  range=("$BASE..HEAD")
else
  echo "commit subjects: $BASE is not in this clone's history; checking HEAD only"
  range=(-n 1 HEAD)
fi
long=$(git log --format='%h %s' "${range[@]}" | awk -v max="$MAX" '{ s = substr($0, index($0, " ") + 1) } length(s) > max')
if [ -n "$long" ]; then
  echo "commit subjects over $MAX characters:"
  echo "$long"
  exit 1
fi
echo "commit subjects: all within $MAX characters"
