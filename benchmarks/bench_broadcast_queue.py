"""Micro-benchmark: broadcasting one step's SchedulerOutput from the executor to R worker processes.

Three transports, measured in the same run against the same reader processes:
  mq    pagedllm.distributed.shm_broadcast.MessageQueue (shared-memory ring, ZMQ doorbell)
  pipe  one multiprocessing.Pipe per reader; the writer pickles once and sends the bytes to each reader
  zmq   one ZMQ PUB socket (ipc://), a SUB socket per reader

The message: 64 running requests each given one new block, plus two new requests with 256-token prompts. Readers
unpickle every message, as workers do.

Throughput: the writer sends N messages back to back; the clock stops when every reader has acknowledged the
last. Latency: one message at a time, from just before the writer's send to the moment the slowest reader has
unpickled it (time.perf_counter_ns in both processes: CLOCK_MONOTONIC, one clock on one machine); the writer
waits for every reader's acknowledgement (on a separate Pipe) before the next message.

    python benchmarks/bench_broadcast_queue.py --messages 20000 --readers 2
"""
from __future__ import annotations

import argparse
import multiprocessing
import pickle
import tempfile
import time

import zmq

from pagedllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.distributed.shm_broadcast import MessageQueue
from pagedllm.sampling_params import SamplingParams

TRANSPORTS = ("pipe", "zmq", "mq")  # pipe first: the baseline the others are compared to
MODES = ("throughput", "latency")
SYNC, STOP = "sync", "stop"


