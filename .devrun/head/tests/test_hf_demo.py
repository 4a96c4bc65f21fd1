"""`eplb demo --model NAME`: a tiny transformers MoE model under the runtime on 2 gloo
ranks, as users run it. Every printed figure is recomputed from the --json per-step
records (per-GPU and per-expert loads), independently of the demo's own arithmetic."""
from __future__ import annotations

import json
import re
import sys
import textwrap
import time

import numpy as np
import pytest
from _hf import require_transformers

require_transformers()

from test_demo import EPLB, ROOT, check_records, run  # noqa: E402

from eplb.ops.demo_args import HF_ARCHITECTURES  # noqa: E402

# sizes: 2 MoE layers x 8 experts top-2, 64 tokens per rank per step (4 sequences x 16)
SIZES = dict(layers=2, experts=8, top_k=2, hidden=32, intermediate=32, tokens=64, seq_len=16)
STEPS, EVERY = 12, 4


def sizes_argv() -> list[str]:
    return [a for k, v in SIZES.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def static_gpu_load(expert_load: np.ndarray, world: int, slots: int) -> np.ndarray:  # [L, M]
    """The per-GPU load of the start-up placement (slot p holds expert p mod N, GPU r the
    slots [r*S, (r+1)*S), an expert's load split evenly over its slots)."""
    L, N = expert_load.shape
    expert_of_slot = np.arange(slots) % N  # [P]
    replicas = np.bincount(expert_of_slot, minlength=N)  # [N]
    slot_load = expert_load[:, expert_of_slot] / replicas[expert_of_slot]  # [L, P]
    return slot_load.reshape(L, world, slots // world).sum(-1)


def balancedness(gpu: np.ndarray) -> np.ndarray:  # [L, M] -> [L]
    return gpu.mean(-1) / gpu.max(-1)


@pytest.mark.parametrize("arch,dtype", [("qwen3_moe", "float32"), ("deepseek_v3", "bfloat16")])
def test_hf_demo_verify_figures(tmp_path, arch, dtype):
    out = tmp_path / "demo.json"
    t0 = time.monotonic()
    r = run(EPLB + ["demo", "--model", arch, "--dtype", dtype, "--nproc", "2", "--steps", str(STEPS),
                    "--rebalance-interval", str(EVERY), "--verify", "--json", str(out), *sizes_argv()])
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    L, N, W, K = SIZES["layers"], SIZES["experts"], 2, SIZES["top_k"]
    P = N + W  # one redundant slot per rank by default
    records = check_records(out, steps=STEPS, layers=L)
    d = json.loads(out.read_text())
    assert d["args"]["model"] == arch and d["run"]["world_size"] == W
    tol = 1e-5 if dtype == "float32" else 0.25

    # every step: each layer counted every (token, k) choice of both ranks once, per GPU
    # and per expert; the JSON's balancedness figures follow from those loads
    for rec in records:
        gpu, load = np.array(rec["gpu_load"]), np.array(rec["expert_load"])  # [L, M], [L, N]
        assert gpu.shape == (L, W) and load.shape == (L, N)
        assert (gpu.sum(1) == SIZES["tokens"] * K * W).all() and (load.sum(1) == gpu.sum(1)).all()
        assert np.allclose(rec["balancedness"], balancedness(gpu), atol=1e-5)
        assert np.allclose(rec["balancedness_static"], balancedness(static_gpu_load(load, W, P)),
                           atol=1e-5)
        assert 0 <= rec["verify_max_abs_diff"] <= tol

    # one line per rebalance: measured balancedness of the window, predicted after, verify
    events = [(rec["step"], rec["rebalance"]) for rec in records if rec["rebalance"]]
    assert [s for s, _ in events] == [EVERY - 1, 2 * EVERY - 1, 3 * EVERY - 1]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("step ") and " rebalance" in ln]
    assert len(lines) == len(events), r.stdout
    elsize = 4 if dtype == "float32" else 2
    previous = -1
    for (s, e), line in zip(events, lines):
        gpu = np.sum([records[i]["gpu_load"] for i in range(s - EVERY + 1, s + 1)], axis=0)  # [L, M]
        before = float(np.mean(balancedness(gpu)))
        assert abs(np.mean(e["balancedness_before"]) - before) < 1e-5
        assert line.startswith(f"step {s + 1:5d} rebalance")
        if e["skipped"]:
            assert f"balancedness {before:.4f}, nothing moved" in line and e["experts_moved"] == 0
        else:
            after = np.mean(e["balancedness_after_predicted"])
            assert f"balancedness {before:.3f} -> {after:.3f} (predicted)" in line, line
            assert after > before
            assert f"{e['experts_moved']} experts moved, {e['bytes_moved'] / 1e6:.2f} MB" in line
        # whole experts: gate_up [2I, H] + down [H, I] per expert, in the run's dtype
        assert e["bytes_moved"] == e["experts_moved"] * 3 * SIZES["hidden"] * SIZES["intermediate"] * elsize
        diff = max(records[i]["verify_max_abs_diff"] for i in range(previous + 1, s + 1))
        assert e["verify_max_abs_diff"] == diff and e["verify_bad_slots"] == 0
        assert line.endswith(f" | verify: max |diff| {diff:.1e}, bad slots 0 OK"), line
        previous = s
    moved = sum(e["experts_moved"] for _, e in events)
    assert moved > 0

    # the summary: totals, and the balancedness after the first rebalance, EPLB vs static
    skipped = sum(e["skipped"] for _, e in events)
    assert (f"{STEPS} steps in" in r.stdout and f"{len(events)} rebalances"
            + (f" ({skipped} skipped)" if skipped else "") + f", {moved} experts moved, "
            f"{sum(e['bytes_moved'] for _, e in events) / 1e6:.2f} MB" in r.stdout), r.stdout
    after = range(events[0][0] + 1, STEPS)
    eplb = np.mean([np.mean(balancedness(np.array(records[i]["gpu_load"]))) for i in after])
    static = np.mean([np.mean(balancedness(static_gpu_load(np.array(records[i]["expert_load"]), W, P)))
                      for i in after])
    assert (f"EPLB {eplb:.4f} vs static placement {static:.4f} "
            f"(imbalance max/mean {1 / eplb:.3f} vs {1 / static:.3f})") in r.stdout, r.stdout
    assert eplb > static  # the skewed token load leaves the balancer something to do

    # the final check: logits over the run and a greedy generate() against the unmodified model
    v = d["verify"]
    assert v["logits_max_abs_diff"] == max(rec["verify_max_abs_diff"] for rec in records)
    tokens = 8 * (SIZES["tokens"] // SIZES["seq_len"]) * W
    assert v["generate_tokens"] == tokens and v["ok"] is True
    assert v["generate_checked"] is (dtype == "float32")
    if dtype == "float32":
        assert v["generate_mismatched"] == 0
    verify_lines = [ln for ln in r.stdout.splitlines() if ln.startswith("verify: ")]
    assert verify_lines == [
        f"verify: logits max |diff| {v['logits_max_abs_diff']:.1e} over {STEPS} steps "
        f"(tolerance {tol:g}); greedy generate() of 8 tokens x {SIZES['tokens'] // SIZES['seq_len']} "
        f"sequences x {W} ranks: {tokens - v['generate_mismatched']}/{tokens} tokens as the "
        f"unmodified model{'' if dtype == 'float32' else ' (bfloat16: not checked)'} OK"], r.stdout
    assert f"2 ranks on cpu, 1 node, {arch} (" in r.stdout and f"{dtype})" in r.stdout
    assert time.monotonic() - t0 < 120


# Loaded at start-up of every process whose PYTHONPATH holds its directory; on rank 1 only:
#   step:     the expert-parallel layers add 1e-3 to their output at every forward
#   generate: ... scale it by -20 in decoding forwards only (fewer rows than a step's 64)
#   weights:  after the first rebalance one slot's weights get 1e-3 added
PERTURB = {
    "step": """
from moe.hf import experts as _e
_f = _e.ExpertParallelExperts.forward
_e.ExpertParallelExperts.forward = lambda self, x, *a: _f(self, x, *a) + 1e-3
""",
    "generate": """
from moe.hf import experts as _e
_f = _e.ExpertParallelExperts.forward
_e.ExpertParallelExperts.forward = lambda self, x, *a: _f(self, x, *a) * (-20 if x.shape[0] < 64 else 1)
""",
    "weights": """
import torch
from eplb import runtime as _r
_s = _r.EplbRuntime.step
def _step(self):
    event = _s(self)
    if event is not None and self.events[:1] == [event]:
        with torch.no_grad():
            self.expert_weights[0][0][0].add_(1e-3)
    return event
_r.EplbRuntime.step = _step
""",
}
EXPECTED = {"step": "verification failed at step 1: max |diff| ",
            "generate": "verification failed at the end of the run",
            "weights": "verification failed after a rebalance"}


@pytest.mark.parametrize("fault", list(PERTURB))
def test_hf_demo_verify_catches_a_wrong_result(tmp_path, fault):
    hook = tmp_path / "perturb"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        'import os\nif os.environ.get("RANK") == "1":\n' + textwrap.indent(PERTURB[fault], "    "))
    r = run(EPLB + ["demo", "--model", "qwen3_moe", "--nproc", "2", "--steps", "4",
                    "--rebalance-interval", "2", "--min-gain", "0", "--verify", *sizes_argv()],
            PYTHONPATH=f"{hook}:{ROOT}")
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("eplb demo: error: ")]
    assert len(errors) == 1 and errors[0].startswith("eplb demo: error: " + EXPECTED[fault]), r.stderr
    if fault == "weights":  # caught at the rebalance, by the bitwise slot check
        assert "step     2 rebalance" in r.stdout and "bad slots 1 FAILED" in r.stdout, r.stdout
    if fault == "generate":  # the logits of every step were right; the tokens were not
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("verify: "))
        assert float(re.search(r"logits max \|diff\| (\S+) ", line)[1]) <= 1e-5, line
        assert "tokens as the unmodified model FAILED" in line and " 64/64 " not in line, line


