"""The shadow step's answer comparison (pure): a mirrored request's stable answer against
the canary's answer to the same request, decoded the same way (greedy, or seeded).

- `first_k_agree`: both answers' first k tokens are the same (the share of mirrored
  requests that agree is the quality gate's `agreement`);
- `token_agreement`: positions compared (the stable answer's length) and positions that
  agree; past the first disagreement the contexts differ, so later positions compare
  answers, not distributions (both count: a shorter canary answer disagrees on the rest);
- `divergence`: with logprobs, the mean of logp_stable(t) - logp_canary(t) over the stable
  answer's tokens t up to and including the first disagreement (the contexts are the same
  there): a one-sample estimate of KL(stable || canary) in nats per token. A token missing
  from the canary's top logprobs counts at the lowest logprob the canary listed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def first_k_agree(stable: Sequence[str], canary: Sequence[str], k: int) -> bool:
    """Whether the first `k` tokens agree (an answer shorter than k must match whole)."""
    return list(stable[:k]) == list(canary[:k])


def token_agreement(stable: Sequence[str], canary: Sequence[str]) -> tuple[int, int]:
    """(positions compared, positions that agree) over the stable answer's tokens."""
    agreed = sum(1 for a, b in zip(stable, canary, strict=False) if a == b)
    return len(stable), agreed


def divergence(
    stable: Sequence[tuple[str, float]], canary: Sequence[Mapping[str, float]]
) -> tuple[float, int]:
    """(sum of logp_stable - logp_canary, tokens) over the stable answer's tokens up to the
    first disagreement. `stable`: (token, its logprob); `canary`: per position, the
    canary's top logprobs {token: logprob} with its own chosen token among them."""
    total, count = 0.0, 0
    for (token, logprob), top in zip(stable, canary, strict=False):
        if not top:
            break
        theirs = top.get(token, min(top.values()))
        total += max(0.0, logprob - theirs)
        count += 1
        if max(top, key=top.__getitem__) != token:
            break  # the canary chose otherwise: the contexts differ from here
    return total, count
