"""Operations: how people run, watch and steer the runtime.

`cli` (the `eplb` command), `demo` / `demo_hf` (the CPU demos), `launch` (torchrun
helpers), `metrics` (Prometheus figures from runtime events), `server` (the HTTP
endpoint on rank 0: /metrics, /healthz, POST /rebalance) and `client` (the HTTP client
the CLI uses), `progress` (progress bars). Nothing here moves weights itself: it calls
`eplb.runtime` and `eplb.core`, which never import it.
"""
