"""Log-probabilities of the sampled tokens, for the requests that ask for them
(``SamplingParams.logprobs``).

What they are: ``log_softmax`` of the raw float32 logits the model produced for the step, before
temperature and top-p (vLLM's default, ``logprobs_mode="raw_logprobs"``): a token's logprob does
not depend on how it was sampled, and greedy and sampled requests report the same distribution.

How they are read: the sampled ids and, for the rows that ask, the chosen token's logprob and the
top-k logprobs and ids are computed on the logits' device and packed into one float64 tensor
(ids below 2**53 are exact in float64, float32 logprobs too), which the host reads back in the
one copy sampling already makes (:func:`writescope.engine.sampling.sample_with_logprobs`): no
extra device synchronization. Rows that do not ask cost nothing; a batch where none asks does
not go through here at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # top logprobs per token the engine computes at most (vLLM's default max_logprobs)


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's logprobs (plain values: handed to other threads).

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability (natural log) under the raw logits.
        top: the ``SamplingParams.logprobs`` most likely tokens as ``(token_id, logprob)``,
            most likely first (empty for ``logprobs=0``).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], k: int) -> torch.Tensor:
    """On the logits' device, for ``rows`` of ``logits`` ``[batch, vocab]`` and their sampled
    ``tokens`` ``[batch]`` (int64): ``[len(rows), 1 + 2k]`` float64 of (the chosen token's
    logprob, the top ``k`` logprobs in descending order, their ids)."""
    idx = torch.tensor(rows)
    if logits.device.type != "cpu":  # through pinned memory, asynchronously: a pageable copy may wait for the stream
        idx = idx.pin_memory().to(logits.device, non_blocking=True)
    lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)  # [R, V]
    chosen = lp.gather(1, tokens.index_select(0, idx).unsqueeze(1))  # [R, 1]
    cols = [chosen.double()]
    if k > 0:
        vals, ids = lp.topk(k, dim=-1)  # sorted, most likely first
        cols += [vals.double(), ids.double()]
    return torch.cat(cols, dim=1)


def unpack(values: list[float], tokens: list[int], rows: list[int], ks: list[int], k: int) -> list[TokenLogprobs]:
    """The host side of :func:`logprob_rows`: ``values`` is its flattened read-back, ``ks`` the
    top count each row asked for (<= ``k``, the count computed)."""
    width, out = 1 + 2 * k, []
    for j, (row, want) in enumerate(zip(rows, ks)):
        v = values[j * width : (j + 1) * width]
        top = tuple((int(v[1 + k + t]), v[1 + t]) for t in range(want))
        out.append(TokenLogprobs(tokens[row], v[0], top))
    return out