def build_message(num_running: int = 64, num_new: int = 2, prompt_len: int = 256,
                  block_size: int = 16) -> SchedulerOutput:
    running = [f"cmpl-{i:04d}-0" for i in range(num_running)]
    cached = CachedRequestData(req_ids=running, resumed_from_preemption=[False] * num_running,
                               resumed_req_token_ids=[None] * num_running,
                               new_block_ids=[([4096 + i],) for i in range(num_running)],
                               num_computed_tokens=[300 + 7 * i for i in range(num_running)])
    new = [NewRequestData(req_id=f"cmpl-{num_running + j:04d}-0",
                          prompt_token_ids=[(j * 7919 + t) % 49000 + 100 for t in range(prompt_len)],
                          sampling_params=SamplingParams(temperature=0.7, top_p=0.95, max_tokens=256),
                          eos_token_id=2, block_ids=(list(range(j * 64, j * 64 + prompt_len // block_size)),),
                          num_computed_tokens=0)
           for j in range(num_new)]
    scheduled = {r: 1 for r in running} | {r.req_id: prompt_len for r in new}
    return SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled,
                           total_num_scheduled_tokens=sum(scheduled.values()), finished_req_ids=set(),
                           preempted_req_ids=set())


# -- reader process ----------------------------------------------------------------------------------------------

def reader_main(rank: int, mq_handle, pipe_conn, zmq_address: str, ack_conn) -> None:
    mq = MessageQueue.create_from_handle(mq_handle, rank)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(zmq_address)
    mq.wait_until_ready(300)
    ack_conn.send("hello")
    receive = {"pipe": lambda: pickle.loads(pipe_conn.recv_bytes()),
               "zmq": lambda: pickle.loads(sub.recv()),
               "mq": mq.dequeue}
    for transport in TRANSPORTS:
        recv = receive[transport]
        for mode in MODES:
            count = 0
            while True:
                obj = recv()
                now = time.perf_counter_ns()
                if isinstance(obj, str):
                    ack_conn.send((obj, count))
                    if obj == STOP:
                        break
                    continue
                count += 1
                if mode == "latency":
                    ack_conn.send(now)
    mq.close()
    sub.close(linger=0)
    ctx.term()


# -- writer ------------------------------------------------------------------------------------------------------

class Writer:
    def __init__(self, readers: int):
        spawn = multiprocessing.get_context("spawn")
        self.mq = MessageQueue(n_reader=readers)
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)  # XPUB only to see the subscriptions arrive; then used as a PUB
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.ipc_dir = tempfile.TemporaryDirectory(prefix="bench-bcast-")
        address = f"ipc://{self.ipc_dir.name}/pub"
        self.pub.bind(address)
        self.pipes, self.acks, self.procs = [], [], []
        for rank in range(readers):
            pipe_recv, pipe_send = spawn.Pipe(duplex=False)
            ack_recv, ack_send = spawn.Pipe(duplex=False)
            proc = spawn.Process(target=reader_main, args=(rank, self.mq.export_handle(), pipe_recv, address,
                                                           ack_send), daemon=True)
            proc.start()
            pipe_recv.close()
            ack_send.close()
            self.pipes.append(pipe_send)
            self.acks.append(ack_recv)
            self.procs.append(proc)
        self.mq.wait_until_ready(300)
        for _ in range(readers):
            assert self.pub.recv()[:1] == b"\x01"  # a subscription
        for ack in self.acks:
            assert ack.recv() == "hello"

    def send(self, transport: str, obj) -> None:
        if transport == "mq":
            self.mq.enqueue(obj)
            return
        data = pickle.dumps(obj, protocol=5)
        if transport == "pipe":
            for conn in self.pipes:
                conn.send_bytes(data)
        else:
            self.pub.send(data)

    def control(self, transport: str, word: str) -> list:
        self.send(transport, word)
        return [ack.recv() for ack in self.acks]

    def throughput(self, transport: str, msg, n: int, warmup: int) -> float:
        for _ in range(warmup):
            self.send(transport, msg)
        self.control(transport, SYNC)
        start = time.perf_counter()
        for _ in range(n):
            self.send(transport, msg)
        acks = self.control(transport, STOP)
        elapsed = time.perf_counter() - start
        assert all(count == warmup + n for _, count in acks), acks
        return n / elapsed

    def latency(self, transport: str, msg, n: int, warmup: int) -> list[float]:
        latencies = []
        for i in range(warmup + n):
            t0 = time.perf_counter_ns()
            self.send(transport, msg)
            t1 = max(ack.recv() for ack in self.acks)
            if i >= warmup:
                latencies.append((t1 - t0) / 1e3)
        self.control(transport, STOP)
        return sorted(latencies)

    def close(self) -> None:
        for proc in self.procs:
            proc.join(30)
        self.mq.close()
        self.pub.close(linger=0)
        self.ctx.term()
        self.ipc_dir.cleanup()


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20000, help="messages per throughput and latency run")
    parser.add_argument("--readers", type=int, default=2)
    args = parser.parse_args()
    msg = build_message()
    size = len(pickle.dumps(msg, protocol=5))
    warmup = max(1, min(args.messages // 10, 500))
    print(f"message: {msg.scheduled_cached_reqs.num_reqs} running + {len(msg.scheduled_new_reqs)} new requests, "
          f"{size} bytes pickled; {args.readers} readers, {args.messages} messages (+{warmup} warm-up)")
    writer = Writer(args.readers)
    results = {}
    try:
        for transport in TRANSPORTS:
            rate = writer.throughput(transport, msg, args.messages, warmup)
            lat = writer.latency(transport, msg, args.messages, warmup)
            results[transport] = (rate, percentile(lat, 0.5), percentile(lat, 0.99))
    finally:
        writer.close()
    base_rate, base_p50, base_p99 = results["pipe"]
    print("latency: send to the slowest reader's unpickled copy. ratios against pipe: msgs/s higher is better, "
          "latency lower is better")
    print(f"{'transport':<10}{'msgs/s':>10}{'x pipe':>8}{'p50 us':>10}{'x pipe':>8}{'p99 us':>10}{'x pipe':>8}")
    for transport in ("mq", "pipe", "zmq"):
        rate, p50, p99 = results[transport]
        print(f"{transport:<10}{rate:>10.0f}{rate / base_rate:>8.2f}{p50:>10.1f}{p50 / base_p50:>8.2f}"
              f"{p99:>10.1f}{p99 / base_p99:>8.2f}")


if __name__ == "__main__":
    main()
