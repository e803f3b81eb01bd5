"""LLM: the offline interface, vLLM's names. LLM(model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from tqdm.auto import tqdm

from fastllm.core.beam_search import beam_score
from fastllm.engine.llm_engine import LLMEngine, PromptType
from fastllm.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from fastllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    """model: a Hugging Face model directory, an embedded config name with load_format="dummy"
    (e.g. "llama-3.1-8b"), or None for the embedded default (TinyStories stories260K).
    Other keyword arguments are engine arguments (dtype, max_model_len, block_size, ...)."""

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine.from_kwargs(model, **kwargs)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompts = _as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or \
                not all(isinstance(p, SamplingParams) for p in sampling_params):
            raise ValueError("sampling_params must be a SamplingParams or a list of them (one a prompt), got "
                             f"{sampling_params!r:.80}")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts")
        # Offline generation only needs each request's final output (no per-step copies).
        final: dict[int, SamplingParams] = {}
        for p in sampling_params:
            if id(p) not in final:
                final[id(p)] = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
        sampling_params = [final[id(p)] for p in sampling_params]

        request_ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_ids.append(str(next(self._ids)))
                self.engine.add_request(request_ids[-1], prompt, params)
        except Exception:
            self.engine.abort_request(request_ids)
            raise
        return self._run(request_ids, use_tqdm)

    def beam_search(self, prompts: PromptType | list[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search over each prompt (BeamSearchParams gives the rules, transformers'). The beams
        share their prompt's KV and fork at each step. Returns per prompt the beams, best first."""
        request_ids = []
        try:
            for prompt in _as_list(prompts):
                request_ids.append(str(next(self._ids)))
                self.engine.add_beam_search(request_ids[-1], prompt, params)
        except Exception:
            self.engine.abort_request(request_ids)
            raise
        tokenizer = self.engine.tokenizer
        outputs = []
        for out in self._run(request_ids, use_tqdm):
            sequences = []
            for beam in out.outputs:
                tokens = out.prompt_token_ids + beam.token_ids
                text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None
                score = beam_score(beam.cumulative_logprob, len(beam.token_ids), params.length_penalty)
                sequences.append(BeamSearchSequence(tokens, text, beam.cumulative_logprob, score, beam.finish_reason))
            outputs.append(BeamSearchOutput(sequences, out.error))
        return outputs

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            try:
                while self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
            except BaseException:
                self.engine.abort_request([r for r in request_ids if r not in finished])
                raise
        return [finished[r] for r in request_ids]


def _as_list(prompts: PromptType | list[PromptType]) -> list[PromptType]:
    """One prompt (a text, a list of token ids, a dict) or a list of them."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise ValueError(f"prompts must be a prompt (a text, a list of token ids, a dict) or a list of them, "
                         f"got {type(prompts).__name__}")
    return list(prompts)
