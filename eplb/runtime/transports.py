"""Transports: how one layer's experts travel into a rank's staging buffer (and, for the
IPC transport, straight into the slots). `eplb.runtime.transfer` drives them.

* `P2PTransport`: torch.distributed point-to-point, NCCL or gloo; per peer and tensor one
  stream of experts cut into `chunk_bytes` messages, sent straight from contiguous slot
  runs or packed into a bounded, double-buffered pack buffer;
* `IpcTransport` (eplb/runtime/ipc.py, built on the helpers here): same host, CUDA;
  peers' tensors mapped once; the receiver copies from the peers' slots, and `move` does
  a synchronous layer in place through a hold buffer;
* `eplb.runtime.transport_choice.make_transport("auto")` picks between them.

Both derive from `eplb.runtime.transport_base.TransportBase` (the `Transport` contract
and its defaults) and use `eplb.runtime.staging` (the staging buffer and the run-wise
slot copies). Ranks here are *group-relative*; `global_rank` maps them for
torch.distributed.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from eplb.core.transfer_plan import LayerTransferPlan
from eplb.runtime.staging import copy_runs
from eplb.runtime.transport_base import TransportBase

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_HOLD_CHUNK_BYTES",
    "P2PTransport",
    "device_uuid",
    "global_rank",
    "peer_blocks",
    "send_lists",
    "stage_local",
    "weights_key",
]


DEFAULT_CHUNK_BYTES = 1 << 30
"""Largest message of the point-to-point transport, in bytes (`P2PTransport.chunk_bytes`).
Chosen by measurement on 2 x H200: the share of the raw peer copy a whole-layer swap
reaches grows with the message size up to 1 GiB (figures: benchmarks/results/transfer-2026-11-30.md
and benchmarks/README.md, "Moving one DeepSeek-V3 layer between two GPUs")."""

DEFAULT_HOLD_CHUNK_BYTES = 2 << 30
"""Granularity of `IpcTransport.move`'s pipeline: a receiver tells its senders when each
`hold_chunk_bytes` of its hold buffer is filled, and they write into those slots while it
holds the next chunk. Chosen by measurement on 2 x H200 (benchmarks/README.md, one layer
of DeepSeek-V3 experts swapped): 0.66 / 0.85 / 0.91 / 0.78 of the raw peer copy with
128 MiB / 512 MiB / 2 GiB / 16 GiB (one chunk: no overlap) chunks."""

def global_rank(group, rank: int) -> int:
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def stage_local(plan: LayerTransferPlan, weights, staging) -> None:
    """Phase 1: local sources that will be overwritten go to their staging rows."""
    rows = np.flatnonzero(plan.stage_src_slot >= 0)  # [K_local]
    copy_runs(staging, rows, weights, plan.stage_src_slot[rows])


def peer_blocks(plan: LayerTransferPlan) -> list[tuple[int, int, int]]:
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


def send_lists(plan: LayerTransferPlan) -> list[tuple[int, np.ndarray]]:
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


class P2PTransport(TransportBase):
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
        stage_local(plan, weights, staging)
        sizes = [(w[0].numel(), w.element_size()) for w in weights]  # per tensor (E, itemsize)
        sends = []  # (global peer, slots, [(tensor, lo, hi, view or None)])
        pack_need: dict[int, int] = {}  # peer -> largest packed message (bytes)
        for q, slots in send_lists(plan):
            msgs = []
            for i, lo, hi in self._messages(len(slots), sizes):
                view = _direct_view(weights[i], slots, sizes[i][0], lo, hi)
                if view is None:
                    pack_need[q] = max(pack_need.get(q, 0), (hi - lo) * sizes[i][1])
                msgs.append((i, lo, hi, view))
            sends.append((q, global_rank(group, q), slots, msgs))
        recvs = [(global_rank(group, q), row0, n, self._messages(n, sizes))
                 for q, row0, n in peer_blocks(plan)]
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


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def weights_key(weights: Sequence[torch.Tensor]) -> tuple:
    return tuple((w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype) for w in weights)
