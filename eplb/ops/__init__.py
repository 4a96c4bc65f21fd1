"""Operations: how people run, watch and steer the runtime.

`cli` (the `eplb` command; `record` and `simulate_report` / `scale_report` run two of
its subcommands, `plots` draws their figures), `demo` / `demo_hf` (the demo job, on CPU
or CUDA; `demo_hf`, --model, on CPU only; `demo_args` their arguments), `launch`
(torchrun helpers), `metrics` (Prometheus figures from runtime events), `server` (the
HTTP endpoint on rank 0: /metrics, /healthz, /placement, /load, POST /rebalance;
`http_base` its hardened plumbing) and `client` (the HTTP client the CLI uses),
`progress` (progress bars), `gpu_cost` (expert work timed on a GPU). Nothing here moves
weights itself: it calls `eplb.runtime` and `eplb.core`, which never import it.
"""
