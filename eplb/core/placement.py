"""Placement: which logical expert each physical slot holds, for every MoE layer.

`physical_to_logical [L, P]` is the single source of truth. Slot `p` lives on GPU
`p // (P // num_gpus)` (DeepSeek EPLB / vLLM / SGLang convention). Everything else
(replica counts, `logical_to_physical`, per-GPU loads) is derived from it.
Pure numpy: no torch.distributed here.
"""
from __future__ import annotations

import json
import operator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1


INITIAL_POLICY = "initial"  # `Placement.policy` of the start-up placement (`Placement.initial`)


@dataclass(frozen=True, eq=False)
class Placement:
    physical_to_logical: np.ndarray  # [L, P] int64
    num_logical_experts: int  # N
    num_gpus: int  # M
    num_nodes: int = 1
    policy: str = ""
    shares: np.ndarray | None = None  # [L, P] float64 or None (= even split over replicas)
    """Weighted replicas: the fraction of its logical expert's tokens each slot receives;
    over the replicas of one expert the shares sum to 1. None means an even split."""

    def __post_init__(self) -> None:
        for name in ("num_logical_experts", "num_gpus", "num_nodes"):
            object.__setattr__(self, name, _as_int(getattr(self, name), name))
        try:
            p2l = np.asarray(self.physical_to_logical)
        except (TypeError, ValueError) as e:
            raise ValueError(f"physical_to_logical is not a rectangular array: {_one_line(e)}") from None
        if p2l.ndim != 2:
            raise ValueError(f"physical_to_logical must be 2-D [L, P], got shape {p2l.shape}")
        if p2l.dtype == bool or not (np.issubdtype(p2l.dtype, np.integer)
                                     or np.issubdtype(p2l.dtype, np.floating)):
            raise ValueError(f"physical_to_logical must hold integer expert ids, got dtype {p2l.dtype}")
        if p2l.size and not np.issubdtype(p2l.dtype, np.integer):
            if not np.all(np.isfinite(p2l)) or not np.all(p2l == np.round(p2l)):
                raise ValueError("physical_to_logical must hold integer expert ids")
        p2l = np.ascontiguousarray(p2l, dtype=np.int64)
        p2l.setflags(write=False)
        object.__setattr__(self, "physical_to_logical", p2l)
        if self.shares is not None:
            try:
                sh = np.ascontiguousarray(self.shares, dtype=np.float64)
            except (TypeError, ValueError) as e:
                raise ValueError(f"shares is not a rectangular array of numbers: {_one_line(e)}") from None
            sh.setflags(write=False)
            object.__setattr__(self, "shares", sh)
        self.validate()

    # ---- sizes -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.physical_to_logical.shape[0]

    @property
    def num_slots(self) -> int:
        return self.physical_to_logical.shape[1]

    @property
    def slots_per_gpu(self) -> int:
        return self.num_slots // self.num_gpus

    @property
    def max_replicas(self) -> int:
        """Largest possible replica count of one expert: P - N + 1."""
        return self.num_slots - self.num_logical_experts + 1

    # ---- validation --------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError unless every expert has a replica and slots divide over GPUs."""
        L, P = self.physical_to_logical.shape
        N, M = self.num_logical_experts, self.num_gpus
        if N < 1:
            raise ValueError(f"num_logical_experts must be >= 1, got {N}")
        if M < 1:
            raise ValueError(f"num_gpus must be >= 1, got {M}")
        if self.num_nodes < 1 or M % self.num_nodes:
            raise ValueError(f"num_gpus ({M}) must be divisible by num_nodes ({self.num_nodes})")
        if P % M:
            raise ValueError(
                f"num_slots ({P}) must be divisible by num_gpus ({M}); "
                f"use a multiple of {M} (e.g. {-(-P // M) * M})"
            )
        if P < N:
            raise ValueError(f"num_slots ({P}) must be >= num_logical_experts ({N})")
        if L == 0:
            return
        p2l = self.physical_to_logical
        if p2l.min() < 0 or p2l.max() >= N:
            raise ValueError(f"physical_to_logical holds ids outside [0, {N})")
        counts = self.replica_count()
        if (counts == 0).any():
            layer, expert = np.argwhere(counts == 0)[0]
            raise ValueError(f"layer {layer}: expert {expert} has no replica")
        if self.shares is not None:
            sh = self.shares
            if sh.shape != p2l.shape:
                raise ValueError(f"shares must have the shape of physical_to_logical {p2l.shape}, "
                                 f"got {sh.shape}")
            if not np.isfinite(sh).all() or (sh < 0).any():
                raise ValueError("shares must be finite and >= 0")
            total = np.zeros((L, N))
            np.add.at(total, (np.repeat(np.arange(L), P), p2l.ravel()), sh.ravel())
            if not np.allclose(total, 1.0, atol=1e-6):
                layer, expert = np.argwhere(~np.isclose(total, 1.0, atol=1e-6))[0]
                raise ValueError(f"layer {layer}: shares of expert {expert} sum to "
                                 f"{total[layer, expert]:.6g}, not 1")

    # ---- derived maps ------------------------------------------------------------
    def replica_count(self) -> np.ndarray:  # [L, N]
        L, P = self.physical_to_logical.shape
        N = self.num_logical_experts  # ids are in [0, N): validate() checks that first
        flat = (self.physical_to_logical + (np.arange(L, dtype=np.int64) * N)[:, None]).ravel()
        return np.bincount(flat, minlength=L * N).astype(np.int64, copy=False).reshape(L, N)

    def logical_to_physical(self, max_replicas: int | None = None) -> np.ndarray:  # [L, N, R]
        """Slots of every expert in ascending slot order, padded with -1 to `max_replicas`."""
        R = self.max_replicas if max_replicas is None else max_replicas
        L, P = self.physical_to_logical.shape
        counts = self.replica_count()  # [L, N]
        if counts.size and counts.max() > R:
            raise ValueError(f"an expert has {counts.max()} replicas, more than max_replicas={R}")
        out = np.full((L, self.num_logical_experts, R), -1, dtype=np.int64)
        # stable sort by expert keeps slots ascending within each expert
        order = np.argsort(self.physical_to_logical, axis=1, kind="stable")  # [L, P]
        experts = np.take_along_axis(self.physical_to_logical, order, 1)  # [L, P]
        first = np.cumsum(counts, axis=1) - counts  # [L, N] start of each expert's run
        rank = np.arange(P)[None, :] - np.take_along_axis(first, experts, 1)  # [L, P]
        out[np.repeat(np.arange(L), P), experts.ravel(), rank.ravel()] = order.ravel()
        return out

    def gpu_of_slot(self) -> np.ndarray:  # [P]
        return np.arange(self.num_slots) // self.slots_per_gpu

    def slot_shares(self) -> np.ndarray:  # [L, P]
        """Each slot's fraction of its expert's tokens (explicit even split when shares is None)."""
        if self.shares is not None:
            return self.shares
        p2l = self.physical_to_logical
        return 1.0 / np.take_along_axis(self.replica_count(), p2l, 1)

    def replica_shares(self, max_replicas: int | None = None) -> np.ndarray:  # [L, N, R]
        """Shares ordered like `logical_to_physical(max_replicas)`, 0 where padded."""
        l2p = self.logical_to_physical(max_replicas)  # [L, N, R]
        sh = self.slot_shares()  # [L, P]
        out = np.take_along_axis(sh[:, :, None], np.maximum(l2p, 0).reshape(self.num_layers, -1, 1), 1)
        return np.where(l2p >= 0, out.reshape(l2p.shape), 0.0)

    def maps(self, max_replicas: int | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The routing maps a model reads, as the runtime's map tensors hold them:
        physical_to_logical [L, P] int64, logical_to_physical [L, N, R] int64 (-1 padded),
        replica_count [L, N] int64 and the cumulative replica shares [L, N, R] float32 in
        logical_to_physical order (`replica_cdf`; even shares when `shares` is None)."""
        count = self.replica_count()  # [L, N]
        cdf = replica_cdf(self.replica_shares(max_replicas), count)  # [L, N, R]
        return (self.physical_to_logical.copy(), self.logical_to_physical(max_replicas), count, cdf)

    def gpu_loads(self, load: np.ndarray) -> np.ndarray:  # [L, M]
        """Tokens per GPU when each expert's load `[L, N]` splits over its replicas by
        `shares` (evenly when shares is None)."""
        load = np.asarray(load, dtype=np.float64)
        per_slot = np.take_along_axis(load, self.physical_to_logical, 1) * self.slot_shares()  # [L, P]
        return per_slot.reshape(self.num_layers, self.num_gpus, self.slots_per_gpu).sum(-1)

    def balancedness(self, load: np.ndarray) -> np.ndarray:  # [L]
        """mean / max GPU load per layer (1.0 is perfect), for a logical load `[L, N]`."""
        return balancedness_of_gpu_loads(self.gpu_loads(load))

    def num_duplicates_on_gpu(self) -> int:
        """Replicas that share a GPU with another replica of the same expert (wasted slots)."""
        g = np.sort(self.physical_to_logical.reshape(self.num_layers, self.num_gpus, -1), axis=-1)
        return int((g[..., 1:] == g[..., :-1]).sum())

    def layer(self, i: int) -> np.ndarray:  # [P]
        return self.physical_to_logical[i]

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Placement)
            and self.num_logical_experts == other.num_logical_experts
            and self.num_gpus == other.num_gpus
            and np.array_equal(self.physical_to_logical, other.physical_to_logical)
            and np.allclose(self.slot_shares(), other.slot_shares(), rtol=0, atol=1e-12)
        )

    def __repr__(self) -> str:
        return (
            f"Placement(L={self.num_layers}, N={self.num_logical_experts}, P={self.num_slots}, "
            f"gpus={self.num_gpus}, nodes={self.num_nodes}, policy={self.policy!r})"
        )

    # ---- construction ------------------------------------------------------------
    @classmethod
    def initial(cls, num_layers: int, num_logical_experts: int, num_slots: int,
                num_gpus: int, num_nodes: int = 1) -> "Placement":
        """The start-up placement: slot p holds expert p % N in every layer. Its policy is
        `INITIAL_POLICY` (see `is_initial`)."""
        p2l = np.tile(np.arange(num_slots) % num_logical_experts, (num_layers, 1))
        return cls(p2l, num_logical_experts, num_gpus, num_nodes, policy=INITIAL_POLICY)

    @property
    def is_initial(self) -> bool:
        """Whether this is the start-up placement (or what a placement change that stopped
        part way left of it): no plan chose it, its spare slots hold the first experts
        whatever their load, so a planner need not keep its layout (the decode-aware
        catch-up may replace a layer of it, `policy.balanced.reads.spread_reads`)."""
        return self.policy == INITIAL_POLICY

    def with_physical_to_logical(self, p2l: np.ndarray, policy: str = "",
                                 shares: np.ndarray | None = None) -> "Placement":
        return Placement(p2l, self.num_logical_experts, self.num_gpus, self.num_nodes, policy, shares)

    def with_layers_of(self, other: "Placement", layers: list[int]) -> "Placement":
        """This placement with `layers` taken from `other` (experts and shares): what a
        placement change that stopped after switching those layers leaves in force."""
        p2l = self.physical_to_logical.copy()  # [L, P]
        p2l[layers] = other.physical_to_logical[layers]
        shares = None
        if self.shares is not None or other.shares is not None:
            shares = self.slot_shares().copy()  # [L, P]
            shares[layers] = other.slot_shares()[layers]
        return self.with_physical_to_logical(p2l, self.policy, shares)

    # ---- I/O ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "physical_to_logical": self.physical_to_logical.tolist(),
            "num_logical_experts": self.num_logical_experts,
            "num_gpus": self.num_gpus,
            "num_nodes": self.num_nodes,
            "num_layers": self.num_layers,
            "num_slots": self.num_slots,
            "policy": self.policy,
            **({"shares": self.shares.tolist()} if self.shares is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict, num_logical_experts: int | None = None,
                  num_gpus: int | None = None) -> "Placement":
        if not isinstance(d, dict) or "physical_to_logical" not in d:
            raise ValueError("placement must be an object with a 'physical_to_logical' field")
        try:
            p2l = np.asarray(d["physical_to_logical"], dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise ValueError(f"physical_to_logical is not a rectangular list of ints: {e}") from None
        if p2l.ndim != 2:
            raise ValueError(f"physical_to_logical must be [L, P] lists, got shape {p2l.shape}")
        n = d.get("num_logical_experts", num_logical_experts)
        if n is None:
            n = int(p2l.max()) + 1 if p2l.size else 0
        m = d.get("num_gpus", num_gpus)
        if m is None:
            raise ValueError("placement lacks 'num_gpus'")
        shares = d.get("shares")
        if shares is not None:
            try:
                shares = np.asarray(shares, dtype=np.float64)
            except (TypeError, ValueError) as e:
                raise ValueError(f"shares is not a rectangular list of numbers: {e}") from None
        return cls(p2l, n, m, d.get("num_nodes", 1), str(d.get("policy", "")), shares)

    def save(self, path: str | Path) -> None:
        """Write JSON (`.json`), a bare `[L, P]` array (`.npy`) or a tensor dict (`.pt`)."""
        path = Path(path)
        if path.suffix == ".npy":
            np.save(path, self.physical_to_logical)
        elif path.suffix == ".pt":
            import torch

            d = self.to_dict()
            d["physical_to_logical"] = torch.from_numpy(self.physical_to_logical.copy())
            if self.shares is not None:
                d["shares"] = torch.from_numpy(self.shares.copy())
            torch.save(d, path)
        else:
            path.write_text(json.dumps(self.to_dict()) + "\n")

    @classmethod
    def load(cls, path: str | Path, num_logical_experts: int | None = None,
             num_gpus: int | None = None) -> "Placement":
        """Read what `save` wrote; `.npy` needs `num_gpus` (and N if not all experts appear)."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"placement file not found: {path}")
        if path.suffix == ".npy":
            from eplb.core.loadio import load_npy_checked

            try:
                d = {"physical_to_logical": load_npy_checked(path)}
            except Exception as e:  # empty, truncated, pickled, too large or not an .npy file
                raise ValueError(f"{path}: not a readable placement .npy file ({_one_line(e)})") from None
        elif path.suffix == ".pt":
            from eplb.core.loadio import torch_load_weights_only

            d = torch_load_weights_only(path, "placement .pt")  # one ValueError line if refused
            if isinstance(d, dict):
                d = {k: v.numpy() if hasattr(v, "numpy") else v for k, v in d.items()}
        else:
            try:
                d = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: invalid JSON ({e})") from None
        return cls.from_dict(d, num_logical_experts, num_gpus)


def _as_int(value, name: str) -> int:
    """`value` as an int (numpy ints fine; bools, floats and strings refused: ValueError)."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or e.__class__.__name__


def replica_cdf(replica_shares: np.ndarray, replica_count: np.ndarray) -> np.ndarray:
    """The content of `logical_replica_cdf`: replica_shares [L, N, R] (ordered like
    `logical_to_physical`, 0 where padded; `Placement.replica_shares`) and
    replica_count [L, N] -> [L, N, R] float32 cumulative shares, the entries from
    r = count - 1 on exactly 1.0."""
    shares = np.asarray(replica_shares, dtype=np.float64)  # [L, N, R]
    count = np.asarray(replica_count, dtype=np.int64)  # [L, N]
    cdf = np.clip(np.cumsum(shares, axis=-1), 0.0, 1.0)  # [L, N, R]
    last_and_padding = np.arange(shares.shape[-1]) >= (count[..., None] - 1)  # [L, N, R]
    return np.where(last_and_padding, 1.0, cdf).astype(np.float32)


def balancedness_of_gpu_loads(gpu_loads: np.ndarray) -> np.ndarray:  # [L, M] -> [L]
    """mean / max per row; a row with no load counts as perfectly balanced."""
    gpu_loads = np.asarray(gpu_loads, dtype=np.float64)
    mx = gpu_loads.max(-1)
    out = np.ones(gpu_loads.shape[:-1])
    ok = mx > 0
    out[ok] = gpu_loads.mean(-1)[ok] / mx[ok]
    return out
