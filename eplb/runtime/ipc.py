"""`IpcTransport`: CUDA IPC between the ranks of one host.

Every rank maps its peers' expert tensors once (collective, at set-up); a receiver then
copies the experts it needs straight from the peers' slots into its staging buffer, and
`move` carries out a whole synchronous layer in place: the old experts that someone
still reads go into a hold buffer first, then each sender writes straight into the
receivers' slots, so each byte crosses NVLink once and is written once. The tokens of
`exchange` ("slots ready") and of `move` travel over a gloo group, so a background
exchange launches no NCCL kernel; `settle`'s ("slots settled", only between a synchronous
exchange and write) are NCCL point-to-point messages on the transfer group.
Built on eplb/runtime/transports.py (the shared helpers and the point-to-point
transport); `eplb.runtime.transport_choice.make_transport` picks between the two.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from eplb.core.transfer_plan import LayerTransferPlan, hold_rows, in_place_ops
from eplb.runtime.staging import allocate_staging, copy_runs
from eplb.runtime.transport_base import TransportBase
from eplb.runtime.transports import (DEFAULT_HOLD_CHUNK_BYTES, device_uuid, global_rank,
                                     peer_blocks, send_lists, stage_local, weights_key)

__all__ = ["IpcTransport"]


class IpcTransport(TransportBase):
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
                 hold_chunk_bytes: int = DEFAULT_HOLD_CHUNK_BYTES, cpu_group=None) -> None:
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
            info["uuid"] = device_uuid(self.device)
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
                local = {device_uuid(torch.device("cuda", d)): d for d in range(torch.cuda.device_count())}
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
        # the tokens of `exchange` and `move`: CPU messages, so a background exchange
        # launches no NCCL kernel (`timeout`: how long a token may take before the
        # exchange fails); on `cpu_group` (gloo, same ranks: the runtime passes
        # EplbGroups.tokens) or a new one
        if cpu_group is None:
            from eplb.runtime.control import new_group_like

            cpu_group = new_group_like(group, "gloo", timeout)
        self._cpu_group = cpu_group

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
        stage_local(plan, weights, staging)
        sends, blocks = send_lists(plan), peer_blocks(plan)
        self.last_messages = len(sends) + len(blocks)
        if not sends and not blocks:
            return 0
        if sends:  # the slots my receivers read hold what was queued before: tell them
            torch.cuda.current_stream(self.device).synchronize()
        cpu = self._cpu_group
        works = [dist.isend(torch.ones(1), global_rank(cpu, q), group=cpu) for q, _s in sends]
        works += [dist.irecv(torch.empty(1), global_rank(cpu, q), group=cpu) for q, _r, _n in blocks]
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
                    works.append(dist.isend(torch.tensor([c]), global_rank(cpu, q), group=cpu, tag=1))
            for p in [p for p, last in sorted(out_last.items()) if last >= c]:
                got = torch.empty(1, dtype=torch.int64)
                dist.recv(got, global_rank(cpu, p), group=cpu, tag=1)
                tokens += 1
                if int(got) != c:
                    raise RuntimeError(f"in-place move of layer {layer}: rank {p} sent token "
                                       f"{int(got)}, expected {c} (plans differ between ranks)")
                self._push(p, layer, plan, np.flatnonzero((plan.send_peer == p) & (send_chunk == c)),
                           rows, events, weights)
        for p in out_last:  # my writes into p are done: tell p
            self._streams[p].synchronize()
            works.append(dist.isend(torch.ones(1), global_rank(cpu, p), group=cpu, tag=2))
        works += [dist.irecv(torch.empty(1), global_rank(cpu, q), group=cpu, tag=2) for q in in_last]
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

        pulled = [q for q, _r, _n in peer_blocks(plan)]
        pullers = [q for q, _s in send_lists(plan)]
        if not pulled and not pullers:
            return
        ops = [dist.P2POp(dist.isend, torch.ones(1, dtype=torch.int64, device=self.device),
                          global_rank(group, q), group) for q in pulled]
        ops += [dist.P2POp(dist.irecv, torch.empty(1, dtype=torch.int64, device=self.device),
                           global_rank(group, q), group) for q in pullers]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
