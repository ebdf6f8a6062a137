"""Handoff latency and drain bandwidth of the runtime, on a real GPU, in one run.

Latency (20,000 batches each, after 200 warm-ups), all ending when the host sees a kernel's
system-scope write:
  - doorbell: the GPU work for batch n is already enqueued behind cuStreamWaitValue64; the clock
    runs from the host's doorbell store to the ack;
  - launch + poll: the host launches the same kernel, then polls for its write;
  - launch + sync: the host launches it, then cuStreamSynchronize.
Bandwidth: the runtime's drain (payload ring -> pinned staging, 32 MB outputs; each checked by its
payload checksum and order, every word of one batch in 128; 12 GiB in all) against a plain pinned
cuMemcpyDtoHAsync of 1 GiB measured in the same run.

    python bench/handoff.py [--iterations 20000]

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from fabric_gpu import _runtime, probe_gpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=20_000)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args()
    status = probe_gpu()
    if not status.available:
        raise SystemExit(f"bench/handoff.py needs a GPU: {status.reason}")

    h = _runtime.measure_handoff(args.device, args.iterations)
    bell, poll, sync = (np.array(h[k]) for k in ("doorbell_us", "launch_poll_us", "launch_sync_us"))

    batches, out_bytes = 384, 32 << 20
    drain = _runtime.selftest(
        emulated=False, device=args.device, batches=batches, seed=1, max_tokens=64, max_items=8,
        max_output_bytes=out_bytes, max_hooks=4, verify_every=128,
        runtime_config=_runtime.RuntimeConfig(payload_ring_bytes=512 << 20, max_output_bytes=out_bytes, staging_buffers=4),
    )  # fmt: skip
    assert drain["output_mismatches"] == drain["checksum_mismatches"] == drain["order_errors"] == 0
    drain_gbps = drain["bytes_out"] / drain["seconds"] / 1e9
    copy_gbps = _runtime.measure_d2h_gbps(args.device, 1 << 30, 5)

    result = {
        "device": h["device"],
        "doorbell_p50_us": round(float(np.percentile(bell, 50)), 2),
        "doorbell_p99_us": round(float(np.percentile(bell, 99)), 2),
        "launch_poll_p50_us": round(float(np.percentile(poll, 50)), 2),
        "launch_poll_p99_us": round(float(np.percentile(poll, 99)), 2),
        "launch_sync_p50_us": round(float(np.percentile(sync, 50)), 2),
        "launch_sync_p99_us": round(float(np.percentile(sync, 99)), 2),
        "ratio_doorbell_vs_launch_poll": round(
            float(np.percentile(bell, 50) / np.percentile(poll, 50)), 3
        ),
        "d2h_gbps": round(drain_gbps, 1),
        "plain_d2h_gbps": round(copy_gbps, 1),
    }
    print(f"device {result['device']}, {args.iterations} batches per method")
    print(
        f"doorbell publish -> ack   p50 {result['doorbell_p50_us']:7.2f} us   p99 {result['doorbell_p99_us']:7.2f} us"
    )
    print(
        f"host launch + poll        p50 {result['launch_poll_p50_us']:7.2f} us   p99 {result['launch_poll_p99_us']:7.2f} us"
    )
    print(
        f"host launch + sync        p50 {result['launch_sync_p50_us']:7.2f} us   p99 {result['launch_sync_p99_us']:7.2f} us"
    )
    print(
        f"doorbell / launch+poll    {result['ratio_doorbell_vs_launch_poll']:.3f}x (target <= 0.75)"
    )
    print(
        f"drain D2H (32 MB outputs) {result['d2h_gbps']:.1f} GB/s; plain pinned copy {result['plain_d2h_gbps']:.1f} GB/s"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
