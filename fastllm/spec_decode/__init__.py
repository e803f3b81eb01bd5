"""Speculative decoding with a draft model: the draft proposes tokens, the target verifies them in
one forward and the rejection sampler keeps the longest prefix the target agrees with."""
