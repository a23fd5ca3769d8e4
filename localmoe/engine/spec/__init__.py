"""Speculative decoding: cheap drafts of the next tokens, verified by the target model in one step.

A drafter (`drafters.py`: prompt lookup, a draft model; `mtp.py`: next-n heads) proposes up to k
tokens; the target runs the last token and the k drafts as k + 1 rows of ONE forward over the
sequence's caches (`verify.py`, engine/batch.py `forward_rows`: every weight and every routed
expert read once for all of them); the accepted prefix is kept by the lossless rule (`accept.py`:
greedy = the longest prefix the target's argmax agrees with; sampling = rejection sampling, so
the output distribution is the target's) and the caches roll back to the last accepted token.
`speculator.py` holds one sequence's drafter, its choice of k and its statistics.
"""
