"""Where ivf's lists lie in memory. A decode row reads its nearest lists (at 32K and k = 1%,
68 of a KV head's 840); laid out as built, each block's lists side by side in k-means
order, a row's 68 lie in ~54 separate runs, each a scattered read. Laid out by their
centre's inner product with a mean query of their layer and KV head, the lists a
question's rows pick lie near each other (~28 runs a row): the scan reads fewer, longer
runs. The picks are the same in any layout (a row ranks every centre), so the answers are.

The mean query is one of plain text: a forward of SAMPLE of the worker's own first tokens
by themselves, placed where a question's rows sit (RoPE is relative, so the hidden states
are those of the text at position 0 and the queries are rotated to the question's
positions). Measured on SmolLM2 at 32K on a 2-core Zen 4 (an experiment kept in git history,
decode_split.py ivf:built against ivf): a row's lists in 28 runs against 54 as built (24
with the mean of a question's own decode queries), a token's kernel calls replayed 5-8%
faster and whole decode tokens 11%, for ~40 ms of forward at load.
"""

from __future__ import annotations

import numpy as np
import torch

from starqa.attention import attend, fold_gqa

SAMPLE = 32  # tokens whose queries are averaged (16: 29 runs a row; 64: 28; 256: 29)


def mean_queries(decoder, ids: torch.Tensor, position: int) -> list[torch.Tensor] | None:
    """Per layer, [Hkv, D] fp32: the mean query of each KV head's query heads over a forward
    of the first SAMPLE of `ids` by themselves at positions position, position + 1, ...
    (causal attention among them, no context); None for no ids."""
    if len(ids) == 0:
        return None
    means: list[torch.Tensor] = []

    def attention(layer: int, q, k, v):  # q [1, Hq, M, D], k and v [1, Hkv, M, D]
        means.append(fold_gqa(q, k.shape[1], torch.float32)[0].mean(1).cpu())
        return attend(q, k, v, causal=True)[0]

    ids = torch.as_tensor(ids[:SAMPLE], dtype=torch.long)
    positions = position + torch.arange(len(ids))
    with torch.inference_mode():
        decoder.forward(ids.to(decoder.device), positions.to(decoder.device), attention)
    return means


def list_order(centres: np.ndarray, toward: torch.Tensor | None) -> np.ndarray | None:
    """A KV head's lists in the order to lay them out: by descending centre · toward
    (centres [C, D], toward [D]); None (as built) without a direction."""
    if toward is None:
        return None
    scores = centres.astype(np.float32) @ toward.float().numpy()
    return np.argsort(-scores, kind="stable")

