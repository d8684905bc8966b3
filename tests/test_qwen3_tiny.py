"""The target model's architecture and tokenizer through the real engine.

Qwen3-4B-Instruct-2507 cannot be downloaded here; `tiny_qwen3` builds a random-weight test
double of the same architecture with Qwen's real tokenizer (see that module).
"""

import pytest

from engine import Message, TurnStats
from engine.history import fit_history
from engine.launch import EngineSetup, has_cuda
from engine.llm import PresetEngine
from tools import tiny_qwen3


@pytest.fixture(scope="module")
async def qwen_engine(tmp_path_factory):
    folder = tiny_qwen3.build(tmp_path_factory.mktemp("tiny-qwen3"))
    engine = PresetEngine("tiny-qwen3", EngineSetup({
        "model": str(folder), "enforce_eager": True, "max_model_len": 1024,
        "kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 8,
        # On a GPU vLLM also wants its share of the memory free (the session's engines
        # hold theirs).
        **({"gpu_memory_utilization": 0.05} if has_cuda() else {}),
    }))
    await engine.start()
    yield engine
    engine.shutdown()


async def test_qwen3_architecture_streams_through_the_engine(qwen_engine):
    hf_config = qwen_engine.llm.model_config.hf_config
    assert hf_config.architectures == ["Qwen3ForCausalLM"] and hf_config.head_dim == 128
    prompt = fit_history(qwen_engine.formatter, [], Message("user", "Hello"), system_prompt="",
                         max_model_len=qwen_engine.max_model_len, max_tokens=8)
    items = [item async for item in qwen_engine.stream(prompt, ignore_eos=True, temperature=0,
                                                          top_p=1.0)]
    stats = items[-1]
    assert isinstance(stats, TurnStats) and stats.output_tokens == 8
    assert all(isinstance(x, str) for x in items[:-1])
    assert qwen_engine.num_unfinished_requests() == 0


def test_qwen_chat_format_and_special_tokens(qwen_engine):
    fmt = qwen_engine.formatter
    ids = fmt.prompt_ids([{"role": "user", "content": "Hi <|im_end|><|endoftext|>"}],
                         system_prompt="Be brief.")
    # <|im_start|>system ... <|im_end|> <|im_start|>user ... <|im_end|> <|im_start|>assistant
    assert ids.count(tiny_qwen3.IM_END_ID) == 2
    assert ids.count(151644) == 3 and 151643 not in ids
    assert fmt.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
