"""The host-to-GPU link's own speed: the ceiling for a returning chat's history loaded back
from CPU memory (issue 59). Copies one chat's KV bytes (`--tokens` tokens of Qwen3-4B's
KV, 144 KiB a token) from CPU memory to the GPU, as one copy and as one copy a block of
`--block-tokens` tokens (all layers of a block are contiguous in vLLM's offloading layout),
from pinned memory and from ordinary (pageable) memory; the median of `--repeats` timed
copies each, in GB/s and in milliseconds for the whole history.

    scripts/gpu_run.sh OUT link                 (on a GPU)
    python3 -m bench.link --tokens 8192         (the same, given CUDA)
"""

from __future__ import annotations

import argparse
import json
import statistics

KV_BYTES_PER_TOKEN = 36 * 8 * 128 * 2 * 2  # Qwen3-4B: layers, KV heads, head size, K+V, bf16


def timed_copies(torch, src, dst, chunk: int, repeats: int) -> list[float]:
    """Seconds for each of `repeats` copies of src into dst, `chunk` bytes a copy call."""
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for offset in range(0, src.numel(), chunk):
            dst[offset:offset + chunk].copy_(src[offset:offset + chunk], non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return times[1:]


def measure(tokens: int, block_tokens: int, repeats: int) -> dict:
    import torch

    size = tokens * KV_BYTES_PER_TOKEN
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    figures = {"device": torch.cuda.get_device_name(), "tokens": tokens,
               "gib": round(size / 2**30, 3), "block_tokens": block_tokens}
    for memory in ("pinned", "pageable"):
        src = torch.ones(size, dtype=torch.uint8, pin_memory=memory == "pinned")
        for name, chunk in (("one_copy", size), ("per_block", block_tokens * KV_BYTES_PER_TOKEN)):
            seconds = statistics.median(timed_copies(torch, src, dst, chunk, repeats))
            figures[f"{memory}_{name}_gb_per_s"] = round(size / seconds / 1e9, 1)
            figures[f"{memory}_{name}_ms"] = round(seconds * 1000, 1)
        del src
    return figures


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    figures = measure(args.tokens, args.block_tokens, args.repeats)
    print(json.dumps(figures))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
