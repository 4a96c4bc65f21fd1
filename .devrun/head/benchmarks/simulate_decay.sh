#!/usr/bin/env bash
# Decay sweep of `eplb simulate` on the packaged ESFT trace, EP16, 80 slots.
# Usage: bash benchmarks/simulate_decay.sh [POLICY] [AGGREGATE] [INTERVAL] [WINDOWS] [DECAYS]
# Prints one markdown row per window: mean out-of-sample imbalance for each decay.
set -euo pipefail
policy=${1:-default}; agg=${2:-20}; interval=${3:-1}
windows=${4:-"1 2 3 4 6 9"}; decays=${5:-"1 0.8 0.6 0.5 0.4 0.3 0.2 0.1"}
eplb=${EPLB:-eplb}
echo "| window \\ decay | $(echo $decays | sed 's/ / | /g') |"
for w in $windows; do
  row="| $w |"
  for d in $decays; do
    m=$($eplb simulate esft --num-gpus 16 --num-slots 80 --aggregate "$agg" --window-size "$w" \
          --rebalance-interval "$interval" --load-decay "$d" --policy "$policy" --no-oracle |
        awk -v p="$policy" '$1 == p {print $2}')
    row="$row $m |"
  done
  echo "$row"
done
