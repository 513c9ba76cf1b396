#!/usr/bin/env bash
# Another commit's source beside the checkout, for the fair harness's ``tree=NAME`` knob
# (fairplan.COMMON_KNOBS): a before/after comparison of two commits in one device call.
#
#   bash benchmarks/fair/tree.sh pack NAME COMMIT   # here (a git checkout): .trees/NAME from COMMIT
#   bash benchmarks/fair/tree.sh build NAME         # on the device: build its extension in place
#
# `.trees/` is ignored by git: carry it to the device (run's carry: [".trees"]). The copy holds
# src/, csrc/, setup.py and pyproject.toml of COMMIT and a COMMIT file the rows record.
set -eu -o pipefail
cmd=${1:?usage: tree.sh pack NAME COMMIT | build NAME}; name=${2:?NAME}
root=$(cd "$(dirname "$0")/../.." && pwd); dir=$root/.trees/$name
case $cmd in
  pack) commit=${3:?COMMIT}
    full=$(git -C "$root" rev-parse --verify "$commit^{commit}")
    rm -rf "$dir"; mkdir -p "$dir"
    git -C "$root" archive "$full" src csrc setup.py pyproject.toml | tar -x -C "$dir"
    echo "$full" > "$dir/COMMIT"
    echo "packed $full into $dir ($(du -sh "$dir" | cut -f1))" ;;
  build)
    [ -f "$dir/COMMIT" ] || { echo "tree.sh: no $dir/COMMIT: pack it first (tree.sh pack $name <commit>)" >&2; exit 1; }
    (cd "$dir" && python3 setup.py build_ext --inplace > build.log 2>&1) \
      || { echo "tree.sh: building $dir failed: $(tail -1 "$dir/build.log")" >&2; exit 1; }
    echo "built $dir ($(cat "$dir/COMMIT"))" ;;
  *) echo "tree.sh: unknown command $cmd: use pack or build" >&2; exit 2 ;;
esac
