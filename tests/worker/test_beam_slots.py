"""BeamSlotRunner's picks (worker/beam_slots.py) against the host's ranking (BeamSearch.advance's sorted()):
the same 2W candidates in the same order, ties included, and the first W not EOS as the next slots."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fastllm.core.scheduler_output import BeamSlotStep
from fastllm.worker.beam_slots import BeamSlotRunner, _SearchState


def host_ranking(cums, top_ids, top_vals, k):
    return sorted(((cum + v, i, t) for i, cum in enumerate(cums) for t, v in zip(top_ids[i][:k], top_vals[i][:k])),
                  key=lambda c: -c[0])[:k]


def test_picks_rank_as_the_host_does_ties_and_eos_included():
    runner = SimpleNamespace(block_size=4, config=SimpleNamespace(model=SimpleNamespace(max_model_len=64)))
    slots = BeamSlotRunner(runner)
    width, eos = 3, 5
    cums = [-1.5, -1.0, -1.5]
    # float32 logprobs with ties within and across beams, and EOS (5) among the best
    top_vals = torch.tensor([[-0.5, -0.5, -1.0, -2.0, -2.0, -3.0],
                             [-1.0, -1.0, -1.0, -1.5, -2.5, -2.5],
                             [-0.5, -0.5, -1.0, -2.0, -2.0, -3.0]])
    top_ids = torch.tensor([[5, 7, 8, 9, 10, 11], [3, 5, 4, 12, 13, 14], [7, 6, 5, 1, 2, 0]])
    slots.states["s"] = _SearchState(torch.zeros(3, 16, dtype=torch.int32), torch.arange(3), torch.zeros(3, dtype=torch.int64),
                                     torch.tensor(cums, dtype=torch.float64))
    step = BeamSlotStep("s", 8, [1, 2, 3], False, width, eos)
    cum, ids = slots._pick([step], [3], None, top_ids, top_vals)
    want = host_ranking(cums, top_ids.tolist(), top_vals.tolist(), 2 * width)
    assert list(zip(cum.tolist(), *ids.tolist())) == want
    running = [(c, i, t) for c, i, t in want if t != eos][:width]
    state = slots.states["s"]
    assert list(zip(state.cum.tolist(), state.parents.tolist(), state.tokens.tolist())) == running
    assert any(t == eos for _, _, t in want[:width])  # (the case the rule is for)
