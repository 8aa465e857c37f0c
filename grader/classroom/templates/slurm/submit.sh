#!/usr/bin/env bash
# Grade a class on a Slurm cluster: SHARDS array tasks (one GPU each), then the merge.
#   SUBMISSIONS=/path/subs OUT=/path/out SHARDS=20 [STAGES=01,02] [HIDDEN=/path/hidden] \
#       bash submit.sh
set -euo pipefail
: "${SUBMISSIONS:?set SUBMISSIONS}" "${OUT:?set OUT}" "${SHARDS:?set SHARDS (how many tasks)}"
here=$(dirname "$0")
export SUBMISSIONS OUT STAGES HIDDEN
grade=$(sbatch --parsable --export=ALL --array="1-$SHARDS" "$here/grade-shard.sbatch")
# afterany: the merge runs even when a task failed, and names what is missing
sbatch --export=ALL --dependency="afterany:${grade%%;*}" "$here/merge.sbatch"
echo "submitted: grading array $grade, merge after it; reports in $OUT"
