"""The draft model of speculative decoding: a small model of the target's vocabulary that proposes
the next tokens of each request.

Its KV cache has its own tensors but the target's block ids: a request's block table addresses
both, so the scheduler's allocation, prefix caching, copy-on-write and swapping cover the draft
with no bookkeeping of its own. The runner keeps each request's draft_len (the positions whose
draft KV is valid): propose() runs the draft over the tokens from there to the newest one, then
drafts autoregressively after it, writing into the lookahead slots the scheduler reserved. Decode
steps run batched_step.py instead, which keeps the same invariant on the device. The KV written
for tokens later rejected is overwritten when those positions are computed again, exactly as the
target's is.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from fastllm.config import EngineConfig, ModelConfig
from fastllm.layers import fp8
from fastllm.layers.sampler import SamplingMetadata, SamplingRow, exponential_noise, filtered_probs
from fastllm.models.loader import load_model
from fastllm.spec_decode import draft_decoder
from fastllm.worker.attn_metadata import AttentionMetadata, forward_context
from fastllm.worker.cache_engine import CacheEngine
from fastllm.worker.input_batch import aligned_width, flat_positions

logger = logging.getLogger(__name__)


def draft_model_config(config: EngineConfig, dtype: torch.dtype) -> ModelConfig:
    """The draft's ModelConfig: the target's dtype, load format and context length, and
    speculative_config's quantization. A draft trained on shorter contexts gets a longer rotary table: past
    its training length it only drafts worse."""
    target = config.model
    draft = ModelConfig(model=config.speculative.model, load_format=target.load_format,
                        quantization=config.speculative.quantization)
    hf_config = dict(draft.hf_config)
    if draft.max_position_embeddings < target.max_model_len:
        logger.info("draft model: max_position_embeddings %d < max_model_len %d; its rotary table is extended "
                    "(it drafts past its training length, which lowers acceptance only)",
                    draft.max_position_embeddings, target.max_model_len)
        hf_config["max_position_embeddings"] = target.max_model_len
    return dataclasses.replace(draft, dtype=str(dtype).removeprefix("torch."), max_model_len=target.max_model_len,
                               seed=target.seed + 1, hf_config=hf_config)


@dataclasses.dataclass
class DraftRequest:
    """One request of a step, as the draft sees it."""

    token_ids: list[int]  # the tokens at positions [start, start + len) to run the draft over
    start: int
    block_table: np.ndarray  # int32, at least up to the last slot the draft writes
    num_proposals: int  # tokens to draft after the last of token_ids (0: only keep the KV whole)
    sampling_row: SamplingRow | None  # the request's sampling params (when num_proposals > 0)


class DraftModel:
    def __init__(self, config: EngineConfig, target_dtype: torch.dtype, target_vocab_size: int, device: torch.device):
        self.device = device
        self.block_size = config.cache.block_size
        self.model_config = draft_model_config(config, target_dtype)
        vocab_size = self.model_config.hf_config.get("vocab_size")
        if vocab_size != target_vocab_size:  # before any weights load
            raise ValueError(f"speculative_config.model: the draft's vocabulary ({vocab_size} tokens) differs from "
                             f"the target's ({target_vocab_size}); speculative decoding needs the same tokenizer")
        scheme = fp8.scheme_for(self.model_config.quantization, self.model_config.hf_config)
        if scheme is not None:
            fp8.check_device(device, scheme, "speculative_config.quantization")
        # Its norms folded into its projections: a decode layer launches no norm or add (models/llama.py).
        # That rounds its weights once more, which moves only the proposals: the target's verification
        # decides.
        self.model = load_model(self.model_config, device, fold_norms=True)
        if self.model.args.fold_norms:
            logger.info("draft model: its RMSNorms folded into the projections after them")
        if config.model.quantization is not None or config.cache.kv_cache_dtype == "fp8":
            # (a draft checkpoint that is FP8 itself loads as one: its weights, not this argument, say so)
            logger.info("draft model: quantization=%r and kv_cache_dtype=%r apply to the target only; the draft's "
                        "KV cache is %s (its weights: speculative_config.quantization=%r)",
                        config.model.quantization, config.cache.kv_cache_dtype, target_dtype,
                        self.model_config.quantization)
        self.args = self.model.args
        self.dtype = target_dtype
        # (before the runner compiles the forward: the decoder makes the layer weights views of its stacks)
        why_not = draft_decoder.unsupported(self.model, device)
        self.decoder = draft_decoder.DraftDecoder(self.model) if why_not is None else None
        # which path runs the one-token rounds (benchmarks report it beside their times)
        self.rounds_path = "persistent kernel" if why_not is None else f"forward ({why_not})"
        logger.info("draft model: a one-request step's one-token rounds through the %s (larger batches': "
                    "the forward)", self.rounds_path)
        self.attention_layers = self.model.attention_layers()
        self.cache: CacheEngine | None = None
        self.forward = self.model.forward  # the compiled forward once the runner compiles it

    def kv_bytes_per_block(self) -> int:
        a = self.args
        return CacheEngine.bytes_per_block(a.num_layers, a.num_kv_heads, a.head_dim, self.block_size, self.dtype)

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        a = self.args
        self.cache = CacheEngine(a.num_layers, a.num_kv_heads, a.head_dim, self.block_size, self.dtype, self.device,
                                 num_blocks, num_cpu_blocks)
        for layer, kv in zip(self.attention_layers, self.cache.layer_caches()):
            layer.kv_cache = kv
        if self.decoder is not None:
            self.decoder.kv_cache = self.cache.gpu

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Run the draft over each request's tokens, then draft num_proposals tokens after them.
        Returns the drafted tokens and, for requests that sample (not greedy), the probabilities
        [num_proposals, V] (float32) each was drawn from; the rejection sampler needs both."""
        assert all(r.token_ids for r in requests), "every request runs the draft over at least one token"
        counts = [len(r.token_ids) for r in requests]
        ids = np.concatenate([np.asarray(r.token_ids, dtype=np.int64) for r in requests])
        starts = np.asarray([r.start for r in requests], dtype=np.int64)
        hidden = self._forward(ids, starts, np.asarray(counts), [r.block_table for r in requests])
        proposing = [i for i, r in enumerate(requests) if r.num_proposals > 0]
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        if not proposing:
            return tokens, [None] * len(requests)
        last_rows = torch.as_tensor(np.cumsum(counts)[proposing] - 1, device=self.device)
        drafted = []  # per drafting round: (request indices, [n] token tensor)
        active = proposing
        logits = self.model.compute_logits(hidden[last_rows])
        for round_index in range(max(requests[i].num_proposals for i in proposing)):
            next_tokens, next_probs = self._sample(logits, [requests[i].sampling_row for i in active])
            drafted.append((active, next_tokens))
            for i, row in zip(active, next_probs or ()):
                probs[i].append(row)
            still = [k for k, i in enumerate(active) if requests[i].num_proposals > round_index + 1]
            if not still:
                break
            active = [active[k] for k in still]
            # One token each at the position after the last: a decode step of the draft.
            positions = np.asarray([requests[i].start + counts[i] + round_index for i in active], dtype=np.int64)
            step_ids = next_tokens[torch.as_tensor(still, device=self.device)]
            hidden = self._forward(step_ids, positions, np.ones(len(active), dtype=np.int64),
                                   [requests[i].block_table for i in active])
            logits = self.model.compute_logits(hidden)
        for active_rows, next_tokens in drafted:  # one copy to the host per round, after all of them
            for i, token in zip(active_rows, next_tokens.tolist()):
                tokens[i].append(token)
        return tokens, [torch.stack(p) if p and not r.sampling_row.params.greedy else None
                        for p, r in zip(probs, requests)]

    def _forward(self, ids, starts: np.ndarray, counts: np.ndarray, block_tables: list[np.ndarray]) -> torch.Tensor:
        """The draft over a flat batch: request i's counts[i] tokens from position starts[i]."""
        seq_lens = (starts + counts).astype(np.int32)
        held = np.asarray([len(t) for t in block_tables])
        # The draft writes only into blocks the request holds (the scheduler's lookahead covers it).
        assert ((seq_lens - 1) // self.block_size < held).all(), "draft KV write past the request's blocks"
        width = int(-(-int(seq_lens.max()) // self.block_size))
        # (padded to an aligned width, as a step's tables are: one kernel variant)
        tables = np.zeros((len(counts), aligned_width(width)), dtype=np.int32)
        for i, table in enumerate(block_tables):
            n = min(width, len(table))
            tables[i, :n] = table[:n]
        query_start_loc, positions, slots = flat_positions(starts, counts, tables, self.block_size)
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.as_tensor(slots, device=device),
            block_tables=torch.as_tensor(tables, device=device),
            seq_lens=torch.as_tensor(seq_lens, device=device),
            query_start_loc=torch.as_tensor(query_start_loc, device=device),
            max_query_len=int(counts.max()), max_seq_len=int(seq_lens.max()),
        )
        input_ids = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(ids, device=device)
        with forward_context(metadata, self.attention_layers):
            return self.forward(input_ids, torch.as_tensor(positions, device=device))

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Draft tokens with the requests' own temperature / top-k / top-p / min-p: the argmax for
        greedy requests, else a draw from the filtered probabilities, which are returned per row
        (zeros on greedy rows, which the rejection sampler does not read)."""
        metadata = SamplingMetadata.build(rows, self.args.vocab_size, self.device)
        greedy = logits.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy, None
        probs = filtered_probs(logits.float(), metadata)
        drawn = (probs / exponential_noise(probs, metadata.generators)).argmax(dim=-1)
        return torch.where(metadata.greedy, greedy, drawn), list(probs.masked_fill(metadata.greedy.unsqueeze(1), 0.0))
