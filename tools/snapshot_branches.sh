#!/usr/bin/env bash
# snapshot_branches.sh BRANCH... -- writes each branch's tree (git archive, no history) to
# .branches/<branch with / as ->/ (git-ignored), for the device call that validates and
# times lab branches side by side (tools/gpu_branches.sh); carry ".branches" with it.
set -eu
root=$(git rev-parse --show-toplevel)
mkdir -p "$root/.branches"
grep -qx ".branches/" "$root/.git/info/exclude" 2>/dev/null || echo ".branches/" >> "$root/.git/info/exclude"
for br in "$@"; do
  dir="$root/.branches/${br//\//-}"
  rm -rf "$dir"; mkdir -p "$dir"
  git -C "$root" archive "$br" kernels core tools | tar -x -C "$dir"
  echo "$br $(git -C "$root" rev-parse --short "$br") -> .branches/${br//\//-}"
  git -C "$root" rev-parse "$br" > "$dir/COMMIT"
done
du -sh "$root/.branches"
