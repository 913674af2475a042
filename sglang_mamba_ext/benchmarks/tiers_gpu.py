"""What a hit costs in each tier of the tree's SSM states, on a GPU (``docs/design.md``, "int8
checkpoints" and "Host tier"): the core's own pools (``mem_cache/checkpoint_pool.py``, torch
only; no SGLang) at Qwen3-Next-80B-A3B shapes at TP 1 (36 Gated DeltaNet layers, 32 value heads
of 128 x 128 float32, a 3-token bfloat16 conv window of 8192 channels: 72.4 MiB a state).

For one state and for a batch of 8, the median time of:

- ``device_copy``: the copy-on-write of a hit in the full-precision pool (``MambaPool.copy_from``);
- ``int8_store`` / ``int8_load``: quantizing a state into the int8 checkpoint pool, and the
  dequantizing copy-on-write of a hit (``Int8CheckpointPool``); with the round trip's relative
  error (max |x - deq(q(x))| / max |x|, random normal states);
- ``host_store`` / ``host_load``: the host tier's copy out at a backup and back at a hit
  (``HostStatePool``, page-locked host memory), each returning when the copy is done.

Last line: ``int8_load_ratio=<int8_load / device_copy> host_load_ratio=<host_load / device_copy>
host_load_gbps=<GB/s of one host load>``, batch of 8. ``--tiny``: toy shapes on CPU (timings
mean nothing). Run by ``scripts/gpu_check.sh`` after the kernel checks; needs torch only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from sglang_mamba_ext.mem_cache.checkpoint_pool import HostStatePool, Int8CheckpointPool
from sglang_mamba_ext.mem_cache.mamba_pool import MambaPool

#: Qwen3-Next-80B-A3B at TP 1 (its published config): GDN layers, value heads, head dims,
#: conv channels (2 * 16 key heads * 128 + 32 value heads * 128) and window (kernel 4 - 1).
QWEN3_NEXT = dict(layers=36, heads=32, k=128, v=128, conv_dim=8192, window=3)
TINY = dict(layers=2, heads=2, k=8, v=8, conv_dim=16, window=3)


def _timed(fn, sync, reps: int) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after two warm-ups."""
    for _ in range(2):
        fn()
    sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="toy shapes on CPU")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if args.tiny:
        dev, shape = torch.device("cpu"), TINY
    elif torch.cuda.is_available():
        dev, shape = torch.device("cuda"), QWEN3_NEXT
    else:
        print("tiers_gpu: no CUDA device; --tiny runs toy shapes on CPU", file=sys.stderr)
        return 2
    batch, slots = 8, 17
    active = MambaPool(
        slots, shape["layers"], (shape["conv_dim"], shape["window"]), (shape["heads"], shape["k"], shape["v"]),
        dtype=torch.float32, conv_dtype=torch.bfloat16, device=dev,
    )
    active.temporal_state.normal_()
    active.conv_state.normal_()
    ckpt = Int8CheckpointPool(slots, active)
    host = HostStatePool(slots, active, pin_memory=dev.type == "cuda")
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    mib = active.slot_bytes() / 2**20
    print(f"[tiers] device: {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}; "
          f"{shape}; a state: {mib:.1f} MiB full precision, {ckpt.slot_bytes() / 2**20:.1f} MiB int8 "
          f"(ratio {ckpt.slot_bytes() / active.slot_bytes():.3f})")
    rows = {}
    for n in (1, batch):
        src = list(range(1, n + 1))
        dst = list(range(n + 1, 2 * n + 1))
        rows[n] = {
            "device_copy": _timed(lambda: active.copy_from(src, dst), sync, args.reps),
            "int8_store": _timed(lambda: ckpt.store_from_active(active, src, src), sync, args.reps),
            "int8_load": _timed(lambda: ckpt.load_to_active(active, src, dst), sync, args.reps),
            "host_store": _timed(lambda: host.store_from_active(active, src, src), sync, args.reps),
            "host_load": _timed(lambda: host.load_to_active(active, src, dst), sync, args.reps),
        }
        print(f"[tiers] {n} state(s), median ms: " + "  ".join(f"{k}={v:.3f}" for k, v in rows[n].items()))
    # the int8 round trip's error (the states are random normal: the worst case for a
    # per-channel scale is a channel with one outlier; this is the typical case)
    ckpt.store_from_active(active, [1], [1])
    ckpt.load_to_active(active, [1], [slots])
    x, y = active.temporal_state[:, 1].float(), active.temporal_state[:, slots].float()
    rel = float((x - y).abs().max() / x.abs().max())
    host.store_from_active(active, [1], [1])
    host.load_to_active(active, [1], [slots])
    exact = bool(torch.equal(active.temporal_state[:, 1], active.temporal_state[:, slots]))
    print(f"[tiers] int8 round trip max rel err={rel:.2e} (bound 1/254={1 / 254:.2e}); host round trip exact={exact}")
    r = rows[batch]
    gbps = batch * active.slot_bytes() / (r["host_load"] / 1e3) / 1e9
    print(f"int8_load_ratio={r['int8_load'] / r['device_copy']:.3f} host_load_ratio={r['host_load'] / r['device_copy']:.3f} "
          f"host_load_gbps={gbps:.2f}")
    return 0 if exact and rel <= 1 / 254 + 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
