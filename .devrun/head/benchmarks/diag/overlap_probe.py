"""Does a local D2D copy overlap an NCCL send/recv or an IPC-style peer copy on H200?"""
import os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp
def work(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank); dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=dev)
    opts = dist.ProcessGroupNCCL.Options(); opts.is_high_priority_stream = True
    hp = dist.new_group([0, 1], backend="nccl", pg_options=opts)
    n = 4 << 30
    send = torch.empty(n, dtype=torch.uint8, device=dev); recv = torch.empty_like(send)
    a = torch.empty(6 << 30, dtype=torch.uint8, device=dev); b = torch.empty_like(a)
    side = torch.cuda.Stream(dev); lowp = torch.cuda.Stream(dev, priority=0); highs = torch.cuda.Stream(dev, priority=-1)
    def xchg(group, stream):
        with torch.cuda.stream(stream):
            ops = [dist.P2POp(dist.isend, send, 1 - rank, group), dist.P2POp(dist.irecv, recv, 1 - rank, group)]
            for w in dist.batch_isend_irecv(ops): w.wait()
    def local(stream):
        with torch.cuda.stream(stream): b.copy_(a)
    def timed(f, reps=3):
        ts = []
        for _ in range(reps):
            dist.barrier(); torch.cuda.synchronize(); t = time.perf_counter(); f(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
        return 1e3 * sorted(ts)[len(ts) // 2]
    for g in (dist.group.WORLD, hp): xchg(g, side)
    local(lowp)
    r = {}
    r["nccl alone"] = timed(lambda: xchg(dist.group.WORLD, side))
    r["copy alone"] = timed(lambda: local(lowp))
    r["nccl + copy (copy after launch)"] = timed(lambda: (xchg_launch := None, xchg(dist.group.WORLD, side), local(lowp)))
    def both_copy_first():
        local(lowp); xchg(dist.group.WORLD, side)
    r["copy first, then nccl"] = timed(both_copy_first)
    def both_hp_copy_first():
        local(lowp); xchg(hp, side)
    r["copy first, then nccl (high-priority NCCL stream)"] = timed(both_hp_copy_first)
    # peer copy (as IPC pulls: copy_ between devices) on rank 0 only, with a local copy on the dst
    if rank == 0:
        peer_src = torch.empty(n, dtype=torch.uint8, device="cuda:1"); dst = torch.empty(n, dtype=torch.uint8, device=dev)
        ps = torch.cuda.Stream(torch.device("cuda", 1))
        def pull(): 
            with torch.cuda.stream(ps): dst.copy_(peer_src)
        pull()
        def t0f(f):
            ts=[]
            for _ in range(3):
                torch.cuda.synchronize(0); torch.cuda.synchronize(1); t=time.perf_counter(); f(); torch.cuda.synchronize(0); torch.cuda.synchronize(1); ts.append(time.perf_counter()-t)
            return 1e3*sorted(ts)[1]
        r["peer pull alone"] = t0f(pull)
        r["copy first, then peer pull"] = t0f(lambda: (local(lowp), pull()))
        r["peer pull, then copy"] = t0f(lambda: (pull(), local(lowp)))
    dist.barrier()
    if rank == 0:
        for k, v in r.items(): print(f"{k}: {v:.2f} ms", flush=True)
    dist.destroy_process_group()
if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.start_processes(work, args=(port,), nprocs=2, start_method="spawn")