def test_hf_demo_bad_input_exits_2_with_one_line(tmp_path):
    hook = tmp_path / "no_transformers"
    hook.mkdir()  # transformers made unimportable (sys.modules entry None) in every process
    (hook / "sitecustomize.py").write_text('import sys\nsys.modules["transformers"] = None\n')
    names = ", ".join(HF_ARCHITECTURES)
    cases = [
        (["--model", "llama"], {}, f"--model: 'llama' is not one of {names}"),
        (["--model", "qwen3_moe", "--trace", "esft"], {}, "with --model the load comes from the token ids"),
        (["--model", "qwen3_moe", "--tokens", "100"], {}, "--tokens 100 is not a multiple of --seq-len 32"),
        (["--model", "mixtral"], {"PYTHONPATH": f"{hook}:{ROOT}"},
         "--model needs transformers, which is not installed: pip install -e '.[hf]'"),
    ]
    for args, extra, needle in cases:
        r = run(EPLB + ["demo", "--nproc", "2", "--steps", "2", *args], timeout=120, **extra)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2, (args, r.stderr)
        assert len(lines) == 1 and lines[0].startswith("eplb demo: error: "), (args, r.stderr)
        assert needle in lines[0], (args, lines)
        assert r.stdout == "", (args, r.stdout)


def test_hf_architectures_match_moe_hf():
    from moe.hf.configs import ARCHITECTURES

    assert HF_ARCHITECTURES == ARCHITECTURES


def test_default_demo_does_not_import_transformers():
    """The core packages and the reference demo's code path never import transformers."""
    r = run([sys.executable, "-c",
             "import sys, eplb, eplb.ops.cli, eplb.ops.demo, eplb.ops.demo_hf, moe, moe.hf, moe.hf.configs; "
             "eplb.ops.cli.build_parser(); print('transformers' in sys.modules)"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"

