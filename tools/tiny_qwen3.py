"""A tiny random-weight Qwen3 checkpoint with Qwen's real tokenizer, built offline.

Test double for Qwen3-4B-Instruct-2507, which cannot be downloaded here: same architecture
(`Qwen3ForCausalLM`, head_dim 128, grouped-query attention), same vocabulary and special
tokens, a ChatML chat template, but 2 layers of random weights. Its replies are noise;
what it proves is that the target model's code path and chat format run through vLLM.

    python -m tools.tiny_qwen3 /tmp/tiny-qwen3
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from engine.qwen import FIRST_SPECIAL_ID, IM_END_ID, tokenizer

DONE = "tiny-qwen3-done.json"
# What a finished build holds; a build that differs is redone. 8,192 positions: the app's
# shutdown test streams throughput-first's longest reply (4,096 tokens).
BUILT = {"layers": 2, "positions": 8192}
__all__ = ["build", "tokenizer"]


def build(target: Path) -> Path:
    """Write the checkpoint to `target` once; later calls reuse it."""
    done = target / DONE
    if done.is_file() and json.loads(done.read_text()) == BUILT:
        return target
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    target.mkdir(parents=True, exist_ok=True)
    tokenizer().save_pretrained(target)  # 1. Qwen's tokenizer

    # 2. Model: Qwen3 architecture, head_dim 128 as in Qwen3-4B (CPU attention needs it).
    config = Qwen3Config(
        vocab_size=151936, hidden_size=256, intermediate_size=512, num_hidden_layers=BUILT["layers"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=BUILT["positions"], tie_word_embeddings=True,
        bos_token_id=FIRST_SPECIAL_ID, eos_token_id=IM_END_ID, torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(target, safe_serialization=True)
    done.write_text(json.dumps(BUILT))
    return target


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
