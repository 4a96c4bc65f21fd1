"""Transports: how one layer's experts travel into a rank's staging buffer (and, for the
IPC transport, straight into the slots). `eplb.runtime.transfer` drives them.

* `P2PTransport`: torch.distributed point-to-point, NCCL or gloo; per peer and tensor one
  stream of experts cut into `chunk_bytes` messages, sent straight from contiguous slot
  runs or packed into a bounded, double-buffered pack buffer;
* `IpcTransport`: same host, CUDA; peers' tensors mapped once; the receiver copies from
  the peers' slots, and `move` does a synchronous layer in place through a hold buffer;
* `make_transport("auto")` picks.

Ranks here are *group-relative*; `_global_rank` maps them for torch.distributed.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from eplb.core.config import TRANSPORTS
from eplb.core.transfer_plan import LayerTransferPlan, hold_rows, in_place_ops

__all__ = [
    "AUTO_PREFERS_IPC",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_HOLD_CHUNK_BYTES",
    "IpcTransport",
    "P2PTransport",
    "TRANSPORTS",
    "allocate_staging",
    "check_staging",
    "check_weights",
    "copy_runs",
    "make_transport",
    "resolve_transport",
    "staging_rows",
    "weights_key",
]


DEFAULT_CHUNK_BYTES = 1 << 30
"""Largest message of the point-to-point transport, in bytes (`P2PTransport.chunk_bytes`).
Chosen by measurement on 2 x H200 (benchmarks/results/transfer-2026-11-30.md): one layer
of DeepSeek-V3 experts swapped between 2 GPUs reached 0.44 / 0.64 / 0.75 / 0.90 of the raw
peer copy with 16 MiB / 64 MiB / 256 MiB / 1 GiB messages."""

DEFAULT_HOLD_CHUNK_BYTES = 2 << 30
"""Granularity of `IpcTransport.move`'s pipeline: a receiver tells its senders when each
`hold_chunk_bytes` of its hold buffer is filled, and they write into those slots while it
holds the next chunk. Chosen by measurement on 2 x H200 (benchmarks/README.md, one layer
of DeepSeek-V3 experts swapped): 0.66 / 0.85 / 0.91 / 0.78 of the raw peer copy with
128 MiB / 512 MiB / 2 GiB / 16 GiB (one chunk: no overlap) chunks."""

AUTO_PREFERS_IPC = True
"""`make_transport("auto")` picks CUDA IPC when every rank is on one host with CUDA weights
and an NCCL group (measured faster there on 2 x H200, one DeepSeek-V3 layer: exchange 0.93
vs 0.89 of the raw peer copy for a whole-layer swap, 0.86 vs 0.79 for a 25% change; a
synchronous move in place 0.90 against 0.75 for NCCL's exchange and write); otherwise
NCCL (or gloo) point-to-point."""


def staging_rows(plan: LayerTransferPlan) -> int:
    """Staging rows `exchange_layer` needs for `plan` (`plan.num_staged`, at most S)."""
    return plan.num_staged


def allocate_staging(weights: Sequence[torch.Tensor], rows: int | None = None) -> list[torch.Tensor]:
    """A contiguous staging buffer for one layer: per weight tensor `[rows, ...]`
    (default `rows = S`, one layer of local experts), same dtype and device."""
    return [torch.empty((w.shape[0] if rows is None else rows, *w.shape[1:]),
                        dtype=w.dtype, device=w.device) for w in weights]


def check_staging(staging: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], rows: int) -> None:
    if len(staging) != len(weights):
        raise ValueError(f"staging has {len(staging)} tensors, the layer has {len(weights)}")
    for i, (b, w) in enumerate(zip(staging, weights)):
        if (b.shape[1:] != w.shape[1:] or b.shape[0] < rows or b.dtype != w.dtype
                or b.device != w.device or not b.is_contiguous()):
            raise ValueError(
                f"staging[{i}] must be contiguous [>= {rows}, {', '.join(map(str, w.shape[1:]))}] "
                f"{w.dtype} on {w.device}; got {tuple(b.shape)} {b.dtype} on {b.device}")


def check_weights(plan: LayerTransferPlan, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    weights = list(weights)
    for i, w in enumerate(weights):
        if w.shape[0] != plan.slots_per_rank:
            raise ValueError(f"weights[{i}] has {w.shape[0]} slots, the plan expects {plan.slots_per_rank}")
    return weights


def _global_rank(group, rank: int) -> int:
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def _runs(a, b) -> list[tuple[int, int, int]]:
    """Split paired index arrays into maximal runs where both step by +1: `(a0, b0, n)`,
    so one `copy_` of `n` consecutive slots/rows replaces `n` single-slot copies."""
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)  # [n], [n]
    if a.size == 0:
        return []
    cut = np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1
    starts, ends = np.concatenate([[0], cut]), np.concatenate([cut, [a.size]])
    return [(int(a[s]), int(b[s]), int(e - s)) for s, e in zip(starts, ends)]


def copy_runs(dst: Sequence[torch.Tensor], dst_idx, src: Sequence[torch.Tensor], src_idx) -> None:
    """`dst[i][dst_idx[j]] = src[i][src_idx[j]]` for every tensor `i` and index `j`, one
    `copy_` per run of indices consecutive on both sides (`_runs`), on the current stream."""
    for d0, s0, n in _runs(dst_idx, src_idx):
        for d, t in zip(dst, src):
            d[d0:d0 + n].copy_(t[s0:s0 + n])


def _stage_local(plan: LayerTransferPlan, weights, staging) -> None:
    """Phase 1: local sources that will be overwritten go to their staging rows."""
    rows = np.flatnonzero(plan.stage_src_slot >= 0)  # [K_local]
    copy_runs(staging, rows, weights, plan.stage_src_slot[rows])


def _peer_blocks(plan: LayerTransferPlan) -> list[tuple[int, int, int]]:
    """`(peer, first staging row, rows)` per sending peer: the plan orders received rows by
    (peer, expert), so each peer's rows are one block, in the order the peer sends them."""
    rows = plan.recv_rows  # [R]
    peers = plan.stage_src_rank[rows]  # [R]
    out = []
    for q in np.unique(peers).tolist():
        mine = rows[peers == q]
        if mine[-1] - mine[0] + 1 != mine.size:
            raise RuntimeError(f"staging rows received from rank {q} are not contiguous")
        out.append((q, int(mine[0]), int(mine.size)))
    return out


def _send_lists(plan: LayerTransferPlan) -> list[tuple[int, np.ndarray]]:
    """`(peer, slots [n])` per receiving peer, slots in ascending expert order (the order in
    which that peer's staging block holds them)."""
    return [(q, plan.send_slot[plan.send_peer == q]) for q in np.unique(plan.send_peer).tolist()]


def _copy_flat_range(dst: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> None:
    """`dst[:] = src.flatten()[lo:hi]` (row-major) without materialising `src`; `dst` is 1-D
    contiguous of length `hi - lo`, `src` may have any strides (a non-contiguous view)."""
    if hi <= lo:
        return
    if src.is_contiguous():
        dst.copy_(src.view(-1)[lo:hi])
        return
    if src.dim() <= 1:
        dst.copy_(src.reshape(-1)[lo:hi] if src.dim() == 0 else src[lo:hi])
        return
    inner = src[0].numel()
    first, last = -(-lo // inner), hi // inner  # whole rows [first, last)
    if first > last:  # lo and hi inside one row
        r = lo // inner
        _copy_flat_range(dst, src[r], lo - r * inner, hi - r * inner)
        return
    pos = 0
    if lo < first * inner:  # partial head row
        pos = first * inner - lo
        _copy_flat_range(dst[:pos], src[first - 1], inner - pos, inner)
    if last > first:
        n = (last - first) * inner
        dst[pos:pos + n].view(last - first, *src.shape[1:]).copy_(src[first:last])
        pos += n
    if hi > last * inner:  # partial tail row
        _copy_flat_range(dst[pos:], src[last], 0, hi - last * inner)


def _direct_view(w: torch.Tensor, slots: np.ndarray, E: int, lo: int, hi: int) -> torch.Tensor | None:
    """Elements `[lo, hi)` of the stream `concat(w[slots[j]].flatten())` as a view of `w`,
    when they lie in consecutive slots of a contiguous region; else None (pack them)."""
    j0, j1 = lo // E, (hi - 1) // E
    s0 = int(slots[j0])
    if j1 > j0 and not np.array_equal(slots[j0:j1 + 1], np.arange(s0, s0 + j1 - j0 + 1)):
        return None
    block = w[s0:s0 + j1 - j0 + 1]
    if not block.is_contiguous():
        return None
    return block.view(-1)[lo - j0 * E:hi - j0 * E]


def _gather(dst: torch.Tensor, w: torch.Tensor, slots: np.ndarray, E: int, lo: int, hi: int) -> None:
    """Pack elements `[lo, hi)` of the stream `concat(w[slots[j]].flatten())` into the 1-D
    contiguous `dst`, one copy per run of consecutive slots."""
    j0, j1 = lo // E, (hi - 1) // E
    pos, j = 0, j0
    while j <= j1:
        k = j
        while k < j1 and slots[k + 1] == slots[k] + 1:
            k += 1
        start = lo - j * E if j == j0 else 0  # within expert j
        end = (k - j) * E + (hi - k * E if k == j1 else E)  # within the run j..k
        s = int(slots[j])
        _copy_flat_range(dst[pos:pos + end - start], w[s:s + k - j + 1], start, end)
        pos += end - start
        j = k + 1


class _Arena:
    """Pack buffers carved first from the staging rows this layer does not use (rows
    `K ..` of a staging buffer allocated for S rows), then freshly allocated."""

    def __init__(self, staging: list[torch.Tensor], rows_used: int) -> None:
        self.free = []  # [uint8 region, bytes taken]
        for b in staging:
            if b.shape[0] > rows_used:
                self.free.append([b.view(-1)[rows_used * b[0].numel():].view(torch.uint8), 0])

    def take(self, nbytes: int, device) -> tuple[torch.Tensor, bool]:
        """A uint8 buffer of `nbytes` at a 16-byte aligned address (viewable as any dtype);
        True if freshly allocated."""
        for region in self.free:
            start = region[1] + (-(region[0].data_ptr() + region[1])) % 16
            if start + nbytes <= region[0].numel():
                region[1] = start + nbytes
                return region[0][start:start + nbytes], False
        return torch.empty(nbytes, dtype=torch.uint8, device=device), True


class P2PTransport:
    """Point-to-point exchange over the group's backend (NCCL on GPUs, gloo on CPU),
    coalesced per peer and chunked.

    Between two ranks and for each weight tensor, the experts one sends the other form ONE
    stream (ascending expert; on the receiver one contiguous block of staging rows, see
    `LayerTransferPlan`), cut into messages of at most `chunk_bytes`. Both sides derive the
    same cuts from counts they share, so no sizes are exchanged. Message `r` of every
    stream of a rank goes into round `r` (one `batch_isend_irecv`); rounds run back to back,
    stream-ordered on CUDA (no host wait). Receives land straight in staging. A send whose
    experts sit in consecutive slots of a contiguous tensor is a view of the weights;
    anything else (scattered slots, non-contiguous views) is packed into a pack buffer,
    double-buffered per peer, taken from the staging rows the layer leaves unused (staging
    allocated for S rows, fewer needed) or else allocated: extra memory beyond staging is
    at most `2 * chunk_bytes` per receiving peer, and none when every send is direct or
    the unused staging rows hold the pack buffers.

    `last_messages`, `last_pack_bytes`: messages posted and pack memory allocated beyond
    staging by the last `exchange` (for benchmarks and tests).
    """

    name = "nccl"
    exchange_launches_no_kernels = False  # NCCL kernels on the group (none on gloo)

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, (int, np.integer)) or chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")
        self.chunk_bytes = int(chunk_bytes)
        self.last_messages = 0
        self.last_pack_bytes = 0

    def __repr__(self) -> str:
        return f"P2PTransport(chunk_bytes={self.chunk_bytes})"

    def _messages(self, n: int, sizes: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """`(tensor, lo, hi)` element ranges of the stream of `n` experts, per tensor in
        order, each at most `chunk_bytes` (at least one element)."""
        out = []
        for i, (E, itemsize) in enumerate(sizes):
            total, step = n * E, max(1, self.chunk_bytes // itemsize)
            out += [(i, a, min(a + step, total)) for a in range(0, total, step)]
        return out

    @torch.no_grad()
    def exchange(self, plan: LayerTransferPlan, weights: list[torch.Tensor], group,
                 staging: list[torch.Tensor]) -> int:
        _stage_local(plan, weights, staging)
        sizes = [(w[0].numel(), w.element_size()) for w in weights]  # per tensor (E, itemsize)
        sends = []  # (global peer, slots, [(tensor, lo, hi, view or None)])
        pack_need: dict[int, int] = {}  # peer -> largest packed message (bytes)
        for q, slots in _send_lists(plan):
            msgs = []
            for i, lo, hi in self._messages(len(slots), sizes):
                view = _direct_view(weights[i], slots, sizes[i][0], lo, hi)
                if view is None:
                    pack_need[q] = max(pack_need.get(q, 0), (hi - lo) * sizes[i][1])
                msgs.append((i, lo, hi, view))
            sends.append((q, _global_rank(group, q), slots, msgs))
        recvs = [(_global_rank(group, q), row0, n, self._messages(n, sizes))
                 for q, row0, n in _peer_blocks(plan)]
        rounds = max([len(m) for *_, m in sends] + [len(m) for *_, m in recvs] + [0])
        self.last_messages, self.last_pack_bytes = 0, 0
        if rounds == 0:
            return 0

        import torch.distributed as dist

        arena = _Arena(staging, plan.num_staged)
        banks: list[dict[int, torch.Tensor]] = [{}, {}]  # per round parity: peer -> uint8 buffer
        pending: list[tuple[list, list]] = []  # per round: (works, tensors kept alive)
        received = 0
        for r in range(rounds):
            if r >= 2:  # its pack buffers are reused now: round r - 2 must be done with them
                for work in pending[r - 2][0]:
                    work.wait()
                pending[r - 2] = ([], [])
            ops, keep = [], []
            for q, gq, slots, msgs in sends:
                if r >= len(msgs):
                    continue
                i, lo, hi, t = msgs[r]
                if t is None:
                    w = weights[i]
                    buf = banks[r % 2].get(q)
                    if buf is None:
                        buf, fresh = arena.take(pack_need[q], w.device)
                        banks[r % 2][q] = buf
                        self.last_pack_bytes += buf.numel() if fresh else 0
                    t = buf[:(hi - lo) * sizes[i][1]].view(w.dtype)
                    _gather(t, w, slots, sizes[i][0], lo, hi)
                ops.append(dist.P2POp(dist.isend, t, gq, group))
                keep.append(t)
            for gq, row0, n, msgs in recvs:
                if r >= len(msgs):
                    continue
                i, lo, hi = msgs[r]
                t = staging[i][row0:row0 + n].view(-1)[lo:hi]
                ops.append(dist.P2POp(dist.irecv, t, gq, group))
                keep.append(t)
                received += t.nbytes
            self.last_messages += len(ops)
            pending.append((dist.batch_isend_irecv(ops) if ops else [], keep))
        for works, _keep in pending[-2:]:
            for work in works:
                work.wait()
        return received

    def settle(self, plan: LayerTransferPlan, group) -> None:
        """Nothing to do: a rank's own sends completed (stream-ordered) inside `exchange`."""


def _uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def weights_key(weights: Sequence[torch.Tensor]) -> tuple:
    return tuple((w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype) for w in weights)


class IpcTransport:
    """CUDA IPC (same host): every rank maps the expert tensors of every peer once
    (`reduce_tensor` handles, one `all_gather_object`; mapped on the rank's own GPU, see
    `_open`), and a receiver copies the experts it needs straight from the peer's old slots
    into its staging rows (`copy_` over NVLink, one copy per run of consecutive slots, on
    its own GPU), with no NCCL kernels and no pack buffer.

    Per layer, in `exchange`: the receiver knows from its plan which slot of which peer
    holds each expert (`stage_src_peer_slot`), so no NCCL message is needed. It waits
    for a token from every peer it pulls from (gloo, on the transport's own CPU group),
    which that peer sends once everything already queued on its current stream (e.g. an
    earlier write of those slots) has completed; then it pulls and synchronizes its
    current stream, so on return its reads are done. No NCCL kernel is launched, so an
    exchange in a background thread never interleaves with the model's NCCL collectives
    (with the tiny NCCL slot messages this transport used before, an asynchronous
    rebalance over IPC could hang beside the model's all-to-all on 2 x H200).
    A rank must not overwrite slots a peer reads before that peer's `exchange` returned:
    `settle` (used by `execute_layer_transfer`) waits for a token from every puller; a
    caller with its own barrier between exchange and write on all ranks may skip it.

    `move` does a whole synchronous layer transfer in place, each sender writing straight
    into its receivers' slots, through a hold buffer of each rank's own (`hold=True`, when
    all layers have the same tensor shapes): one layer of local experts, allocated at
    construction and kept; `hold` exposes it so a caller can use it as its staging buffer
    too (the runtime does). `hold_chunk_bytes`: the pipeline's granularity (equal on all
    ranks).

    Construction is collective over `group` (every rank, same layers); it raises on every
    rank when IPC cannot work (ranks on different hosts, a peer GPU not visible, non-CUDA
    weights, shapes differing between ranks). Costs: the hold buffer, and the peers'
    mappings (address space, no memory).
    """

    name = "ipc"
    exchange_launches_no_kernels = True  # `exchange` may run beside the model's collectives

    def __init__(self, expert_weights: Sequence[Sequence[torch.Tensor]], group=None,
                 timeout: float | None = None, *, hold: bool = True,
                 hold_chunk_bytes: int = DEFAULT_HOLD_CHUNK_BYTES) -> None:
        import socket

        import torch.distributed as dist
        from torch.multiprocessing.reductions import reduce_tensor

        layers = [list(ws) for ws in expert_weights]
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        problem = None
        if not layers or not layers[0]:
            problem = "no expert weights given"
        elif any(w.device.type != "cuda" for ws in layers for w in ws):
            problem = "expert weights are not all CUDA tensors"
        elif dist.get_backend(group) != "nccl":
            problem = f"the group's backend is {dist.get_backend(group)}, not nccl"
        info = {"problem": problem, "host": socket.gethostname()}
        self.hold: list[torch.Tensor] | None = None  # [S, ...] per tensor, for `move`
        if problem is None:
            self.device = layers[0][0].device
            info["uuid"] = _uuid(self.device)
            info["layout"] = [[(tuple(w.shape), w.dtype) for w in ws] for ws in layers]
            # one set of handles per consumer: each share counts one reference that the
            # consumer gives back when it drops its mapping (torch's CUDA IPC ref counting)
            info["handles"] = {q: [[reduce_tensor(w.detach()) for w in ws] for ws in layers]
                               for q in range(self.num_ranks) if q != self.rank}
            # the hold buffer of `move` (one layer of local experts), when every layer has
            # the same tensor shapes (the layouts are equal on all ranks, checked below)
            if hold and all(ws_l == info["layout"][0] for ws_l in info["layout"]):
                try:
                    self.hold = allocate_staging(layers[0])
                except RuntimeError as e:  # e.g. out of memory: reported on every rank
                    info["problem"] = f"hold buffer: {type(e).__name__}: {e}"
        infos: list = [None] * self.num_ranks
        dist.all_gather_object(infos, info, group=group)
        bad = [f"rank {q}: {x['problem']}" for q, x in enumerate(infos) if x["problem"]]
        if not bad and len({x["host"] for x in infos}) > 1:
            bad = [f"ranks on several hosts {sorted({x['host'] for x in infos})}"]
        if not bad and any(x["layout"] != info["layout"] for x in infos):
            bad = ["expert tensor shapes or dtypes differ between ranks"]
        self._peers: dict[int, list[list[torch.Tensor]]] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}  # per peer, on this GPU
        if not bad:
            try:
                local = {_uuid(torch.device("cuda", d)): d for d in range(torch.cuda.device_count())}
                for q, x in enumerate(infos):
                    if q == self.rank:
                        continue
                    dev = local.get(x["uuid"])
                    if dev is None:
                        raise RuntimeError(f"rank {q}'s GPU {x['uuid']} is not visible in this "
                                           "process (CUDA_VISIBLE_DEVICES)")
                    self._peers[q] = [[self._open(h, self.device.index) for h in hs]
                                      for hs in x["handles"][self.rank]]
                    self._streams[q] = torch.cuda.Stream(self.device)
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                bad = [f"rank {self.rank}: {type(e).__name__}: {e}"]
        verdicts: list = [None] * self.num_ranks
        dist.all_gather_object(verdicts, bad, group=group)
        bad = [b for v in verdicts for b in v]
        if bad:
            self._peers.clear()
            raise RuntimeError("CUDA IPC transport unavailable: " + "; ".join(dict.fromkeys(bad)))
        self._layer_of = {weights_key(ws): l for l, ws in enumerate(layers)}
        self.last_messages = 0
        if isinstance(hold_chunk_bytes, bool) or not isinstance(hold_chunk_bytes, int) or hold_chunk_bytes < 1:
            raise ValueError(f"hold_chunk_bytes must be a positive integer, got {hold_chunk_bytes!r}")
        self.hold_chunk_bytes = hold_chunk_bytes
        self._can_move = self.hold is not None  # the same verdict on every rank
        self.moves = 0  # layers moved in place so far (`move` calls with work)
        from eplb.runtime.control import new_group_like

        # the "slots settled" tokens: CPU messages, so a background exchange launches no
        # NCCL kernel (`timeout`: how long a token may take before the exchange fails)
        self._cpu_group = new_group_like(group, "gloo", timeout)

    @staticmethod
    def _open(handle, device_index: int) -> torch.Tensor:
        """Map a peer's tensor into this GPU's context (`cudaIpcOpenMemHandle` with lazy
        peer access, from `device_index`): the tensor lives in the peer's memory but torch
        sees it on this GPU, so a `copy_` to or from it is a plain copy on this GPU's
        current stream, reading or writing the peer's memory over NVLink. No work of this
        process ever runs on the peer's GPU, where it would be time-sliced against the
        peer process's own kernels and copies (a GPU runs one process's context at a
        time): on 2 x H200 a move whose copies ran on the peer's GPU lost the overlap of
        the two GPUs' copies."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        fn, args = handle
        if fn is not rebuild_cuda_tensor:
            raise RuntimeError(f"unexpected IPC handle rebuilt by {fn!r}")
        args = list(args)
        args[0], args[6], args[10] = torch.Tensor, device_index, False  # plain tensor, local index, no grad
        return fn(*args)

    def __repr__(self) -> str:
        return f"IpcTransport(rank={self.rank}, peers={sorted(self._peers)})"

    def close(self) -> None:
        """Drop this process's mappings of the peers' tensors (this rank's hold buffer stays
        until the transport is deleted). Shutdown order: every rank calls `close()`, then
        a barrier, then the weights and the transport may be freed (follow with
        `torch.cuda.ipc_collect()`); a producer that frees or exits while a peer still maps
        its memory keeps it in torch's IPC limbo, and freeing that at interpreter exit can
        abort the process ("driver shutting down"). Not collective; the transport's CPU
        group goes with the process group (or `torch.distributed.destroy_process_group`)."""
        self._peers.clear()
        self._streams.clear()
        self._layer_of = {}
        self._can_move = False

    def _layer(self, weights: Sequence[torch.Tensor]) -> int:
        layer = self._layer_of.get(weights_key(weights))
        if layer is None:
            raise ValueError("these expert weights were not registered with the IPC transport "
                             "(make_transport got other tensors, or it was closed)")
        return layer

    @torch.no_grad()
    def exchange(self, plan: LayerTransferPlan, weights: list[torch.Tensor], group,
                 staging: list[torch.Tensor]) -> int:
        import torch.distributed as dist

        layer = self._layer(weights)
        _stage_local(plan, weights, staging)
        sends, blocks = _send_lists(plan), _peer_blocks(plan)
        self.last_messages = len(sends) + len(blocks)
        if not sends and not blocks:
            return 0
        if sends:  # the slots my receivers read hold what was queued before: tell them
            torch.cuda.current_stream(self.device).synchronize()
        cpu = self._cpu_group
        works = [dist.isend(torch.ones(1), _global_rank(cpu, q), group=cpu) for q, _s in sends]
        works += [dist.irecv(torch.empty(1), _global_rank(cpu, q), group=cpu) for q, _r, _n in blocks]
        for work in works:
            work.wait()
        received = 0
        for q, row0, n in blocks:
            slots = plan.stage_src_peer_slot[row0:row0 + n]  # [n] the peer's local slots
            peer = self._peers[q][layer]
            stream = self._streams[q]  # one stream per peer: pulls from several peers overlap
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                copy_runs(staging, np.arange(row0, row0 + n), peer, slots)
            received += n * sum(b[0].nbytes for b in staging)
        for q, _r, _n in blocks:
            torch.cuda.current_stream(self.device).wait_stream(self._streams[q])
        torch.cuda.current_stream(self.device).synchronize()  # every read of peer memory done
        return received

    @property
    def hold_bytes(self) -> int:
        """GPU memory of the hold buffer (allocated at construction; 0 without one)."""
        return 0 if self.hold is None else sum(b.nbytes for b in self.hold)

    def can_move(self, weights: Sequence[torch.Tensor]) -> bool:
        """Whether `move` can carry out a layer of these (registered) weights."""
        return self._can_move and weights_key(weights) in self._layer_of

    @torch.no_grad()
    def move(self, plan: LayerTransferPlan, weights: list[torch.Tensor], group) -> int:
        """Carry out `plan` in place in one pass, with no staging of received experts:
        the whole layer transfer of a synchronous rebalance (`execute_layer_transfer`).
        Returns bytes received. Every rank with a non-noop plan calls it.

        1. hold: copy the old experts of `plan.hold_slots` (changed slots whose expert is
           still sent or copied locally) into this rank's hold buffer, in chunks of about
           `hold_chunk_bytes`, on the current stream; then the local writes;
        2. as each hold chunk completes, tell the ranks that write into those slots (a CPU
           token on the gloo group); on each token from a receiver, write the experts that
           go into that chunk of its slots straight there (`send_dst_slot`), from this
           rank's hold rows or unchanged slots, on a per-peer stream of this GPU. Writing
           into a peer's chunk k overlaps holding chunk k+1 on both GPUs. The copies are
           pushes, run by this process on its own GPU, so they never share a GPU with
           another process's work (a pull issued on the peer's GPU would be time-sliced
           against that peer's hold copies);
        3. wait for the pushes and tell the receivers; wait for every sender's word, then
           copy a received expert into any further slot that wants it. On return no peer
           writes this rank's slots any more and nothing reads this rank's hold buffer.
        """
        import torch.distributed as dist

        layer = self._layer(weights)
        if not self._can_move:
            raise RuntimeError("this IPC transport has no hold buffer (hold=False, layers of "
                               "different shapes, or closed): use exchange/settle/write_layer")
        ops = in_place_ops(plan)
        cur = torch.cuda.current_stream(self.device)
        expert_bytes = sum(w[0].nbytes for w in weights)
        rows = max(1, self.hold_chunk_bytes // expert_bytes)  # hold rows per chunk
        H = plan.num_held
        events = []  # [chunks] hold chunk c done (and, with it, everything queued before)
        for c in range(max(1, -(-H // rows))):
            lo, hi = c * rows, min(H, (c + 1) * rows)
            copy_runs(self.hold, np.arange(lo, hi), weights, plan.hold_slots[lo:hi])
            events.append(torch.cuda.Event())
            events[-1].record(cur)
        from_hold = ops.local_hold_row >= 0  # [W']
        copy_runs(weights, ops.local_dst[from_hold], self.hold, ops.local_hold_row[from_hold])
        copy_runs(weights, ops.local_dst[~from_hold], weights, ops.local_src_slot[~from_hold])

        # token c from a receiver: its hold chunk c is done, so the slots held there (and,
        # for c = 0, the slots it does not hold) may be written
        send_chunk = np.maximum(plan.send_dst_hold_row, 0) // rows  # [T] token each send waits for
        out_last = {p: int(send_chunk[plan.send_peer == p].max()) for p in np.unique(plan.send_peer).tolist()}
        recv_rows = hold_rows(plan.hold_slots, ops.recv_dst)  # [R]
        recv_chunk = np.maximum(recv_rows, 0) // rows  # [R]
        in_last = {q: int(recv_chunk[ops.recv_peer == q].max()) for q in np.unique(ops.recv_peer).tolist()}

        cpu = self._cpu_group
        works, tokens = [], 0
        for c in range(max([-1, *out_last.values(), *in_last.values()]) + 1):
            senders = [q for q, last in sorted(in_last.items()) if last >= c]
            if senders:
                events[c].synchronize()  # my hold chunk c (for c = 0: all earlier work) done
                for q in senders:
                    works.append(dist.isend(torch.tensor([c]), _global_rank(cpu, q), group=cpu, tag=1))
            for p in [p for p, last in sorted(out_last.items()) if last >= c]:
                got = torch.empty(1, dtype=torch.int64)
                dist.recv(got, _global_rank(cpu, p), group=cpu, tag=1)
                tokens += 1
                if int(got) != c:
                    raise RuntimeError(f"in-place move of layer {layer}: rank {p} sent token "
                                       f"{int(got)}, expected {c} (plans differ between ranks)")
                self._push(p, layer, plan, np.flatnonzero((plan.send_peer == p) & (send_chunk == c)),
                           rows, events, weights)
        for p in out_last:  # my writes into p are done: tell p
            self._streams[p].synchronize()
            works.append(dist.isend(torch.ones(1), _global_rank(cpu, p), group=cpu, tag=2))
        works += [dist.irecv(torch.empty(1), _global_rank(cpu, q), group=cpu, tag=2) for q in in_last]
        for work in works:
            work.wait()
        copy_runs(weights, ops.dup_dst, weights, ops.dup_src)  # every sender is done
        self.last_messages = tokens + len(in_last) + len(out_last)
        self.moves += 1
        return len(ops.recv_peer) * expert_bytes

    def _push(self, p: int, layer: int, plan: LayerTransferPlan, idx: np.ndarray, rows: int,
              events: list, weights: list[torch.Tensor]) -> None:
        """Queue the sends `idx` (indices into `plan.send_*`) to rank `p` on the per-peer
        stream: each expert from its hold row (after that hold chunk) or unchanged slot into
        the receiver's slot."""
        if idx.size == 0:
            return
        stream = self._streams[p]
        src_rows = plan.send_hold_row[idx]  # [n]
        # after the hold chunk of the last held row read; at least after chunk 0, which
        # follows everything queued before on this rank (an unchanged slot read here may
        # have been written by an earlier move whose local copies are still queued)
        stream.wait_event(events[max(int(src_rows.max()), 0) // rows])
        dst, slots = plan.send_dst_slot[idx], plan.send_slot[idx]  # [n], [n]
        held = src_rows >= 0
        peer = self._peers[p][layer]
        with torch.cuda.stream(stream):  # the peer's tensors are mapped on this GPU (`_open`)
            copy_runs(peer, dst[held], self.hold, src_rows[held])
            copy_runs(peer, dst[~held], weights, slots[~held])

    def settle(self, plan: LayerTransferPlan, group) -> None:
        """Pairwise, stream-ordered: send a token to every rank this rank pulled from and make
        the current stream wait for a token from every rank that pulls from this rank; writes
        queued after it cannot overwrite slots a peer still reads."""
        import torch.distributed as dist

        pulled = [q for q, _r, _n in _peer_blocks(plan)]
        pullers = [q for q, _s in _send_lists(plan)]
        if not pulled and not pullers:
            return
        ops = [dist.P2POp(dist.isend, torch.ones(1, dtype=torch.int64, device=self.device),
                          _global_rank(group, q), group) for q in pulled]
        ops += [dist.P2POp(dist.irecv, torch.empty(1, dtype=torch.int64, device=self.device),
                           _global_rank(group, q), group) for q in pullers]
        for work in dist.batch_isend_irecv(ops):
            work.wait()




def make_transport(kind: str = "auto", expert_weights: Sequence[Sequence[torch.Tensor]] | None = None,
                   group=None, *, chunk_bytes: int | None = None, timeout: float | None = None):
    """A transport for `exchange_layer(..., transport=...)`.

    `kind`: "nccl" (point-to-point over the group's backend: NCCL on GPUs, gloo on CPU,
    `P2PTransport(chunk_bytes)`), "ipc" (`IpcTransport`, raises where it cannot work) or
    "auto" (IPC when every rank is on one host with CUDA weights and an NCCL group and
    `AUTO_PREFERS_IPC`, else "nccl"). "ipc" and "auto" are collective over `group`
    (call on every rank, once, with every layer's weights: the weights are registered).
    `timeout`: seconds the IPC transport's CPU tokens may wait for a peer (None: the default
    of torch.distributed).
    """
    if kind not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {kind!r}")
    p2p = P2PTransport(DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes)
    if kind == "nccl":
        return p2p
    if expert_weights is None:
        raise ValueError(f"expert_weights is required for transport {kind!r}")
    import torch.distributed as dist

    if kind == "auto":
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
            return p2p
        mine = AUTO_PREFERS_IPC and dist.get_backend(group) == "nccl" and all(
            w.device.type == "cuda" for ws in expert_weights for w in ws)
        votes: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(votes, bool(mine), group=group)
        if not all(votes):
            return p2p
        try:
            return IpcTransport(expert_weights, group, timeout)
        except RuntimeError as e:  # raised on every rank alike
            import logging

            logging.getLogger("eplb.runtime.transfer").info("auto transport: NCCL (%s)", e)
            return p2p
    return IpcTransport(expert_weights, group, timeout)


def resolve_transport(transport):
    if transport is None or transport == "nccl":
        return P2PTransport()
    if isinstance(transport, str):
        raise ValueError(f"transport {transport!r} needs set-up: pass the object from "
                         f"make_transport({transport!r}, expert_weights, group) (collective)")
    if not (hasattr(transport, "exchange") and hasattr(transport, "settle")):
        raise ValueError(f"transport must be None, 'nccl' or a transport object, got {transport!r}")
    return transport
